"""How much the workdir grew during a run, measured on the host while the sandbox writes.

gVisor has no per-mount write quota, so a host-side watcher walks the workdir and stops the sandbox
once it has grown by more than ``max_write_bytes``. The walk never follows symlinks (the sandbox can
point them anywhere), counts hard-linked inodes once, and counts a file as the larger of its apparent
size and its allocated blocks (sparse files and many tiny files both count honestly).
"""

from __future__ import annotations

import asyncio
import os
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


def disk_usage(root: str) -> int:
    total = 0
    seen: set[tuple[int, int]] = set()
    stack = [root]
    while stack:
        path = stack.pop()
        try:
            it = os.scandir(path)
        except OSError:  # vanished or unreadable meanwhile: the sandbox is busy; not our concern
            continue
        with it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
                except OSError:
                    continue
                if st.st_nlink > 1 and not entry.is_dir(follow_symlinks=False):
                    key = (st.st_dev, st.st_ino)
                    if key in seen:
                        continue
                    seen.add(key)
                total += max(st.st_size, st.st_blocks * 512)
    return total


def fs_used(root: str) -> int:
    st = os.statvfs(root)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


async def watch_growth(
    root: str,
    baseline: asyncio.Future[int],
    limit: int,
    on_exceeded: Callable[[int], None],
) -> None:
    """Poll until cancelled; call ``on_exceeded(growth)`` once and return if growth passes ``limit``.

    The walk is the authority. The filesystem-wide figure only decides when to walk: the workdir
    cannot have grown by more than the whole filesystem did (unless something elsewhere freed space
    at the same time, which the periodic walk still catches).
    """
    t0 = time.monotonic()
    start = await baseline
    next_walk = t0 + min(MAX_INTERVAL_S, max(MIN_INTERVAL_S, (time.monotonic() - t0) * COST_FACTOR))
    await asyncio.sleep(FIRST_CHECK_S)
    growth = 0
    fs_at_walk = await asyncio.to_thread(fs_used, root)
    while True:
        fs_now = await asyncio.to_thread(fs_used, root)
        if time.monotonic() >= next_walk or fs_now - fs_at_walk > limit - growth:
            fs_at_walk = fs_now
            t0 = time.monotonic()
            growth = await asyncio.to_thread(disk_usage, root) - start
            cost = time.monotonic() - t0
            if growth > limit:
                on_exceeded(growth)
                return
            next_walk = time.monotonic() + min(MAX_INTERVAL_S, max(MIN_INTERVAL_S, cost * COST_FACTOR))
        await asyncio.sleep(FS_POLL_S)
