"""Reconcile: index vs disk, hostile entries, quota enforcement, recovery after a crash."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from storage import Expiry, Policy, Quotas, Store
from tests.storage.storage_helpers import run_python, user_usage

Sql = Callable[..., list[tuple[Any, ...]]]


def _touch(path: Path, size: int, mtime: float | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)
    if mtime is not None:
        os.utime(path, (mtime, mtime))


async def test_added_changed_removed(store: Store) -> None:
    s = await store.session("u", "c")
    async with s.lock():
        _touch(s.path / "a.txt", 1)
        _touch(s.path / "d/b.txt", 2)
        r = await s.reconcile()
        assert (r.added, r.changed, r.removed, r.files, r.bytes) == (["a.txt", "d/b.txt"], [], [], 2, 3)
        assert "2 added" in r.summary()
        _touch(s.path / "a.txt", 5)
        (s.path / "d/b.txt").unlink()
        _touch(s.path / "c.txt", 1)
        r = await s.reconcile()
        assert (r.added, r.changed, r.removed, r.files, r.bytes) == (["c.txt"], ["a.txt"], ["d/b.txt"], 2, 6)
        r = await s.reconcile()
        assert (r.added, r.changed, r.removed) == ([], [], [])
    assert await store.check() == []


async def test_mtime_only_change_is_seen(store: Store) -> None:
    s = await store.session("u", "c")
    _touch(s.path / "a.txt", 3, mtime=1_000_000)
    await s.reconcile()
    os.utime(s.path / "a.txt", (2_000_000, 2_000_000))
    assert (await s.reconcile()).changed == ["a.txt"]


def test_special_files_removed_without_following_or_blocking(tmp_path: Path, database_url: str) -> None:
    # In a separate process with a timeout: if opening the FIFO blocked, the test fails, not hangs.
    code = """
        import asyncio, os, socket, sys
        from pathlib import Path
        from storage import Store

        async def main(root, url):
            async with Store(root, database_url=url) as store:
                s = await store.session("u", "c")
                os.symlink("/etc/passwd", s.path / "passwd")
                os.symlink("/etc", s.path / "etc")
                os.makedirs(s.path / "sub")
                os.symlink("/", s.path / "sub" / "rootfs")
                os.mkfifo(s.path / "fifo")
                sock = socket.socket(socket.AF_UNIX)
                os.chdir(s.path)  # AF_UNIX paths are short: bind relative to the folder
                sock.bind("sock")
                (s.path / "ok.txt").write_text("ok")
                r = await s.reconcile()
                print(sorted((x.path, x.kind) for x in r.rejected))
                print(r.added)
                print(sorted(os.listdir(s.path)), os.listdir(s.path / "sub"))
                sock.close()

        asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
    before = Path("/etc/passwd").stat()
    result = run_python(code, str(tmp_path / "root"), database_url, timeout=30)
    assert result.returncode == 0, result.stderr
    rejected, added, listing = result.stdout.splitlines()
    assert rejected == str(
        sorted(
            [
                ("passwd", "symlink"),
                ("etc", "symlink"),
                ("sub/rootfs", "symlink"),
                ("fifo", "fifo"),
                ("sock", "socket"),
            ]
        )
    )
    assert added == "['ok.txt']"
    assert listing == "['ok.txt', 'sub'] []"
    assert Path("/etc/passwd").stat().st_mtime_ns == before.st_mtime_ns


async def test_symlinked_dir_outside_is_not_walked(store: Store, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    _touch(outside / "big.bin", 10)
    s = await store.session("u", "c")
    os.symlink(outside, s.path / "escape")
    r = await s.reconcile()
    assert [(x.path, x.kind) for x in r.rejected] == [("escape", "symlink")]
    assert r.added == [] and (outside / "big.bin").exists()


async def test_non_utf8_names_are_renamed(store: Store) -> None:
    s = await store.session("u", "c")
    raw = os.fsencode(s.path) + b"/caf\xe9.txt"
    with open(raw, "wb") as fh:
        fh.write(b"x")
    _touch(s.path / "caf_.txt", 1)  # the obvious new name is taken
    r = await s.reconcile()
    assert [(x.old, x.new) for x in r.renamed] == [("caf\\xe9.txt", "caf_ (2).txt")]
    assert sorted(r.added) == ["caf_ (2).txt", "caf_.txt"]
    assert await s.files.read("caf_ (2).txt") == b"x"


async def test_too_deep_content_is_removed(store: Store) -> None:
    s = await store.session("u", "c")
    deep = s.path.joinpath(*["d"] * 40)
    _touch(deep / "f.txt", 1)
    _touch(s.path.joinpath(*["d"] * 31) / "ok.txt", 1)
    r = await s.reconcile()
    assert [x.kind for x in r.rejected] == ["too deep"]
    assert r.added == ["/".join(["d"] * 31) + "/ok.txt"]
    assert not s.path.joinpath(*["d"] * 32).exists()


async def test_crash_before_indexing_is_recovered(root: Path, database_url: str) -> None:
    async with Store(root, database_url=database_url) as store:
        s = await store.session("u", "c")
        await s.files.write("known.txt", b"1")
    # a run wrote files, then the process died before reconcile
    (s.path / "late.txt").write_bytes(b"22")
    async with Store(root, database_url=database_url) as store:
        s = await store.session("u", "c")
        r = await s.reconcile()
        assert r.added == ["late.txt"] and r.files == 2 and r.bytes == 3
        assert await store.check() == []


async def test_quota_rollback_keeps_old_files_and_removes_new_ones(store: Store) -> None:
    policy = Policy(Quotas(max_files_per_user=4, max_bytes_per_user=1000, max_file_bytes=500))
    other = await store.session("u", "other", policy=policy)
    _touch(other.path / "o1", 100)
    await other.reconcile()
    s = await store.session("u", "c", policy=policy)
    _touch(s.path / "old1", 100, mtime=1000)
    _touch(s.path / "old2", 100, mtime=1001)
    await s.reconcile()
    budget = await s.run_budget()
    # 700 bytes are left; a run may still write the floor (what is over is removed when it ends)
    assert (budget.max_write_bytes, budget.max_file_bytes, budget.note) == (1024 * 1024, 500, None)
    # the run: one too large, three more than allowed in total
    _touch(s.path / "huge", 600, mtime=2000)
    _touch(s.path / "n1", 10, mtime=2001)
    _touch(s.path / "n2", 10, mtime=2002)
    _touch(s.path / "n3", 10, mtime=2003)
    # an existing file grows: it adds no file, so the file count never removes it
    _touch(s.path / "old1", 150, mtime=2004)
    r = await s.reconcile()
    removed = {q.path: q.reason for q in r.quota_removed}
    assert removed.keys() == {"huge", "n2", "n3"}
    assert "per-file limit" in removed["huge"]
    assert "4 files" in removed["n3"]
    assert sorted(os.listdir(s.path)) == ["n1", "old1", "old2"]
    assert r.changed == ["old1"] and r.added == ["n1"]
    assert (r.files, r.bytes) == (3, 260)
    assert (await user_usage(store, "u")).files == 4
    assert await store.check() == []
    # audit trail
    events = [a.event for a in await store.activity()]
    assert "quota_removed" in events
    # and now the user is at the limit: the next run may still start, with nothing to spend
    budget = await s.run_budget()
    assert budget.note is not None and "4 files" in budget.note and "!clear-files" in budget.note


async def test_bytes_quota_removes_newest_first(store: Store) -> None:
    policy = Policy(Quotas(max_bytes_per_user=250, max_files_per_user=None, max_file_bytes=None))
    s = await store.session("u", "c", policy=policy)
    _touch(s.path / "old", 100, mtime=1000)
    await s.reconcile()
    for i, name in enumerate(["a", "b", "c", "d"]):
        _touch(s.path / name, 50, mtime=2000 + i)
    r = await s.reconcile()
    assert [q.path for q in r.quota_removed] == ["d"]
    assert "storage limit" in r.quota_removed[0].reason
    assert r.bytes == 250


async def test_files_per_run_limit_keeps_the_oldest(store: Store) -> None:
    policy = Policy(Quotas(max_new_files_per_run=3))
    s = await store.session("u", "c", policy=policy)
    for i in range(6):
        _touch(s.path / f"f{i}", 1, mtime=1000 + (5 - i))  # f5 oldest
    r = await s.reconcile()
    assert sorted(r.added) == ["f3", "f4", "f5"]
    assert sorted(q.path for q in r.quota_removed) == ["f0", "f1", "f2"]
    assert all("3 new files" in q.reason for q in r.quota_removed)
    # without enforcement nothing is removed
    for i in range(6):
        _touch(s.path / f"g{i}", 1)
    r = await s.reconcile(enforce_quotas=False)
    assert len(r.added) == 6 and r.quota_removed == []


async def test_a_run_at_the_limit_starts_with_nothing_to_spend(store: Store) -> None:
    policy = Policy(Quotas(max_bytes_per_user=100))
    s = await store.session("u", "c", policy=policy)
    _touch(s.path / "a", 100)
    await s.reconcile()
    budget = await s.run_budget()
    assert budget.note is not None and "100 B" in budget.note and "delete or shrink" in budget.note
    # the run shrinks a file and adds one: what fits is kept, what is over goes
    _touch(s.path / "a", 40, mtime=1000)
    _touch(s.path / "b", 50, mtime=2000)
    _touch(s.path / "c", 50, mtime=2001)
    r = await s.reconcile()
    assert [q.path for q in r.quota_removed] == ["c"] and r.bytes == 90
    unlimited = Quotas(max_bytes_per_user=0, max_files_per_user=0, max_new_files_per_run=0, max_file_bytes=0)
    s = await store.session("u", "c", policy=Policy(unlimited))
    budget = await s.run_budget()
    assert (budget.max_write_bytes, budget.max_file_bytes, budget.note) == (None, None, None)


def test_no_limit_is_none_however_it_is_given() -> None:
    """0 ("no limit", as a valve or an older recorded policy says it) is held as None, the one way
    every layer says it; a negative limit or a bool is refused."""
    quotas = Quotas(max_files_per_user=0, max_bytes_per_user=0, max_file_bytes=0, max_new_files_per_run=0)
    assert quotas == Quotas(None, None, None, None)
    expiry = Expiry(file_max_age_s=0, session_idle_s=0.0, temporary_idle_s=0, activity_max_age_s=0)
    assert expiry == Expiry(None, None, None, None)
    assert Quotas(max_file_bytes=5).max_file_bytes == 5
    for wrong in (-1, True):
        with pytest.raises(ValueError):
            Quotas(max_file_bytes=wrong)


async def test_a_grown_file_goes_when_it_takes_the_user_over_the_bytes(store: Store) -> None:
    policy = Policy(Quotas(max_bytes_per_user=1000, max_files_per_user=None, max_file_bytes=None))
    other = await store.session("u", "other", policy=policy)
    _touch(other.path / "o", 500)
    await other.reconcile()
    s = await store.session("u", "c", policy=policy)
    _touch(s.path / "log", 400, mtime=1000)
    await s.reconcile()
    _touch(s.path / "log", 900, mtime=2000)  # the run appends 500 bytes: 1400 > 1000
    r = await s.reconcile(changed=["log"])
    assert [(q.path, q.size) for q in r.quota_removed] == [("log", 900)]
    assert "storage limit" in r.quota_removed[0].reason
    assert not (s.path / "log").exists() and (r.files, r.bytes) == (0, 0)
    assert (await user_usage(store, "u")).bytes == 500
    assert await store.check() == []


async def test_user_usage_sums_all_chats_and_is_fast(store: Store, index_sql: Sql, backend_kind: str) -> None:
    s = await store.session("u", "c0")
    await s.files.write("f", b"x" * 10)
    now = time.time()
    # 100 more sessions for this user (rows only)
    for i in range(1, 101):
        index_sql(
            "INSERT INTO sessions (user_id, chat_id, user_key, chat_key, temporary, created_at, last_used_at,"
            " bytes, file_count) VALUES ('u', ?, ?, ?, 0, ?, ?, 5, 1)",
            (f"c{i}", s.user_key, f"k{i}", now, now),
        )
    usage = await user_usage(store, "u")
    assert (usage.files, usage.bytes) == (101, 510)
    assert (await s.user_usage()) == usage
    query = "SELECT sum(bytes) FROM sessions WHERE user_key = 'x'"
    if backend_kind == "sqlite":
        plan = index_sql("EXPLAIN QUERY PLAN " + query)
        assert any("USING INDEX" in str(row) for row in plan)
    else:
        # A hundred rows are read fastest without the index; forbid that to see that it serves.
        index_sql("ANALYZE sessions")
        plan = index_sql(f"SET enable_seqscan = off; EXPLAIN {query}")
        assert any("sessions_user_key_chat_key_key" in str(row) for row in plan), plan


async def test_a_step_that_changed_nothing_reports_the_totals_read_under_its_lock(store: Store) -> None:
    s = await store.session("u", "c")
    await s.files.write("a.txt", b"12345")
    async with s.lock():
        await s.run_budget()
        await s.begin_run()
        report = await s.reconcile(changed=[])
    assert (report.files, report.bytes, report.full) == (1, 5, False)
    # Totals read without the lock are never reported later: the folder may change in between.
    await s.run_budget()
    await s.files.write("b.txt", b"123")
    async with s.lock():
        await s.begin_run()
        report = await s.reconcile(changed=[])
    assert (report.files, report.bytes) == (2, 8)
    # Nor are those of an earlier hold of the lock.
    async with s.lock():
        await s.run_budget()
    await s.files.write("c.txt", b"1")
    async with s.lock():
        await s.begin_run()
        report = await s.reconcile(changed=[])
    assert (report.files, report.bytes) == (3, 9)
