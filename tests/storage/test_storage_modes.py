"""What the store creates is its own alone, even in a storage root made beforehand with mode 0755 (a
common pre-made volume) and a umask of 022: the index (with its -wal and -shm), sidecars, locks, link
records and the folders. Another local user cannot read the index."""

from __future__ import annotations

import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from storage import DirectoryPublisher, Store
from tests.storage.storage_helpers import sqlite_only

NOBODY = "65534"


@pytest.fixture
def loose_umask() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def _open_to_others(root: Path) -> list[str]:
    """Everything under root (but inside the chats' folders, which are the sandbox's) that a user
    other than its owner may read, write or enter."""
    found = []
    for folder, dirs, files in os.walk(root):
        here = Path(folder)
        if here.parent == root / "sessions":
            dirs[:] = []  # a user's folder: its chats' folders are the sandbox's own
        for name in (*dirs, *files):
            mode = stat.S_IMODE((here / name).lstat().st_mode)
            if mode & 0o077:
                found.append(f"{(here / name).relative_to(root)} {mode:04o}")
    return found


def _read_as_nobody(path: Path) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "cat", str(path)],
        capture_output=True,
    )


@sqlite_only
async def test_a_root_made_0755_beforehand_gets_nothing_others_can_read(
    tmp_path: Path, publisher: DirectoryPublisher, database_url: str, loose_umask: None
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    os.chmod(root, 0o755)
    os.chmod(tmp_path, 0o755)  # so only the modes of what the store made stand between nobody and it
    async with Store(root, publisher=publisher, database_url=database_url) as store:
        s = await store.session("alice", "chat-1")
        await s.files.write("report.csv", b"secret,data\n")
        await s.publish("report.csv")
        # Open, with writes behind it: the WAL and its shared memory exist now.
        assert (root / "index.sqlite3-wal").exists() and (root / "index.sqlite3-shm").exists()
        assert _open_to_others(root) == []
        refused = _read_as_nobody(root / "index.sqlite3")
        assert refused.returncode != 0 and b"Permission denied" in refused.stderr
    assert _open_to_others(root) == []


@sqlite_only
async def test_an_index_left_readable_by_an_earlier_version_is_tightened(
    tmp_path: Path, publisher: DirectoryPublisher, database_url: str, loose_umask: None
) -> None:
    root = tmp_path / "root"
    async with Store(root, publisher=publisher, database_url=database_url) as store:
        await (await store.session("alice", "chat-1")).files.write("a.txt", b"x")
    for name in ("index.sqlite3", "index.sqlite3-wal", "index.sqlite3-shm"):
        (root / name).touch()
        os.chmod(root / name, 0o644)
    async with Store(root, publisher=publisher, database_url=database_url) as store:
        assert [f.path for f in await (await store.session("alice", "chat-1")).files.list()] == ["a.txt"]
        for name in ("index.sqlite3", "index.sqlite3-wal", "index.sqlite3-shm"):
            assert stat.S_IMODE((root / name).stat().st_mode) == 0o600, name
