"""Locks, expiry, purges and cleanup safety while runs are in progress."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from storage import Expiry, Policy, Purge, StorageBusy, Store
from tests.storage.storage_helpers import start_python

DAY = 86400
Sql = Callable[..., list[tuple[Any, ...]]]


def _age_session(sql: Sql, chat_id: str, seconds: float) -> None:
    sql("UPDATE sessions SET last_used_at = ? WHERE chat_id = ?", (time.time() - seconds, chat_id))


def _age_files(sql: Sql, seconds: float, path: str | None = None) -> None:
    stamp = time.time() - seconds
    if path is None:
        sql("UPDATE files SET last_changed = ?", (stamp,))
    else:
        sql("UPDATE files SET last_changed = ? WHERE path = ?", (stamp, path))


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root.parent):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            out[p] = (st.st_size, st.st_mtime_ns)
    return out


async def test_lock_is_exclusive_and_times_out(store: Store) -> None:
    s = await store.session("u", "c")
    same = await store.session("u", "c")
    async with s.lock():
        with pytest.raises(StorageBusy, match="busy"):
            async with same.lock(timeout=0.2):
                pass
    async with same.lock(timeout=1):
        pass


async def test_lock_waiter_gets_it_after_release(store: Store) -> None:
    s = await store.session("u", "c")
    order: list[str] = []

    async def holder() -> None:
        async with s.lock():
            order.append("a-in")
            await asyncio.sleep(0.1)
            order.append("a-out")

    async def waiter() -> None:
        await asyncio.sleep(0.02)
        async with s.lock(timeout=5):
            order.append("b-in")

    await asyncio.gather(holder(), waiter())
    assert order == ["a-in", "a-out", "b-in"]


HOLDER = """
    import asyncio, sys
    from storage import Store

    async def main(root, url):
        async with Store(root, database_url=url) as store:
            s = await store.session("u", "busy")
            async with s.lock():
                (s.path / "running.txt").write_text("sandbox at work")
                print("locked", flush=True)
                await asyncio.to_thread(sys.stdin.readline)
        print("released", flush=True)

    asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


async def test_cleanup_skips_a_session_locked_by_another_process(
    store: Store, root: Path, database_url: str
) -> None:
    idle = await store.session("u", "idle")
    await idle.files.write("a", b"1")
    proc = start_python(HOLDER, str(root), database_url)
    try:
        line = await asyncio.to_thread(proc.stdout.readline)
        assert line.strip() == "locked", proc.stderr.read() if proc.stderr else ""
        busy = await store.session("u", "busy")
        with pytest.raises(StorageBusy):
            async with busy.lock(timeout=0.2):
                pass
        report = await store.cleanup(Purge(everything=True))
        assert report.sessions_in_use == 1 and report.sessions_removed == 1
        assert [(d.chat_id, d.action) for d in report.details if d.action == "in use"] == [("busy", "in use")]
        assert (busy.path / "running.txt").exists()
        assert not idle.path.exists()
        dry = await store.cleanup(Purge(everything=True), dry_run=True)
        assert dry.sessions_in_use == 1 and dry.sessions_removed == 0
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert (await asyncio.to_thread(proc.stdout.readline)).strip() == "released"
    finally:
        proc.kill() if proc.poll() is None else None
        await asyncio.to_thread(proc.wait, 30)
    report = await store.cleanup(Purge(everything=True))
    assert report.sessions_in_use == 0 and report.sessions_removed == 1
    assert not busy.path.exists()
    assert await store.sessions() == []
    assert os.listdir(root / "sessions") == [] and os.listdir(root / "state") == []


async def test_expiry_by_idle_and_temporary(store: Store, index_sql: Sql) -> None:
    fresh = await store.session("u", "fresh")
    old = await store.session("u", "old")
    temp = await store.session("u", "temporary:t")
    for s in (fresh, old, temp):
        await s.files.write("f.txt", b"12345")
    _age_session(index_sql, "old", 31 * DAY)
    _age_session(index_sql, "temporary:t", 2 * 3600)
    report = await store.cleanup()
    assert sorted(d.chat_id for d in report.details if d.action == "removed") == ["old", "temporary:t"]
    assert (report.sessions_removed, report.files_removed, report.bytes_freed) == (2, 2, 10)
    assert fresh.path.exists() and not old.path.exists() and not temp.path.exists()
    again = await store.cleanup()
    assert (again.sessions_removed, again.files_removed, again.links_removed) == (0, 0, 0)
    # 0 means never
    never = Policy(expiry=Expiry(session_idle_s=0, temporary_idle_s=0, file_max_age_s=0))
    _age_session(index_sql, "fresh", 1000 * DAY)
    assert (await store.cleanup(policy=never)).sessions_removed == 0


async def test_using_a_session_saves_it_from_expiry(store: Store, index_sql: Sql) -> None:
    await store.session("u", "c")
    _age_session(index_sql, "c", 40 * DAY)
    await store.session("u", "c")  # the chat is opened again
    assert (await store.cleanup()).sessions_removed == 0


async def test_expiry_by_file_age(store: Store, index_sql: Sql) -> None:
    s = await store.session("u", "c")
    await s.files.write("old/report.csv", b"x" * 7)
    await s.files.write("new.csv", b"y")
    await s.files.write("changed.csv", b"z")
    _age_files(index_sql, 31 * DAY, "old/report.csv")
    _age_files(index_sql, 31 * DAY, "changed.csv")
    (s.path / "changed.csv").write_text("changed since indexed")  # never deleted before reconcile sees it
    link = await s.publish("old/report.csv")
    report = await store.cleanup()
    assert (report.files_removed, report.bytes_freed, report.links_removed) == (1, 7, 1)
    assert [d.action for d in report.details] == ["files expired"]
    assert not (s.path / "old/report.csv").exists()
    assert (s.path / "new.csv").exists() and (s.path / "changed.csv").exists()
    assert not (store.publisher.directory / link.ref).exists()
    assert sorted(f.path for f in await s.files.list()) == ["changed.csv", "new.csv"]
    assert (await s.usage()).files == 2
    assert (await store.cleanup()).files_removed == 0


async def test_expiry_lets_a_run_in_between_batches(
    store: Store, index_sql: Sql, monkeypatch: pytest.MonkeyPatch
) -> None:
    import storage._expiry as cleanup_module

    s = await store.session("alice", "big")
    for i in range(5):
        await s.files.write(f"f{i}.csv", b"x" * 10)
    _age_files(index_sql, 31 * DAY)
    monkeypatch.setattr(cleanup_module, "_EXPIRY_BATCH", 2)
    monkeypatch.setattr(cleanup_module, "_BATCHES_PER_HOLD", 1)  # the lock is let go after each batch
    backend = store.backend
    real_chat_lock = backend.chat_lock
    run = real_chat_lock(s.user_key, s.chat_key)
    run_started: list[bool] = []

    def chat_lock(user_key: str, chat_key: str) -> Any:
        lock = real_chat_lock(user_key, chat_key)
        real_release = lock.release

        async def release_then_a_run_starts(**kwargs: bool) -> None:
            await real_release(**kwargs)
            if (user_key, chat_key) == (s.user_key, s.chat_key) and not run_started:
                # a user's step takes the lock the first batch let go
                assert await run.try_acquire()
                run_started.append(True)

        lock.release = release_then_a_run_starts
        return lock

    monkeypatch.setattr(backend, "chat_lock", chat_lock)
    report = await store.cleanup()
    assert report.files_removed == 2
    assert sorted(d.action for d in report.details) == ["files expired", "in use"]
    assert len(await s.files.list()) == 3
    await run.release()
    assert (await store.cleanup()).files_removed == 3
    assert await s.files.list() == []


async def test_purge_user_and_idle(store: Store, index_sql: Sql) -> None:
    for user, chat in [("alice", "a1"), ("alice", "a2"), ("bob", "b1"), ("bob", "b2")]:
        s = await store.session(user, chat)
        await s.files.write("f", b"1")
    report = await store.cleanup(Purge(user_id="alice"))
    assert sorted(d.chat_id for d in report.details) == ["a1", "a2"]
    _age_session(index_sql, "b1", 3 * DAY)
    report = await store.cleanup(Purge(idle_longer_than_s=2 * DAY))
    assert [d.chat_id for d in report.details] == ["b1"]
    report = await store.cleanup(Purge(chat_id="b2"))
    assert [d.chat_id for d in report.details] == ["b2"]
    assert await store.sessions() == []
    assert (await store.cleanup(Purge())).sessions_removed == 0


async def test_dry_run_touches_nothing(store: Store, root: Path, index_sql: Sql) -> None:
    a = await store.session("u", "a")
    await a.files.write("f.txt", b"1")
    await a.publish("f.txt")
    b = await store.session("u", "b")
    await b.files.write("old.txt", b"22")
    _age_session(index_sql, "a", 60 * DAY)
    _age_files(index_sql, 60 * DAY, "old.txt")
    (root / "state" / "orphan-lock-dir").mkdir()

    def rows() -> tuple[list[tuple[Any, ...]], ...]:
        return (
            index_sql("SELECT * FROM sessions ORDER BY id"),
            index_sql("SELECT * FROM files ORDER BY session_id, path"),
            index_sql("SELECT * FROM links ORDER BY token"),
        )

    before_disk = _snapshot(root)
    before_db = rows()
    activity = index_sql("SELECT count(*) FROM activity")
    report = await store.cleanup(dry_run=True)
    assert report.dry_run
    assert (report.sessions_removed, report.files_removed, report.links_removed) == (1, 2, 1)
    assert _snapshot(root) == before_disk
    assert rows() == before_db
    assert index_sql("SELECT count(*) FROM activity") == activity
    real = await store.cleanup()
    assert (real.sessions_removed, real.files_removed, real.links_removed) == (1, 2, 1)


async def test_cleanup_removes_stale_links_and_strays(store: Store, index_sql: Sql) -> None:
    s = await store.session("u", "c")
    await s.files.write("a.png", b"png")
    link = await s.publish("a.png")
    pub = store.publisher.directory
    # a stray copy (crash between copy and index row), old enough to be swept
    stray = pub / ("S" * 32)
    stray.mkdir()
    (stray / "x.png").write_bytes(b"1")
    os.utime(stray, (time.time() - 3600, time.time() - 3600))
    young = pub / ("Y" * 32)
    young.mkdir()
    not_ours = pub / "keep-me.txt"
    not_ours.write_text("not ours")
    report = await store.cleanup()
    assert report.links_removed == 1
    assert not stray.exists() and young.exists() and not_ours.exists()
    assert (pub / link.ref).exists()
    # the file changes: the old copy is stale once its grace period is over
    await s.files.write("a.png", b"png2")
    index_sql("UPDATE links SET created_at = created_at - 3600")
    report = await store.cleanup()
    assert report.links_removed == 1 and not (pub / link.ref).exists()
    assert await store.links() == []


async def test_vanished_session_rows_are_dropped(store: Store) -> None:
    import shutil

    s = await store.session("u", "c")
    await s.files.write("a", b"1")
    shutil.rmtree(s.path)
    report = await store.cleanup()
    assert [d.action for d in report.details] == ["vanished"]
    assert await store.sessions() == []
    assert (await store.cleanup()).sessions_removed == 0


async def test_session_removed_while_waiting_for_lock_is_recreated(store: Store) -> None:
    s = await store.session("u", "c")
    await s.files.write("a", b"1")
    await store.cleanup(Purge(everything=True))
    assert not s.path.exists()
    async with s.lock(timeout=1):
        assert s.path.is_dir()
        await s.files.write("b", b"2")
        assert (await s.reconcile()).files == 1
    assert [x.chat_id for x in await store.sessions()] == ["c"]


def test_lock_on_an_unlinked_lock_file_is_not_taken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from storage._lock import FileLock

    path = tmp_path / "chat.lock"
    holder = FileLock(path)
    assert holder.try_acquire()
    stale = os.open(path, os.O_RDWR)  # a waiter opened the file before cleanup unlinked it
    holder.release(unlink=True)
    newcomer = FileLock(path)
    assert newcomer.try_acquire()  # locks a fresh file at the same path
    real_open = os.open
    handed: list[int] = []

    def open_racing(file, flags, mode=0o777, **kw):
        if not handed and str(file) == str(path):
            handed.append(1)
            return os.dup(stale)  # the waiter's first attempt gets the orphan inode
        return real_open(file, flags, mode, **kw)

    monkeypatch.setattr(os, "open", open_racing)
    waiter = FileLock(path)
    # flock on the orphan succeeds, but the path names another inode: the waiter must retry and
    # then find the real lock held, instead of believing it holds the lock too.
    assert waiter.try_acquire() is False
    assert handed == [1]
    monkeypatch.undo()
    newcomer.release()
    assert waiter.try_acquire()
    waiter.release()
    os.close(stale)


def _saved_state(session: Any, size: int) -> Path:
    """Bytes in the session's saved-state folder, as the runner writes a sleeping kernel there."""
    folder = session.state_path / "kernel"
    folder.mkdir(parents=True)
    (folder / "pages.img").write_bytes(b"\0" * size)
    return session.state_path


async def test_a_sessions_saved_state_goes_with_it_and_is_shown(store: Store, index_sql: Sql) -> None:
    kept = await store.session("alice", "kept")
    gone = await store.session("alice", "gone")
    assert not kept.state_path.is_relative_to(kept.path)  # outside /mnt/data: the sandbox cannot reach it
    _saved_state(kept, 3000)
    gone_state = _saved_state(gone, 5000)
    usage = {u.user_id: u for u in await store.users_usage()}["alice"]
    assert usage.saved_state_bytes == 8000 and usage.bytes == 0  # not counted as files
    assert await store.check() == []
    report = await store.cleanup(Purge(chat_id="gone"))
    assert [d.chat_id for d in report.details] == ["gone"]
    assert not gone_state.exists()
    assert {u.user_id: u for u in await store.users_usage()}["alice"].saved_state_bytes == 3000
    # One left behind without its session (written as the session went) is reported by check.
    stray = _saved_state(gone, 10)
    drift = await store.check()
    assert [d.kind for d in drift] == ["stray saved state"]
    assert drift[0].chat_id.startswith("unknown:")  # the session's ids went with its sidecar
    assert str(stray) in drift[0].detail
