"""Charts: plotly figures a cell shows (``fig.show()``, ``plotly.io.show``) or leaves as its last value,
saved into the workdir as chart-N.plotly.json (plotly's own JSON, which the host draws with plotly.js),
with chart-N.png beside it, a static picture drawn with matplotlib (the sandbox has no kaleido)."""

from __future__ import annotations

import contextlib
import os

from .figures import _Figures
from .protocol import MAX_FIGURES_PER_RUN

TYPE_CHECKING = False
if TYPE_CHECKING:
    import types
    from collections.abc import Callable
    from typing import Any

_EXCL = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _is_plotly_figure(value: object) -> bool:
    kind = type(value)
    return kind.__module__.startswith("plotly.") and any(
        base.__name__ == "BaseFigure" for base in kind.__mro__
    )


class _Charts:
    """Collects the plotly figures of a run, then saves them. They share the figures' bound per run
    (MAX_FIGURES_PER_RUN, and its count of the rest): a chart is one of a run's figures."""

    def __init__(self, workdir: str, figures: _Figures, stderr: Callable[[str], None]) -> None:
        self._workdir = workdir
        self._figures = figures
        self._note = stderr
        self._next = 1
        self.pending: list[Any] = []

    def patch(self, pio: types.ModuleType) -> None:
        """plotly.io.show (what fig.show() calls) keeps the figure for the end of the run."""
        if getattr(getattr(pio, "show", None), "_code_sessions", False):
            return

        def show(fig: Any, *args: Any, **kwargs: Any) -> None:
            """The sandbox has no browser: the figure is shown in the chat once the run ends."""
            self.capture(fig)

        show._code_sessions = True  # type: ignore[attr-defined]
        pio.show = show  # type: ignore[attr-defined]

    def capture(self, value: object) -> bool:
        """Keep a plotly figure (a dict too, from plotly.io.show) for this run; False: not one."""
        if not (_is_plotly_figure(value) or (isinstance(value, dict) and "data" in value)):
            return False
        if not any(kept is value for kept in self.pending):
            self.pending.append(value)
        return True

    def save_pending(self) -> None:
        pending, self.pending = self.pending, []
        for fig in pending:
            if len(self._figures.saved) >= MAX_FIGURES_PER_RUN:
                self._figures.more += 1
                continue
            name = self._save(fig)
            if name is not None:
                self._figures.saved.append(name)

    def _claim(self) -> tuple[str, int, int] | None:
        """A number N with chart-N.plotly.json and chart-N.png both new, opened exclusively."""
        while True:
            stem = os.path.join(self._workdir, f"chart-{self._next}")
            self._next += 1
            try:
                spec = os.open(stem + ".plotly.json", _EXCL, 0o644)
            except FileExistsError:
                continue
            except OSError as exc:
                self._note(f"[code-sessions: cannot save the chart: {exc}]\n")
                return None
            try:
                picture = os.open(stem + ".png", _EXCL, 0o644)
            except OSError:
                os.close(spec)
                os.unlink(stem + ".plotly.json")
                continue
            return os.path.basename(stem), spec, picture

    def _save(self, fig: Any) -> str | None:
        try:
            if isinstance(fig, dict):
                import plotly.graph_objects as go

                fig = go.Figure(fig)
            text = fig.to_json()
            spec = fig.to_plotly_json()
        except Exception as exc:
            self._note(f"[code-sessions: cannot save the chart: {exc!r}]\n")
            return None
        claimed = self._claim()
        if claimed is None:
            return None
        stem, spec_fd, picture_fd = claimed
        with os.fdopen(spec_fd, "w", encoding="utf-8") as file:
            file.write(text)
        drawn = False
        try:
            with os.fdopen(picture_fd, "wb") as file:
                drawn = _draw(spec, file)
        except Exception as exc:
            self._note(f"[code-sessions: no static picture of {stem}: {exc!r}]\n")
        if not drawn:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self._workdir, stem + ".png"))
        return stem + ".plotly.json"


def _array(value: Any) -> Any:
    """A trace's data as matplotlib takes it: plotly 6 and later write numeric arrays as typed arrays
    ({"dtype": "i1", "bdata": base64, "shape": "2, 3"})."""
    if isinstance(value, dict) and "bdata" in value and "dtype" in value:
        import base64

        import numpy

        array = numpy.frombuffer(base64.b64decode(value["bdata"]), dtype=numpy.dtype(value["dtype"]))
        shape = value.get("shape")
        if isinstance(shape, str) and shape:
            array = array.reshape([int(n) for n in shape.split(",")])
        return array
    return value


def _title(value: Any) -> str:
    if isinstance(value, dict):
        value = value.get("text")
    return value if isinstance(value, str) else ""


def _draw(spec: dict[str, Any], file: Any) -> bool:
    """A static sketch of the chart's common traces (scatter and lines, bars, histograms, pies) with
    matplotlib's object API (never pyplot: the figure must not join the cell's open figures). False:
    nothing it can draw."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    layout = spec.get("layout") or {}
    figure = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    drawn = 0
    for trace in spec.get("data") or ():
        kind = trace.get("type") or "scatter"
        x, y, label = _array(trace.get("x")), _array(trace.get("y")), trace.get("name") or None
        if kind in ("scatter", "scattergl") and y is not None:
            x = list(range(len(y))) if x is None else x
            mode = trace.get("mode") or "lines+markers"
            axes.plot(
                x,
                y,
                linestyle="-" if "lines" in mode else "",
                marker="o" if "markers" in mode else "",
                markersize=3,
                label=label,
            )
        elif kind == "bar" and x is not None and y is not None:
            if trace.get("orientation") == "h":
                axes.barh(y, x, label=label)
            else:
                axes.bar(x, y, label=label)
        elif kind == "histogram" and (x is not None or y is not None):
            axes.hist(x if x is not None else y, label=label)
        elif kind == "pie" and trace.get("values") is not None:
            axes.pie(_array(trace["values"]), labels=_array(trace.get("labels")))
        else:
            continue
        drawn += 1
    if not drawn:
        return False
    axes.set_title(_title(layout.get("title")))
    axes.set_xlabel(_title((layout.get("xaxis") or {}).get("title")))
    axes.set_ylabel(_title((layout.get("yaxis") or {}).get("title")))
    if drawn > 1 and any(t.get("name") for t in spec.get("data") or ()):
        axes.legend()
    figure.savefig(file, format="png", bbox_inches="tight")
    return True
