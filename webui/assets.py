"""plotly.js for the charts' embeds, served by Open WebUI's own web server:
`GET /code-sessions/plotly/<digest>.js`.

A chart's embed is saved with its message; with plotly.js inside, every chart stored 2 MB with the
chat, and a chat of a few charts took seconds to load. So the embed names plotly.js by URL instead
(engine/charts.py), and this route serves it.

What it serves: only files of one folder (`<DATA_DIR>/code_sessions_assets/`, shared by every worker
and replica that shares DATA_DIR), named by the SHA-256 of their content, written there by `publish`
from the sandbox environment's plotly package (installed by the admin, never by a chat): a name is
checked against the digest's pattern before it names a file, and nothing a user or a chat sends ever
becomes one of these files. A version stays after the environment moves on, so older messages keep
drawing with the plotly.js their charts were made for. Each is served as JavaScript with `nosniff`
(a browser never renders it as a page of Open WebUI's origin), a `sandbox` Content-Security-Policy
(opened as a document, it gets an opaque origin), cached for a year (the name changes with the
content), gzipped when the browser takes it. No login: plotly.js is public code, and the charts'
frames, whose origin is opaque, send no cookie.

Like the upload link's route (webui/uploads.py), it is put at the front of the FastAPI app's routes,
before the web UI's catch-all, once per worker process, by whichever Code Sessions file loads first.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import logging
import os
import re
import tempfile
import threading
from pathlib import Path
from typing import Any

from .routes import add_route_once

log = logging.getLogger("code_sessions.function")

__all__ = ["ASSET_ROUTE", "publish", "register_asset_route"]

ASSET_ROUTE = "/code-sessions/plotly/{name}"
_PREFIX = ASSET_ROUTE.split("{", 1)[0]
_NAME = re.compile(r"[0-9a-f]{64}\.js")
_STATE_FOLDER = "code_sessions_assets_folder"
_STATE_ROUTE = "code_sessions_assets_route"
_HEADERS = {
    "Content-Type": "text/javascript; charset=utf-8",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "public, max-age=31536000, immutable",
    "Content-Security-Policy": "default-src 'none'; sandbox",
    "Cross-Origin-Resource-Policy": "cross-origin",  # the charts' frames have an opaque origin
    "Vary": "Accept-Encoding",
}
_MAX_SCRIPT = 64 << 20  # bytes of a plotly.min.js published (it is about 5 MB)

# source path -> (its size and mtime, its published name): a source is read and hashed once per process.
_published: dict[str, tuple[tuple[int, int], str]] = {}
_lock = threading.Lock()


def publish(folder: Path, source: Path) -> str:
    """Put `source` (a plotly.min.js) into `folder` under its digest, with a gzipped copy beside it,
    unless it is there already; returns the URL path it is served at. Blocking (a 5 MB read and
    compression, once per version and process); raises OSError."""
    st = source.stat()
    key = (st.st_size, st.st_mtime_ns)
    with _lock:
        known = _published.get(str(source))
        if known is not None and known[0] == key and (folder / known[1]).is_file():
            return _PREFIX + known[1]
        if st.st_size > _MAX_SCRIPT:
            raise OSError(f"{source} is larger than plotly.js can be ({st.st_size} bytes)")
        data = source.read_bytes()
        name = hashlib.sha256(data).hexdigest() + ".js"
        folder.mkdir(mode=0o755, parents=True, exist_ok=True)
        if not (folder / (name + ".gz")).is_file():
            _write(folder, name + ".gz", gzip.compress(data, 9, mtime=0))
        if not (folder / name).is_file():
            _write(folder, name, data)  # last: its presence says both are there
        _published[str(source)] = (key, name)
    return _PREFIX + name


def _write(folder: Path, name: str, data: bytes) -> None:
    """Write a file whole, or not at all (another worker may publish the same file at once: the same
    bytes, so whichever rename comes last changes nothing)."""
    fd, temporary = tempfile.mkstemp(prefix=".publishing-", dir=folder)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
        os.chmod(temporary, 0o644)
        os.replace(temporary, folder / name)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def register_asset_route(app: Any, folder: Path) -> None:
    """Serve the published files of `folder` in this process from now on (idempotent)."""
    setattr(app.state, _STATE_FOLDER, folder)
    add_route_once(app, ASSET_ROUTE, _endpoint, ["GET", "HEAD"], _STATE_ROUTE, "plotly.js")


async def _endpoint(request: Any) -> Any:
    from starlette.responses import FileResponse, PlainTextResponse

    folder: Path = getattr(request.app.state, _STATE_FOLDER)
    name = str(request.path_params.get("name") or "")
    if not _NAME.fullmatch(name):
        return PlainTextResponse("Not found.", status_code=404, headers={"X-Content-Type-Options": "nosniff"})
    gzipped = "gzip" in request.headers.get("accept-encoding", "").lower()
    path = folder / (name + ".gz" if gzipped else name)
    if not path.is_file():  # one small stat: the name is a digest, the folder ours
        return PlainTextResponse("Not found.", status_code=404, headers={"X-Content-Type-Options": "nosniff"})
    headers = dict(_HEADERS)
    if gzipped:
        headers["Content-Encoding"] = "gzip"
    # FileResponse streams the file from a thread: nothing of it is read on the event loop.
    return FileResponse(path, headers=headers, media_type=_HEADERS["Content-Type"])
