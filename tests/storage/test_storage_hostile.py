"""Folders shaped by hostile code (thousands of levels deep, thousands wide, empty by the thousand),
sparse files, copies that escape the quota, and a run its process did not live to index.

Each is a weakness tests/adversarial found through the whole product; these pin the storage fix.
"""

from __future__ import annotations

import logging
import os
import resource
from pathlib import Path
from typing import Any

import pytest

from storage import DirectoryPublisher, InvalidPath, Policy, QuotaExceeded, Quotas, StorageError, Store
from storage._fsops import remove_tree
from storage._reconcile import MAX_EMPTY_FOLDERS
from tests.storage.storage_helpers import sqlite_only


def _chain(top: Path, levels: int) -> Path:
    """top/d/d/.../d, made with relative mkdir so no path ever gets long."""
    top.mkdir(parents=True, exist_ok=True)
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(levels):
            os.mkdir("d", dir_fd=fd)
            child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
        os.close(os.open("x", os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=fd))
    finally:
        os.close(fd)
    return top


def test_remove_tree_survives_a_chain_deeper_than_the_recursion_limit(tmp_path: Path) -> None:
    tree = _chain(tmp_path / "tree", 3000)
    os.symlink("/etc", tree / "d" / "link")
    remove_tree(tree)
    assert not tree.exists()
    assert Path("/etc/passwd").exists()


async def test_reconcile_removes_a_deep_chain_and_the_session_can_be_purged(store: Store) -> None:
    s = await store.session("u", "c")
    _chain(s.path, 3000)
    async with s.lock():
        report = await s.reconcile()
    assert [(r.path.count("/"), r.kind) for r in report.rejected] == [(32, "too deep")]
    _chain(s.path / "again", 3000)  # left by a run that crashed before its reconcile
    from storage import Purge

    cleaned = await store.cleanup(Purge(user_id="u"))
    assert cleaned.sessions_removed == 1 and not s.path.exists()


async def test_scan_of_thousands_of_sibling_folders_keeps_few_files_open(store: Store) -> None:
    s = await store.session("u", "c")
    for i in range(3000):
        (s.path / f"d{i}").mkdir()
        (s.path / f"d{i}" / "f").write_bytes(b"x")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    try:
        async with s.lock():
            report = await s.reconcile(enforce_quotas=False)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert report.files == 3000


async def test_empty_folders_beyond_the_limit_are_removed(store: Store) -> None:
    s = await store.session("u", "c")
    (s.path / "keep").mkdir()
    (s.path / "keep" / "f").write_bytes(b"x")
    for i in range(MAX_EMPTY_FOLDERS + 50):
        (s.path / f"e{i:05}").mkdir()
    async with s.lock():
        report = await s.reconcile()
    assert sum(r.kind == "empty folder" for r in report.rejected) == 50
    assert len([p for p in s.path.iterdir() if p.is_dir()]) == MAX_EMPTY_FOLDERS + 1
    assert (s.path / "keep" / "f").exists()


# About the copy, which no index takes part in (and 20-30 s on this machine's disk): one backend is enough.
@sqlite_only
async def test_a_sparse_file_is_published_sparse(store: Store) -> None:
    policy = Policy(Quotas(max_bytes_per_user=0))  # no quota: nothing else bounds the file
    s = await store.session("u", "c", policy=policy)
    with open(s.path / "huge", "wb") as f:
        f.write(b"head")
        f.seek(1 << 32)
        f.write(b"tail")
    link = await s.publish("huge")
    copy = store.publisher.directory / link.ref / link.name
    assert copy.stat().st_size == (1 << 32) + 4
    assert copy.stat().st_blocks * 512 < 1 << 20
    with open(copy, "rb") as f:
        assert f.read(4) == b"head"
        f.seek(1 << 32)
        assert f.read() == b"tail"


async def test_published_copies_count_toward_the_quota(
    root: Path, publisher: DirectoryPublisher, database_url: str
) -> None:
    quotas = Quotas(max_bytes_per_user=3000)
    async with Store(root, publisher=publisher, quotas=quotas, database_url=database_url) as store:
        s = await store.session("u", "c")
        (s.path / "f.bin").write_bytes(b"0" * 1000)
        await s.reconcile()
        await s.publish("f.bin")
        await s.publish("f.bin")  # unchanged: the same copy, nothing more counted
        assert (await s.user_usage()).bytes == 2000
        (s.path / "f.bin").write_bytes(b"1" * 1000)
        await s.reconcile()
        await s.publish("f.bin")
        assert (await s.user_usage()).bytes == 3000
        (s.path / "f.bin").write_bytes(b"2" * 1000)
        await s.reconcile()
        with pytest.raises(QuotaExceeded, match="was not linked"):
            await s.publish("f.bin")
        total = sum(p.stat().st_size for p in publisher.directory.rglob("*") if p.is_file())
        assert total == 2000


async def test_a_run_its_process_did_not_index_is_indexed_at_the_next_open(
    root: Path, publisher: DirectoryPublisher, database_url: str, caplog
) -> None:
    async with Store(root, publisher=publisher, database_url=database_url) as store:
        s = await store.session("u", "c")
        async with s.lock():
            await s.begin_run()
            (s.path / "made-by-the-run.txt").write_bytes(b"x")
            # ... and the process dies here: no reconcile.
        assert [d.kind for d in await store.check()] == ["file not indexed"]
    caplog.set_level(logging.WARNING, logger="code_sessions.storage")
    async with Store(root, publisher=publisher, database_url=database_url) as store:
        assert await store.check() == []
        assert [f.path for f in await (await store.session("u", "c")).files.list()] == ["made-by-the-run.txt"]
    assert "ended with its process before its files were indexed" in caplog.text
    assert not any((root / "running").iterdir())


async def test_a_path_longer_than_any_index_can_key_is_removed_and_said(store: Store) -> None:
    """PostgreSQL refuses an index entry of more than about 2.7 KB: a path that long would make every
    write of the session fail. Such content goes, like content too deep, and the report says so."""
    s = await store.session("u", "c")
    deep = s.path
    for _ in range(9):  # 9 levels of 240-byte names: over MAX_PATH_BYTES, within MAX_DEPTH
        deep = deep / ("d" * 240)
    deep.mkdir(parents=True)
    (deep / "far.txt").write_bytes(b"far")
    near = s.path / ("n" * 240) / ("é" * 120)  # long in characters, short enough in bytes
    near.mkdir(parents=True)
    (near / "near.txt").write_bytes(b"near")
    async with s.lock():
        report = await s.reconcile()
    assert {r.kind for r in report.rejected} == {"path too long"}
    assert [f.path for f in await s.files.list()] == [f"{'n' * 240}/{'é' * 120}/near.txt"]
    assert not any(s.path.rglob("far.txt"))
    assert await store.check() == []
    with pytest.raises(InvalidPath, match="longer than"):
        await s.files.write("/".join(["f" * 250] * 9), b"x")


async def test_an_id_longer_than_the_index_keeps_is_refused_with_a_sentence(store: Store) -> None:
    with pytest.raises(StorageError, match="longer than 512 characters"):
        await store.session("u", "c" * 6000)
    assert (await store.session("u", "c" * 512)).chat_id == "c" * 512


async def test_the_quota_decision_in_the_publish_transaction_stands_alone(
    root: Path, publisher: DirectoryPublisher, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another chat of the user took the room between publish's first look and its transaction: here
    # the first look is made to see an empty account, so only the transaction's own decision (made by
    # the INSERT of the link, on both backends) stands between the copy and the quota.
    import storage._index_links as index_module
    from storage.models import Usage

    real = index_module.links_of_file_and_usage

    async def blind(*args: Any, **kwargs: Any) -> Any:
        links, _ = await real(*args, **kwargs)
        return links, Usage(0, 0)

    monkeypatch.setattr(index_module, "links_of_file_and_usage", blind)
    quotas = Quotas(max_bytes_per_user=1500)
    async with Store(root, publisher=publisher, quotas=quotas, database_url=database_url) as store:
        s = await store.session("u", "c")
        (s.path / "f.bin").write_bytes(b"0" * 1000)
        await s.reconcile()
        with pytest.raises(QuotaExceeded, match="was not linked: a copy for download would take 1000 B"):
            await s.publish("f.bin")
        assert await s.links() == []
        assert (await s.user_usage()).bytes == 1000
        assert not [p for p in publisher.directory.rglob("*") if p.is_file()]  # the copy went again
        # Where there is room, the same transaction links the copy: 1,100 used + 100 <= 1,500.
        (s.path / "small.txt").write_bytes(b"x" * 100)
        await s.reconcile()
        link = await s.publish("small.txt")
        assert [x.ref for x in await s.links()] == [link.ref]
        assert (await s.user_usage()).bytes == 1200
