"""The index: migrations and corruption of the SQLite file; on both backends, rebuild from disk and
several processes at once (PostgreSQL's own schema and locks: test_storage_postgres.py)."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from storage import Copy, DirectoryPublisher, Published, Quotas, Reconcile, StorageBusy, StorageError, Store
from storage._schema import CURRENT_VERSION, MIGRATIONS, statements
from tests.storage.storage_helpers import lose_index, sql, sqlite_only, stored_id, temporary_chat, user_usage

Sql = Callable[..., list[tuple[Any, ...]]]


@sqlite_only
async def test_new_index_is_wal_and_current(store: Store, root: Path) -> None:
    assert sql(root, "PRAGMA journal_mode") == [("wal",)]
    assert sql(root, "PRAGMA user_version") == [(CURRENT_VERSION,)]
    assert CURRENT_VERSION >= 2


async def test_v1_database_is_migrated(root: Path) -> None:
    root.mkdir()
    conn = sqlite3.connect(root / "index.sqlite3", isolation_level=None)
    for statement in statements(MIGRATIONS[0]):
        conn.execute(statement)
    conn.execute("PRAGMA user_version = 1")
    conn.execute(
        "INSERT INTO sessions (user_id, chat_id, user_key, chat_key, temporary, created_at, last_used_at)"
        " VALUES ('u', 'c', 'uk', 'ck', 0, 1, 2)"
    )
    conn.close()
    async with Store(root) as store:
        assert [s.chat_id for s in await store.sessions()] == ["c"]
        await store.cleanup(dry_run=False)  # uses the v2 activity table
        assert next(a.event for a in await store.activity()) == "cleanup"
    assert sql(root, "PRAGMA user_version") == [(CURRENT_VERSION,)]


async def test_newer_database_is_refused(root: Path) -> None:
    root.mkdir()
    conn = sqlite3.connect(root / "index.sqlite3", isolation_level=None)
    conn.execute("PRAGMA user_version = 99")
    conn.close()
    with pytest.raises(StorageError, match="newer version"):
        async with Store(root):
            pass


async def _populate(root: Path, database_url: str = "") -> None:
    async with Store(root, database_url=database_url, temporary_chat=temporary_chat) as store:
        a = await store.session("alice\x00", "chat/1")
        await a.files.write("report.csv", b"1,2")
        b = await store.session("bob", "temporary:9")
        await b.files.write("x/y.txt", b"yy")


@pytest.mark.parametrize("damage", ["garbage", "page"])
async def test_corrupt_index_is_moved_aside_and_rebuilt(
    root: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    await _populate(root)
    db = root / "index.sqlite3"
    if damage == "garbage":
        db.write_bytes(b"this is not a database" * 100)
    else:
        sql(root, "PRAGMA wal_checkpoint(TRUNCATE)")
        data = bytearray(db.read_bytes())
        assert len(data) > 3 * 4096
        data[4096 + 100 : 4096 * 3] = b"\xa5" * (4096 * 2 - 100)  # scribble over b-tree pages
        db.write_bytes(bytes(data))
    with caplog.at_level("WARNING", logger="code_sessions.storage"):
        async with Store(root, temporary_chat=temporary_chat) as store:
            sessions = {(s.user_id, s.chat_id, s.files, s.bytes, s.temporary) for s in await store.sessions()}
            assert sessions == {("alice\x00", "chat/1", 1, 3, False), ("bob", "temporary:9", 1, 2, True)}
            assert await store.check() == []
            assert "corrupt_index" in [a.event for a in await store.activity()]
    assert len(list(root.glob("index.sqlite3.corrupt-*"))) >= 1
    assert any("corrupt" in r.message for r in caplog.records)


async def test_deleted_index_is_rebuilt_with_real_ids(root: Path, database_url: str) -> None:
    await _populate(root, database_url)
    lose_index(root, database_url)
    async with Store(root, database_url=database_url) as store:
        rows = {(s.user_id, s.chat_id, s.files, s.bytes) for s in await store.sessions()}
        assert rows == {(stored_id("alice\x00", database_url), "chat/1", 1, 3), ("bob", "temporary:9", 1, 2)}
        a = await store.session("alice\x00", "chat/1")
        assert [f.path for f in await a.files.list()] == ["report.csv"]
        assert (await user_usage(store, "bob")).bytes == 2


async def test_rebuild_without_sidecar_keeps_files(root: Path, database_url: str) -> None:
    await _populate(root, database_url)
    async with Store(root, database_url=database_url) as store:
        s = await store.session("bob", "temporary:9")
        (root / "state" / s.user_key / f"{s.chat_key}.json").unlink()
    lose_index(root, database_url)
    async with Store(root, database_url=database_url) as store:
        rows = {(s.user_id, s.files) for s in await store.sessions()}
        assert (stored_id("alice\x00", database_url), 1) in rows
        assert any(u.startswith("unknown:bob-") and n == 1 for u, n in rows)
        report = await store.reconcile(Reconcile.REBUILD)
        assert report.sessions == 2 and report.sessions_without_sidecar == 1 and report.added == 0
        assert next(a.event for a in await store.activity()) == "rebuild"


async def test_a_session_rebuilt_under_unknown_ids_still_finds_its_links_and_usage(
    root: Path, publisher: DirectoryPublisher, database_url: str
) -> None:
    quotas = Quotas(max_files_per_user=1)
    async with Store(root, publisher=publisher, quotas=quotas, database_url=database_url) as store:
        s = await store.session("bob", "c1")
        await s.files.write("a.txt", b"1")
        (root / "state" / s.user_key / f"{s.chat_key}.json").unlink()  # the ids are lost with it
    lose_index(root, database_url)
    async with Store(root, publisher=publisher, quotas=quotas, database_url=database_url) as store:
        [info] = await store.sessions()
        assert info.user_id.startswith("unknown:")
        rebuilt = store.session_at(info)
        await rebuilt.publish("a.txt")
        assert [link.path for link in await rebuilt.links()] == ["a.txt"]
        # its one file counts against the (unknown) user: a run has nothing to spend
        assert (await rebuilt.user_usage()).files == 1
        assert (await rebuilt.run_budget()).note is not None


async def test_rebuild_drops_rows_without_folder(store: Store) -> None:
    s = await store.session("u", "c")
    await s.files.write("a", b"1")
    import shutil

    shutil.rmtree(s.path)
    assert [d.kind for d in await store.check()] == ["session folder missing"]
    report = await store.reconcile(Reconcile.REBUILD)
    assert report.rows_removed == 1
    assert await store.sessions() == []


async def test_rebuild_repairs_drifted_totals_and_reports_the_repaired_ones(
    store: Store, index_sql: Sql
) -> None:
    s = await store.session("u", "c")
    await s.files.write("a", b"12345")
    index_sql("UPDATE sessions SET file_count = 7, bytes = 999")
    report = await store.reconcile(Reconcile.REBUILD)
    assert (report.files, report.bytes) == (1, 5)
    assert [(i.files, i.bytes) for i in await store.sessions()] == [(1, 5)]


async def test_check_reports_drift(store: Store) -> None:
    s = await store.session("u", "c")
    await s.files.write("a.txt", b"1")
    await s.files.write("b.txt", b"1")
    (s.path / "new.txt").write_text("x")
    (s.path / "a.txt").unlink()
    (s.path / "b.txt").write_text("changed")
    (s.path / "fifo").parent.mkdir(exist_ok=True)
    import os

    os.mkfifo(s.path / "fifo")
    kinds = sorted((d.kind, d.path) for d in await store.check())
    assert kinds == [
        ("file changed", "b.txt"),
        ("file missing", "a.txt"),
        ("file not indexed", "new.txt"),
        ("special file", "fifo"),
    ]
    assert (s.path / "fifo").exists()  # check changes nothing
    await s.reconcile()
    assert await store.check() == []


WRITER = """
    import asyncio, sys
    from storage import Store

    async def main(root, name, url):
        async with Store(root, busy_timeout_s=60, database_url=url) as store:
            for i in range(40):
                s = await store.session(f"user-{i % 3}", f"{name}-{i % 5}")
                await s.files.write(f"f{i}.txt", b"x" * (i + 1))
                await s.files.write_new("upload.csv", b"abc")
                async with s.lock():
                    await s.reconcile()
                await store.users_usage()
        print("done")

    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3]))
"""


def test_two_processes_write_the_index_at_once(root: Path, database_url: str) -> None:
    from tests.storage.storage_helpers import start_python

    procs = [start_python(WRITER, str(root), name, database_url) for name in ("p1", "p2")]
    outputs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err
        assert out.strip() == "done"
        assert "locked" not in err and "busy" not in err.lower()

    async def verify() -> None:
        async with Store(root, database_url=database_url) as store:
            assert await store.check() == []
            sessions = await store.sessions()
            assert len(sessions) == 2 * 15  # (i % 3, i % 5) covers 15 pairs per process
            assert sum(s.files for s in sessions) == 2 * 40 + 2 * 40
            total = sum(s.bytes for s in sessions)
            assert total == 2 * (sum(range(1, 41)) + 40 * 3)

    asyncio.run(verify())


class _Blocker:
    """Another client holding the index's write lock: SQLite's (BEGIN IMMEDIATE), or on PostgreSQL a
    lock on the files table that lets readers through and no writer."""

    def __init__(self, root: Path, database_url: str) -> None:
        if database_url:
            import psycopg

            self.conn: Any = psycopg.connect(database_url, autocommit=True)
            self.conn.execute("BEGIN")
            self.conn.execute("LOCK TABLE code_sessions.files IN EXCLUSIVE MODE")
        else:
            self.conn = sqlite3.connect(root / "index.sqlite3", isolation_level=None)
            self.conn.execute("BEGIN IMMEDIATE")

    def release(self) -> None:
        self.conn.execute("ROLLBACK")
        self.conn.close()


async def test_index_locked_too_long_raises_storage_busy(root: Path, database_url: str) -> None:
    async with Store(root, busy_timeout_s=0.5, database_url=database_url) as store:
        s = await store.session("u", "c")
        blocker = _Blocker(root, database_url)
        try:
            with pytest.raises(StorageBusy, match="locked"):
                await s.files.write("a", b"1")
            # reads still work while a writer holds the lock (WAL; MVCC)
            assert (await s.usage()).files == 0
        finally:
            blocker.release()
        await s.files.write("a", b"1")
        assert (await s.usage()).files == 1


async def test_concurrent_tasks_share_the_pool(store: Store) -> None:
    sessions = [await store.session("u", f"c{i}") for i in range(10)]
    await asyncio.gather(*(s.files.write(f"f{j}", b"x") for s in sessions for j in range(5)))
    assert (await user_usage(store, "u")).files == 50
    assert await store.check() == []


def test_a_store_never_closed_does_not_keep_the_process_alive(tmp_path: Path, database_url: str) -> None:
    # A web server's Store lives until the process ends; its threads must not block that end.
    script = (
        "import asyncio, sys\n"
        "from pathlib import Path\n"
        "from storage import Store\n"
        "async def main():\n"
        "    store = Store(Path(sys.argv[1]), database_url=sys.argv[2])\n"
        "    await store.open()\n"
        "    await (await store.session('u', 'c')).usage()\n"
        "asyncio.run(main())\n"
    )
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path / "root"), database_url], timeout=30)
    assert result.returncode == 0


class _ElsewherePublisher:
    """Copies held by another system (as Open WebUI's Files API holds the application's): a dict."""

    kind = "elsewhere"

    def __init__(self) -> None:
        self.held: dict[str, bytes] = {}

    async def put(self, copy: Copy) -> Published:
        ref = f"copy-{len(self.held)}"
        self.held[ref] = os.pread(copy.fd, copy.size, 0)
        return Published(ref, f"/elsewhere/{ref}")

    async def remove(self, refs: Sequence[str]) -> None:
        for ref in refs:
            self.held.pop(ref, None)

    async def missing(self, refs: Sequence[str]) -> set[str]:
        return {ref for ref in refs if ref not in self.held}

    async def strays(self, known: set[str], older_than_s: float) -> list[str]:
        return [ref for ref in self.held if ref not in known]


async def test_a_lost_index_rebuilt_where_its_copies_cannot_be_checked_keeps_their_links(
    root: Path, database_url: str
) -> None:
    """The CLI rebuilds an index lost by an application that publishes elsewhere (Open WebUI's files):
    it cannot look at those copies, so it keeps their records' links; the application's next cleanup
    must not then delete the copies as strays, breaking the links in old answers."""
    elsewhere = _ElsewherePublisher()
    async with Store(root, publisher=elsewhere, database_url=database_url) as store:
        s = await store.session("alice", "chat")
        await s.files.write("report.csv", b"a,b\n")
        link = await s.publish("report.csv")
    lose_index(root, database_url)
    async with Store(root, database_url=database_url) as cli:  # no publisher of that kind
        await cli.reconcile(Reconcile.REBUILD)
        assert [(i.path, i.url) for i in await cli.links()] == [("report.csv", link.url)]
    async with Store(root, publisher=elsewhere, database_url=database_url) as store:
        await store.cleanup()
        assert list(elsewhere.held) == [link.ref]
        s = await store.session("alice", "chat")
        assert (await s.publish("report.csv")).url == link.url  # the same copy, reused
