"""The SQL of published links (`links`) and of copies waiting to be deleted (`unpublished`), as
functions over a transaction, in the portable subset of _index.py (see there).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from . import _index
from ._backend import Tx
from ._index import CHUNK
from .models import LinkInfo, Usage


@dataclass(frozen=True, slots=True)
class LinkRow:
    ref: str
    kind: str
    name: str
    url: str
    size: int
    created_at: float
    sha256: str | None
    mtime_ns: int
    inode: int
    ctime_ns: int


async def insert_link(
    tx: Tx,
    session_id: int,
    *,
    ref: str,
    kind: str,
    path: str,
    name: str,
    url: str,
    directory: str,
    size: int,
    mtime_ns: int,
    inode: int,
    ctime_ns: int,
    sha256: str,
    now: float,
) -> None:
    await tx.run(
        "INSERT INTO links (token, session_id, kind, path, name, url, directory, size, mtime_ns, inode,"
        " ctime_ns, sha256, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (ref, session_id, kind, path, name, url, directory, size, mtime_ns, inode, ctime_ns, sha256, now),
    )


async def insert_link_by_keys(
    tx: Tx,
    user_key: str,
    chat_key: str,
    *,
    ref: str,
    kind: str,
    path: str,
    name: str,
    url: str,
    directory: str,
    size: int,
    mtime_ns: int,
    inode: int,
    ctime_ns: int,
    sha256: str,
    now: float,
    ceiling: int | None,
) -> Callable[[], Awaitable[tuple[bool, Usage]]]:
    """`insert_link` for the session named by its keys, only while the user uses at most `ceiling`
    bytes (None: always; see Policy.publish_ceiling), in statements that wait for nothing. Returns
    whether the row went in and the user's usage after it, known once the transaction is over."""
    condition: str = ""
    extra: tuple[Any, ...] = ()
    if ceiling is not None:
        condition = (
            " AND (SELECT coalesce(sum(bytes + published_bytes), 0) FROM sessions WHERE user_key = ?) <= ?"
        )
        extra = (user_key, ceiling)
    row = (
        ref,
        kind,
        path,
        name,
        url,
        directory,
        size,
        mtime_ns,
        inode,
        ctime_ns,
        sha256,
        now,
        user_key,
        chat_key,
    )
    await tx.many(
        "INSERT INTO links (token, session_id, kind, path, name, url, directory, size, mtime_ns, inode,"
        " ctime_ns, sha256, created_at) SELECT ?, s.id, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ? FROM sessions s"
        f" WHERE s.user_key = ? AND s.chat_key = ?{condition}",
        [(*row, *extra)],
    )
    # Whether it went in, and the user's usage as the transaction leaves it (what a refusal says), in
    # one statement: each statement of a transaction is work for both ends of a network database.
    later = await tx.one_later(
        "SELECT (SELECT count(*) FROM links WHERE token = ?), coalesce(sum(file_count), 0),"
        " coalesce(sum(bytes + published_bytes), 0) FROM sessions WHERE user_key = ?",
        (ref, user_key),
    )

    async def inserted() -> tuple[bool, Usage]:
        found = await later()
        if found is None:
            return False, Usage(0, 0)
        return bool(found[0]), Usage(int(found[1]), int(found[2]))

    return inserted


async def links_of_file_and_usage(
    tx: Tx, user_key: str, chat_key: str, path: str, kind: str
) -> tuple[list[LinkRow], Usage]:
    """`links_of_file` and the user's `user_usage`, in one statement (what publish reads first)."""
    rows = await tx.all(
        "SELECT u.files, u.bytes, l.token, l.kind, l.name, l.url, l.size, l.created_at, l.sha256,"
        " l.mtime_ns, l.inode, l.ctime_ns FROM (SELECT coalesce(sum(file_count), 0) AS files,"
        " coalesce(sum(bytes + published_bytes), 0) AS bytes FROM sessions WHERE user_key = ?) u"
        " LEFT JOIN (SELECT l.* FROM links l JOIN sessions s ON s.id = l.session_id"
        " WHERE s.user_key = ? AND s.chat_key = ? AND l.path = ? AND l.kind = ?) l ON 1 = 1"
        " ORDER BY l.created_at DESC",
        (user_key, user_key, chat_key, path, kind),
    )
    usage = Usage(int(rows[0][0]), int(rows[0][1])) if rows else Usage(0, 0)
    links = [
        LinkRow(r[2], r[3], r[4], r[5], int(r[6]), float(r[7]), r[8], int(r[9]), int(r[10]), int(r[11]))
        for r in rows
        if r[2] is not None
    ]
    return links, usage


async def note_link_signature(tx: Tx, ref: str, mtime_ns: int, inode: int, ctime_ns: int) -> None:
    """The file was checked to hold the link's bytes as it is now: remember how it looks."""
    await tx.run(
        "UPDATE links SET mtime_ns = ?, inode = ?, ctime_ns = ? WHERE token = ?",
        (mtime_ns, inode, ctime_ns, ref),
    )


async def link_listing(tx: Tx, user_key: str | None = None, chat_key: str | None = None) -> list[LinkInfo]:
    where, params = [], []
    if user_key is not None:
        where.append("s.user_key = ?")
        params.append(user_key)
    if chat_key is not None:
        where.append("s.chat_key = ?")
        params.append(chat_key)
    sql = (
        "SELECT l.token, l.kind, s.user_id, s.chat_id, l.path, l.name, l.url, l.size, l.created_at"
        " FROM links l LEFT JOIN sessions s ON s.id = l.session_id"
        + (" WHERE " + " AND ".join(where) if where else "")
        + " ORDER BY l.created_at"
    )
    return [
        LinkInfo(r[0], r[1], r[2], r[3], r[4], r[5], r[6], int(r[7]), float(r[8]))
        for r in await tx.all(sql, params)
    ]


async def links_of_session(tx: Tx, session_id: int) -> list[tuple[str, str, str]]:
    """(ref, kind, directory) of every link of a session."""
    return await tx.all("SELECT token, kind, directory FROM links WHERE session_id = ?", (session_id,))


async def count_links(tx: Tx, session_id: int) -> int:
    row = await tx.one("SELECT count(*) FROM links WHERE session_id = ?", (session_id,))
    return int(row[0]) if row else 0


async def links_of_paths(tx: Tx, session_id: int, paths: Sequence[str]) -> list[tuple[str, str, str]]:
    found: list[tuple[str, str, str]] = []
    for i in range(0, len(paths), CHUNK):
        chunk = paths[i : i + CHUNK]
        marks = ", ".join("?" * len(chunk))
        found.extend(
            await tx.all(
                f"SELECT token, kind, directory FROM links WHERE session_id = ? AND path IN ({marks})",
                (session_id, *chunk),
            )
        )
    return found


async def delete_links(tx: Tx, refs: Sequence[str]) -> None:
    await tx.many("DELETE FROM links WHERE token = ?", [(r,) for r in refs])


async def all_link_refs(tx: Tx, kind: str) -> set[str]:
    return {r for (r,) in await tx.all("SELECT token FROM links WHERE kind = ?", (kind,))}


async def link_health(tx: Tx) -> list[tuple[Any, ...]]:
    """For each link: (ref, kind, directory, name, created_at, no session, no file, file changed, path)."""
    return await tx.all(
        "SELECT l.token, l.kind, l.directory, l.name, l.created_at,"
        " CASE WHEN s.id IS NULL THEN 1 ELSE 0 END, CASE WHEN f.path IS NULL THEN 1 ELSE 0 END,"
        " CASE WHEN f.size != l.size OR f.mtime_ns != l.mtime_ns THEN 1 ELSE 0 END, l.path"
        " FROM links l LEFT JOIN sessions s ON s.id = l.session_id"
        " LEFT JOIN files f ON f.session_id = l.session_id AND f.path = l.path"
    )


async def links_with_owners(tx: Tx) -> list[tuple[Any, ...]]:
    """(ref, kind, directory, name, path, user_id, chat_id) of every link (check)."""
    return await tx.all(
        "SELECT l.token, l.kind, l.directory, l.name, l.path, s.user_id, s.chat_id"
        " FROM links l LEFT JOIN sessions s ON s.id = l.session_id"
    )


async def queue_unpublished(tx: Tx, kind: str, refs: Sequence[str], now: float) -> None:
    await tx.many(
        "INSERT INTO unpublished (kind, token, queued_at) VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
        [(kind, r, now) for r in refs],
    )


async def unpublished_refs(tx: Tx, kind: str) -> list[str]:
    return [r for (r,) in await tx.all("SELECT token FROM unpublished WHERE kind = ?", (kind,))]


async def clear_unpublished(tx: Tx, kind: str, refs: Sequence[str]) -> None:
    await tx.many("DELETE FROM unpublished WHERE kind = ? AND token = ?", [(kind, r) for r in refs])


# ---------------------------------------------------------------------------- deleted files


async def forget_files(tx: Tx, session_id: int, paths: Sequence[str]) -> list[tuple[str, str, str]]:
    """Drop the rows of deleted files and their links; returns the links' (ref, kind, directory)."""
    links = await links_of_paths(tx, session_id, paths)
    await delete_links(tx, [ref for ref, _, _ in links])
    await _index.delete_files(tx, session_id, paths)
    return links
