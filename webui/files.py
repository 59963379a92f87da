"""Published copies as Open WebUI files: owner-only links, and attachments on the message.

`FilesPublisher` implements storage's Publisher protocol on Open WebUI's Files API (0.12):

* a copy is a `file` row owned by the chat's user, its bytes stored through Open WebUI's own storage
  provider (local disk, or S3/GCS/Azure when Open WebUI is set up so), with no RAG processing;
* its link is `/api/v1/files/<id>/content`, which Open WebUI serves to the owner, admins, and users the
  chat is shared with (through the `chat_file` rows `attach` writes); anyone else gets 404;
* active content can never run: only passive images keep their own type and extension; everything
  else is stored under a `.bin` name with `application/octet-stream`, so every Files API route
  (`/content`, `/content/{name}`, `/content/html`, which guesses from the stored name) hands it out as a
  download, whoever owns it (an admin's HTML would otherwise run on Open WebUI's origin);
* our ids start with `code-sessions-`, so copies of ours the index does not know (a crash between the
  upload and the link's row) are found and removed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Collection, Iterable, Sequence
from typing import Any

from storage import PASSIVE_IMAGE_TYPES, Copy, DiskFull, Link, Published, StorageError, human_bytes

__all__ = ["ID_PREFIX", "FilesPublisher", "attachment_item", "content_url"]

log = logging.getLogger("code_sessions.function")

ID_PREFIX = "code-sessions-"
KIND = "open-webui-files"
_DOWNLOAD_TYPE = "application/octet-stream"
# Open WebUI's storage providers read an uploaded file into memory whole (storage/provider.py,
# upload_file): the largest copy published through them, whatever max_file_mb allows (a sparse file
# of a terabyte would otherwise be read, and written, dense).
MAX_STORED_BYTES = 1 << 30
_CHUNK = 500


def _stored_as(copy: Copy) -> tuple[str, str]:
    """(extension of the stored name, content type): passive images as themselves, the rest a download."""
    if copy.inline and copy.content_type is not None and copy.content_type in PASSIVE_IMAGE_TYPES:
        return PASSIVE_IMAGE_TYPES[copy.content_type], copy.content_type
    return ".bin", _DOWNLOAD_TYPE


def content_url(file_id: str) -> str:
    """Where Open WebUI's Files API serves a file's bytes (to those who may read it)."""
    return f"/api/v1/files/{file_id}/content"


def attachment_item(link: Link, content_type: str) -> dict[str, Any]:
    """The item Open WebUI shows as a file chip (or an image) under the message."""
    ref = link.ref
    return {
        "type": "image" if link.is_image else "file",
        "id": ref,
        "url": content_url(ref),
        "name": link.name,
        "content_type": content_type,
        "size": link.size,
    }


class FilesPublisher:
    kind = KIND

    async def put(self, copy: Copy) -> Published:
        if copy.size == 0:
            raise StorageError(f"{copy.path} is empty: there is nothing to download")
        if copy.size > MAX_STORED_BYTES:
            raise StorageError(
                f"{copy.path} is too large to link ({human_bytes(copy.size)}; Open WebUI holds a file in "
                f"memory while it stores it, so links stop at {human_bytes(MAX_STORED_BYTES)})"
            )
        from open_webui.models.files import FileForm, Files
        from open_webui.storage.provider import Storage

        file_id = ID_PREFIX + str(uuid.uuid4())
        extension, content_type = _stored_as(copy)
        try:
            _, stored = await asyncio.to_thread(
                Storage.upload_file, _WholeFile(copy.fd, copy.size), file_id + extension, {}
            )
        except OSError as error:
            if error.errno in (28, 122):  # ENOSPC, EDQUOT
                raise DiskFull(
                    f"Not enough disk space to publish {copy.path}; nothing was published."
                ) from error
            raise StorageError(f"{copy.path} could not be stored by Open WebUI: {error}") from error
        except Exception as error:  # a cloud provider's own errors
            raise StorageError(f"{copy.path} could not be stored by Open WebUI: {error}") from error
        meta = {
            "name": copy.name,
            "content_type": content_type,
            "size": copy.size,
            # What the copy is, for an admin looking at Open WebUI's files (and for us, finding ours).
            "code_sessions": {"chat_id": copy.chat_id, "path": copy.path, "sha256": copy.sha256},
        }
        form = FileForm(id=file_id, filename=copy.name, path=stored, meta=meta, data={})
        row = await Files.insert_new_file(copy.user_id, form)
        if row is None:  # Open WebUI logged why; keep no bytes of a record that does not exist
            await asyncio.to_thread(_delete_stored, stored)
            raise StorageError(f"{copy.path} could not be recorded by Open WebUI (see its log)")
        return Published(file_id, content_url(file_id))

    async def remove(self, refs: Sequence[str]) -> None:
        from open_webui.models.files import Files

        for start in range(0, len(refs), _CHUNK):
            chunk = [r for r in refs[start : start + _CHUNK] if r.startswith(ID_PREFIX)]
            for row in await Files.get_files_by_ids(chunk):
                if row.path:
                    await asyncio.to_thread(_delete_stored, row.path)
                await Files.delete_file_by_id(row.id)
                await _drop_chat_links(row.id)

    async def missing(self, refs: Sequence[str]) -> set[str]:
        from open_webui.models.files import Files

        present: set[str] = set()
        for start in range(0, len(refs), _CHUNK):
            rows = await Files.get_files_by_ids(list(refs[start : start + _CHUNK]))
            stored = [(row.id, row.path) for row in rows]
            present.update(await asyncio.to_thread(_with_bytes_there, stored))
        return set(refs) - present

    async def strays(self, known: set[str], older_than_s: float) -> list[str]:
        from open_webui.internal.db import get_async_db
        from open_webui.models.files import File
        from sqlalchemy import select

        cutoff = time.time() - older_than_s
        async with get_async_db() as session:
            rows = (
                await session.execute(select(File.id, File.created_at).where(File.id.like(ID_PREFIX + "%")))
            ).all()
        return [file_id for file_id, created in rows if file_id not in known and (created or 0) <= cutoff]


async def attach(
    chat_id: str,
    message_id: str,
    user_id: str,
    items: Iterable[dict[str, Any]],
    inline_urls: Collection[str] = (),
    replacing: Collection[str] = (),
) -> list[dict[str, Any]] | None:
    """Link the answer's files to the chat (shared-chat readers may then fetch them), and to the
    message as attachments, each once, except the images the text shows inline (`inline_urls`: as
    attachments they would show twice); the attachments whose ids are in `replacing` go (copies these
    replace). Returns the message's full list of files, for the UI."""
    from open_webui.models.chats import Chats

    items = list(items)
    if not items:
        return None
    ids = [item["id"] for item in items]
    await Chats.insert_chat_files(chat_id=chat_id, message_id=message_id, file_ids=ids, user_id=user_id)
    message = await Chats.get_message_by_id_and_message_id(chat_id, message_id) or {}
    listed = [f for f in message.get("files") or [] if isinstance(f, dict)]
    already = {f.get("id") for f in listed}
    new = [item for item in items if item["id"] not in already and item["url"] not in inline_urls]
    if replacing and any(f.get("id") in replacing for f in listed):
        kept = [f for f in listed if f.get("id") not in replacing] + new
        await Chats.upsert_message_to_chat_by_id_and_message_id(chat_id, message_id, {"files": kept})
        return kept
    if not new:
        return None
    files: list[dict[str, Any]] | None = await Chats.add_message_files_by_id_and_message_id(
        chat_id, message_id, new
    )
    return files


async def _drop_chat_links(file_id: str) -> None:
    # SQLite does not cascade Open WebUI's foreign keys: remove the chat_file rows ourselves.
    from open_webui.internal.db import get_async_db
    from open_webui.models.chats import ChatFile
    from sqlalchemy import delete

    try:
        async with get_async_db() as session:
            await session.execute(delete(ChatFile).where(ChatFile.file_id == file_id))
            await session.commit()
    except Exception as error:  # the row is harmless: its file is gone, so it grants nothing
        log.warning("code-sessions: could not remove the chat links of %s: %s", file_id, error)


class _WholeFile:
    """The copy as Open WebUI's `Storage.upload_file` takes it: it calls read() once for everything.
    Read into one buffer of the copy's size (a list of chunks joined would hold it twice)."""

    def __init__(self, fd: int, size: int) -> None:
        self._fd, self._size = fd, size

    def read(self, size: int = -1) -> bytearray:
        buffer = bytearray(self._size)
        view = memoryview(buffer)
        got = 0
        while got < self._size:
            n = os.preadv(self._fd, [view[got:]], got)
            if n == 0:  # shorter now than when it was hashed: what is there is what goes
                break
            got += n
        view.release()
        if got < self._size:
            del buffer[got:]
        return buffer


def _delete_stored(path: str) -> None:
    from open_webui.storage.provider import Storage

    try:
        Storage.delete_file(path)
    except Exception as error:  # already gone, or a provider's error: nothing more to do here
        log.warning("code-sessions: could not delete %s: %s", path, error)


def _with_bytes_there(stored: Sequence[tuple[str, str | None]]) -> list[str]:
    """The ids of these (id, path) records whose bytes are there: one thread hop for a chunk."""
    return [file_id for file_id, path in stored if _bytes_there(path)]


def _bytes_there(path: str | None) -> bool:
    if not path:
        return False
    if "://" in path:  # a cloud provider: its record is what we can check from here
        return True
    return os.path.isfile(path)
