"""Figures: pyplot's new or changed figures saved into the workdir as figure-N.png."""

from __future__ import annotations

import contextlib
import functools
import os
import sys

from .protocol import MAX_FIGURES_PER_RUN

TYPE_CHECKING = False
if TYPE_CHECKING:
    import types
    import weakref
    from collections.abc import Callable
    from typing import Any


class _Figures:
    """Saves pyplot's open figures that are new or changed into the workdir as figure-N.png.

    ``fig.stale`` cannot tell: matplotlib 3.6 leaves it True after savefig (it restores dpi and colours
    afterwards), and a cell's own ``canvas.draw()`` makes it False without any save. Instead: every
    savefig (ours or the cell's) marks the figure clean, and a wrapper on the figure's stale_callback,
    to which matplotlib reports every change of every artist in it, marks it dirty again. Drawing
    (which savefig does) also reports changes (ticks, layout): those are not the cell's and are
    ignored, by muting the wrapper while a Figure draws or saves."""

    def __init__(self, workdir: str, stderr: Callable[[str], None]) -> None:
        self._workdir = workdir
        self._note = stderr
        self._clean: weakref.WeakKeyDictionary[Any, bool] | None = None  # made when pyplot is imported
        self._muted = 0
        self._next = 1
        self.saved: list[str] = []  # this run's, in order
        self.more = 0  # this run's figures past MAX_FIGURES_PER_RUN: counted, not saved

    def patch(self, pyplot: types.ModuleType) -> None:
        """Make plt.show() save now and every savefig count as a save. Idempotent (also after a reload)."""
        if self._clean is None:
            import weakref

            self._clean = weakref.WeakKeyDictionary()
        if not getattr(pyplot.show, "_code_sessions", False):

            def show(*args: Any, **kwargs: Any) -> None:
                """The sandbox has no display: save new or changed figures now. They stay open."""
                self.save_open()

            show._code_sessions = True  # type: ignore[attr-defined]
            pyplot.show = show  # type: ignore[attr-defined]
        figure_class = getattr(sys.modules.get("matplotlib.figure"), "Figure", None)
        if figure_class is None:
            return
        for method, marks_clean in (("savefig", True), ("draw", False)):
            original = getattr(figure_class, method)
            if not getattr(original, "_code_sessions", False):
                setattr(figure_class, method, self._muting(original, marks_clean))

    def _muting(self, original: Callable[..., Any], marks_clean: bool) -> Callable[..., Any]:
        @functools.wraps(original)
        def wrapper(fig: Any, *args: Any, **kwargs: Any) -> Any:
            self._muted += 1
            try:
                result = original(fig, *args, **kwargs)
            finally:
                self._muted -= 1
            if marks_clean:
                self._mark_clean(fig)
            return result

        wrapper._code_sessions = True  # type: ignore[attr-defined]
        return wrapper

    def _mark_clean(self, fig: Any) -> None:
        clean = self._clean
        assert clean is not None
        clean[fig] = True
        inner = getattr(fig, "stale_callback", None)
        if getattr(inner, "_code_sessions", False):
            return

        def stale_callback(artist: Any, value: bool) -> None:
            if value and not self._muted:
                clean[artist] = False
            if inner is not None:
                inner(artist, value)

        stale_callback._code_sessions = True  # type: ignore[attr-defined]
        fig.stale_callback = stale_callback

    def save_open(self) -> None:
        helpers = sys.modules.get("matplotlib._pylab_helpers")
        if helpers is None or self._clean is None:
            return
        managers = list(helpers.Gcf.get_all_fig_managers())
        with contextlib.suppress(TypeError):  # creation order: figure 1 becomes the first file
            managers.sort(key=lambda m: m.num)
        for manager in managers:
            fig = getattr(getattr(manager, "canvas", None), "figure", None)
            if fig is None or self._clean.get(fig) or not _has_content(fig):
                continue
            if len(self.saved) >= MAX_FIGURES_PER_RUN:
                # Counted for this run's answer, and taken as seen: a later run saves it only if it
                # changes again, never as a leftover of this one.
                self.more += 1
                self._mark_clean(fig)
                continue
            name = self._save(fig)
            if name is not None:
                self.saved.append(name)

    def _save(self, fig: Any) -> str | None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        while True:
            name = f"figure-{self._next}.png"
            path = os.path.join(self._workdir, name)
            try:
                fd = os.open(path, flags, 0o644)  # O_EXCL: an existing file (or link) is never touched
                break
            except FileExistsError:
                self._next += 1
            except OSError as exc:
                self._note(f"[code-sessions: cannot save the figure as {name}: {exc}]\n")
                return None
        self._next += 1
        try:
            with os.fdopen(fd, "wb") as file:
                fig.savefig(file, format="png", bbox_inches="tight")
        except BaseException as exc:
            with contextlib.suppress(OSError):
                os.unlink(path)
            if not isinstance(exc, Exception):
                raise
            self._note(f"[code-sessions: cannot save the figure as {name}: {exc!r}]\n")
            return None
        self._mark_clean(fig)
        return name


def _has_content(fig: Any) -> bool:
    """An empty plt.figure() is not worth a file."""
    try:
        return any(
            getattr(fig, attr, None)
            for attr in ("axes", "images", "texts", "lines", "patches", "artists", "legends", "subfigs")
        )
    except Exception:
        return True
