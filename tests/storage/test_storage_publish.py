"""Publishing: copies under unguessable names, passive types only rendered inline."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest

from storage import DirectoryPublisher, FileMissing, InvalidPath, StorageError, Store, _fsops
from tests.storage.storage_helpers import FifoGuard


async def test_publish_makes_a_regular_copy_under_a_random_token(
    store: Store, publisher: DirectoryPublisher
) -> None:
    s = await store.session("u", "c")
    await s.files.write("plots/chart.png", b"\x89PNG data")
    link = await s.publish("plots/chart.png")
    assert len(link.ref) >= 32 and link.ref.replace("-", "").replace("_", "").isalnum()
    assert link.url == f"/cache/functions/code_sessions/{link.ref}/chart.png"
    assert (link.path, link.name, link.size, link.is_image) == ("plots/chart.png", "chart.png", 9, True)
    copy = publisher.directory / link.ref / "chart.png"
    st = os.lstat(copy)
    assert stat.S_ISREG(st.st_mode) and copy.read_bytes() == b"\x89PNG data"
    assert os.listdir(publisher.directory) == [link.ref]  # no staging left
    # unchanged file: same link; changed file: a new one
    assert (await s.publish("plots/chart.png")).ref == link.ref
    await s.files.write("plots/chart.png", b"\x89PNG other")
    second = await s.publish("plots/chart.png")
    assert second.ref != link.ref
    tokens = {(await s.publish("plots/chart.png")).ref for _ in range(3)}
    assert tokens == {second.ref}
    assert {li.ref for li in await store.links()} == {link.ref, second.ref}
    # a copy deleted by someone else is re-made
    os.unlink(publisher.directory / second.ref / "chart.png")
    assert (await s.publish("plots/chart.png")).ref != second.ref


async def test_a_file_rewritten_with_its_size_and_mtime_restored_gets_a_new_link(store: Store) -> None:
    s = await store.session("u", "c")
    path = s.path / "report.csv"
    path.write_bytes(b"old,bytes\n")
    first = await s.publish("report.csv")
    st = path.stat()
    path.write_bytes(b"new,bytes\n")  # same size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # and the old mtime
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns
    second = await s.publish("report.csv")
    assert second.ref != first.ref
    assert (store.publisher.directory / second.ref / second.name).read_bytes() == b"new,bytes\n"
    # the same bytes again (a new inode, as an editor's save makes): the first link is reused
    path.unlink()
    path.write_bytes(b"old,bytes\n")
    assert (await s.publish("report.csv")).ref == first.ref


async def test_svg_is_published_as_text(store: Store, publisher: DirectoryPublisher) -> None:
    s = await store.session("u", "c")
    await s.files.write("logo.svg", b"<svg onload='alert(1)'/>")
    link = await s.publish("logo.svg")
    assert link.name == "logo.svg.txt" and link.url.endswith("/logo.svg.txt") and not link.is_image
    assert (publisher.directory / link.ref / "logo.svg.txt").exists()


async def test_unsafe_name_characters_are_replaced(store: Store) -> None:
    s = await store.session("u", "c")
    await s.files.write('a"b; filename=evil.html', b"x")
    link = await s.publish('a"b; filename=evil.html')
    assert link.name == "a_b__filename_evil.html"


async def test_publish_refuses_symlinks_and_special_files(store: Store, tmp_path: Path) -> None:
    s = await store.session("u", "c")
    os.symlink("/etc/passwd", s.path / "passwd")
    (tmp_path / "d").mkdir()
    os.symlink(tmp_path / "d", s.path / "dirlink")
    (tmp_path / "d" / "f.txt").write_text("x")
    os.mkfifo(s.path / "fifo")
    with pytest.raises(InvalidPath, match="symlink"):
        await s.publish("passwd")
    with pytest.raises(InvalidPath, match="symlink"):
        await s.publish("dirlink/f.txt")
    with FifoGuard(s.path / "fifo", timeout=5) as guard, pytest.raises(InvalidPath, match="fifo"):
        await s.publish("fifo")
    assert not guard.fired
    with pytest.raises(FileMissing):
        await s.publish("nope.txt")
    with pytest.raises(InvalidPath):
        await s.publish("../index.sqlite3")
    assert await store.links() == []


async def test_disk_full_leaves_nothing(
    store: Store, publisher: DirectoryPublisher, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = await store.session("u", "c")
    await s.files.write("big.bin", b"x" * 1000)

    def full(src: int, dst: int) -> None:
        os.write(dst, b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_fsops, "copy_fd", full)
    monkeypatch.setattr("storage.publishing.copy_fd", full)
    with pytest.raises(StorageError, match="disk space"):
        await s.publish("big.bin")
    assert os.listdir(publisher.directory) == []
    assert await store.links() == []


async def test_no_publisher_is_a_clear_error(root: Path, database_url: str) -> None:
    async with Store(root, database_url=database_url) as store:
        s = await store.session("u", "c")
        await s.files.write("a", b"1")
        with pytest.raises(StorageError, match="not configured"):
            await s.publish("a")
