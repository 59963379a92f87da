"""Interactive charts: the plotly figures a run saved (chart-N.plotly.json, see the kernel program's
charts.py), drawn by plotly.js in the message, through Open WebUI's `embeds` (HTML that its page shows
in a sandboxed iframe, saved with the message).

Isolation. Open WebUI gives an embed's iframe `allow-scripts` and, when the user turns on "iframe
sandbox allow same origin", `allow-same-origin` too: a script in it could then read the user's token.
So the embed's own document runs no script that touches the chart: it is a fixed frame (one line that
tells Open WebUI its height) around an inner iframe with `sandbox="allow-scripts allow-downloads"`
only, whose document (the `srcdoc`, escaped) holds the specs and a fixed loader. The inner document's
origin is opaque whatever the user's setting (downloads: plotly's "Download plot as a PNG"), and both
documents carry a Content-Security-Policy that allows no connection, no image but data: and blob:, and
no script but the two fixed inline ones (by their hashes) and scripts from Open WebUI's own origin
(`'self'`, which in a srcdoc document is its embedder's origin).

plotly.js is not in the embed: the host serves the sandbox environment's copy (the same version as the
plotly that wrote the specs) at a URL of its own (webui/assets.py), and `ChartEmbed.html` writes that
URL into the loader, which fetches it once the chart scrolls into view. A message with charts stores
only their specs and about 3 KB of frame.

The specs are hostile JSON: each is parsed and re-serialised, `<`, `>` and `&` written as escapes, so
nothing in it can end the script element it sits in; it reaches plotly.js as data.

Bounds. The embed is sent to Open WebUI and saved with the message, and escaping grows a spec (a `<`
becomes six characters, then a `"` six more in the srcdoc): the whole embed is at most
MAX_EMBED_BYTES, its size reckoned from a spec's characters before any escaping is done; the charts
that would not fit are left out, and one sentence names them. A spec that cannot be read as a figure
(not JSON, nested too deeply, anything else) is left out with a sentence of its own: a chart never ends
the answer. Parsing and escaping run in a thread, one spec at a time (each at most MAX_CHART_BYTES),
never on the event loop.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import hashlib
import html
import json
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from runner import RunResult
from storage import ReconcileReport, StorageError, human_bytes

from .markup import mention

__all__ = [
    "CHART_SUFFIX",
    "MAX_CHARTS",
    "MAX_CHART_BYTES",
    "ChartEmbed",
    "charts_of",
    "embed_html",
    "figures_of",
    "plotly_js",
]

CHART_SUFFIX = ".plotly.json"
MAX_CHART_BYTES = 4 * 1024 * 1024  # of one chart's spec (a bigger one stays a file and a picture)
MAX_CHARTS = 20  # charts in one message's embed
MAX_EMBED_BYTES = 8 * 1024 * 1024  # of the message's embed
MAX_SCRIPT_URL = 200  # characters of the URL plotly.js is served at (the host's choice)
CHART_HEIGHT = 440  # pixels, each
_FIGURE_SUFFIXES = (".png",)
_PLAIN_NAME = re.compile(r"[A-Za-z0-9._-]+(?:/[A-Za-z0-9._-]+)*")
# A path on the embedding page's own origin (`//` would name another host).
_SCRIPT_URL = re.compile(r"/(?!/)[A-Za-z0-9/._-]+")
_PLOTLY_JS = "usr/local/lib/python3*/dist-packages/plotly/package_data/plotly.min.js"
# What may not appear as itself in JSON inside a script element (U+2028 and U+2029 never do: json.dumps
# writes every non-ASCII character as an escape). One str.replace per character: a translate table
# holds the GIL for one long call over the whole spec, several times slower.
_JSON_ESCAPES = (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"))


def _kept(result: RunResult | None, report: ReconcileReport | None) -> tuple[list[str], set[str]]:
    if result is None or report is None or not result.figures:
        return [], set()
    return [p for p in result.figures if _PLAIN_NAME.fullmatch(p)], set(report.added) | set(report.changed)


def figures_of(result: RunResult | None, report: ReconcileReport | None) -> tuple[str, ...]:
    """The figures a kernel says it saved, kept only where the disk agrees: files this run added or
    changed (the index is the disk's word), with a picture's name."""
    claimed, saved = _kept(result, report)
    return tuple(p for p in claimed if p in saved and p.lower().endswith(_FIGURE_SUFFIXES))


def charts_of(result: RunResult | None, report: ReconcileReport | None) -> tuple[tuple[str, str | None], ...]:
    """The charts the kernel says it saved, where the disk agrees: (spec, its static picture or None)."""
    claimed, saved = _kept(result, report)
    found = []
    for spec in claimed:
        if spec in saved and spec.endswith(CHART_SUFFIX):
            picture = spec[: -len(CHART_SUFFIX)] + ".png"
            found.append((spec, picture if picture in saved else None))
    return tuple(found)


def _find_plotly_js(root: Path) -> Path | None:
    found = sorted(root.glob(_PLOTLY_JS))
    return found[-1] if found else None


async def plotly_js(environment_root: Path) -> Path | None:
    """plotly.js of the sandbox environment (the same version as the plotly that wrote the specs), or
    None when the environment has no plotly."""
    return await asyncio.to_thread(_find_plotly_js, environment_root)


class _NotShown(ValueError):
    """Why a spec is not shown interactively (the end of a sentence)."""


def _compact_figure(text: bytes) -> str:
    """A hostile spec as compact JSON (ASCII: json.dumps escapes the rest) holding only a figure's
    data and layout. Raises _NotShown when it is not a figure."""
    try:
        spec = json.loads(text)
    except RecursionError:  # a spec nested thousands deep: json.loads recurses once per level
        raise _NotShown("it is nested too deeply to be a plotly figure") from None
    except ValueError:
        raise _NotShown("it is not a plotly figure") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("data", []), list):
        raise _NotShown("it is not a plotly figure")
    figure = {"data": spec.get("data") or [], "layout": spec.get("layout") or {}}
    if not isinstance(figure["layout"], dict):
        figure["layout"] = {}
    return json.dumps(figure, separators=(",", ":"))


def _embedded_size(compact: str) -> int:
    """How many bytes compact JSON takes in the embed, escaped for the script element (each of `<`, `>`
    and `&` becomes a six-character escape) and then for the srcdoc attribute (each `"` and `'`
    becomes a six-character entity). Counted before escaping, so a spec too large is never escaped."""
    return len(compact) + 5 * sum(compact.count(c) for c in "<>&\"'")


def _script_safe(compact: str) -> str:
    for char, escape in _JSON_ESCAPES:
        compact = compact.replace(char, escape)
    return compact


def _spec_json(text: bytes) -> str | None:
    """A hostile spec as JSON that is safe inside a script element, or None when it is not a figure."""
    try:
        return _script_safe(_compact_figure(text))
    except _NotShown:
        return None


def _prepared(text: bytes, room: int) -> tuple[str | None, int]:
    """(the spec as it goes into the embed's srcdoc, its size), or (None, its size) when it would take
    more than `room` bytes. Raises _NotShown when it is not a figure. Run in a thread: a spec is up to
    MAX_CHART_BYTES, and each step is one pass over it."""
    compact = _compact_figure(text)
    size = _embedded_size(compact)
    if size > room:
        return None, size
    return html.escape(_script_safe(compact), quote=True), size


# The inner document's one script: plotly.js is fetched (from the embedding page's origin) once the
# chart first scrolls into view, SETTLE_MS later, when the page is idle, then each spec is drawn.
# Running plotly.js takes the page's main thread for a few hundred milliseconds: started at once, it
# held back the chat's text as the page opened (a chat of five charts showed its text 0.2-0.3 s later
# than with no plotly.js loaded at all; with the wait, no later). `__SCRIPT__` and `__NAMES__` are
# filled in as JSON (a path the host chose; the charts' file names, for the PNG download's name). No
# `//` in it: the browser test finds no URL in an embed but plotly.js's path.
_LOADER = """
const names = __NAMES__;
const specs = JSON.parse(document.getElementById('specs').textContent);
const draw = () => specs.forEach((spec, i) => {
  const layout = Object.assign({}, spec.layout, {autosize: true});
  delete layout.width;
  delete layout.height;
  const titled = layout.title && (typeof layout.title === 'string' || layout.title.text);
  layout.margin = Object.assign({t: titled ? 56 : 24, b: 48, l: 56, r: 24}, layout.margin);
  Plotly.newPlot('chart-' + i, spec.data, layout, {
    responsive: true, displaylogo: false, showSendToCloud: false, showEditInChartStudio: false,
    toImageButtonOptions: {filename: names[i]},
  });
});
const failed = () => {
  document.body.textContent = 'The interactive chart could not be drawn: Open WebUI did not serve ' +
    'plotly.js. Its picture is in the block of the run that made it.';
};
const load = () => {
  const script = document.createElement('script');
  script.src = __SCRIPT__;
  script.onload = () => (typeof Plotly === 'undefined' ? failed() : draw());
  script.onerror = failed;
  document.head.appendChild(script);
};
const idle = window.requestIdleCallback || ((then) => setTimeout(then, 50));
new IntersectionObserver((seen, observer) => {
  if (seen.some((entry) => entry.isIntersecting)) {
    observer.disconnect();
    setTimeout(() => idle(load, {timeout: 2000}), SETTLE_MS);
  }
}).observe(document.body);
"""


_SETTLE_MS = 800  # after a chart comes into view, before plotly.js runs (see _LOADER)


def _hash(script: str) -> str:
    """A CSP hash-source allowing exactly this inline script."""
    return "'sha256-" + base64.b64encode(hashlib.sha256(script.encode()).digest()).decode("ascii") + "'"


def _csp(*scripts: str) -> str:
    allowed = " ".join(_hash(script) for script in scripts)
    return (
        f"default-src 'none'; script-src 'self' {allowed}; style-src 'unsafe-inline'; "
        "img-src data: blob:; font-src data:"
    )


@dataclass(frozen=True, slots=True)
class ChartEmbed:
    """The message's embed before the host says where plotly.js is served: `script` is the sandbox
    environment's plotly.min.js, which the host serves; `html` is the embed once it has that URL.
    `specs`: each spec as it goes into the srcdoc (`_prepared`); `names`: the charts' file names."""

    specs: tuple[str, ...]
    names: tuple[str, ...]
    script: Path

    def html(self, script_url: str) -> str:
        """The embed, loading plotly.js from `script_url` (a path on Open WebUI's own origin). Blocking:
        a spec may be megabytes, so the host calls it in a thread."""
        if len(script_url) > MAX_SCRIPT_URL or not _SCRIPT_URL.fullmatch(script_url):
            raise ValueError(f"not a path plotly.js can be served at: {script_url[:80]!r}")
        return _embed(self.specs, self.names, script_url)


def embed_html(specs: Sequence[str], script_url: str, names: Sequence[str] = ()) -> str:
    """One embed showing every chart of the message (plotly.js fetched once): the outer fixed frame,
    with the charts in an inner iframe without same-origin (see the module's docstring). `specs`: JSON
    safe in a script element (`_spec_json`)."""
    named = tuple(names) or tuple(f"chart-{i + 1}" for i in range(len(specs)))
    return _embed([html.escape(spec, quote=True) for spec in specs], named, script_url)


def _framing(names: Sequence[str], script_url: str) -> tuple[str, str, str]:
    """The embed around its specs, each piece as it stands in the outer document (the inner document
    escaped for the srcdoc): (before the specs, between the specs, after them)."""
    count = len(names)
    loader = _LOADER.replace("SETTLE_MS", str(_SETTLE_MS)).replace("__SCRIPT__", _script_json(script_url))
    loader = loader.replace(
        "__NAMES__", _script_json([name.rsplit("/", 1)[-1].removesuffix(CHART_SUFFIX) for name in names])
    )
    height = CHART_HEIGHT * count
    resize = f"parent.postMessage({{type:'iframe:height',height:{height}}},'*')"
    csp = _csp(resize, loader)  # the inner document keeps its embedder's policy too: one for both
    divs = "".join(f'<div id="chart-{i}" class="chart"></div>' for i in range(count))
    inner_head = (
        f'<!doctype html><html><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{csp}">'
        "<style>html,body{margin:0;background:#fff;font:14px sans-serif}.chart{height:"
        f"{CHART_HEIGHT - 10}px;margin-bottom:10px}}</style></head><body>{divs}"
        '<script type="application/json" id="specs">['
    )
    inner_tail = f"]</script><script>{loader}</script></body></html>"
    outer_head = (
        f'<!doctype html><html><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{csp}">'
        f"<style>html,body{{margin:0}}iframe{{border:0;width:100%;height:{height}px;display:block}}</style>"
        # lazy: a chart out of view makes no document yet (fewer frames as the chat opens)
        '</head><body><iframe sandbox="allow-scripts allow-downloads" loading="lazy" '
        'title="Interactive chart" srcdoc="'
    )
    outer_tail = f'"></iframe><script>{resize}</script></body></html>'
    escape = functools.partial(html.escape, quote=True)
    return outer_head + escape(inner_head), escape(","), escape(inner_tail) + outer_tail


def _script_json(value: object) -> str:
    """JSON that is safe inside a script element."""
    return _script_safe(json.dumps(value))


def _embed(escaped_specs: Sequence[str], names: Sequence[str], script_url: str) -> str:
    """The embed of specs already escaped for the srcdoc."""
    before, between, after = _framing(names, script_url)
    return before + between.join(escaped_specs) + after


def _framing_size(names: Sequence[str]) -> int:
    """The embed's bytes but the specs, for these charts (with the longest URL plotly.js may have)."""
    before, between, after = _framing(names, "/" + "x" * (MAX_SCRIPT_URL - 1))
    return len(before) + len(between) * max(0, len(names) - 1) + len(after)


HeadReader = Callable[[str, int], Awaitable[tuple[bytes, int]]]


async def chart_embed(
    charts: Sequence[str], read_head: HeadReader, environment_root: Path | None
) -> tuple[ChartEmbed | None, list[str]]:
    """The message's embed for its charts (None: nothing to show), and sentences about the charts that
    cannot be shown interactively (too large, not a figure, unreadable, over the embed's bound, no
    plotly.js). Never raises for a chart: each one that fails is left out with its sentence."""
    if not charts:
        return None, []
    try:
        script = await plotly_js(environment_root) if environment_root is not None else None
    except OSError as error:
        return None, [f"Interactive charts are not shown: plotly.js could not be found ({error})."]
    if script is None:
        return None, ["Interactive charts are not shown: the sandbox environment has no plotly.js."]
    wanted = list(dict.fromkeys(charts))[:MAX_CHARTS]
    # The bound leaves room for the frames of every chart wanted (a chart left out only shrinks them).
    room = MAX_EMBED_BYTES - await asyncio.to_thread(_framing_size, wanted)
    specs: list[str] = []
    names: list[str] = []
    notes: list[str] = []
    over: list[str] = []
    for path in wanted:
        try:
            data, size = await read_head(path, MAX_CHART_BYTES + 1)
            if size > MAX_CHART_BYTES:
                raise _NotShown(f"larger than {human_bytes(MAX_CHART_BYTES)}")
            spec, taken = await asyncio.to_thread(_prepared, data, room)
        except StorageError:
            continue  # deleted since: nothing to show
        except _NotShown as why:
            notes.append(f"{mention(path)} is not shown interactively: {why}")
            continue
        except Exception as error:  # whatever it is, a chart never ends the answer
            notes.append(
                f"{mention(path)} is not shown interactively: it could not be read ({_named(error)})"
            )
            continue
        if spec is None:
            over.append(path)
            continue
        specs.append(spec)
        names.append(path)
        room -= taken
    if over:
        notes.append(_over_the_bound(over))
    if not specs:
        return None, notes
    return ChartEmbed(tuple(specs), tuple(names), script), notes


def _over_the_bound(paths: Sequence[str]) -> str:
    """The one sentence about the charts left out of the embed for its size."""
    one = len(paths) == 1
    return (
        f"{', '.join(mention(path) for path in paths)} {'is' if one else 'are'} not shown interactively: "
        f"with {'it' if one else 'them'}, the message's charts would take more than "
        f"{human_bytes(MAX_EMBED_BYTES)} ({'it stays a file' if one else 'they stay files'} of the chat)"
    )


def _named(error: BaseException) -> str:
    text = str(error)
    return type(error).__name__ + (f": {text[:120]}" if text else "")
