"""SQL shared by the modules that use the index (rows of sessions, totals, activity, meta)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ._db import Tx
from ._keys import db_text

_SESSION_COLUMNS = (
    "id, user_id, chat_id, user_key, chat_key, temporary, created_at, last_used_at, bytes, file_count,"
    " linked_files"
)


@dataclass(frozen=True, slots=True)
class SessionRow:
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
    linked_files: bool  # files with several hard links were seen (see _partial)

    @classmethod
    def from_row(cls, row: tuple[Any, ...]) -> SessionRow:
        return cls(row[0], row[1], row[2], row[3], row[4], bool(row[5]), *row[6:10], bool(row[10]))


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
    row = await tx.one(
        "INSERT INTO sessions (user_id, chat_id, user_key, chat_key, temporary, created_at, last_used_at)"
        " VALUES (?, ?, ?, ?, ?, ?, ?)"
        " ON CONFLICT (user_key, chat_key) DO UPDATE"
        " SET last_used_at = max(sessions.last_used_at, ?)"
        " RETURNING id",
        (
            db_text(user_id),
            db_text(chat_id),
            user_key,
            chat_key,
            int(temporary),
            created_at,
            used_at if used_at is not None else created_at,
            used_at if used_at is not None else 0.0,
        ),
    )
    assert row is not None
    return int(row[0])


async def session_by_keys(tx: Tx, user_key: str, chat_key: str) -> SessionRow | None:
    row = await tx.one(
        f"SELECT {_SESSION_COLUMNS} FROM sessions WHERE user_key = ? AND chat_key = ?", (user_key, chat_key)
    )
    return SessionRow.from_row(row) if row else None


async def all_sessions(tx: Tx, where: str = "", params: tuple[Any, ...] = ()) -> list[SessionRow]:
    rows = await tx.all(f"SELECT {_SESSION_COLUMNS} FROM sessions {where} ORDER BY user_id, chat_id", params)
    return [SessionRow.from_row(r) for r in rows]


async def refresh_totals(tx: Tx, session_id: int) -> tuple[int, int]:
    """Recompute the session's cached totals from its file rows (repair; triggers keep them in step)."""
    row = await tx.one(
        "SELECT count(*), coalesce(sum(size), 0) FROM files WHERE session_id = ?", (session_id,)
    )
    files, size = (int(row[0]), int(row[1])) if row else (0, 0)
    await tx.run("UPDATE sessions SET file_count = ?, bytes = ? WHERE id = ?", (files, size, session_id))
    return files, size


async def session_totals(tx: Tx, session_id: int) -> tuple[int, int]:
    row = await tx.one("SELECT file_count, bytes FROM sessions WHERE id = ?", (session_id,))
    return (int(row[0]), int(row[1])) if row else (0, 0)


async def user_totals(tx: Tx, user_key: str, *, except_chat_key: str | None = None) -> tuple[int, int, int]:
    """(sessions, files, bytes) of a user across chats: one indexed SUM over the user's session rows."""
    sql = (
        "SELECT count(*), coalesce(sum(file_count), 0), coalesce(sum(bytes), 0)"
        " FROM sessions WHERE user_key = ?"
    )
    params: tuple[Any, ...] = (user_key,)
    if except_chat_key is not None:
        sql += " AND chat_key != ?"
        params += (except_chat_key,)
    row = await tx.one(sql, params)
    return (int(row[0]), int(row[1]), int(row[2])) if row else (0, 0, 0)


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


async def get_meta(tx: Tx, key: str) -> str | None:
    row = await tx.one("SELECT value FROM meta WHERE key = ?", (key,))
    return None if row is None else str(row[0])


async def set_meta(tx: Tx, key: str, value: str) -> None:
    await tx.run(
        "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
        (key, value),
    )
