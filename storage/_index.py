"""Every SQL statement of the store, as functions over a transaction (`_backend.Tx`); those of
published links are in _index_links.py.

The SQL is the portable subset both backends run: `?` placeholders, `ON CONFLICT` upserts,
`RETURNING`, `CASE` instead of SQLite's scalar `max()`, no temporary tables, no PRAGMA. Paths are
compared as byte strings (PostgreSQL declares the columns `COLLATE "C"`), which the range queries
below rely on. Nothing outside these two modules writes SQL, so a backend is only a connection, its
transactions, its locks and its migrations.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ._backend import Tx
from ._keys import db_text
from .models import ActivityEntry, ChatInfo, FileEntry, Usage, UserUsage

# Parameters per statement: SQLite's default limit is 32,766, PostgreSQL's 65,535.
CHUNK = 500

_SESSION_COLUMNS = (
    "id, user_id, chat_id, user_key, chat_key, temporary, created_at, last_used_at, bytes, file_count,"
    " linked_files, published_bytes"
)


# ---------------------------------------------------------------------------- sessions


@dataclass(frozen=True, slots=True)
class ChatRow:
    """One chat's row of the `sessions` table, as read."""

    id: int
    user_id: str
    chat_id: str
    user_key: str
    chat_key: str
    temporary: bool
    created_at: float
    last_used_at: float
    bytes: int
    file_count: int
    linked_files: bool  # files with several hard links were seen (see _reconcile_changed)
    published_bytes: int

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> ChatRow:
        return cls(
            int(row[0]),
            row[1],
            row[2],
            row[3],
            row[4],
            bool(row[5]),
            float(row[6]),
            float(row[7]),
            int(row[8]),
            int(row[9]),
            bool(row[10]),
            int(row[11]),
        )

    def info(self) -> ChatInfo:
        return ChatInfo(
            self.user_id,
            self.chat_id,
            self.user_key,
            self.chat_key,
            self.temporary,
            self.created_at,
            self.last_used_at,
            self.file_count,
            self.bytes,
        )


_INSERT_SESSION = (
    "INSERT INTO sessions (user_id, chat_id, user_key, chat_key, temporary, created_at, last_used_at)"
    " VALUES (?, ?, ?, ?, ?, ?, ?)"
)
_ENSURE_SESSION = (
    _INSERT_SESSION + " ON CONFLICT (user_key, chat_key) DO UPDATE SET last_used_at ="
    " CASE WHEN sessions.last_used_at > ? THEN sessions.last_used_at ELSE ? END"
)


async def ensure_session(
    tx: Tx,
    *,
    user_id: str,
    chat_id: str,
    user_key: str,
    chat_key: str,
    temporary: bool,
    created_at: float,
    used_at: float | None,
) -> int:
    """Insert the session row if missing; with used_at, move last_used_at forward. Returns its id."""
    if used_at is None:
        # The usual case, a row that exists and is not to be touched: read its id. An upsert would
        # update the row all the same (a new row version and its index entries, on PostgreSQL the
        # most costly statement of a step).
        row = await tx.one(
            "SELECT id FROM sessions WHERE user_key = ? AND chat_key = ?", (user_key, chat_key)
        )
        if row is not None:
            return int(row[0])
    params = _ensure_params(user_id, chat_id, user_key, chat_key, temporary, created_at, used_at)
    row = await tx.one(_ENSURE_SESSION + " RETURNING id", params)
    assert row is not None
    return int(row[0])


def _ensure_params(
    user_id: str,
    chat_id: str,
    user_key: str,
    chat_key: str,
    temporary: bool,
    created_at: float,
    used_at: float | None,
) -> tuple[Any, ...]:
    used = used_at if used_at is not None else 0.0
    return (
        db_text(user_id),
        db_text(chat_id),
        user_key,
        chat_key,
        int(temporary),
        created_at,
        used_at if used_at is not None else created_at,
        used,
        used,
    )


async def ensure_session_queued(
    tx: Tx, *, user_id: str, chat_id: str, user_key: str, chat_key: str, temporary: bool, created_at: float
) -> None:
    """`ensure_session` (without touching) that waits for nothing (on PostgreSQL it goes with the next
    statement that needs an answer): the statements after it name the session by its keys. A row that
    exists is left alone."""
    params = _ensure_params(user_id, chat_id, user_key, chat_key, temporary, created_at, None)
    await tx.many(_INSERT_SESSION + " ON CONFLICT (user_key, chat_key) DO NOTHING", [params[:7]])


async def session_by_keys(tx: Tx, user_key: str, chat_key: str) -> ChatRow | None:
    row = await tx.one(
        f"SELECT {_SESSION_COLUMNS} FROM sessions WHERE user_key = ? AND chat_key = ?", (user_key, chat_key)
    )
    return ChatRow.from_row(row) if row else None


async def all_sessions(tx: Tx, user_key: str | None = None) -> list[ChatRow]:
    if user_key is None:
        rows = await tx.all(f"SELECT {_SESSION_COLUMNS} FROM sessions ORDER BY user_id, chat_id")
    else:
        rows = await tx.all(
            f"SELECT {_SESSION_COLUMNS} FROM sessions WHERE user_key = ? ORDER BY user_id, chat_id",
            (user_key,),
        )
    return [ChatRow.from_row(r) for r in rows]


async def session_ids(tx: Tx) -> list[tuple[str, str, int, float, bool]]:
    """(user_id, chat_id, id, created_at, temporary) of every session: the cheap listing."""
    rows = await tx.all("SELECT user_id, chat_id, id, created_at, temporary FROM sessions")
    return [(r[0], r[1], int(r[2]), float(r[3]), bool(r[4])) for r in rows]


async def sessions_missing(tx: Tx) -> list[tuple[str, str, float, float]]:
    """(user_key, chat_key, missing_since, last_used_at) of sessions marked missing."""
    rows = await tx.all(
        "SELECT user_key, chat_key, missing_since, last_used_at FROM sessions WHERE missing_since IS NOT NULL"
    )
    return [(r[0], r[1], float(r[2]), float(r[3])) for r in rows]


async def touch_session(tx: Tx, user_key: str, chat_key: str, used_at: float) -> bool:
    """Move an existing session's last_used_at forward (never creating its row); False: no row."""
    changed = await tx.run(
        "UPDATE sessions SET last_used_at = CASE WHEN last_used_at > ? THEN last_used_at ELSE ? END"
        " WHERE user_key = ? AND chat_key = ?",
        (used_at, used_at, user_key, chat_key),
    )
    return changed > 0


async def set_missing_since(tx: Tx, keys: Sequence[tuple[str, str]], since: float | None) -> None:
    await tx.many(
        "UPDATE sessions SET missing_since = ? WHERE user_key = ? AND chat_key = ?",
        [(since, user_key, chat_key) for user_key, chat_key in keys],
    )


async def delete_session(tx: Tx, session_id: int) -> None:
    await tx.run("DELETE FROM sessions WHERE id = ?", (session_id,))


async def set_linked_files(tx: Tx, session_id: int, count: int) -> None:
    await tx.run(
        "UPDATE sessions SET linked_files = ? WHERE id = ? AND linked_files != ?", (count, session_id, count)
    )


async def refresh_totals(tx: Tx, session_id: int) -> tuple[int, int]:
    """Recompute the session's cached totals from its rows (repair; triggers keep them in step)."""
    row = await tx.one(
        "SELECT count(*), coalesce(sum(size), 0) FROM files WHERE session_id = ?", (session_id,)
    )
    files, size = (int(row[0]), int(row[1])) if row else (0, 0)
    links = await tx.one("SELECT coalesce(sum(size), 0) FROM links WHERE session_id = ?", (session_id,))
    published = int(links[0]) if links else 0
    await tx.run(
        "UPDATE sessions SET file_count = ?, bytes = ?, published_bytes = ? WHERE id = ?",
        (files, size, published, session_id),
    )
    return files, size


async def session_totals(tx: Tx, session_id: int) -> tuple[int, int]:
    row = await tx.one("SELECT file_count, bytes FROM sessions WHERE id = ?", (session_id,))
    return (int(row[0]), int(row[1])) if row else (0, 0)


async def session_totals_later(tx: Tx, session_id: int) -> Callable[[], Awaitable[tuple[int, int]]]:
    """`session_totals` as the transaction leaves them, read with its COMMIT (see Tx.one_later)."""
    later = await tx.one_later("SELECT file_count, bytes FROM sessions WHERE id = ?", (session_id,))

    async def totals() -> tuple[int, int]:
        row = await later()
        return (int(row[0]), int(row[1])) if row else (0, 0)

    return totals


async def session_usage_later(
    tx: Tx, user_key: str, chat_key: str
) -> Callable[[], Awaitable[tuple[int, int]]]:
    """The session's (files, bytes) as the transaction leaves them, read with its COMMIT."""
    later = await tx.one_later(
        "SELECT file_count, bytes FROM sessions WHERE user_key = ? AND chat_key = ?", (user_key, chat_key)
    )

    async def totals() -> tuple[int, int]:
        row = await later()
        return (int(row[0]), int(row[1])) if row else (0, 0)

    return totals


async def session_usage(tx: Tx, user_key: str, chat_key: str) -> Usage:
    row = await tx.one(
        "SELECT file_count, bytes FROM sessions WHERE user_key = ? AND chat_key = ?", (user_key, chat_key)
    )
    return Usage(0, 0) if row is None else Usage(int(row[0]), int(row[1]))


async def user_usage(tx: Tx, user_key: str) -> Usage:
    """What counts toward a user's quota, across all their chats: files, and the bytes of the files
    plus their published copies. One indexed SUM over the user's session rows."""
    row = await tx.one(
        "SELECT coalesce(sum(file_count), 0), coalesce(sum(bytes + published_bytes), 0)"
        " FROM sessions WHERE user_key = ?",
        (user_key,),
    )
    return Usage(int(row[0]), int(row[1])) if row else Usage(0, 0)


async def user_and_session_usage(tx: Tx, user_key: str, chat_key: str) -> tuple[Usage, Usage]:
    """`user_usage` and `session_usage` in one statement: the same SUM over the user's session rows,
    and the session's own row among them."""
    row = await tx.one(
        "SELECT coalesce(sum(file_count), 0), coalesce(sum(bytes + published_bytes), 0),"
        " coalesce(sum(CASE WHEN chat_key = ? THEN file_count END), 0),"
        " coalesce(sum(CASE WHEN chat_key = ? THEN bytes END), 0)"
        " FROM sessions WHERE user_key = ?",
        (chat_key, chat_key, user_key),
    )
    if row is None:
        return Usage(0, 0), Usage(0, 0)
    return Usage(int(row[0]), int(row[1])), Usage(int(row[2]), int(row[3]))


async def users_usage(tx: Tx) -> list[UserUsage]:
    rows = await tx.all(
        "SELECT min(user_id), count(*), coalesce(sum(file_count), 0),"
        " coalesce(sum(bytes + published_bytes), 0) FROM sessions GROUP BY user_key ORDER BY min(user_id)"
    )
    return [UserUsage(r[0], int(r[1]), int(r[2]), int(r[3])) for r in rows]


# ---------------------------------------------------------------------------- files

_UPSERT_FILE = (
    "INSERT INTO files (session_id, path, size, mtime_ns, first_seen, last_changed) VALUES (?, ?, ?, ?, ?, ?)"
    " ON CONFLICT (session_id, path) DO UPDATE"
    " SET size = excluded.size, mtime_ns = excluded.mtime_ns, last_changed = excluded.last_changed"
)


async def upsert_files(tx: Tx, session_id: int, rows: Iterable[tuple[str, int, int, float]]) -> None:
    """(path, size, mtime_ns, now): insert, or update a changed file (first_seen is kept)."""
    await tx.many(_UPSERT_FILE, [(session_id, p, size, ns, now, now) for p, size, ns, now in rows])


# One row of VALUES, typed (PostgreSQL would take untyped parameters of a VALUES list for text).
_BY_KEYS_ROW = (
    "(CAST(? AS TEXT), CAST(? AS BIGINT), CAST(? AS BIGINT), CAST(? AS DOUBLE PRECISION),"
    " CAST(? AS DOUBLE PRECISION))"
)


async def upsert_files_by_keys(
    tx: Tx, user_key: str, chat_key: str, rows: Sequence[tuple[str, int, int, float]]
) -> None:
    """`upsert_files` for the session named by its keys, in one statement that waits for nothing (a
    step's few changed files: on PostgreSQL it travels with the COMMIT)."""
    values = ", ".join([_BY_KEYS_ROW] * len(rows))
    await tx.many(
        "INSERT INTO files (session_id, path, size, mtime_ns, first_seen, last_changed)"
        " SELECT s.id, v.column1, v.column2, v.column3, v.column4, v.column5"
        f" FROM sessions s JOIN (VALUES {values}) AS v ON 1 = 1 WHERE s.user_key = ? AND s.chat_key = ?"
        " ON CONFLICT (session_id, path) DO UPDATE"
        " SET size = excluded.size, mtime_ns = excluded.mtime_ns, last_changed = excluded.last_changed",
        [(*(v for p, size, ns, now in rows for v in (p, size, ns, now, now)), user_key, chat_key)],
    )


async def delete_files_by_keys(tx: Tx, user_key: str, chat_key: str, paths: Sequence[str]) -> None:
    """`delete_files` for the session named by its keys, in one statement that waits for nothing."""
    await tx.many(
        "DELETE FROM files WHERE session_id = (SELECT id FROM sessions WHERE user_key = ? AND chat_key = ?)"
        f" AND path IN ({', '.join('?' * len(paths))})",
        [(user_key, chat_key, *paths)],
    )


async def delete_files(tx: Tx, session_id: int, paths: Sequence[str]) -> None:
    # Up to CHUNK paths per statement (an expiry's batch of 2,000 files is four statements, not 2,000
    # on SQLite); queued like any `many` on PostgreSQL.
    full = len(paths) - len(paths) % CHUNK
    if full:
        marks = ", ".join("?" * CHUNK)
        await tx.many(
            f"DELETE FROM files WHERE session_id = ? AND path IN ({marks})",
            [(session_id, *paths[i : i + CHUNK]) for i in range(0, full, CHUNK)],
        )
    if full < len(paths):
        marks = ", ".join("?" * (len(paths) - full))
        await tx.many(
            f"DELETE FROM files WHERE session_id = ? AND path IN ({marks})", [(session_id, *paths[full:])]
        )


async def file_rows(tx: Tx, session_id: int) -> list[tuple[str, int, int]]:
    """(path, size, mtime_ns) of every file of a session."""
    return await tx.all("SELECT path, size, mtime_ns FROM files WHERE session_id = ?", (session_id,))


async def file_entries(tx: Tx, user_key: str, chat_key: str) -> list[FileEntry]:
    rows = await tx.all(
        "SELECT f.path, f.size, f.mtime_ns, f.first_seen, f.last_changed FROM files f"
        " JOIN sessions s ON s.id = f.session_id WHERE s.user_key = ? AND s.chat_key = ?"
        " ORDER BY f.path",
        (user_key, chat_key),
    )
    return [FileEntry(p, int(size), int(ns) / 1e9, first, last) for p, size, ns, first, last in rows]


async def file_size(tx: Tx, session_id: int, path: str) -> int | None:
    row = await tx.one("SELECT size FROM files WHERE session_id = ? AND path = ?", (session_id, path))
    return None if row is None else int(row[0])


async def move_file(
    tx: Tx, session_id: int, src: str, dst: str, size: int, mtime_ns: int, now: float
) -> None:
    """The index side of a rename: dst takes src's row (and its expiry clock)."""
    row = await tx.one(
        "SELECT first_seen, last_changed FROM files WHERE session_id = ? AND path = ?", (session_id, src)
    )
    first, last = row if row else (now, now)
    await tx.run("DELETE FROM files WHERE session_id = ? AND path IN (?, ?)", (session_id, src, dst))
    await tx.run(
        "INSERT INTO files (session_id, path, size, mtime_ns, first_seen, last_changed)"
        " VALUES (?, ?, ?, ?, ?, ?)",
        (session_id, dst, size, mtime_ns, first, last),
    )


async def rows_at_and_under(tx: Tx, session_id: int, paths: Sequence[str]) -> dict[str, tuple[int, int]]:
    """The rows of each path and of everything under `path/`, found through the primary key."""
    index: dict[str, tuple[int, int]] = {}
    for i in range(0, len(paths), CHUNK):
        chunk = paths[i : i + CHUNK]
        marks = ", ".join("?" * len(chunk))
        for path, size, mtime_ns in await tx.all(
            f"SELECT path, size, mtime_ns FROM files WHERE session_id = ? AND path IN ({marks})",
            (session_id, *chunk),
        ):
            index[path] = (int(size), int(mtime_ns))
        # `path/` up to `path0` ('0' follows '/'): exactly the rows under the folder.
        values = ", ".join("(?, ?)" for _ in chunk)
        bounds = [b for p in chunk for b in (p + "/", p + "0")]
        for path, size, mtime_ns in await tx.all(
            f"WITH q(lo, hi) AS (VALUES {values}) SELECT f.path, f.size, f.mtime_ns"
            " FROM q JOIN files f ON f.session_id = ? AND f.path >= q.lo AND f.path < q.hi",
            (*bounds, session_id),
        ):
            index[path] = (int(size), int(mtime_ns))
    return index


async def session_rows_at_and_under(
    tx: Tx, user_key: str, chat_key: str, paths: Sequence[str]
) -> tuple[int, int, dict[str, tuple[int, int]]] | None:
    """(session id, linked_files, rows_at_and_under) in one statement for at most CHUNK paths: a step's
    reconcile reads this, and on a network database each statement is a round trip. None: no row."""
    assert len(paths) <= CHUNK
    values = ", ".join("(?, ?, ?)" for _ in paths)
    bounds = [b for p in paths for b in (p, p + "/", p + "0")]
    rows = await tx.all(
        f"WITH s AS (SELECT id, linked_files FROM sessions WHERE user_key = ? AND chat_key = ?),"
        f" q(p, lo, hi) AS (VALUES {values})"
        " SELECT s.id, s.linked_files, NULL, NULL, NULL FROM s"
        " UNION ALL SELECT s.id, s.linked_files, f.path, f.size, f.mtime_ns"
        " FROM s JOIN q ON 1 = 1 JOIN files f ON f.session_id = s.id AND f.path = q.p"
        " UNION ALL SELECT s.id, s.linked_files, f.path, f.size, f.mtime_ns"
        " FROM s JOIN q ON 1 = 1 JOIN files f ON f.session_id = s.id AND f.path >= q.lo AND f.path < q.hi",
        (user_key, chat_key, *bounds),
    )
    if not rows:
        return None
    index = {path: (int(size), int(mtime_ns)) for _, _, path, size, mtime_ns in rows if path is not None}
    return int(rows[0][0]), int(rows[0][1]), index


async def expired_files(tx: Tx, cutoff: float) -> list[tuple[int, str, int, int]]:
    """(session id, path, size, mtime_ns) of files the index last saw change before cutoff."""
    return await tx.all(
        "SELECT session_id, path, size, mtime_ns FROM files WHERE last_changed < ? ORDER BY session_id",
        (cutoff,),
    )


# ---------------------------------------------------------------------------- imports


async def imported_path(tx: Tx, user_key: str, chat_key: str, source: str) -> str | None:
    row = await tx.one(
        "SELECT i.path FROM imports i JOIN sessions s ON s.id = i.session_id "
        "WHERE s.user_key = ? AND s.chat_key = ? AND i.source = ?",
        (user_key, chat_key, source),
    )
    return None if row is None else row[0]


async def record_import(tx: Tx, session_id: int, source: str, path: str, now: float) -> None:
    await tx.run(
        "INSERT INTO imports (session_id, source, path, imported_at) VALUES (?, ?, ?, ?)"
        " ON CONFLICT DO NOTHING",
        (session_id, source, path, now),
    )


async def import_rows(tx: Tx, user_key: str, chat_key: str) -> list[tuple[str, str]]:
    """Every (source, path) the chat has imported (path "" for a refusal), for its history."""
    rows = await tx.all(
        "SELECT i.source, i.path FROM imports i JOIN sessions s ON s.id = i.session_id "
        "WHERE s.user_key = ? AND s.chat_key = ? ORDER BY i.source",
        (user_key, chat_key),
    )
    return [(str(source), str(path)) for source, path in rows]


async def replace_imports(tx: Tx, session_id: int, rows: Sequence[tuple[str, str]], now: float) -> None:
    """The chat's imports become `rows` (a restored state's: an attachment its files lack is taken
    again at the next message)."""
    await tx.run("DELETE FROM imports WHERE session_id = ?", (session_id,))
    for source, path in rows:
        await record_import(tx, session_id, source, path, now)


# ---------------------------------------------------------------------------- activity and meta


async def log_activity(
    tx: Tx,
    at: float,
    event: str,
    user_id: str | None = None,
    chat_id: str | None = None,
    detail: dict[str, Any] | None = None,
) -> None:
    await tx.run(
        "INSERT INTO activity (at, event, user_id, chat_id, detail) VALUES (?, ?, ?, ?, ?)",
        (
            at,
            event,
            None if user_id is None else db_text(user_id),
            None if chat_id is None else db_text(chat_id),
            json.dumps(detail or {}, default=str),
        ),
    )


async def prune_activity(tx: Tx, before: float) -> None:
    await tx.run("DELETE FROM activity WHERE at < ?", (before,))


async def newest_activity(tx: Tx, limit: int) -> list[ActivityEntry]:
    rows = await tx.all(
        "SELECT at, event, user_id, chat_id, detail FROM activity ORDER BY at DESC, id DESC LIMIT ?", (limit,)
    )
    return [ActivityEntry(at, ev, u, c, _json(detail)) for at, ev, u, c, detail in rows]


async def get_meta(tx: Tx, key: str) -> str | None:
    row = await tx.one("SELECT value FROM meta WHERE key = ?", (key,))
    return None if row is None else str(row[0])


async def set_meta(tx: Tx, key: str, value: str) -> None:
    await tx.run(
        "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
        (key, value),
    )


def _json(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        return {"raw": text}
    return value if isinstance(value, dict) else {"value": value}
