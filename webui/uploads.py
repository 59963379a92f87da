"""The upload link's route on Open WebUI's own web server: `GET|POST /code-sessions/upload/<token>`.

Open WebUI (0.12.4) has no hook for a function's own HTTP routes, so the route is put at the front of
its FastAPI app's routes (before the web UI's catch-all), once per worker process, by whichever Code
Sessions file that process loads first; a newer version's receiver replaces the older one's. Each
uvicorn worker loads functions lazily, so a worker has the route once it has loaded one of the files
(with several workers, ENABLE_BASE_MODELS_CACHE=true makes each load them at start: docs/operations.md,
"Scaling out").

The token in the URL is the credential: the link works from a browser or another system without a
login. A request that does carry an Open WebUI login (a bearer token, an API key or the browser's
cookie) must be the chat's owner's: another user's login never helps, and is refused before the link
is touched. A link whose chat is gone (deleted in Open WebUI, purged, expired) answers as a dead
link (410) and creates nothing: neither the chat's folder nor its index row is made again for it.
The body is read as it streams (webui/multipart.py); the storage checks the per-file limit and the
quota as it arrives, and a refusal is a sentence (JSON `detail`, or a small page for a browser). A
refused upload's remaining body is read and dropped, so the sender gets the sentence
rather than a broken connection.
"""

from __future__ import annotations

import html
import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol

from storage import (
    DiskFull,
    FileExists,
    Incoming,
    InvalidPath,
    LinkRefused,
    QuotaExceeded,
    SessionGone,
    StorageBusy,
    StorageError,
    UploadGrant,
)

from .multipart import MultipartError, MultipartFile, boundary_of
from .routes import add_route_once

log = logging.getLogger("code_sessions.function")

__all__ = ["ROUTE", "UploadReceiver", "receive_body", "receive_upload", "register_upload_route", "upload_url"]

ROUTE = "/code-sessions/upload/{token}"
_PREFIX = ROUTE.split("{", 1)[0]
_STATE_RECEIVER = "code_sessions_upload_receiver"
_STATE_ROUTE = "code_sessions_upload_route"
_BATCH = 1 << 20  # bytes handed to the storage at once (one thread hop per MiB, not per packet)


class UploadReceiver(Protocol):
    """What receives an upload (engine.Inbound)."""

    async def peek(self, token: str) -> UploadGrant: ...

    async def claim(self, token: str) -> UploadGrant: ...

    async def begin(self, grant: UploadGrant) -> Incoming: ...

    async def finish(self, grant: UploadGrant, incoming: Incoming) -> str: ...


def upload_url(base_url: str, token: str) -> str:
    return base_url.rstrip("/") + _PREFIX + token


def register_upload_route(app: Any, receiver: UploadReceiver) -> None:
    """Serve upload links in this process from now on (idempotent; the latest receiver is used)."""
    setattr(app.state, _STATE_RECEIVER, receiver)
    add_route_once(app, ROUTE, _endpoint, ["GET", "POST"], _STATE_ROUTE, "upload links")


async def _endpoint(request: Any) -> Any:
    receiver: UploadReceiver = getattr(request.app.state, _STATE_RECEIVER)
    token = str(request.path_params.get("token") or "")
    browser = "text/html" in request.headers.get("accept", "")
    try:
        grant = await receiver.peek(token)
    except LinkRefused as refused:
        return _answer(request, browser, 404 if refused.kind == "unknown" else 410, str(refused))
    except StorageError as error:  # the link is not used up: the sender may try again
        return _answer(request, browser, _status(error), _sentence(error))
    refusal = await _foreign_login(request, grant.user_id)
    if refusal is not None:
        return _answer(request, browser, 403, refusal)
    if request.method == "GET":
        return _page(grant)
    return await _receive(request, receiver, token, browser)


async def _receive(request: Any, receiver: UploadReceiver, token: str, browser: bool) -> Any:
    status, sentence, extra = await receive_upload(
        receiver, token, request.headers.get("content-type", ""), request.stream()
    )
    return _answer(request, browser, status, sentence, **extra)


async def receive_upload(
    receiver: UploadReceiver, token: str, content_type: str, stream: AsyncIterator[bytes]
) -> tuple[int, str, dict[str, Any]]:
    """An upload link's POST once the link and the login were checked: (HTTP status, the sentence,
    what else the JSON answer holds). Reads the body as it streams (`stream`), to its end whatever
    happens, so the sender gets the answer."""
    try:
        parser = MultipartFile(boundary_of(content_type))
    except MultipartError as error:
        return 400, str(error), {}
    try:
        grant = await receiver.claim(token)  # from here on the link is used, whatever follows
    except LinkRefused as refused:
        return 410, str(refused), {}
    try:
        incoming = await receiver.begin(grant)
    except StorageError as error:
        await _drain(stream)
        return _status(error), _sentence(error), {}
    try:
        await receive_body(parser, incoming, stream)
        said = await receiver.finish(grant, incoming)
    except (StorageError, MultipartError) as error:
        await incoming.discard()
        await _drain(stream)
        if isinstance(error, MultipartError):
            return 400, str(error), {}
        return _status(error), _sentence(error), {}
    except BaseException:
        await incoming.discard()
        raise
    await _drain(stream)
    log.info("code-sessions: upload link: %d bytes into chat %r", incoming.received, grant.chat_id[:80])
    return 201, said, {"path": f"/mnt/data/{grant.path}", "size": incoming.received}


async def receive_body(parser: MultipartFile, incoming: Incoming, chunks: AsyncIterator[bytes]) -> None:
    """Feed the body to the multipart reader and the file's data to the storage (a MiB at a time), as
    it arrives; stops at the file's closing delimiter. Raises MultipartError when the body ends before
    it, and the storage's refusals (QuotaExceeded, DiskFull) as they happen."""
    pending: list[bytes] = []
    size = 0
    async for chunk in chunks:
        for data in parser.feed(chunk):
            pending.append(data)
            size += len(data)
        if size >= _BATCH:
            await incoming.write(b"".join(pending))
            pending, size = [], 0
        if parser.done:
            break
    if pending:
        await incoming.write(b"".join(pending))
    if not parser.done:
        raise MultipartError(
            "The upload ended before the whole file arrived; nothing was saved. Ask in the chat for a "
            "new upload link and send the file again."
        )


async def _drain(stream: Any) -> None:
    """Read and drop the rest of the body: a sender still writing gets our answer, not a reset."""
    try:
        async for _ in stream:
            pass
    except Exception:  # the body was read whole already, or the sender went away
        return


async def _foreign_login(request: Any, owner_id: str) -> str | None:
    """A sentence when the request carries an Open WebUI login that is not the chat owner's (or not a
    valid one); None when it carries none, or the owner's."""
    from fastapi import BackgroundTasks, HTTPException, Response
    from open_webui.utils.auth import get_current_user, get_http_authorization_cred

    credentials = get_http_authorization_cred(request.headers.get("authorization"))
    if credentials is None and not request.cookies.get("token"):
        return None
    try:
        user = await get_current_user(request, Response(), BackgroundTasks(), auth_token=credentials)
    except HTTPException:
        return (
            "The login sent with this upload is not valid. Send the upload without it (the link is "
            "enough), or log in again."
        )
    if getattr(user, "id", None) != owner_id:
        return (
            "This upload link belongs to another user's chat: your login does not open it, and nothing "
            "was uploaded. Ask in your own chat for a link of your own."
        )
    return None


def _status(error: StorageError) -> int:
    if isinstance(error, LinkRefused | SessionGone):  # the chat went while the file arrived
        return 410
    if isinstance(error, QuotaExceeded):
        return 413
    if isinstance(error, FileExists):
        return 409
    if isinstance(error, DiskFull):
        return 507
    if isinstance(error, StorageBusy):
        return 503
    if isinstance(error, InvalidPath):
        return 400
    return 500


def _sentence(error: StorageError) -> str:
    text = str(error)
    if isinstance(error, QuotaExceeded | DiskFull | LinkRefused | SessionGone):
        return text
    return f"The upload was not saved: {text}."


def _answer(request: Any, browser: bool, status: int, sentence: str, **extra: Any) -> Any:
    from starlette.responses import HTMLResponse, JSONResponse

    headers = {"Cache-Control": "no-store", "Referrer-Policy": "no-referrer"}
    if browser:
        body = f"<p>{html.escape(sentence)}</p>"
        return HTMLResponse(_html("Upload", body), status_code=status, headers={**headers, **_PAGE_HEADERS})
    return JSONResponse({"detail": sentence, **extra}, status_code=status, headers=headers)


_PAGE_HEADERS = {
    # Our page runs on Open WebUI's origin: no script at all, nothing loaded from elsewhere, never framed.
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; "
    "frame-ancestors 'none'; base-uri 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
}


def _page(grant: UploadGrant) -> Any:
    from starlette.responses import HTMLResponse

    target = html.escape(f"/mnt/data/{grant.path}")
    body = (
        f"<p>Choose the file to put at <code>{target}</code> in your chat. The link takes one file, "
        "once.</p>"
        '<form method="post" enctype="multipart/form-data">'
        '<input type="file" name="file" required> <button type="submit">Upload</button></form>'
    )
    headers = {"Cache-Control": "no-store", "Referrer-Policy": "no-referrer", **_PAGE_HEADERS}
    return HTMLResponse(_html("Upload a file", body), headers=headers)


def _html(title: str, body: str) -> str:
    return (
        f'<!doctype html><html><head><meta charset="utf-8"><title>{title}</title>'
        "<style>body{font-family:sans-serif;max-width:40rem;margin:3rem auto}</style></head>"
        f"<body><h1>{title}</h1>{body}</body></html>"
    )
