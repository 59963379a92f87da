"""Expired files leave by rename into the trash (one rename per folder when it can), and the trash is
emptied in the background: nothing expired stays readable, the index is exact when cleanup returns,
and a crash between the two leaves only the trash, which the next cleanup empties."""

from __future__ import annotations

import asyncio
import os
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import storage._expiry as expiry_module
from storage import Store
from tests.storage.storage_helpers import start_python

DAY = 86400
Sql = Callable[..., list[tuple[Any, ...]]]


def _age(sql: Sql, *paths: str) -> None:
    for path in paths:
        sql("UPDATE files SET last_changed = ? WHERE path = ?", (time.time() - 31 * DAY, path))


def _tree(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*")}


async def _session_with_expired_files(store: Store, sql: Sql) -> Any:
    s = await store.session("u", "c")
    for name in ("out/a.csv", "out/b.csv", "out/c.csv", "mixed/old1.csv", "mixed/old2.csv", "top.csv"):
        await s.files.write(name, b"expired " + name.encode())
    await s.files.write("mixed/fresh.csv", b"kept")
    os.chmod(s.path / "out", 0o750)
    _age(sql, "out/a.csv", "out/b.csv", "out/c.csv", "mixed/old1.csv", "mixed/old2.csv", "top.csv")
    return s


async def test_a_folder_whose_files_all_expired_leaves_in_one_rename(
    store: Store, root: Path, index_sql: Sql, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = await _session_with_expired_files(store, index_sql)
    out_inode = os.stat(s.path / "out").st_ino
    monkeypatch.setattr(expiry_module, "empty_trash_soon", lambda core: None)  # look at the trash first
    report = await store.cleanup()
    assert (report.files_removed, report.bytes_freed) == (
        6,
        sum(
            len(b"expired ") + len(n)
            for n in ("out/a.csv", "out/b.csv", "out/c.csv", "mixed/old1.csv", "mixed/old2.csv", "top.csv")
        ),
    )
    # Nothing expired is left in the session; the folders stay, `out` as it was (mode), now empty.
    assert _tree(s.path) == {"out", "mixed", "mixed/fresh.csv"}
    assert stat.S_IMODE(os.stat(s.path / "out").st_mode) == 0o750
    # The index is exact the moment cleanup returns.
    assert [f.path for f in await s.files.list()] == ["mixed/fresh.csv"]
    assert (await s.usage()).files == 1
    # `out` went whole: its own inode is in the trash, with its three files; the others one by one.
    trash = root / "trash"
    folders = [p for p in trash.iterdir() if p.name.endswith(".dir")]
    assert len(folders) == 1 and folders[0].stat().st_ino == out_inode
    assert sorted(p.name for p in folders[0].iterdir()) == ["a.csv", "b.csv", "c.csv"]
    moved = sorted(
        p.read_bytes() for p in trash.rglob("*") if p.is_file() and p.parent.name != folders[0].name
    )
    assert moved == [b"expired mixed/old1.csv", b"expired mixed/old2.csv", b"expired top.csv"]
    # The trash is outside the session folder (what the sandbox sees at /mnt/data).
    assert not trash.resolve().is_relative_to(s.path.resolve())
    assert trash.stat().st_dev == s.path.stat().st_dev


async def test_cleanup_returns_before_the_trash_is_emptied(
    store: Store, root: Path, index_sql: Sql, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = await _session_with_expired_files(store, index_sql)
    may_unlink = threading.Event()
    real_empty = expiry_module._empty_trash

    def slow_empty(core: Any) -> None:
        assert may_unlink.wait(30)
        real_empty(core)

    monkeypatch.setattr(expiry_module, "_empty_trash", slow_empty)
    # Were the unlinks part of cleanup, it would wait for the event nobody sets until it returns.
    report = await asyncio.wait_for(store.cleanup(), 20)
    assert report.files_removed == 6
    assert _tree(s.path) == {"out", "mixed", "mixed/fresh.csv"}
    assert [f.path for f in await s.files.list()] == ["mixed/fresh.csv"]
    assert _tree(root / "trash")  # still there: the unlinks have not started
    may_unlink.set()
    await expiry_module.trash_emptied(store._core)
    assert list((root / "trash").iterdir()) == []


async def test_what_is_moved_while_the_trash_is_emptied_is_emptied_too(
    store: Store, root: Path, index_sql: Sql, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = await _session_with_expired_files(store, index_sql)
    started, go_on = threading.Event(), threading.Event()
    real_empty = expiry_module._empty_trash

    def gated_empty(core: Any) -> None:
        started.set()
        assert go_on.wait(30)
        real_empty(core)

    monkeypatch.setattr(expiry_module, "_empty_trash", gated_empty)
    await store.cleanup()
    assert await asyncio.to_thread(started.wait, 10)
    await s.files.write("late/x.csv", b"x")
    _age(index_sql, "late/x.csv")
    await store.cleanup()  # moves late/ while the first round is still under way
    assert (root / "trash").exists() and len(list((root / "trash").iterdir())) >= 1
    go_on.set()
    await expiry_module.trash_emptied(store._core)
    assert list((root / "trash").iterdir()) == []


CRASH = """
    import asyncio, os, sys
    import storage._expiry as expiry
    from storage import Store

    def dies_at(n, real):
        calls = []
        def wrapped(*args, **kwargs):
            calls.append(1)
            if len(calls) == n:
                os._exit(9)
            return real(*args, **kwargs)
        return wrapped

    async def main(root, url, point):
        store = Store(root, database_url=url)
        await store.open()
        expiry._BATCHES_PER_HOLD = 1
        expiry._EXPIRY_BATCH = 2  # out/ (3 files) goes file by file, in two batches
        if point == "before the unlinks":  # right after the renames and the index writes
            expiry.empty_trash_soon = lambda core: os._exit(9)
        elif point == "between a move and its index write":
            async def forget(*args, **kwargs):
                os._exit(9)
            expiry._forget_files = forget
        elif point == "in the middle of a batch's moves":  # one batch; after the first folder's renames
            expiry._EXPIRY_BATCH = 100
            expiry.move_aside_unchanged = dies_at(2, expiry.move_aside_unchanged)
        elif point == "between two batches":  # the first batch moved and written
            expiry.move_aside_unchanged = dies_at(2, expiry.move_aside_unchanged)
        elif point == "in the middle of the unlinks":  # after the first entry of the trash is gone
            expiry.remove_tree = dies_at(2, expiry.remove_tree)
        await store.cleanup()
        await expiry.trash_emptied(store._core)

    asyncio.run(main(*sys.argv[1:]))
"""
EXPIRED = ("out/a.csv", "out/b.csv", "out/c.csv", "mixed/old1.csv", "mixed/old2.csv", "top.csv")


@pytest.mark.parametrize(
    "point",
    [
        "before the unlinks",
        "between a move and its index write",
        "in the middle of a batch's moves",
        "between two batches",
        "in the middle of the unlinks",
    ],
)
async def test_a_crash_anywhere_leaves_nothing_expired_visible_and_the_next_cleanup_finishes(
    store: Store, root: Path, index_sql: Sql, database_url: str, point: str
) -> None:
    s = await _session_with_expired_files(store, index_sql)
    proc = start_python(CRASH, str(root), database_url, point)
    _, err = await asyncio.to_thread(proc.communicate, None, 60)
    assert proc.returncode == 9, err
    # Whatever left the session is in the trash, never half-way: each name is in one place or the other.
    trash = [p for p in (root / "trash").rglob("*") if p.is_file()]
    in_session = {name for name in EXPIRED if (s.path / name).exists()}
    moved = sorted(p.read_bytes() for p in trash)
    if point == "in the middle of the unlinks":  # every file moved, and the emptying had begun
        assert in_session == set() and 0 < len(moved) < 6, (moved, in_session)
    else:  # nothing unlinked yet: every expired file is in the folder or in the trash
        assert len(moved) + len(in_session) == 6, (moved, in_session)
    assert not {b"expired " + name.encode() for name in in_session} & set(moved)
    if point in ("before the unlinks", "in the middle of the unlinks"):
        assert in_session == set()  # the moves and the index writes were done
        assert [f.path for f in await s.files.list()] == ["mixed/fresh.csv"]
    # The next cleanup moves what is left, drops the rows of what is gone, and empties the trash.
    await store.cleanup()
    await expiry_module.trash_emptied(store._core)
    assert _tree(s.path) == {"out", "mixed", "mixed/fresh.csv"}  # expiry takes files, not the folders
    assert [f.path for f in await s.files.list()] == ["mixed/fresh.csv"]
    assert (await s.usage()).files == 1
    assert list((root / "trash").iterdir()) == []
    assert (s.path / "mixed/fresh.csv").read_bytes() == b"kept"


async def test_a_changed_file_in_an_expired_folder_keeps_the_folder(store: Store, index_sql: Sql) -> None:
    # The folder cannot go whole when one of its files changed since the index saw it: that file stays.
    s = await store.session("u", "c")
    await s.files.write("out/a.csv", b"a")
    await s.files.write("out/b.csv", b"b")
    _age(index_sql, "out/a.csv", "out/b.csv")
    (s.path / "out/b.csv").write_bytes(b"changed since indexed")
    report = await store.cleanup()
    assert report.files_removed == 1
    assert _tree(s.path) == {"out", "out/b.csv"}
    assert (s.path / "out/b.csv").read_bytes() == b"changed since indexed"


async def test_a_large_folder_that_cannot_go_whole_goes_in_batches(
    store: Store, index_sql: Sql, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(expiry_module, "_EXPIRY_BATCH", 3)
    monkeypatch.setattr(expiry_module, "_BATCHES_PER_HOLD", 1)
    s = await store.session("u", "c")
    for i in range(8):
        await s.files.write(f"big/f{i}.csv", b"x")
    await s.files.write("big/fresh.csv", b"kept")
    _age(index_sql, *(f"big/f{i}.csv" for i in range(8)))
    locks = 0
    real_lock_of = store._core.lock_of

    def counting(ref: Any) -> Any:
        nonlocal locks
        locks += 1
        return real_lock_of(ref)

    monkeypatch.setattr(store._core, "lock_of", counting)
    report = await store.cleanup()
    assert report.files_removed == 8
    assert _tree(s.path) == {"big", "big/fresh.csv"}
    assert [f.path for f in await s.files.list()] == ["big/fresh.csv"]
    assert locks == 3  # 3 + 3 + 2 files, the lock let go between batches
