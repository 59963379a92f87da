"""Figures, as Jupyter's inline backend shows them: pyplot's new or changed figures saved into the
workdir as figure-N.png at plt.show() and at the end of every cell, then closed."""

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
    """What matplotlib-inline does with ``close_figures`` (its default), which is what models write code
    for: ``plt.show()`` and the end of every cell save pyplot's open figures that are new or changed,
    then close them all, so the next ``plt.plot`` starts on a new figure, never on one (3D axes, say)
    an earlier cell left. A Figure kept in a variable still works (``fig.savefig``), and a Figure that
    is a cell's last value is shown (saved), as Jupyter displays it. One help beyond Jupyter:
    ``plt.savefig()`` with no figure open saves the figure that was current when the kernel closed it
    (``plt.show(); plt.savefig(...)``, or "save it" a cell later), where Jupyter writes an empty image.

    New or changed: ``fig.stale`` cannot tell: matplotlib 3.6 leaves it True after savefig (it restores
    dpi and colours afterwards), and a cell's own ``canvas.draw()`` makes it False without any save.
    Instead: every savefig (ours or the cell's) marks the figure clean, and a wrapper on the figure's
    stale_callback, to which matplotlib reports every change of every artist in it, marks it dirty
    again. Drawing (which savefig does) also reports changes (ticks, layout): those are not the cell's
    and are ignored, by muting the wrapper while a Figure draws or saves."""

    def __init__(self, workdir: str, stderr: Callable[[str], None]) -> None:
        self._workdir = workdir
        self._note = stderr
        self._clean: weakref.WeakKeyDictionary[Any, bool] | None = None  # made when first needed
        self._muted = 0
        self._next = 1
        self._last: Any = None  # current when the kernel last closed the figures (None: the cell closed some)
        self.saved: list[str] = []  # this run's, in order
        self.more = 0  # this run's figures past MAX_FIGURES_PER_RUN: counted, not saved
        self.pending: list[Any] = []  # this run's Figures shown as a cell's last value
        self._run = 0
        self._saved_in: weakref.WeakKeyDictionary[Any, int] | None = None  # a figure -> the run that saved it

    def begin_run(self) -> None:
        self._run += 1
        self.saved = []
        self.more = 0
        self.pending = []

    def patch(self, pyplot: types.ModuleType) -> None:
        """Make plt.show() save and close, plt.close() forget the closed figure, plt.savefig() with no
        figure open save the last one closed, and every savefig count as a save. Idempotent (also after
        a reload)."""
        self._clean_map()
        if not getattr(pyplot.show, "_code_sessions", False):

            def show(*args: Any, **kwargs: Any) -> None:
                """The sandbox has no display: save new or changed figures now, then close them, as
                Jupyter's inline backend does."""
                try:
                    self.save()
                finally:
                    self.close()

            show._code_sessions = True  # type: ignore[attr-defined]
            pyplot.show = show  # type: ignore[attr-defined]
        for name, wrap in (("close", self._closing), ("savefig", self._saving_last)):
            original = getattr(pyplot, name, None)
            if original is not None and not getattr(original, "_code_sessions", False):
                setattr(pyplot, name, wrap(original))
        figure_class = getattr(sys.modules.get("matplotlib.figure"), "Figure", None)
        if figure_class is None:
            return
        for method, marks_clean in (("savefig", True), ("draw", False)):
            original = getattr(figure_class, method)
            if not getattr(original, "_code_sessions", False):
                setattr(figure_class, method, self._muting(original, marks_clean))

    def _closing(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def close(*args: Any, **kwargs: Any) -> Any:
            self._last = None  # the cell closes figures itself: plt.savefig() then means its own
            return original(*args, **kwargs)

        close._code_sessions = True  # type: ignore[attr-defined]
        return close

    def _saving_last(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def savefig(*args: Any, **kwargs: Any) -> Any:
            last = self._last
            if last is not None and not _open_managers():
                return last.savefig(*args, **kwargs)  # not a new, empty figure
            return original(*args, **kwargs)

        savefig._code_sessions = True  # type: ignore[attr-defined]
        return savefig

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

    def _clean_map(self) -> weakref.WeakKeyDictionary[Any, bool]:
        if self._clean is None or self._saved_in is None:
            import weakref

            self._clean = weakref.WeakKeyDictionary()
            self._saved_in = weakref.WeakKeyDictionary()
        return self._clean

    def _mark_clean(self, fig: Any) -> None:
        clean = self._clean_map()
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

    def capture(self, value: object) -> bool:
        """Keep a matplotlib Figure that is a cell's last value, to be shown (saved) at the end of the
        run even if closed or unchanged, as Jupyter displays it; False: not one (or an empty one, which
        Jupyter prints as text)."""
        figure_class = getattr(sys.modules.get("matplotlib.figure"), "Figure", None)
        if figure_class is None or not isinstance(value, figure_class) or not _has_content(value):
            return False
        if not any(kept is value for kept in self.pending):
            self.pending.append(value)
        return True

    def save(self) -> None:
        """Save this run's last-value Figure (unless this run saved it already as it is), then every
        open figure that is new or changed, in the order pyplot made them, within the run's bound."""
        pending, self.pending = self.pending, []
        clean = self._clean_map()
        saved_in = self._saved_in
        assert saved_in is not None  # made with the clean map
        shown = [fig for fig in pending if not (clean.get(fig) and saved_in.get(fig) == self._run)]
        if pending:
            self._last = pending[-1]  # plt.savefig()'s figure, unless one is open (see close)
        for manager in _open_managers():
            fig = getattr(getattr(manager, "canvas", None), "figure", None)
            if fig is None or clean.get(fig) or not _has_content(fig) or any(fig is s for s in shown):
                continue
            shown.append(fig)
        for fig in shown:
            if len(self.saved) >= MAX_FIGURES_PER_RUN:
                self.more += 1  # counted for this run's answer; closed with the others
                continue
            name = self._save(fig)
            if name is not None:
                self.saved.append(name)
                saved_in[fig] = self._run

    def close(self) -> None:
        """Close pyplot's figures (``plt.close('all')``), keeping the current one for plt.savefig()
        with none open."""
        helpers = sys.modules.get("matplotlib._pylab_helpers")
        if helpers is None:
            return
        try:
            gcf = helpers.Gcf
            if not gcf.get_all_fig_managers():
                return
            active = gcf.get_active()
            self._last = getattr(getattr(active, "canvas", None), "figure", None)
            gcf.destroy_all()
        except Exception as exc:  # a cell that broke pyplot's registry: its figures stay open
            self._note(f"[code-sessions: cannot close the figures: {exc!r}]\n")

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


def _open_managers() -> list[Any]:
    """pyplot's open figure managers, in creation order (figure 1 becomes the first file)."""
    helpers = sys.modules.get("matplotlib._pylab_helpers")
    if helpers is None:
        return []
    managers = list(helpers.Gcf.get_all_fig_managers())
    with contextlib.suppress(TypeError):
        managers.sort(key=lambda m: m.num)
    return managers


def _has_content(fig: Any) -> bool:
    """An empty plt.figure() is not worth a file."""
    try:
        return any(
            getattr(fig, attr, None)
            for attr in ("axes", "images", "texts", "lines", "patches", "artists", "legends", "subfigs")
        )
    except Exception:
        return True
