"""How much the workdir grew during a run, measured on the host while the sandbox writes.

gVisor has no per-mount write quota, so a host-side watcher walks the workdir and stops the sandbox
once it has grown by more than ``max_write_bytes``. The walk never follows symlinks (the sandbox can
point them anywhere), counts hard-linked inodes once, and counts a file as the larger of its apparent
size and its allocated blocks (sparse files and many tiny files both count honestly).

Two places a walk by path name would miss are covered too: folders nested so deep that their path is
longer than PATH_MAX (every folder is opened from its parent's descriptor, so path length does not
matter; nesting deeper than MAX_DEPTH cannot be measured and stops the run), and files deleted while
still open, whose blocks stay allocated until the sandbox exits (found through the open descriptors
of the sandbox's host processes).
"""

from __future__ import annotations

import asyncio
import os
import stat
import time
from collections.abc import Callable

FIRST_CHECK_S = 0.2  # gVisor takes ~0.25 s to boot: nothing can have been written before that
FS_POLL_S = 0.05  # statvfs of the workdir's filesystem: a single cheap syscall
MIN_INTERVAL_S = 0.1
MAX_INTERVAL_S = 5.0
# Between forced walks, sleep this many times as long as the last walk took: a workdir of 100k files
# then costs under ~5% of one core. A cheap statvfs poll triggers a walk early whenever the whole
# filesystem grew by more than the remaining budget, so a fast writer is still caught within ~0.1 s.
COST_FACTOR = 20.0
# Folders nested deeper than this cannot be measured (one descriptor is open per level while walking).
MAX_DEPTH = 128
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class TooDeep(Exception):
    """The workdir holds folders nested deeper than MAX_DEPTH levels: writes there cannot be measured."""


def disk_usage(root: str, max_depth: int = MAX_DEPTH) -> int:
    """Bytes under ``root``. Raises TooDeep for folders nested more than ``max_depth`` levels."""
    try:
        top = os.open(root, _DIR_FLAGS)
    except OSError:
        return 0
    seen: set[tuple[int, int]] = set()
    size, subfolders = _measure(top, seen)
    total = size
    # Depth first with one open folder per level, whatever a level's width; a folder is opened from
    # its parent's descriptor, so a path longer than PATH_MAX is no obstacle.
    stack: list[tuple[int, list[str]]] = [(top, subfolders)]
    try:
        while stack:
            fd, pending = stack[-1]
            if not pending:
                os.close(fd)
                stack.pop()
                continue
            name = pending.pop()
            try:
                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError:  # vanished or swapped meanwhile: the sandbox is busy; not our concern
                continue
            if len(stack) > max_depth:
                os.close(child)
                raise TooDeep(f"folders nested more than {max_depth} levels deep")
            try:
                size, subfolders = _measure(child, seen)
            except BaseException:
                os.close(child)
                raise
            total += size
            stack.append((child, subfolders))
    finally:
        for fd, _ in stack:
            os.close(fd)
    return total


def _measure(fd: int, seen: set[tuple[int, int]]) -> tuple[int, list[str]]:
    """(bytes of the entries of one folder, names of its subfolders)."""
    total = 0
    subfolders: list[str] = []
    try:
        listing = os.scandir(fd)
    except OSError:
        return 0, subfolders
    with listing:
        for entry in listing:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                subfolders.append(entry.name)
            elif st.st_nlink > 1:
                key = (st.st_dev, st.st_ino)
                if key in seen:
                    continue
                seen.add(key)
            total += max(st.st_size, st.st_blocks * 512)
    return total, subfolders


def deleted_but_open(pids: list[int], device: int) -> int:
    """Bytes of files on ``device`` that have no name left but are held open by these processes: code
    can write without end to a file it unlinked, and no walk of the folder will ever see it."""
    total = 0
    seen: set[int] = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                st = os.stat(f"/proc/{pid}/fd/{fd}")  # follows the magic link to the open file itself
            except OSError:
                continue
            if st.st_nlink or st.st_dev != device or not stat.S_ISREG(st.st_mode) or st.st_ino in seen:
                continue
            seen.add(st.st_ino)
            total += max(st.st_size, st.st_blocks * 512)
    return total


def fs_used(root: str) -> int:
    st = os.statvfs(root)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


async def watch_growth(
    root: str,
    baseline: asyncio.Future[int],
    limit: int,
    on_exceeded: Callable[[int | None], None],
    pids: Callable[[], list[int]] | None = None,
) -> None:
    """Poll until cancelled; call ``on_exceeded(growth)`` once and return if growth passes ``limit``
    (``on_exceeded(None)``: folders nested too deep to measure). ``pids``: the sandbox's host processes,
    whose deleted-but-open files count too.

    The walk is the authority. The filesystem-wide figure only decides when to walk: the workdir
    cannot have grown by more than the whole filesystem did (unless something elsewhere freed space
    at the same time, which the periodic walk still catches).
    """
    try:
        await _watch(root, baseline, limit, on_exceeded, pids)
    except TooDeep:
        on_exceeded(None)


async def _watch(
    root: str,
    baseline: asyncio.Future[int],
    limit: int,
    on_exceeded: Callable[[int | None], None],
    pids: Callable[[], list[int]] | None,
) -> None:
    t0 = time.monotonic()
    start = await baseline
    device = os.stat(root).st_dev
    next_walk = t0 + min(MAX_INTERVAL_S, max(MIN_INTERVAL_S, (time.monotonic() - t0) * COST_FACTOR))
    await asyncio.sleep(FIRST_CHECK_S)
    growth = 0
    fs_at_walk = await asyncio.to_thread(fs_used, root)

    def measure() -> int:
        hidden = deleted_but_open(pids(), device) if pids is not None else 0
        return disk_usage(root) + hidden - start

    while True:
        fs_now = await asyncio.to_thread(fs_used, root)
        if time.monotonic() >= next_walk or fs_now - fs_at_walk > limit - growth:
            fs_at_walk = fs_now
            t0 = time.monotonic()
            growth = await asyncio.to_thread(measure)
            cost = time.monotonic() - t0
            if growth > limit:
                on_exceeded(growth)
                return
            next_walk = time.monotonic() + min(MAX_INTERVAL_S, max(MIN_INTERVAL_S, cost * COST_FACTOR))
        await asyncio.sleep(FS_POLL_S)
