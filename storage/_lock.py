"""Cross-process exclusive locks on files (fcntl.flock), usable from asyncio without blocking it.

Why poll with LOCK_NB instead of a blocking flock() in a thread: a thread stuck in flock() can be
neither cancelled nor timed out, and if it acquired the lock after its caller gave up, the lock would
be held by nobody who knows. Polling with a short, growing sleep is cancellable and honours timeouts.

Lock files may be unlinked by cleanup while it holds them (when it deletes a session). A waiter that
opened the old file would then lock an orphan inode while a newcomer locks a fresh file at the same
path: two holders. So after every acquisition we check that the path still names the inode we locked,
and start over if not.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import time
from pathlib import Path

from .errors import StorageBusy

_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC


class FileLock:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def try_acquire(self) -> bool:
        """Take the lock if free, without waiting. Creates the lock file (and its folder) if needed."""
        if self._fd is not None:
            raise RuntimeError("lock already held by this object")
        for _ in range(100):
            try:
                fd = os.open(self.path, _FLAGS, 0o600)
            except FileNotFoundError:
                # Our folder was removed by a cleanup of the last session of this user: recreate.
                self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False
            except BaseException:
                os.close(fd)
                raise
            if _same_file(fd, self.path):
                self._fd = fd
                return True
            os.close(fd)  # unlinked under us: lock the file that is there now
        raise StorageBusy(f"the lock file {self.path} keeps being replaced")

    async def acquire(self, timeout: float | None = None, *, what: str = "this chat") -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.005
        while not self.try_acquire():
            if deadline is not None and time.monotonic() >= deadline:
                raise StorageBusy(
                    f"{what} is busy with another request (waited {timeout:g} s); try again in a moment"
                )
            wait = delay if deadline is None else min(delay, max(0.0, deadline - time.monotonic()))
            await asyncio.sleep(wait)
            delay = min(delay * 2, 0.2)

    def release(self, *, unlink: bool = False) -> None:
        """Release; with unlink=True the lock file is removed first (while still held)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if unlink:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
        finally:
            os.close(fd)  # closing the last fd releases the flock


def is_locked(path: Path) -> bool:
    """True if someone holds the lock at path. Creates nothing (used by dry runs and check)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _same_file(fd: int, path: Path) -> bool:
    try:
        on_path = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (on_path.st_dev, on_path.st_ino)
