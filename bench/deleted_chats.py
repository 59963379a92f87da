"""Section: finding chats deleted in Open WebUI, once a minute, among 10,000 sessions.

What one background tick does for it, measured with 10,000 saved-chat sessions in the index:

(a) list our sessions (`Store.chats()`, one query);
(b) ask which of their chats still exist, the way Open WebUI answers the function (webui.host:
    `Chats.get_owner_ids_by_chat_ids`, one `SELECT id, user_id FROM chat WHERE id IN (...)` per 500
    ids), here against an SQLite `chat` table of 10,000 rows shaped like Open WebUI's, 1% of them
    deleted;
(c) mark the missing ones and pick those missing at two looks (`Store.mark_missing`, one write).

The target: a+b+c <= 500 ms for 10,000 sessions, once a minute (under 1% of a core); (a) and (c) run
in the index's thread, (b) in Open WebUI's database, so none of it holds the event loop.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
import uuid
from typing import Any

from storage import Store

from ._common import Context, summary

SECTION = "deleted_chats"
TARGET_MS = 500.0
_CHUNK = 500


def _owners(db: str, chat_ids: list[str]) -> dict[str, str]:
    conn = sqlite3.connect(db)
    try:
        found: dict[str, str] = {}
        for start in range(0, len(chat_ids), _CHUNK):
            chunk = chat_ids[start : start + _CHUNK]
            marks = ",".join("?" * len(chunk))
            found.update(
                conn.execute(f"SELECT id, user_id FROM chat WHERE id IN ({marks})", chunk).fetchall()
            )
        return found
    finally:
        conn.close()


async def run(ctx: Context) -> dict[str, Any]:
    count = 1_000 if ctx.quick else 10_000
    reps = 3 if ctx.quick else 15
    base = ctx.scratch / "deleted-chats"
    base.mkdir(parents=True, exist_ok=True)
    owui = base / "webui.db"
    chats = [(f"user-{i % 100}", str(uuid.uuid4())) for i in range(count)]
    deleted = set(chats[::100])  # 1%

    def make_open_webui_db() -> None:
        conn = sqlite3.connect(owui)
        conn.execute("CREATE TABLE chat (id TEXT PRIMARY KEY, user_id TEXT, title TEXT, created_at INTEGER)")
        conn.executemany(
            "INSERT INTO chat VALUES (?, ?, 'New Chat', 0)",
            [(c, u) for u, c in chats if (u, c) not in deleted],
        )
        conn.commit()
        conn.close()

    await asyncio.to_thread(make_open_webui_db)
    async with Store(base / "root") as store:
        ctx.log(f"{SECTION}: {count} sessions")
        for user, chat in chats:  # rows only: the folders are not what a tick looks at
            await store.session(user, chat)
        listing_t: list[float] = []
        lookup_t: list[float] = []
        mark_t: list[float] = []
        total_t: list[float] = []
        gone: list[tuple[str, str]] = []
        for _ in range(reps):
            t0 = time.perf_counter()
            saved = [(u, c) for u, c, _, temporary in await store.chats() if not temporary]
            t1 = time.perf_counter()
            owners = await asyncio.to_thread(_owners, str(owui), sorted({c for _, c in saved}))
            t2 = time.perf_counter()
            missing = [(u, c) for u, c in saved if owners.get(c) != u]
            gone = await store.mark_missing(missing, after_s=0.0)
            t3 = time.perf_counter()
            listing_t.append(t1 - t0)
            lookup_t.append(t2 - t1)
            mark_t.append(t3 - t2)
            total_t.append(t3 - t0)
        if len(gone) != len(deleted):
            ctx.error(SECTION, f"found {len(gone)} deleted chats, expected {len(deleted)}")
    return {
        "sessions": count,
        "deleted": len(deleted),
        "list_sessions": summary(listing_t),
        "which_chats_exist": summary(lookup_t),
        "mark_missing": summary(mark_t),
        "tick": summary(total_t),
        "target_ms": TARGET_MS,
    }
