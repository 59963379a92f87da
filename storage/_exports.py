"""Exports: a download made from a chat that is not one of its files (a notebook of an answer, the folder
as a zip), published like a file (the same publisher, a link row, a link record) and counted toward the
user's storage like any copy, deleted with the chat.

An export's link row has a path no file can have, `/exports/<slot>/<name>` (a folder's paths are
relative), so nothing takes it for a file of the folder: a cleanup keeps it while its chat's session
exists (it has no file to be missing), and `sandbox_view` never maps it to /mnt/data. A new export in a
slot (`zip`, `notebook-<answer>`) replaces the one before it, so a chat holds one export per slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import tempfile
import time
import zipfile
from pathlib import Path
from typing import BinaryIO

from . import _index, _index_links
from ._backend import Tx
from ._core import ChatRef, Core
from ._format import human_bytes
from ._fsops import DIR_FLAGS, fd_closing
from ._history import walk
from ._names import publish_name
from ._publish import copy_removed_unless_linked, link_columns, remove_copies, sha256_of
from .errors import StorageError
from .models import Link, Usage
from .policy import Policy
from .publishing import Copy

EXPORTS = "/exports/"
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CHUNK = 1 << 20
_ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)


def is_export(path: str) -> bool:
    return path.startswith(EXPORTS)


async def publish_export(
    core: Core, ref: ChatRef, policy: Policy, slot: str, name: str, fd: int
) -> tuple[Link, list[str]]:
    """Publish the open file `fd` as the chat's export in `slot`, within `policy`'s quotas: (its link,
    the refs of the copies it replaced). The same bytes under the same name as the slot's export
    already: that one, nothing replaced. Raises StorageError (QuotaExceeded, DiskFull) with the
    sentence."""
    publisher = core.publisher
    if publisher is None:
        raise StorageError("publishing is not configured (the store has no publisher)")
    st = os.fstat(fd)
    safe, content_type = publish_name(name)
    prefix = f"{EXPORTS}{slot}/"
    path = prefix + safe
    digest = await asyncio.to_thread(sha256_of, fd)
    kind = publisher.kind
    rows, usage = await core.read(
        lambda tx: _index_links.links_of_file_and_usage(tx, ref.user_key, ref.chat_key, path, kind)
    )
    for row in rows:
        if row.sha256 == digest and row.size == st.st_size:
            return Link(row.ref, row.url, path, row.name, row.size, False, row.created_at), []
    listed = await core.read(lambda tx: _index_links.link_listing(tx, ref.user_key, ref.chat_key))
    freed = sum(link.size for link in listed if link.path.startswith(prefix))  # what it replaces
    policy.refuse_publish(Usage(usage.files, usage.bytes - freed), st.st_size, safe)
    copy = Copy(fd, st.st_size, safe, content_type, False, path, ref.user_id, ref.chat_id, digest)
    published = await publisher.put(copy)
    columns = link_columns(publisher, published, path, safe, st.st_size, (0, 0, 0), digest)
    now = columns["now"]

    async def write(tx: Tx) -> tuple[Usage | None, list[tuple[str, str, str]]]:
        await tx.serialise_user(ref.user_key)
        sid = await core.session_id(tx, ref, now)
        before = [
            link
            for link in await _index_links.link_listing(tx, ref.user_key, ref.chat_key)
            if link.path.startswith(prefix)
        ]
        replaced = await _index_links.links_of_session(tx, sid)
        gone = [row for row in replaced if row[0] in {link.ref for link in before}]
        await _index_links.delete_links(tx, [row[0] for row in gone])
        usage = await _index.user_usage(tx, ref.user_key)
        freed = sum(link.size for link in before)
        ceiling = policy.publish_ceiling(st.st_size)
        if ceiling is not None and usage.bytes - freed > ceiling:  # the quota, decided where it counts
            return Usage(usage.files, usage.bytes - freed), []
        await _index_links.insert_link(tx, sid, **columns)
        return None, gone

    async with copy_removed_unless_linked(core, ref, columns):
        refused, gone = await core.write(write)
        if refused is not None:
            policy.refuse_publish(refused, st.st_size, safe)  # raises: the same rule
            raise StorageError(f"{safe} was not linked: your storage is full")
    await remove_copies(core, gone)
    return Link(published.ref, published.url, path, safe, st.st_size, False, now), [r for r, _, _ in gone]


def scratch(folder: Path) -> BinaryIO:
    """An unnamed file for building an export, in the chat's own saved-state folder (not /mnt/data),
    gone when closed."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    return tempfile.TemporaryFile(dir=folder)


def folder_size(live_dir: Path) -> tuple[int, int]:
    """(files, bytes) of the regular files in the folder, no link followed."""
    files = size = 0
    with fd_closing(os.open(live_dir, DIR_FLAGS)) as root:
        for _, st, _, _ in walk(root):
            if stat.S_ISREG(st.st_mode):
                files += 1
                size += st.st_size
    return files, size


def zip_folder(live_dir: Path, out: BinaryIO, *, max_bytes: int | None) -> tuple[int, int]:
    """Write the folder's regular files (no link followed; names as the folder has them) into `out` as
    a zip; returns (files, bytes). StorageError with the sentence when they are more than `max_bytes`
    (checked before anything is written, and again as each file is read: a file that grew meanwhile)."""
    _, size = folder_size(live_dir)
    if max_bytes is not None and size > max_bytes:
        raise StorageError(_too_large(size, max_bytes))
    written = count = 0
    with (
        fd_closing(os.open(live_dir, DIR_FLAGS)) as root,
        zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, allowZip64=True, compresslevel=6) as archive,
    ):
        for path, st, parent, name in walk(root):
            if not stat.S_ISREG(st.st_mode):
                continue
            try:
                fd = os.open(name, _READ, dir_fd=parent)
            except OSError:
                continue  # gone meanwhile
            with fd_closing(fd):
                now = os.fstat(fd)
                if not stat.S_ISREG(now.st_mode):
                    continue
                stamp = max(_ZIP_EPOCH, time.localtime(now.st_mtime)[:6])
                info = zipfile.ZipInfo(path, date_time=stamp)
                info.compress_type = zipfile.ZIP_DEFLATED
                info.external_attr = (stat.S_IMODE(now.st_mode) | stat.S_IFREG) << 16
                with archive.open(info, "w", force_zip64=True) as entry:
                    offset = 0
                    while chunk := os.pread(fd, _CHUNK, offset):
                        offset += len(chunk)
                        written += len(chunk)
                        if max_bytes is not None and written > max_bytes:
                            raise StorageError(_too_large(written, max_bytes))
                        entry.write(chunk)
            count += 1
    with contextlib.suppress(OSError):
        out.flush()
    return count, written


def _too_large(size: int, limit: int) -> str:
    return (
        f"Not zipped: this chat's files take {human_bytes(size)}, more than the {human_bytes(limit)} one "
        "download may take. Download the files one by one, or delete some first."
    )
