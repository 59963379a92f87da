"""Open WebUI 0.12.4's Files API, stood in for in-process, as the function uses it (webui/files.py).

The in-process harness (tests/support/pipe_harness.py) has no Open WebUI, so the function's
`FilesPublisher` cannot run there. This stand-in keeps its behaviour, with the bundle's own rules
(`_stored_as`, `MAX_STORED_BYTES`, `ID_PREFIX`, `KIND`, `attachment_item`, `content_url`, read from the
loaded bundle so they cannot drift):

* a copy becomes a file row owned by the chat's user, its bytes written to `uploads/` under
  `<id><.png|.bin...>` (on whatever disk that folder is: a full one refuses, as Open WebUI's local
  storage provider does); ids are `code-sessions-<uuid4>`, links `/api/v1/files/<id>/content`;
* `fetch(url, viewer)` answers the way `routers/files.py` does: the owner, an admin, or a user the chat
  is shared with (a `chat_file` row plus a grant) gets the bytes; anyone else gets None (a 404); passive
  images keep their type, everything else is a download (`application/octet-stream`, attachment);
* `attach` is `OpenWebUI.attach` over `webui/files.py` `attach`: `chat_file` rows for every linked
  copy, the message's files (non-images, each once), one `chat:message:files` event with the full list;
* `remove`, `missing`, `strays` as `FilesPublisher` has them.

The claims about Open WebUI itself are proven against a real one (tests/e2e/test_files_api.py,
tests/adversarial/test_cross_tenant.py); this is what lets the many in-process tests check links the
way production makes them.
"""

from __future__ import annotations

import asyncio
import errno
import json
import mimetypes
import re
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

ID_PATTERN = r"code-sessions-[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}"
URL_PATTERN = rf"/api/v1/files/{ID_PATTERN}/content"  # no groups: for patterns of a whole answer
LINK = re.compile(rf"/api/v1/files/({ID_PATTERN})/content")


def _content_type(name: str) -> str:
    return mimetypes.guess_type(name, strict=False)[0] or "application/octet-stream"


@dataclass
class FileRow:
    id: str
    user_id: str
    path: Path
    name: str
    content_type: str
    size: int
    meta: dict[str, Any]
    created_at: float


@dataclass(frozen=True)
class Served:
    """What `GET /api/v1/files/<id>/content` gives a reader who may see the file."""

    body: bytes
    content_type: str
    disposition: str  # "attachment" for every download; images are attachments that an <img> renders


class FilesApi:
    """The Files API of one Open WebUI, in memory, with the bytes on disk under `uploads`."""

    def __init__(self, bundle: ModuleType, uploads: Path, database: Path) -> None:
        """`database`: where its rows live across restarts (Open WebUI's webui.db, as a JSON file)."""
        package = bundle._CS_PACKAGE
        self._storage = __import__(package + ".storage", fromlist=["storage"])
        self._files = __import__(package + ".webui.files", fromlist=["files"])
        self.uploads = uploads
        self._database = database
        self.rows: dict[str, FileRow] = {}
        self.chat_files: set[tuple[str, str, str]] = set()  # (chat id, message id, file id)
        self.message_files: dict[tuple[str, str], list[dict[str, Any]]] = {}
        self.shared_with: dict[str, set[str]] = {}  # chat id -> users granted read
        self.admins: set[str] = set()
        self._load()

    def _load(self) -> None:
        if not self._database.is_file():
            return
        saved = json.loads(self._database.read_text())
        self.rows = {r["id"]: FileRow(**{**r, "path": Path(r["path"])}) for r in saved["rows"]}
        self.chat_files = {tuple(c) for c in saved["chat_files"]}
        self.message_files = {(chat, message): files for chat, message, files in saved["message_files"]}

    def _save(self) -> None:
        rows = [{**asdict(r), "path": str(r.path)} for r in self.rows.values()]
        saved = {
            "rows": rows,
            "chat_files": sorted(self.chat_files),
            "message_files": [
                [chat, message, files] for (chat, message), files in self.message_files.items()
            ],
        }
        self._database.parent.mkdir(parents=True, exist_ok=True)
        self._database.write_text(json.dumps(saved))

    # -- what the function calls ----------------------------------------------------------------------

    def publisher(self) -> _Publisher:
        return _Publisher(self)

    async def attach(
        self,
        chat_id: str,
        message_id: str | None,
        user_id: str,
        links: list,
        emit: Any,
        *,
        inline_urls=(),
        replacing=(),
    ) -> None:
        """`OpenWebUI.attach`: nothing for a temporary chat or without a message id; every file linked
        to the chat, the message's attachments each once, but the images the text shows inline; the
        attachments whose ids are in `replacing` go."""
        saved = bool(chat_id) and not chat_id.startswith(("temporary:", "local:", "channel:"))
        if not links or not message_id or not saved:
            return
        items = [
            self._files.attachment_item(link, _content_type(link.name))
            for link in links
            if link.url.startswith("/api/")
        ]
        if not items:
            return
        self.chat_files.update((chat_id, message_id, item["id"]) for item in items)
        files = self.message_files.setdefault((chat_id, message_id), [])
        already = {f["id"] for f in files}
        new = [item for item in items if item["id"] not in already and item["url"] not in inline_urls]
        replaced = [f for f in files if f["id"] in replacing]
        files[:] = [f for f in files if f["id"] not in replacing]
        files.extend(new)
        self._save()
        if not new and not replaced:
            return
        if emit is not None:
            await emit({"type": "chat:message:files", "data": {"files": list(files)}})

    # -- what a browser gets --------------------------------------------------------------------------

    def fetch(self, url: str, viewer: str) -> Served | None:
        """The link as `viewer` opens it; None where Open WebUI answers 404."""
        found = LINK.fullmatch(url)
        row = self.rows.get(found.group(1)) if found else None
        if row is None or not self._may_read(row, viewer) or not row.path.is_file():
            return None
        return Served(row.path.read_bytes(), row.content_type, "attachment")

    def share(self, chat_id: str, user_id: str) -> None:
        self.shared_with.setdefault(chat_id, set()).add(user_id)

    def unshare(self, chat_id: str, user_id: str) -> None:
        self.shared_with.get(chat_id, set()).discard(user_id)

    def stored(self) -> list[Path]:
        """Every copy's bytes on disk."""
        return sorted(p for p in self.uploads.glob("*") if p.is_file()) if self.uploads.is_dir() else []

    def _may_read(self, row: FileRow, viewer: str) -> bool:
        if viewer == row.user_id or viewer in self.admins:
            return True
        chats = {chat for chat, _, file_id in self.chat_files if file_id == row.id}
        return any(viewer in self.shared_with.get(chat, set()) for chat in chats)


class _Publisher:
    """`FilesPublisher` over the stand-in: the same checks, ids, names, types and errors."""

    def __init__(self, api: FilesApi) -> None:
        self._api = api
        self.kind = api._files.KIND

    async def put(self, copy: Any) -> Any:
        files, storage = self._api._files, self._api._storage
        if copy.size == 0:
            raise storage.StorageError(f"{copy.path} is empty: there is nothing to download")
        if copy.size > files.MAX_STORED_BYTES:
            size, most = storage.human_bytes(copy.size), storage.human_bytes(files.MAX_STORED_BYTES)
            raise storage.StorageError(
                f"{copy.path} is too large to link ({size}; Open WebUI holds a file in memory while it "
                f"stores it, so links stop at {most})"
            )
        file_id = files.ID_PREFIX + str(uuid.uuid4())
        extension, content_type = files._stored_as(copy)
        path = self._api.uploads / (file_id + extension)
        try:
            await asyncio.to_thread(self._write, path, files._WholeFile(copy.fd, copy.size))
        except OSError as error:
            path.unlink(missing_ok=True)
            if error.errno in (errno.ENOSPC, errno.EDQUOT):
                raise storage.DiskFull(
                    f"Not enough disk space to publish {copy.path}; nothing was published."
                ) from error
            raise storage.StorageError(f"{copy.path} could not be stored by Open WebUI: {error}") from error
        meta = {
            "name": copy.name,
            "content_type": content_type,
            "size": copy.size,
            "code_sessions": {"chat_id": copy.chat_id, "path": copy.path, "sha256": copy.sha256},
        }
        self._api.rows[file_id] = FileRow(
            file_id, copy.user_id, path, copy.name, content_type, copy.size, meta, time.time()
        )
        self._api._save()
        return storage.Published(file_id, files.content_url(file_id))

    def _write(self, path: Path, source: Any) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(source.read())

    async def remove(self, refs: Any) -> None:
        for ref in refs:
            row = self._api.rows.pop(ref, None) if ref.startswith(self._api._files.ID_PREFIX) else None
            if row is not None:
                row.path.unlink(missing_ok=True)
                self._api.chat_files = {c for c in self._api.chat_files if c[2] != ref}
        self._api._save()

    async def missing(self, refs: Any) -> set[str]:
        return {r for r in refs if r not in self._api.rows or not self._api.rows[r].path.is_file()}

    async def strays(self, known: set[str], older_than_s: float) -> list[str]:
        cutoff = time.time() - older_than_s
        return [i for i, row in self._api.rows.items() if i not in known and row.created_at <= cutoff]
