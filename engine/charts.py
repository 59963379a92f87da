"""Interactive charts: the plotly figures a run saved (chart-N.plotly.json, see the kernel program's
charts.py), drawn by plotly.js in the message, through Open WebUI's `embeds` (HTML that its page shows
in a sandboxed iframe, saved with the message).

Isolation. Open WebUI gives an embed's iframe `allow-scripts` and, when the user turns on "iframe
sandbox allow same origin", `allow-same-origin` too: a script in it could then read the user's token.
So the embed's own document runs no script that touches the chart: it is a fixed frame (one line that
tells Open WebUI its height) around an inner iframe with `sandbox="allow-scripts"` only, whose document
(the `srcdoc`, escaped) holds plotly.js and the specs. The inner document's origin is opaque whatever
the user's setting, and both documents carry a Content-Security-Policy that allows no network at all
(`default-src 'none'`): plotly.js comes with the embed, from the sandbox environment's plotly package,
deflated and base64-encoded (about 2 MB for its 4.8 MB), never from a CDN.

The specs are hostile JSON: each is parsed and re-serialised, `<`, `>` and `&` written as escapes, so
nothing in it can end the script element it sits in; it reaches plotly.js as data.
"""

from __future__ import annotations

import asyncio
import base64
import html
import json
import re
import zlib
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from runner import RunResult
from storage import ReconcileReport, StorageError, human_bytes

from .markup import mention

__all__ = [
    "CHART_SUFFIX",
    "MAX_CHARTS",
    "MAX_CHART_BYTES",
    "charts_of",
    "embed_html",
    "figures_of",
    "plotly_script",
]

CHART_SUFFIX = ".plotly.json"
MAX_CHART_BYTES = 4 * 1024 * 1024  # of one chart's spec (a bigger one stays a file and a picture)
MAX_CHARTS = 20  # charts in one message's embed
CHART_HEIGHT = 440  # pixels, each
_FIGURE_SUFFIXES = (".png",)
_PLAIN_NAME = re.compile(r"[A-Za-z0-9._-]+(?:/[A-Za-z0-9._-]+)*")
_PLOTLY_JS = "usr/local/lib/python3*/dist-packages/plotly/package_data/plotly.min.js"
_CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data: blob:; "
    "font-src data:"
)
_JSON_ESCAPES = str.maketrans(
    {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}
)


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


_script_cache: dict[tuple[str, float], str] = {}


def _load_plotly_js(root: Path) -> str | None:
    found = sorted(root.glob(_PLOTLY_JS))
    if not found:
        return None
    path = found[-1]
    key = (str(path), path.stat().st_mtime)
    if key not in _script_cache:
        _script_cache.clear()
        _script_cache[key] = base64.b64encode(zlib.compress(path.read_bytes(), 9)).decode("ascii")
    return _script_cache[key]


async def plotly_script(environment_root: Path) -> str | None:
    """plotly.js of the sandbox environment (the same version as the plotly that wrote the specs),
    deflated and in base64, made once per process; None when the environment has no plotly."""
    return await asyncio.to_thread(_load_plotly_js, environment_root)


def _spec_json(text: bytes) -> str | None:
    """A hostile spec as JSON that is safe inside a script element, or None when it is not a figure."""
    try:
        spec = json.loads(text)
    except ValueError:
        return None
    if not isinstance(spec, dict) or not isinstance(spec.get("data", []), list):
        return None
    figure = {"data": spec.get("data") or [], "layout": spec.get("layout") or {}}
    if not isinstance(figure["layout"], dict):
        figure["layout"] = {}
    return json.dumps(figure, separators=(",", ":")).translate(_JSON_ESCAPES)


_LOADER = """
(async () => {
  const bin = atob(document.getElementById('plotly').textContent.trim());
  const bytes = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream('deflate'));
  const script = document.createElement('script');
  script.textContent = await new Response(stream).text();
  document.head.appendChild(script);
  const specs = JSON.parse(document.getElementById('specs').textContent);
  specs.forEach((spec, i) => {
    const layout = Object.assign({}, spec.layout, {autosize: true});
    delete layout.width;
    delete layout.height;
    Plotly.newPlot('chart-' + i, spec.data, layout, {responsive: true, displaylogo: false});
  });
})();
"""


def embed_html(specs: Sequence[str], script_b64: str) -> str:
    """One embed showing every chart of the message (plotly.js once): the outer fixed frame, with the
    charts in an inner iframe without same-origin (see the module's docstring)."""
    divs = "".join(f'<div id="chart-{i}" class="chart"></div>' for i in range(len(specs)))
    inner = (
        f'<!doctype html><html><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">'
        "<style>html,body{margin:0;background:#fff}.chart{height:"
        f"{CHART_HEIGHT - 10}px;margin-bottom:10px}}</style></head><body>{divs}"
        f'<script type="text/plain" id="plotly">{script_b64}</script>'
        f'<script type="application/json" id="specs">[{",".join(specs)}]</script>'
        f"<script>{_LOADER}</script></body></html>"
    )
    height = CHART_HEIGHT * len(specs)
    return (
        f'<!doctype html><html><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">'
        f"<style>html,body{{margin:0}}iframe{{border:0;width:100%;height:{height}px;display:block}}</style>"
        f'</head><body><iframe sandbox="allow-scripts" title="Interactive chart" '
        f'srcdoc="{html.escape(inner, quote=True)}"></iframe>'
        f"<script>parent.postMessage({{type:'iframe:height',height:{height}}},'*')</script></body></html>"
    )


HeadReader = Callable[[str, int], Awaitable[tuple[bytes, int]]]


async def chart_embed(
    charts: Sequence[str], read_head: HeadReader, environment_root: Path | None
) -> tuple[str | None, list[str]]:
    """The message's embed for its charts (None: nothing to show), and sentences about the charts that
    cannot be shown interactively (too large, not a figure, no plotly.js)."""
    if not charts:
        return None, []
    script = await plotly_script(environment_root) if environment_root is not None else None
    if script is None:
        return None, ["Interactive charts are not shown: the sandbox environment has no plotly.js."]
    specs, notes = [], []
    for path in list(dict.fromkeys(charts))[:MAX_CHARTS]:
        try:
            data, size = await read_head(path, MAX_CHART_BYTES + 1)
        except StorageError:
            continue  # deleted since: nothing to show
        if size > MAX_CHART_BYTES:
            notes.append(
                f"{mention(path)} is not shown interactively: larger than {human_bytes(MAX_CHART_BYTES)}"
            )
            continue
        spec = await asyncio.to_thread(_spec_json, data) if len(data) > 65536 else _spec_json(data)
        if spec is None:
            notes.append(f"{mention(path)} is not shown interactively: it is not a plotly figure")
            continue
        specs.append(spec)
    return (embed_html(specs, script) if specs else None), notes
