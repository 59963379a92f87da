"""What the store needs of any backend, checked on each: byte order for paths and ids (the range reads
of a change-driven reconcile rely on it), and the Python types that totals and listings come back in.
(One user's quota decisions taking turns: test_storage_postgres.py; SQLite has one writer at a time.)"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from storage import Store, _index, _index_links


async def test_paths_and_ids_sort_and_range_by_bytes(store: Store) -> None:
    # '-' (0x2d), '.' (0x2e) and '/' (0x2f) sort before '0'; a locale-aware collation would mix them.
    paths = ["a", "a/b", "a/c/d", "a/é", "a-b", "a.txt", "a0", "ab", "A/x", "b", "é"]
    s = await store.session("u", "c")
    for path in paths:
        if "/" not in path or path.split("/")[0] not in paths:
            await s.files.write(path, b"x")
    written = [f.path for f in await s.files.list()]
    assert written == sorted(written, key=lambda p: p.encode()) and len(written) == 8

    for user in ["b", "B", "_x", "é", "a-b", "a b"]:
        await store.session(user, "c")
    users = [u.user_id for u in await store.users_usage()]
    assert users == sorted(users, key=lambda u: u.encode())
    ids = [(i.user_id, i.chat_id) for i in await store.sessions()]
    assert ids == sorted(ids, key=lambda p: (p[0].encode(), p[1].encode()))


async def test_rows_at_and_under_reads_folders_exactly(store: Store) -> None:
    s = await store.session("u", "c")
    for path in ["d/x", "d/y/z", "d-x", "d0", "dd", "e/d/x", "f"]:
        await s.files.write(path, b"12")

    async def under(tx: Any) -> dict[str, tuple[int, int]]:
        row = await _index.session_by_keys(tx, s.user_key, s.chat_key)
        assert row is not None
        return await _index.rows_at_and_under(tx, row.id, ["d", "f", "e/d", "missing"])

    rows = await store.backend.read(under)
    assert sorted(rows) == ["d/x", "d/y/z", "e/d/x", "f"]
    assert all(type(size) is int and type(ns) is int and size == 2 for size, ns in rows.values())


async def test_totals_and_listings_come_back_as_python_numbers(store: Store) -> None:
    s = await store.session("u", "c")
    await s.files.write("a", b"123")
    await s.files.write("b", b"4567")
    await s.publish("a")
    [user] = await store.users_usage()
    assert (user.sessions, user.files, user.bytes) == (1, 2, 10)
    assert all(type(v) is int for v in (user.sessions, user.files, user.bytes))
    [info] = await store.sessions()
    assert type(info.created_at) is float and type(info.files) is int and info.temporary is False
    [link] = await store.links()
    assert type(link.size) is int and type(link.created_at) is float
    health = await store.backend.read(_index_links.link_health)
    assert [row[5:] for row in health] == [(0, 0, 0, "a")]

    async def refresh(tx: Any) -> tuple[int, int]:
        row = await _index.session_by_keys(tx, s.user_key, s.chat_key)
        assert row is not None
        return await _index.refresh_totals(tx, row.id)

    assert await store.backend.write(refresh) == (2, 7)
    assert all(type(v) is int for v in await store.backend.write(refresh))


async def test_totals_follow_bulk_writes(store: Store) -> None:
    """sessions.file_count / bytes / published_bytes stay equal to the rows they count through bulk
    upserts (new and changed rows in one call, a path given twice), bulk deletes, and links; on
    PostgreSQL these go as a few multi-row statements whose triggers run once per statement."""
    s = await store.session("u", "c")
    other = await store.session("u", "other")
    backend = store.backend

    async def ids(tx: Any) -> tuple[int, int]:
        a = await _index.session_by_keys(tx, s.user_key, s.chat_key)
        b = await _index.session_by_keys(tx, other.user_key, other.chat_key)
        assert a is not None and b is not None
        return a.id, b.id

    sid, oid = await backend.read(ids)

    async def check() -> None:
        async def totals(tx: Any) -> list[tuple[Any, ...]]:
            return await tx.all(
                "SELECT s.id, s.file_count, s.bytes, s.published_bytes,"
                " (SELECT count(*) FROM files f WHERE f.session_id = s.id),"
                " (SELECT coalesce(sum(size), 0) FROM files f WHERE f.session_id = s.id),"
                " (SELECT coalesce(sum(size), 0) FROM links l WHERE l.session_id = s.id)"
                " FROM sessions s ORDER BY s.id"
            )

        for row in await backend.read(totals):
            assert tuple(int(v) for v in row[1:4]) == tuple(int(v) for v in row[4:7]), row

    now = 1.0
    await backend.write(
        lambda tx: _index.upsert_files(tx, sid, [(f"f{i:04}", i, i, now) for i in range(2500)])
    )
    await check()
    # 1,000 grow, 500 are new, one path twice (the last counts), and the other session's rows
    mixed = [(f"f{i:04}", i + 10, i, now) for i in range(1500, 3000)] + [
        ("f0001", 7, 1, now),
        ("f0001", 9, 1, now),
    ]
    await backend.write(lambda tx: _index.upsert_files(tx, sid, mixed))
    await backend.write(lambda tx: _index.upsert_files(tx, oid, [(f"g{i}", 3, 3, now) for i in range(1200)]))
    await check()
    assert (await s.usage()).files == 3000 and (await other.usage()).bytes == 3600

    async def size_of(tx: Any) -> int | None:
        return await _index.file_size(tx, sid, "f0001")

    assert await backend.read(size_of) == 9
    await backend.write(
        lambda tx: _index.delete_files(tx, sid, [f"f{i:04}" for i in range(0, 3000, 3)] + ["nope"])
    )
    await backend.write(lambda tx: _index.delete_files(tx, oid, [f"g{i}" for i in range(1100)]))
    await check()
    assert (await s.usage()).files == 2000 and (await other.usage()).files == 100

    async def links(tx: Any) -> None:
        for n in range(3):
            await _index_links.insert_link(
                tx, sid, ref=f"t{n}", kind="directory", path="f0001", name="f0001", url="/x",
                directory="/d", size=100 + n, mtime_ns=1, inode=1, ctime_ns=1, sha256="h", now=now,
            )  # fmt: skip

    await backend.write(links)
    await backend.write(lambda tx: _index_links.delete_links(tx, ["t0", "t2", "gone"]))
    await check()
    assert (await s.user_usage()).bytes == (await s.usage()).bytes + (await other.usage()).bytes + 101
    await backend.write(lambda tx: _index.delete_session(tx, oid))  # its files go by cascade
    await check()


async def test_a_periodic_task_is_claimed_by_one_process_per_interval(root: Path, database_url: str) -> None:
    # Six processes (six stores, each with its own connections) ask at once whether the task is due.
    stores = [Store(root, busy_timeout_s=20, database_url=database_url) for _ in range(6)]
    for s in stores:
        await s.open()
    try:
        rounds = [await asyncio.gather(*(s.claim("maintenance", 3600) for s in stores)) for _ in range(3)]
        assert [r.count(True) for r in rounds] == [1, 0, 0], rounds
        assert await stores[0].claim("maintenance", 0) is True  # due again at once with no interval
        assert await stores[1].claim("other task", 3600) is True
    finally:
        for s in stores:
            await s.close()
