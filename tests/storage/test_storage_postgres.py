"""The PostgreSQL backend on a real server: its own schema, its migrations, locks that hold across
processes and go with a killed holder, one user's quota decisions across processes, a database
restart, a dropped schema, and the CLI with --database-url."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from storage import DirectoryPublisher, DiskFull, IndexDamaged, StorageBusy, Store
from storage._postgres import PostgresBackend, advisory_key, is_postgres_url, libpq_url, redact_url
from storage._postgres_schema import CURRENT_VERSION
from storage._postgres_tx import to_pyformat
from storage.errors import StorageError
from tests.storage.storage_helpers import run_python, start_python
from tests.storage.test_storage_cli import run_cli
from tests.support.postgres import PostgresServer

OUR_TABLES = {"meta", "sessions", "files", "links", "activity", "imports", "unpublished", "schema_version"}


def _query(url: str, statement: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True) as conn:
        cursor = conn.execute(statement, params)
        return cursor.fetchall() if cursor.description else []


async def _populate(store: Store) -> None:
    s = await store.session("alice", "chat-1")
    await s.files.write("report.csv", b"a,b\n1,2\n")
    await s.files.write("plots/chart.png", b"\x89PNG")
    await s.publish("plots/chart.png")
    await s.files.write_new("upload.csv", b"x", source="upload:1")
    async with s.lock():
        await s.reconcile()
    await store.cleanup()
    await store.mark_missing([("alice", "chat-1")], after_s=60)


# ---------------------------------------------------------------------------- schema and migrations


async def test_the_index_lives_in_its_own_schema_and_never_touches_public(
    root: Path, publisher: DirectoryPublisher, postgres_url: str
) -> None:
    # Open WebUI's tables are in `public`, some with the names of ours: they must never be touched.
    _query(postgres_url, "CREATE TABLE public.sessions (id INTEGER PRIMARY KEY, note TEXT)")
    _query(postgres_url, "INSERT INTO public.sessions VALUES (1, 'open webui')")
    async with Store(root, publisher=publisher, database_url=postgres_url) as store:
        await _populate(store)
        assert [s.chat_id for s in await store.sessions()] == ["chat-1"]
    assert _query(postgres_url, "SELECT * FROM public.sessions") == [(1, "open webui")]
    outside = "NOT IN ('pg_catalog', 'information_schema', 'pg_toast')"
    tables = _query(
        postgres_url,
        f"SELECT table_schema, table_name FROM information_schema.tables WHERE table_schema {outside}",
    )
    assert {name for schema, name in tables if schema == "code_sessions"} == OUR_TABLES
    assert {(schema, name) for schema, name in tables if schema != "code_sessions"} == {
        ("public", "sessions")
    }
    # Nothing else of ours outside the schema either: indexes, sequences, functions, triggers.
    relations = _query(
        postgres_url,
        "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = 'public'",
    )
    assert sorted(r for (r,) in relations) == ["sessions", "sessions_pkey"]
    routines = _query(
        postgres_url,
        "SELECT routine_schema, routine_name FROM information_schema.routines"
        f" WHERE routine_schema {outside}",
    )
    assert {schema for schema, _ in routines} == {"code_sessions"}
    triggers = _query(postgres_url, "SELECT DISTINCT event_object_schema FROM information_schema.triggers")
    assert triggers == [("code_sessions",)]
    # Byte order for every text column (paths' range reads; the same sort as SQLite, whatever the locale).
    loose = _query(
        postgres_url,
        "SELECT table_name, column_name FROM information_schema.columns WHERE table_schema = 'code_sessions'"
        " AND data_type = 'text' AND collation_name IS DISTINCT FROM 'C' AND table_name != 'meta'",
    )
    assert loose == [("activity", "detail")]


async def test_migrations_run_once_and_are_idempotent(root: Path, postgres_url: str) -> None:
    backends = [PostgresBackend(postgres_url, busy_total_s=20) for _ in range(3)]
    try:
        # Three processes opening an empty database at once: one creates the schema, the others wait.
        opened = await asyncio.gather(*(b.open() for b in backends))
        assert sorted(o.fresh for o in opened) == [False, False, True]
    finally:
        for b in backends:
            await b.close()
    assert _query(postgres_url, "SELECT version FROM code_sessions.schema_version") == [(CURRENT_VERSION,)]
    async with Store(root, database_url=postgres_url) as store:
        await (await store.session("u", "c")).files.write("a", b"1")
    again = PostgresBackend(postgres_url)
    try:
        assert (await again.open()).fresh is False
    finally:
        await again.close()
    async with Store(root, database_url=postgres_url) as store:
        assert [(s.chat_id, s.files) for s in await store.sessions()] == [("c", 1)]
    assert _query(postgres_url, "SELECT version FROM code_sessions.schema_version") == [(CURRENT_VERSION,)]


async def test_a_newer_schema_is_refused(root: Path, postgres_url: str) -> None:
    async with Store(root, database_url=postgres_url):
        pass
    _query(postgres_url, "UPDATE code_sessions.schema_version SET version = 99")
    with pytest.raises(StorageError, match="newer version of code-sessions"):
        async with Store(root, database_url=postgres_url):
            pass


async def test_a_dropped_schema_is_rebuilt_from_the_folders_while_open(root: Path, postgres_url: str) -> None:
    async with Store(root, database_url=postgres_url) as store:
        s = await store.session("u", "c")
        await s.files.write("kept.txt", b"123")
        _query(postgres_url, "DROP SCHEMA code_sessions CASCADE")
        # The next operation finds the tables gone, the backend creates them again, the store rebuilds.
        assert [(i.chat_id, i.files, i.bytes) for i in await store.sessions()] == [("c", 1, 3)]
        assert await store.check() == []


# ---------------------------------------------------------------------------- locks across processes

HOLDER = """
    import asyncio, sys
    from storage import Store

    async def main(root, url):
        async with Store(root, database_url=url) as store:
            s = await store.session("u", "busy")
            named = store.lock("cleanup")
            async with s.lock():
                assert await named.try_acquire()
                print("locked", flush=True)
                await asyncio.to_thread(sys.stdin.readline)
                await named.release()
        print("released", flush=True)

    asyncio.run(main(sys.argv[1], sys.argv[2]))
"""

TRIER = """
    import asyncio, sys
    from storage import StorageBusy, Store

    async def main(root, url):
        async with Store(root, database_url=url) as store:
            s = await store.session("u", "busy")
            try:
                async with s.lock(timeout=0.5):
                    print("got it")
            except StorageBusy as exc:
                print("busy:", exc)
            print("named", await store.lock("cleanup").try_acquire())

    asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


async def _wait_for_line(proc: Any, expected: str) -> None:
    line = await asyncio.to_thread(proc.stdout.readline)
    if line.strip() != expected:
        proc.kill()
        raise AssertionError(f"{line!r}: {proc.stderr.read()}")


async def test_a_chat_lock_is_exclusive_across_processes(root: Path, postgres_url: str) -> None:
    async with Store(root, database_url=postgres_url) as store:
        s = await store.session("u", "busy")
        holder = start_python(HOLDER, str(root), postgres_url)
        try:
            await _wait_for_line(holder, "locked")
            tried = await asyncio.to_thread(run_python, TRIER, str(root), postgres_url)
            assert tried.returncode == 0, tried.stderr
            assert tried.stdout.splitlines() == [
                "busy: this chat is busy with another request (waited 0.5 s); try again in a moment",
                "named False",
            ]
            # Seen held without taking it (dry runs, check); this process cannot take it either.
            assert await store.backend.chat_locked(s.user_key, s.chat_key)
            assert not await store.backend.chat_locked(s.user_key, "other-chat")
            with pytest.raises(StorageBusy, match="busy"):
                async with s.lock(timeout=0.2):
                    pass
            holder.stdin.write("\n")
            holder.stdin.flush()
            await _wait_for_line(holder, "released")
        finally:
            if holder.poll() is None:
                holder.kill()
            await asyncio.to_thread(holder.wait, 30)
        assert not await store.backend.chat_locked(s.user_key, s.chat_key)
        tried = await asyncio.to_thread(run_python, TRIER, str(root), postgres_url)
        assert tried.stdout.splitlines() == ["got it", "named True"], tried.stderr


async def test_the_lock_of_a_killed_process_frees_within_seconds(root: Path, postgres_url: str) -> None:
    async with Store(root, database_url=postgres_url) as store:
        s = await store.session("u", "busy")
        holder = start_python(HOLDER, str(root), postgres_url)
        try:
            await _wait_for_line(holder, "locked")
            assert await store.backend.chat_locked(s.user_key, s.chat_key)
            # A replica killed mid-run: no release, no cleanup of any kind.
            os.kill(holder.pid, signal.SIGKILL)
            await asyncio.to_thread(holder.wait, 30)
            started = time.monotonic()
            async with s.lock(timeout=10):
                freed = time.monotonic() - started
            assert freed < 5
            assert await store.lock("cleanup").try_acquire()
        finally:
            if holder.poll() is None:
                holder.kill()


async def test_locks_of_one_process_exclude_each_other_and_keys_are_apart(
    root: Path, postgres_url: str
) -> None:
    async with Store(root, database_url=postgres_url) as store:
        backend = store.backend
        assert isinstance(backend, PostgresBackend)
        first, second = backend.chat_lock("u", "c"), backend.chat_lock("u", "c")
        assert await first.try_acquire()
        # Session-level advisory locks are reentrant within one connection: each lock has its own.
        assert not await second.try_acquire()
        with pytest.raises(RuntimeError):
            await first.try_acquire()
        await first.release()
        assert await second.try_acquire()
        await second.release()
        await second.release()  # a second release is a no-op
        keys = {
            backend.chat_key("u", "c"),
            backend.user_key("u"),
            advisory_key("code-sessions:code_sessions:lock:u"),
            PostgresBackend(postgres_url, schema="other").chat_key("u", "c"),
        }
        assert len(keys) == 4


# ---------------------------------------------------------------------------- quota decisions

WRITER = """
    import asyncio, sys
    from storage import QuotaExceeded, Quotas, Store

    async def main(root, url, chat):
        quotas = Quotas(max_files_per_user=30, max_new_files_per_run=0)
        async with Store(root, database_url=url, quotas=quotas) as store:
            s = await store.session("u", chat)
            sys.stdin.readline()  # both start at once
            saved = refused = 0
            for i in range(25):
                try:
                    await s.files.write_new(f"f{i}.txt", b"x")
                    saved += 1
                except QuotaExceeded:
                    refused += 1
            print(saved, refused)

    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3]))
"""


async def test_quota_decisions_of_one_user_serialise_across_processes(root: Path, postgres_url: str) -> None:
    async with Store(root, database_url=postgres_url):
        pass
    writers = [start_python(WRITER, str(root), postgres_url, chat) for chat in ("c1", "c2")]
    try:
        for w in writers:
            w.stdin.write("\n")
            w.stdin.flush()
        outputs = [await asyncio.to_thread(w.communicate, timeout=120) for w in writers]
    finally:
        for w in writers:
            if w.poll() is None:
                w.kill()
    counts = []
    for w, (out, err) in zip(writers, outputs, strict=True):
        assert w.returncode == 0, err
        counts.append(tuple(int(n) for n in out.split()))
    assert sum(saved for saved, _ in counts) == 30  # all the room taken, never more
    async with Store(root, database_url=postgres_url) as store:
        assert sum(s.files for s in await store.sessions()) == 30
        assert await store.check() == []


# A transaction of this database queued behind another's advisory lock (serialise_user's).
WAITING_FOR_A_USER_LOCK = (
    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
    " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
)


async def test_serialise_user_makes_the_second_decision_wait_for_the_first(postgres_url: str) -> None:
    one, two = PostgresBackend(postgres_url), PostgresBackend(postgres_url)
    await one.open()
    await two.open()
    events: list[str] = []
    holding = asyncio.Event()
    go_on = asyncio.Event()

    # As the store does: the lock, then the totals the decision reads (the lock is only queued; the
    # statement after it waits for it).
    async def first(tx: Any) -> None:
        await tx.serialise_user("alice")
        await tx.one("SELECT 1")
        events.append("first decides")
        holding.set()
        await go_on.wait()
        events.append("first commits")

    async def second(tx: Any) -> None:
        await tx.serialise_user("alice")
        await tx.one("SELECT 1")
        events.append("second decides")

    async def other_user(tx: Any) -> None:
        await tx.serialise_user("bob")
        await tx.one("SELECT 1")
        events.append("bob decides")

    try:
        task = asyncio.create_task(one.write(first))
        await holding.wait()
        waiting = asyncio.create_task(two.write(second))
        await two.write(other_user)  # another user's decision does not wait
        deadline = time.monotonic() + 10
        while not (await asyncio.to_thread(_query, postgres_url, WAITING_FOR_A_USER_LOCK))[0][0]:
            assert not waiting.done(), "the second decision did not wait for the first"
            assert time.monotonic() < deadline, "the second decision never asked for alice's lock"
            await asyncio.sleep(0.02)
        assert not waiting.done()
        go_on.set()
        await asyncio.gather(task, waiting)
    finally:
        await one.close()
        await two.close()
    assert events == ["first decides", "bob decides", "first commits", "second decides"]


# ---------------------------------------------------------------------------- transactions and errors


async def test_a_conflicting_write_is_run_again_then_busy(postgres_url: str) -> None:
    backend = PostgresBackend(postgres_url, busy_total_s=0.5)
    await backend.open()
    calls = 0

    async def conflicted_once(tx: Any) -> str:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise psycopg.errors.SerializationFailure("could not serialize access")
        return "done"

    async def always(tx: Any) -> None:
        raise psycopg.errors.DeadlockDetected("deadlock detected")

    try:
        assert await backend.write(conflicted_once) == "done" and calls == 2
        with pytest.raises(StorageBusy, match=r"locked by other processes for 0\.5 s"):
            await backend.write(always)
        assert isinstance(backend.error(psycopg.errors.DiskFull("no space")), DiskFull)
        assert isinstance(backend.error(psycopg.errors.UndefinedTable("no table")), IndexDamaged)
        with pytest.raises(StorageError, match=r"index error: .*division by zero"):
            await backend.read(lambda tx: tx.one("SELECT 1 / 0"))
        # After errors the pool is whole: every connection is back and usable.
        rows = await asyncio.gather(
            *(backend.read(lambda tx: tx.one("SELECT 1 + ?", (1,))) for _ in range(8))
        )
        assert rows == [(2,)] * 8
    finally:
        await backend.close()


async def test_reads_are_one_snapshot_and_read_only(postgres_url: str) -> None:
    backend = PostgresBackend(postgres_url)
    await backend.open()
    try:
        with pytest.raises(StorageError, match="read-only"):
            await backend.read(lambda tx: tx.run("INSERT INTO meta (key, value) VALUES ('k', 'v')"))

        # A write commits between the read's two statements: the read does not see it. (The read is
        # run twice: first as a single statement, then, asking for a second, in a transaction.)
        written: list[str] = []

        async def twice(tx: Any) -> tuple[Any, Any]:
            before = await tx.one("SELECT count(*) FROM meta")
            key = f"k{len(written)}"
            written.append(key)
            await backend.write(lambda w: w.run("INSERT INTO meta (key, value) VALUES (?, '%v?')", (key,)))
            return before, await tx.one("SELECT count(*) FROM meta")

        before, after = await backend.read(twice)
        assert before == after == (1,) and written == ["k0", "k1"]
        assert await backend.read(twice) == ((2,), (2,)) and len(written) == 3  # now a transaction at once
        value = await backend.read(lambda tx: tx.all("SELECT DISTINCT value FROM meta"))
        assert value == [("%v?",)]
    finally:
        await backend.close()


async def test_a_database_restart_is_survived(
    root: Path, postgres_url: str, postgres_server: PostgresServer, caplog: pytest.LogCaptureFixture
) -> None:
    async with Store(root, database_url=postgres_url) as store:
        s = await store.session("u", "c")
        await s.files.write("before.txt", b"1")
        lock = store.backend.chat_lock(s.user_key, s.chat_key)
        assert await lock.try_acquire()
        await asyncio.to_thread(postgres_server.restart)
        # Every pooled connection is dead now: the next transactions replace them and go on.
        await s.files.write("after.txt", b"22")
        assert [f.path for f in await s.files.list()] == ["after.txt", "before.txt"]
        # The lock went with its connection; releasing says so instead of failing (the unlock's answer
        # is awaited in the background, and this process's next lock on the chat waits for it).
        with caplog.at_level(logging.WARNING, logger="code_sessions.storage"):
            await lock.release()
            async with s.lock(timeout=5):
                assert "went with its connection" in caplog.text
                assert await store.backend.chat_locked(s.user_key, s.chat_key)


async def test_a_lock_taken_again_right_after_its_release_never_races_the_unlock(
    root: Path, postgres_url: str
) -> None:
    # The unlock's answer comes in the background; the same process's next lock waits for it.
    async with Store(root, database_url=postgres_url) as store:
        s = await store.session("u", "c")
        for _ in range(30):
            first = store.backend.chat_lock(s.user_key, s.chat_key)
            assert await first.try_acquire()
            await first.release()
            again = store.backend.chat_lock(s.user_key, s.chat_key)
            assert await again.try_acquire()
            await again.release()
        async with s.lock(timeout=5):
            assert await store.backend.chat_locked(s.user_key, s.chat_key)
        deadline = time.monotonic() + 5  # the advisory lock's connection lets go
        while await store.backend.chat_locked(s.user_key, s.chat_key):
            assert time.monotonic() < deadline, "the chat's lock was never released"
            await asyncio.sleep(0.02)


async def test_an_unreachable_server_is_a_clear_error(root: Path) -> None:
    with pytest.raises(
        StorageError, match=r"cannot connect to the index database postgresql://u@127\.0\.0\.1:9/db: "
    ):
        async with Store(root, database_url="postgresql://u:secret@127.0.0.1:9/db"):
            pass


# ---------------------------------------------------------------------------- URLs and the CLI


def test_urls() -> None:
    for url in ("postgresql://h/db", "postgres://h/db", "postgresql+psycopg://h/db", "POSTGRESQL://h/db"):
        assert is_postgres_url(url)
    assert not is_postgres_url("sqlite:///data/webui.db") and not is_postgres_url("")
    assert libpq_url("postgresql+psycopg2://u@h/db") == "postgresql://u@h/db"
    assert libpq_url("postgres://u@h/db") == "postgresql://u@h/db"
    assert redact_url("postgresql://u:pa%40ss@h:5/db?sslmode=require&password=x") == (
        "postgresql://u@h:5/db?sslmode=require"
    )
    assert to_pyformat("SELECT '?', \"a?\", ? WHERE x LIKE 'a%' AND y = ?") == (
        "SELECT '?', \"a?\", %s WHERE x LIKE 'a%%' AND y = %s"
    )


async def test_store_picks_the_backend_from_the_url(root: Path, postgres_url: str) -> None:
    other_form = postgres_url.replace("postgresql://", "postgresql+psycopg://")
    async with Store(root, database_url=other_form) as store:
        assert store.backend.kind == "postgresql"
        assert store.backend.where == postgres_url
        await store.session("u", "c")
    assert not (root / "index.sqlite3").exists()
    async with Store(root, database_url="sqlite:////elsewhere/webui.db") as store:
        assert store.backend.kind == "sqlite" and store.backend.where == str(root / "index.sqlite3")
    with pytest.raises(StorageError, match="unsupported database URL 'mysql://u@h/db'"):
        Store(root, database_url="mysql://u:pw@h/db")


async def test_the_cli_works_with_database_url(
    root: Path, publisher: DirectoryPublisher, postgres_url: str
) -> None:
    async with Store(root, publisher=publisher, database_url=postgres_url) as store:
        await _populate(store)
    args = ["--root", str(root), "--database-url", postgres_url]
    sessions = await asyncio.to_thread(run_cli, *args, "sessions", "--json")
    assert sessions.returncode == 0, sessions.stderr
    assert [(r["user_id"], r["chat_id"], r["files"]) for r in json.loads(sessions.stdout)] == [
        ("alice", "chat-1", 3)
    ]
    check = await asyncio.to_thread(run_cli, *args, "check")
    assert (check.returncode, check.stdout.strip()) == (0, "index matches disk"), check.stderr
    links = await asyncio.to_thread(run_cli, *args, "links", "--json")
    assert [li["path"] for li in json.loads(links.stdout)] == ["plots/chart.png"]
    bad = await asyncio.to_thread(
        run_cli, "--root", str(root), "--database-url", "postgresql://u:pw@127.0.0.1:9/x", "sessions"
    )
    assert bad.returncode == 2 and "cannot connect" in bad.stderr and "pw" not in bad.stderr


def test_storage_works_without_psycopg(tmp_path: Path) -> None:
    # psycopg is imported only when a PostgreSQL index opens: without it, SQLite works and a
    # PostgreSQL URL is a sentence, not an ImportError at import time.
    code = """
        import asyncio, sys
        sys.modules["psycopg"] = None  # as if it were not installed
        import storage
        from storage import StorageError, Store

        async def main(root):
            async with Store(root) as store:
                await (await store.session("u", "c")).files.write("a", b"1")
                print([s.files for s in await store.sessions()])
            try:
                async with Store(root, database_url="postgresql://u@127.0.0.1/db"):
                    pass
            except StorageError as exc:
                print(exc)

        asyncio.run(main(sys.argv[1]))
    """
    done = run_python(code, str(tmp_path / "root"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "[1]",
        "a PostgreSQL index needs psycopg 3 (`pip install 'psycopg[binary]'`); it is not installed",
    ]
