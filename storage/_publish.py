"""Publishing a session file: one copy per distinct content, reused while the bytes are the same.

The file is opened through the no-symlink walk and everything is read from that descriptor, never
from the path again (the sandbox could swap it). "The same bytes" is decided by a SHA-256 of the
content, skipped only when the file still has the inode, size, mtime *and ctime* it had when a link
was last checked: sandboxed code can restore size and mtime (`os.utime`) but not ctime, which the
host kernel sets on every change. The index row is written after the copy exists, so a row always has
its copy; a crash in between leaves a stray copy, which cleanup removes.

Removing copies goes through the publisher that made them (`remove_copies`). Folder copies are
removed here; copies in the web server's file store need its publisher, and when this process has
none (the CLI), they wait in the `unpublished` table for the application's next cleanup.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import hashlib
import json
import os
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypedDict

from . import _index, _index_links
from ._backend import Tx
from ._core import ChatRef, Core
from ._fsops import fd_closing, open_dir, open_regular, write_private
from ._names import is_passive_image, publish_name, split_path
from .errors import DiskFull, StorageError
from .models import Link, Usage
from .policy import Policy
from .publishing import (
    Copy,
    DirectoryPublisher,
    Published,
    Publisher,
    copy_present,
    remove_directory_copies,
)

_HASH_CHUNK = 1 << 20
_DIGEST_AT_ONCE = 1 << 20  # bytes: a file this small is hashed as it is opened


async def publish(core: Core, ref: ChatRef, path: str, policy: Policy) -> Link:
    publisher = core.publisher
    if publisher is None:
        raise StorageError("publishing is not configured (the store has no publisher)")
    parts = split_path(path)
    rel = "/".join(parts)

    def open_source() -> tuple[int, os.stat_result, str | None]:
        with fd_closing(open_dir(ref.path)) as root:
            fd = open_regular(root, parts)
        try:
            st = os.fstat(fd)
            # A small file's digest is taken at once (cheap), a large one's only if no link matches.
            return fd, st, sha256_of(fd) if st.st_size <= _DIGEST_AT_ONCE else None
        except BaseException:
            os.close(fd)
            raise

    # The file and its links are read at once (neither needs the other): on PostgreSQL the links'
    # round trip then costs nothing while the thread opens the file. The user's usage comes with the
    # links, one statement: the quota decision below is made again in the transaction that counts
    # the copy, so reading it early changes no outcome.
    opened, found = await asyncio.gather(
        asyncio.to_thread(open_source),
        core.read(
            lambda tx: _index_links.links_of_file_and_usage(
                tx, ref.user_key, ref.chat_key, rel, publisher.kind
            )
        ),
        return_exceptions=True,
    )
    if isinstance(found, BaseException):
        if not isinstance(opened, BaseException):
            os.close(opened[0])
        raise found
    if isinstance(opened, BaseException):
        raise opened
    fd, st, digest = opened
    with fd_closing(fd):
        name, content_type = publish_name(rel)
        inline = is_passive_image(content_type)
        rows, usage = found
        rows = [r for r in rows if _usable(publisher, r.ref, r.name)]
        for row in rows:
            if (row.size, row.mtime_ns, row.inode, row.ctime_ns) == (
                st.st_size,
                st.st_mtime_ns,
                st.st_ino,
                st.st_ctime_ns,
            ):
                return Link(row.ref, row.url, rel, row.name, row.size, inline, row.created_at)
        if digest is None:
            digest = await asyncio.to_thread(sha256_of, fd)
        for row in rows:
            if row.sha256 == digest and row.size == st.st_size:
                await core.write(
                    functools.partial(
                        _index_links.note_link_signature,
                        ref=row.ref,
                        mtime_ns=st.st_mtime_ns,
                        inode=st.st_ino,
                        ctime_ns=st.st_ctime_ns,
                    )
                )
                return Link(row.ref, row.url, rel, row.name, row.size, inline, row.created_at)
        policy.refuse_publish(usage, st.st_size, rel)
        copy = Copy(fd, st.st_size, name, content_type, inline, rel, ref.user_id, ref.chat_id, digest)
        published = await publisher.put(copy)

    columns = link_columns(
        publisher, published, rel, name, st.st_size, (st.st_mtime_ns, st.st_ino, st.st_ctime_ns), digest
    )
    now = columns["now"]

    async def write(tx: Tx) -> Callable[[], Awaitable[tuple[bool, Usage]]]:
        # The quota decision again, in the transaction that counts the copy (two chats of one user
        # publishing at once cannot both take the last room), made by the INSERT itself: every
        # statement here is queued, and the transaction is one round trip on PostgreSQL.
        await tx.serialise_user(ref.user_key)
        await _index.ensure_session_queued(
            tx,
            user_id=ref.user_id,
            chat_id=ref.chat_id,
            user_key=ref.user_key,
            chat_key=ref.chat_key,
            temporary=ref.temporary,
            created_at=now,
        )
        return await _index_links.insert_link_by_keys(
            tx, ref.user_key, ref.chat_key, **columns, ceiling=policy.publish_ceiling(st.st_size)
        )

    async with copy_removed_unless_linked(core, ref, columns):
        inserted, usage_then = await (await core.write(write))()
        if not inserted:
            policy.refuse_publish(usage_then, st.st_size, rel)  # raises: the same rule
            raise StorageError(f"{rel} was not linked: its session is gone from the index")
    return Link(published.ref, published.url, rel, name, st.st_size, inline, now)


class LinkColumns(TypedDict):
    """A new link's columns, as `_index_links.insert_link` takes them."""

    ref: str
    kind: str
    path: str
    name: str
    url: str
    directory: str
    size: int
    mtime_ns: int
    inode: int
    ctime_ns: int
    sha256: str
    now: float


def link_columns(
    publisher: Publisher,
    published: Published,
    path: str,
    name: str,
    size: int,
    signature: tuple[int, int, int],
    sha256: str,
) -> LinkColumns:
    """The columns of the link to the copy `publisher` just made, dated now; `signature` is the
    file's (mtime_ns, inode, ctime_ns) as it was copied (zeros: no file stands behind it)."""
    mtime_ns, inode, ctime_ns = signature
    directory = str(publisher.directory) if isinstance(publisher, DirectoryPublisher) else ""
    return LinkColumns(
        ref=published.ref,
        kind=publisher.kind,
        path=path,
        name=name,
        url=published.url,
        directory=directory,
        size=size,
        mtime_ns=mtime_ns,
        inode=inode,
        ctime_ns=ctime_ns,
        sha256=sha256,
        now=time.time(),
    )


@contextlib.asynccontextmanager
async def copy_removed_unless_linked(core: Core, ref: ChatRef, columns: LinkColumns) -> AsyncIterator[None]:
    """Write the new link's record, then run the body that indexes it: if either fails, the copy
    (and its record) goes, so no copy outlives a link that never was."""
    try:
        await asyncio.to_thread(_write_record, core, _link_record(ref, columns))
        yield
    except BaseException:
        copy = (columns["ref"], columns["kind"], columns["directory"])
        await asyncio.shield(remove_copies(core, [copy]))
        raise


def _link_record(ref: ChatRef, columns: LinkColumns) -> dict[str, Any]:
    return {
        "ref": columns["ref"],
        "kind": columns["kind"],
        "user_key": ref.user_key,
        "chat_key": ref.chat_key,
        "path": columns["path"],
        "name": columns["name"],
        "url": columns["url"],
        "directory": columns["directory"],
        "size": columns["size"],
        "mtime_ns": columns["mtime_ns"],
        "inode": columns["inode"],
        "ctime_ns": columns["ctime_ns"],
        "sha256": columns["sha256"],
        "created_at": columns["now"],
    }


def _write_record(core: Core, record: dict[str, Any]) -> None:
    """What the copy is, beside the index: a lost index takes the link back from it (rebuild)."""
    path = core.layout.link_record(record["kind"], record["ref"])
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        try:
            write_private(tmp, json.dumps(record).encode("utf-8"))
        except FileNotFoundError:  # the folder of a store made before records existed
            path.parent.mkdir(mode=0o700, exist_ok=True)
            write_private(tmp, json.dumps(record).encode("utf-8"))
        os.replace(tmp, path)
    except OSError as error:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFull(
                f"Not enough disk space to publish {record['path']}; nothing was published."
            ) from error
        raise


def link_records(core: Core) -> list[dict[str, Any]]:
    """Every readable link record (rebuild, stray sweep)."""
    found: list[dict[str, Any]] = []
    with contextlib.suppress(FileNotFoundError), os.scandir(core.layout.links) as entries:
        for entry in entries:
            if not entry.name.endswith(".json") or not entry.is_file(follow_symlinks=False):
                continue
            try:
                with open(entry.path, "rb") as fh:
                    data = json.loads(fh.read(1 << 16))
            except (OSError, ValueError):
                continue
            if isinstance(data, dict) and data.keys() >= _RECORD_KEYS:
                data["_mtime"] = entry.stat(follow_symlinks=False).st_mtime
                found.append(data)
    return found


_RECORD_KEYS = frozenset(
    {"ref", "kind", "user_key", "chat_key", "path", "name", "url", "directory", "size", "mtime_ns"}
    | {"inode", "ctime_ns", "sha256", "created_at"}
)


def _usable(publisher: object, ref: str, name: str) -> bool:
    # A folder copy someone deleted by hand is not reused (cheap to see); the web server's records
    # are trusted here, and `check` reports one that went missing.
    if isinstance(publisher, DirectoryPublisher):
        return publisher.present(ref, name)
    return True


def sha256_of(fd: int) -> str:
    """The hex SHA-256 of the open file's whole content, read by offset (blocking)."""
    digest = hashlib.sha256()
    offset = 0
    while chunk := os.pread(fd, _HASH_CHUNK, offset):
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()


async def remove_copies(core: Core, links: Sequence[tuple[str, str, str]]) -> None:
    """Delete the copies (and their records) of links whose rows are gone: (ref, kind, directory)."""
    if not links:
        return

    def forget() -> None:
        for ref, kind, _ in links:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(core.layout.link_record(kind, ref))

    await asyncio.to_thread(forget)
    by_kind: dict[str, list[str]] = defaultdict(list)
    folders: list[tuple[str, str]] = []
    for ref, kind, directory in links:
        if kind == DirectoryPublisher.kind:
            folders.append((directory, ref))
        else:
            by_kind[kind].append(ref)
    if folders:
        await asyncio.to_thread(remove_directory_copies, folders)
    publisher = core.publisher
    for kind, refs in by_kind.items():
        if publisher is not None and publisher.kind == kind:
            await publisher.remove(refs)
        else:
            queued = time.time()
            queue = functools.partial(_index_links.queue_unpublished, kind=kind, refs=refs, now=queued)
            await core.write(queue)


async def drain_unpublished(core: Core) -> int:
    """Delete the queued copies this process's publisher holds; returns how many."""
    publisher = core.publisher
    if publisher is None or publisher.kind == DirectoryPublisher.kind:
        return 0
    refs = await core.read(lambda tx: _index_links.unpublished_refs(tx, publisher.kind))
    if not refs:
        return 0
    await publisher.remove(refs)
    await core.write(lambda tx: _index_links.clear_unpublished(tx, publisher.kind, refs))
    return len(refs)


def folder_copy_present(directory: str, ref: str, name: str) -> bool:
    return copy_present(Path(directory), ref, name)
