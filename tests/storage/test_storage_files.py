"""ChatFiles: reads and writes that never follow a symlink, and keep the index in step."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from storage import FileExists, FileMissing, InvalidPath, Policy, QuotaExceeded, Quotas, Store
from tests.storage.storage_helpers import FifoGuard, user_usage


async def test_write_read_list_remove_rename(store: Store) -> None:
    s = await store.session("u", "c")
    await s.files.write("out/data.csv", b"a,b\n")
    assert (s.path / "out" / "data.csv").read_bytes() == b"a,b\n"
    assert await s.files.read("out/data.csv") == b"a,b\n"
    assert await s.files.exists("out/data.csv")
    assert not await s.files.exists("out/nope.csv")
    [entry] = await s.files.list()
    assert (entry.path, entry.size) == ("out/data.csv", 4)
    assert entry.first_seen == entry.last_changed and entry.mtime > 0

    await s.files.write("out/data.csv", b"a,b\n1,2\n")  # replace keeps first_seen
    [again] = await s.files.list()
    assert again.size == 8 and again.first_seen == entry.first_seen

    await s.files.rename("out/data.csv", "final/data.csv")
    assert not (s.path / "out" / "data.csv").exists()
    assert [e.path for e in await s.files.list()] == ["final/data.csv"]
    assert await s.usage() == (await user_usage(store, "u"))
    assert (await s.usage()).files == 1 and (await s.usage()).bytes == 8

    await s.files.write("other.txt", b"x")
    with pytest.raises(FileExists):
        await s.files.rename("other.txt", "final/data.csv")
    await s.files.rename("other.txt", "final/data.csv", overwrite=True)
    assert await s.files.read("final/data.csv") == b"x"
    assert (await s.usage()).files == 1

    await s.files.remove("final/data.csv")
    assert await s.files.list() == []
    assert (await s.usage()).bytes == 0
    with pytest.raises(FileMissing):
        await s.files.remove("final/data.csv")
    with pytest.raises(FileMissing):
        await s.files.read("final/data.csv")


async def test_write_is_atomic_and_leaves_no_temp_files(store: Store) -> None:
    s = await store.session("u", "c")
    for i in range(5):
        await s.files.write("f.bin", bytes([i]) * 1000)
    assert sorted(os.listdir(s.path)) == ["f.bin"]
    assert stat.S_IMODE(os.stat(s.path / "f.bin").st_mode) == 0o600


async def test_symlinks_are_never_followed(store: Store, tmp_path: Path) -> None:
    s = await store.session("u", "c")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("secret")
    os.symlink(outside, s.path / "link")
    os.symlink(outside / "secret.txt", s.path / "secret.txt")
    with pytest.raises(InvalidPath, match="symlink"):
        await s.files.read("link/secret.txt")
    with pytest.raises(InvalidPath):
        await s.files.read("secret.txt")
    with pytest.raises(InvalidPath):
        await s.files.write("link/new.txt", b"x")
    with pytest.raises(InvalidPath):
        await s.files.rename("secret.txt", "moved.txt")
    assert not await s.files.exists("link/secret.txt")
    assert not await s.files.exists("secret.txt")
    # writing over a symlink replaces the link itself, never the target
    await s.files.write("secret.txt", b"mine")
    assert (outside / "secret.txt").read_text() == "secret"
    assert not (s.path / "secret.txt").is_symlink()
    assert sorted(os.listdir(outside)) == ["secret.txt"]
    # removing a symlink removes the link only
    await s.files.remove("link")
    assert (outside / "secret.txt").exists()


async def test_bounded_reads_take_only_what_they_ask_and_follow_no_symlink(
    store: Store, tmp_path: Path
) -> None:
    s = await store.session("u", "c")
    await s.files.write("big.csv", b"0123456789" * 1000)
    assert await s.files.read_head("big.csv", 25) == (b"0123456789" * 2 + b"01234", 10_000)
    assert await s.files.read_head("big.csv", 1 << 20) == (b"0123456789" * 1000, 10_000)
    assert await s.files.read_at("big.csv", 9_995, 100) == b"56789"
    assert await s.files.read_at("big.csv", 20_000, 100) == b""
    (tmp_path / "secret.txt").write_text("secret")
    os.symlink(tmp_path / "secret.txt", s.path / "secret.csv")
    with pytest.raises(InvalidPath):
        await s.files.read_head("secret.csv", 100)
    with pytest.raises(InvalidPath):
        await s.files.read_at("secret.csv", 0, 100)
    os.mkfifo(s.path / "pipe.csv")
    with FifoGuard(s.path / "pipe.csv", timeout=5) as guard, pytest.raises(InvalidPath, match="fifo"):
        await s.files.read_head("pipe.csv", 100)
    assert not guard.fired


async def test_read_refuses_fifo_without_blocking(store: Store) -> None:
    s = await store.session("u", "c")
    os.mkfifo(s.path / "pipe")
    with FifoGuard(s.path / "pipe", timeout=5) as guard, pytest.raises(InvalidPath, match="fifo"):
        await s.files.read("pipe")
    assert not guard.fired
    with pytest.raises(InvalidPath, match="folder"):
        os.mkdir(s.path / "d")
        await s.files.read("d")


@pytest.mark.parametrize("bad", ["/etc/passwd", "../x", "a//b", "a\x00b", ""])
async def test_invalid_paths(store: Store, bad: str) -> None:
    s = await store.session("u", "c")
    with pytest.raises(InvalidPath):
        await s.files.write(bad, b"x")
    with pytest.raises(InvalidPath):
        await s.files.read(bad)


async def test_write_new_never_overwrites(store: Store) -> None:
    s = await store.session("u", "c")
    assert await s.files.write_new("a.csv", b"1") == "a.csv"
    assert await s.files.write_new("a.csv", b"2") == "a (2).csv"
    assert await s.files.write_new("dir/../a.csv", b"3") == "a (3).csv"
    assert await s.files.write_new("../../etc/passwd", b"4") == "passwd"
    assert await s.files.write_new(".hidden", b"5") == "_hidden"
    assert await s.files.read("a.csv") == b"1"
    assert await s.files.read("a (2).csv") == b"2"
    assert sorted(e.path for e in await s.files.list()) == [
        "_hidden",
        "a (2).csv",
        "a (3).csv",
        "a.csv",
        "passwd",
    ]
    assert not (s.path.parent / "passwd").exists()


async def test_write_new_enforces_quotas(store: Store) -> None:
    policy = Policy(Quotas(max_file_bytes=10, max_bytes_per_user=25, max_files_per_user=3))
    s = await store.session("u", "c1", policy=policy)
    other = await store.session("u", "c2", policy=policy)
    with pytest.raises(QuotaExceeded, match="per-file limit"):
        await s.files.write_new("big.bin", b"x" * 11)
    await s.files.write_new("a", b"x" * 10)
    await other.files.write_new("b", b"x" * 10)
    with pytest.raises(QuotaExceeded, match="storage limit"):
        await s.files.write_new("c", b"x" * 6)  # 26 > 25 across both chats
    await s.files.write_new("c", b"x" * 5)
    with pytest.raises(QuotaExceeded, match="3 files"):
        await s.files.write_new("d", b"")
    assert sorted(os.listdir(s.path)) == ["a", "c"]
    policy = Policy(Quotas(max_files_per_user=0, max_bytes_per_user=None, max_file_bytes=0))
    s = await store.session("u", "c1", policy=policy)
    await s.files.write_new("d", b"x" * 100)  # 0/None: no limit


async def test_owner_is_applied_to_what_we_create(root: Path, database_url: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("chown needs root")
    async with Store(root, owner=(4242, 4343), database_url=database_url) as store:
        s = await store.session("u", "c")
        await s.files.write("sub/dir/f.txt", b"x")
        name = await s.files.write_new("up.csv", b"y")
        for path in (s.path, s.path / "sub", s.path / "sub/dir", s.path / "sub/dir/f.txt", s.path / name):
            st = os.stat(path)
            assert (st.st_uid, st.st_gid) == (4242, 4343), path
        assert stat.S_IMODE(os.stat(s.path).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(root).st_mode) == 0o700


async def test_write_enforces_quotas_counting_the_replaced_file(store: Store) -> None:
    policy = Policy(Quotas(max_bytes_per_user=100, max_file_bytes=80))
    s = await store.session("u", "c", policy=policy)
    await s.files.write("a", b"x" * 80)
    await s.files.write("a", b"y" * 80)  # replacing: 80 - 80 + 80 <= 100
    with pytest.raises(QuotaExceeded, match="per-file"):
        await s.files.write("b", b"x" * 81)
    with pytest.raises(QuotaExceeded, match="storage limit"):
        await s.files.write("b", b"x" * 21)
    await s.files.write("b", b"x" * 21, enforce_quotas=False)
    assert (await s.usage()).bytes == 101


async def test_an_import_source_is_copied_once_per_chat(store: Store) -> None:
    s = await store.session("u", "c")
    assert await s.files.imported("upload:1") is None
    first = await s.files.write_new("data.csv", b"1", source="upload:1")
    again = await s.files.write_new("data.csv", b"1", source="upload:1")
    assert first == again == "data.csv"
    assert [e.path for e in await s.files.list()] == ["data.csv"]
    # A different upload with the same name gets its own name; another chat imports its own copy.
    assert await s.files.write_new("data.csv", b"2", source="upload:2") == "data (2).csv"
    other = await store.session("u", "c2")
    assert await other.files.write_new("data.csv", b"1", source="upload:1") == "data.csv"
    # Deleted by the chat's code: it stays deleted (the import is remembered).
    await s.files.remove("data.csv")
    assert await s.files.write_new("data.csv", b"1", source="upload:1") == "data.csv"
    assert not await s.files.exists("data.csv")
