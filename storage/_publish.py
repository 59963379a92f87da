"""Publishing: an immutable copy of a session file under an unguessable URL.

The copy is made from the fd we opened and checked (never from the path again, which the sandbox
could have swapped), into a staging folder that is renamed to `<directory>/<token>/` only when
complete: the web server never serves a partial file, and the index row is written after the copy
exists, so a row always has its copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import re
import secrets
import stat
import time
import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING

from ._db import Tx
from ._format import human_bytes
from ._fsops import copy_fd, fd_closing, open_dir, open_regular, remove_tree
from ._index import set_meta
from ._names import is_passive_image, publish_name, split_path
from .errors import QuotaExceeded, StorageError
from .models import Link, Publisher

if TYPE_CHECKING:
    from .session import Session

TOKEN_BYTES = 24  # 192 random bits
TOKEN_RE = re.compile(r"[A-Za-z0-9_-]{32}")
STAGING_PREFIX = ".staging-"


async def publish(session: Session, path: str) -> Link:
    store = session._store
    publisher = store.publisher
    if publisher is None:
        raise StorageError("publishing is not configured (the store has no Publisher)")
    parts = split_path(path)
    rel = "/".join(parts)

    def open_source() -> int:
        with fd_closing(open_dir(session.path)) as root:
            return open_regular(root, parts)

    fd = await asyncio.to_thread(open_source)
    with fd_closing(fd):
        st = os.fstat(fd)
        existing = await _reusable(session, publisher, rel, st)
        if existing is not None:
            return existing
        await _check_budget(session, rel, st.st_size)
        name, kind = publish_name(rel)
        token = secrets.token_urlsafe(TOKEN_BYTES)
        await asyncio.to_thread(_copy, fd, publisher.directory, token, name, rel)

    url = publisher.url_prefix + token + "/" + urllib.parse.quote(name)
    now = time.time()

    async def write(tx: Tx) -> None:
        sid = await session._session_id(tx, now)
        await tx.run(
            "INSERT INTO links (token, session_id, path, name, url, directory, size, mtime_ns, created_at)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (token, sid, rel, name, url, str(publisher.directory), st.st_size, st.st_mtime_ns, now),
        )

    try:
        await store._db.write(write)
    except BaseException:
        await asyncio.to_thread(remove_tree, publisher.directory / token)
        raise
    return Link(token, url, rel, name, st.st_size, is_passive_image(kind), now)


async def _reusable(session: Session, publisher: Publisher, rel: str, st: os.stat_result) -> Link | None:
    async def read(tx: Tx) -> list[tuple[str, str, str, float, str]]:
        rows = await tx.all(
            "SELECT l.token, l.name, l.url, l.created_at, l.directory FROM links l"
            " JOIN sessions s ON s.id = l.session_id"
            " WHERE s.user_key = ? AND s.chat_key = ? AND l.path = ? AND l.size = ? AND l.mtime_ns = ?"
            " AND (l.expires_at IS NULL OR l.expires_at > ?) ORDER BY l.created_at DESC",
            (session.user_key, session.chat_key, rel, st.st_size, st.st_mtime_ns, time.time()),
        )
        return [tuple(r) for r in rows]  # type: ignore[misc]

    for token, name, url, created_at, directory in await session._store._db.read(read):
        if directory != str(publisher.directory) or not url.startswith(publisher.url_prefix):
            continue
        if copy_present(Path(directory), token, name):
            kind = publish_name(name)[1]
            return Link(token, url, rel, name, st.st_size, is_passive_image(kind), created_at)
    return None


async def _check_budget(session: Session, rel: str, size: int) -> None:
    """Copies live outside the user's folders, so the folder quota does not see them: rewriting a file
    and linking it again makes a new copy each time, and the old one stays until cleanup finds it stale.
    A user's copies may take twice max_bytes_per_user (the current files, plus as much again of copies
    of older versions); beyond that nothing more is published until cleanup removes stale copies."""
    limit = session._store.quotas.max_bytes_per_user or None
    if limit is None:
        return

    async def read(tx: Tx) -> int:
        row = await tx.one(
            "SELECT coalesce(sum(l.size), 0) FROM links l JOIN sessions s ON s.id = l.session_id"
            " WHERE s.user_key = ?",
            (session.user_key,),
        )
        return int(row[0]) if row else 0

    used = await session._store._db.read(read)
    if used + size > 2 * limit:
        raise QuotaExceeded(
            f"{rel} was not linked: your published copies already take {human_bytes(used)} (at most "
            f"{human_bytes(2 * limit)}, twice your storage limit); copies of files that changed or were "
            "deleted are removed by the next cleanup"
        )


def copy_present(directory: Path, token: str, name: str) -> bool:
    try:
        st = os.stat(directory / token / name, follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode)


def _copy(src: int, directory: Path, token: str, name: str, rel: str) -> None:
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    staging = directory / f"{STAGING_PREFIX}{token}"
    try:
        os.mkdir(staging, 0o700)
        out = os.open(
            staging / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        with fd_closing(out):
            os.lseek(src, 0, os.SEEK_SET)
            copy_fd(src, out)
        os.rename(staging, directory / token)
    except BaseException as exc:
        remove_tree(staging)
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StorageError(f"not enough disk space to publish {rel}; nothing was published") from exc
        raise


async def remember_publisher(store_db: object, publisher: Publisher) -> None:
    """Record the publish folder and URL prefix so the CLI can clean published copies."""

    async def write(tx: Tx) -> None:
        await set_meta(tx, "publish_dir", str(publisher.directory))
        await set_meta(tx, "url_prefix", publisher.url_prefix)

    await store_db.write(write)  # type: ignore[attr-defined]


def remove_copy(directory: str | Path, token: str) -> None:
    """Delete a published copy; refuses anything that is not one of our token folders."""
    if not TOKEN_RE.fullmatch(token):
        return
    with contextlib.suppress(OSError):
        remove_tree(Path(directory) / token)
