"""How much the workdir grew during a run, measured on the host while the sandbox writes.

gVisor has no per-mount write quota, so a host-side watcher walks the workdir and stops the sandbox
once its folders have gained more than ``max_write_bytes`` (each folder against its own size before
the run, so a walk can stop at the first folders that prove the limit broken). The walk never
follows symlinks (the sandbox can point them anywhere), counts hard-linked inodes once, and counts a
file as the larger of its apparent size and its allocated blocks (sparse files and many tiny files
both count honestly).

Two places a walk by path name would miss are covered too: folders nested so deep that their path is
longer than PATH_MAX (every folder is opened from its parent's descriptor, so path length does not
matter; nesting deeper than MAX_DEPTH cannot be measured and stops the run), and files deleted while
still open, whose blocks stay allocated until the sandbox exits (found through the open descriptors
of the sandbox's host processes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
import threading
import time
from collections.abc import Callable

log = logging.getLogger("code_sessions.runner")

FS_POLL_S = 0.01  # statvfs of the workdir's filesystem: a single cheap syscall
MIN_INTERVAL_S = 0.1
MAX_INTERVAL_S = 5.0
# A kernel's watch between runs (GrowthWatch.idle): nothing of it should write, so the statvfs poll
# backs off, doubling up to this while the filesystem is quiet, then one thread of the process polls
# for all quiet watches at this pace (_IdleWatches); a watch is back at FS_POLL_S as soon as its
# filesystem grew by an eighth of the budget left; a walk at least every IDLE_WALK_S. An idle kernel's
# watch costs next to nothing then, where polling every FS_POLL_S alone costs about 1.4% of a core; a
# writer a cell left running is still caught within IDLE_POLL_MAX_S of passing the budget, by the fall
# in free space.
IDLE_POLL_MAX_S = 0.25
IDLE_WALK_S = 60.0
# Between forced walks, sleep this many times as long as the last walk took: a workdir of 100k files
# then costs under ~5% of one core. A cheap statvfs poll triggers a walk early whenever the whole
# filesystem grew by more than the remaining budget, so a fast writer is caught at the next walk.
COST_FACTOR = 20.0
# Folders nested deeper than this cannot be measured (one descriptor is open per level while walking).
MAX_DEPTH = 128
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class TooDeep(Exception):
    """The workdir holds folders nested deeper than MAX_DEPTH levels: writes there cannot be measured."""


FolderSizes = dict[tuple[int, int], int]  # (st_dev, st_ino) of a folder -> bytes of its own entries


def folder_sizes(root: str, max_depth: int = MAX_DEPTH) -> FolderSizes:
    """The bytes of each folder under ``root`` (its own entries, not its subfolders'): the baseline
    that `growth` compares against. Raises TooDeep for folders nested more than ``max_depth`` levels."""
    sizes: FolderSizes = {}

    def record(key: tuple[int, int], size: int) -> bool:
        sizes[key] = size
        return False

    _walk(root, max_depth, record)
    return sizes


def growth(
    root: str, before: FolderSizes, stop_above: int | None = None, abandon: Callable[[], bool] | None = None
) -> int:
    """Bytes the folders under ``root`` gained since ``before``, a folder that shrank counting as 0.

    Counting per folder is what lets a walk stop early: once the folders seen so far gained more than
    ``stop_above``, the rest cannot take it back, and finishing a walk of 100k files would only let
    the writer go on. (So moving existing files into another folder counts as writing them there.)
    ``abandon``: asked after each folder; True ends the walk (the run is over, nobody needs the answer).
    """
    total = 0

    def add(key: tuple[int, int], size: int) -> bool:
        nonlocal total
        total += max(0, size - before.get(key, 0))
        return (stop_above is not None and total > stop_above) or (abandon is not None and abandon())

    _walk(root, max_depth=MAX_DEPTH, visit=add)
    return total


def _walk(root: str, max_depth: int, visit: Callable[[tuple[int, int], int], bool]) -> None:
    """Call ``visit(folder key, bytes of its entries)`` for each folder until it returns True."""
    try:
        top = os.open(root, _DIR_FLAGS)
    except OSError:
        return
    seen: set[tuple[int, int]] = set()
    # Depth first with one open folder per level, whatever a level's width; a folder is opened from
    # its parent's descriptor, so a path longer than PATH_MAX is no obstacle. Every descriptor is on
    # the stack before anything can raise or return, so the `finally` closes them all.
    stack: list[tuple[int, list[str]]] = [(top, [])]
    try:
        if _enter(top, stack[-1][1], seen, visit):
            return
        while stack:
            fd, pending = stack[-1]
            if not pending:
                os.close(fd)
                stack.pop()
                continue
            try:
                child = os.open(pending.pop(), _DIR_FLAGS, dir_fd=fd)
            except OSError:  # vanished or swapped meanwhile: the sandbox is busy; not our concern
                continue
            stack.append((child, []))
            if len(stack) > max_depth + 1:
                raise TooDeep(f"folders nested more than {max_depth} levels deep")
            if _enter(child, stack[-1][1], seen, visit):
                return
    finally:
        for fd, _ in stack:
            os.close(fd)


def _enter(
    fd: int, pending: list[str], seen: set[tuple[int, int]], visit: Callable[[tuple[int, int], int], bool]
) -> bool:
    """Measure one open folder, queue its subfolders, and return what ``visit`` says."""
    size, subfolders = _measure(fd, seen)
    pending.extend(subfolders)
    return visit(_key(fd), size)


def _key(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


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
    limit: int,
    on_exceeded: Callable[[int | None], None],
    pids: Callable[[], list[int]],
    stop_now: Callable[[], None],
) -> None:
    """Watch until cancelled; call ``on_exceeded(growth)`` once and return if growth passes ``limit``
    (``on_exceeded(None)``: folders nested too deep to measure). ``pids``: the sandbox's host processes,
    whose deleted-but-open files count too. ``stop_now``: called from the watching thread, to stop the
    writer without waiting for the event loop (it must be thread-safe).

    Start it before the sandbox: it reads the filesystem's level and walks the baseline at once, while
    gVisor boots (~0.25 s), so a short run (`print(1)`) never waits for a walk.

    The walk is the authority. The filesystem-wide figure only decides when to walk: the workdir
    cannot have grown by more than the whole filesystem did (unless something elsewhere freed space
    at the same time, which the periodic walk still catches).

    Everything runs in a thread of its own: a writer fills ~0.5 GB/s here, so every hop through the
    event loop or a shared executor (busy with other chats' runs) is megabytes of overshoot.
    """
    loop = asyncio.get_running_loop()
    finished = asyncio.Event()
    cancelled = threading.Event()

    def report(growth: int | None) -> None:
        if cancelled.is_set():  # the run is over: its outcome is decided
            return
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is waiting any more
            loop.call_soon_threadsafe(on_exceeded, growth)
        stop_now()

    def body() -> None:
        try:
            _watch(root, limit, report, pids, cancelled)
        except TooDeep:
            report(None)
        except FileNotFoundError:  # the workdir was removed (a purge): the run's own end reconciles it
            log.info("disk watcher stopped: %s is gone", root)
        except Exception:
            log.exception("disk watcher stopped for %s", root)
        finally:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(finished.set)

    threading.Thread(target=body, name="disk-watch", daemon=True).start()
    try:
        await finished.wait()
    finally:
        cancelled.set()


def _watch(
    root: str,
    limit: int,
    report: Callable[[int | None], None],
    pids: Callable[[], list[int]],
    cancelled: threading.Event,
) -> None:
    # The filesystem's level before the baseline walk: growth from here on triggers a walk, even growth
    # that happens while the baseline walk is still running (it is slow under load).
    fs_at_walk = fs_used(root)
    t0 = time.monotonic()
    start = folder_sizes(root)
    next_walk = time.monotonic() + _interval(time.monotonic() - t0)
    device = os.stat(root).st_dev
    grown = 0

    def measure() -> int:
        hidden = deleted_but_open(pids(), device)
        return growth(root, start, stop_above=limit - hidden, abandon=cancelled.is_set) + hidden

    while not cancelled.wait(FS_POLL_S):
        fs_now = fs_used(root)
        if time.monotonic() >= next_walk or fs_now - fs_at_walk > limit - grown:
            fs_at_walk = fs_now
            t0 = time.monotonic()
            grown = measure()
            if grown > limit:
                report(grown)
                return
            next_walk = time.monotonic() + _interval(time.monotonic() - t0)


def _interval(walk_cost: float) -> float:
    return min(MAX_INTERVAL_S, max(MIN_INTERVAL_S, walk_cost * COST_FACTOR))


class GrowthWatch:
    """A growth watch that lives as long as a kernel, in a thread of its own.

    Its baseline is taken again by `rebase()` at the start of every run, so growth means what was
    written since the latest run began: a run's budget covers what it writes and what anything it
    left running (a thread, a process the kernel could not end) writes until the next run begins.
    `on_exceeded(growth)` is called once, from the watching thread (None: folders too deep to
    measure); the watch then stops. `set_limit()` changes the budget for the next rebase on.
    """

    def __init__(
        self, root: str, limit: int, on_exceeded: Callable[[int | None], None], pids: Callable[[], list[int]]
    ) -> None:
        self.root = root
        self._limit = limit
        self._on_exceeded = on_exceeded
        self._pids = pids
        self._rebase = threading.Event()
        self._stopped = threading.Event()
        self._rebased = threading.Event()
        self._idle = threading.Event()  # between runs: poll lazily while the filesystem is quiet
        self._wake = threading.Event()  # a rebase or a stop: look now, not at the end of a lazy wait
        # What the idle watches' thread reads (see stirred): written by this watch's thread only.
        self.device = 0
        self.limit = limit
        self.fs_before = self.fs_at_walk = self.grown = 0
        self._thread = threading.Thread(target=self._main, name="kernel-disk-watch", daemon=True)

    def start(self) -> None:
        self._rebase.set()
        self._thread.start()

    def rebase(self, limit: int) -> None:
        """A run begins: measure from here, with this budget. Returns at once; the baseline walk runs
        in the watching thread."""
        self._limit = limit
        self._rebased.clear()
        self._idle.clear()
        self._rebase.set()
        self._wake.set()

    def idle(self) -> None:
        """A run ended: until the next one, nothing of the kernel should write (see IDLE_POLL_MAX_S)."""
        self._idle.set()

    def stop(self) -> None:
        self._stopped.set()
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def _main(self) -> None:
        try:
            self._loop()
        except TooDeep:
            if not self._stopped.is_set():
                self._on_exceeded(None)
        except FileNotFoundError:  # the workdir was removed (a purge): the kernel is being stopped anyway
            if not self._stopped.is_set():
                log.info("kernel disk watcher stopped: %s is gone", self.root)
        except Exception:
            if not self._stopped.is_set():
                log.exception("kernel disk watcher stopped for %s", self.root)

    def _loop(self) -> None:
        start: FolderSizes = {}
        next_walk = 0.0
        limit = self._limit
        device = self.device = os.stat(self.root).st_dev
        poll = FS_POLL_S
        while True:
            if poll >= IDLE_POLL_MAX_S:  # idle and quiet: one thread of the process looks for us all
                _IDLE_WATCHES.add(self)
                try:
                    self._wake.wait(max(0.0, next_walk - time.monotonic()))
                finally:
                    _IDLE_WATCHES.discard(self)
            else:
                self._wake.wait(poll)
            self._wake.clear()
            if self._stopped.is_set():
                return
            if self._rebase.is_set():
                self._rebase.clear()
                limit = self.limit = self._limit
                self.fs_at_walk = self.fs_before = fs_used(self.root)
                t0 = time.monotonic()
                start = folder_sizes(self.root)
                self.grown = 0
                next_walk = time.monotonic() + _interval(time.monotonic() - t0)
                poll = FS_POLL_S
                self._rebased.set()
                continue
            fs_now = fs_used(self.root)
            idle = self._idle.is_set()
            poll = min(2 * poll, IDLE_POLL_MAX_S) if idle and not self.stirred(fs_now) else FS_POLL_S
            self.fs_before = fs_now
            if time.monotonic() < next_walk and fs_now - self.fs_at_walk <= limit - self.grown:
                continue
            self.fs_at_walk = fs_now
            t0 = time.monotonic()
            hidden = deleted_but_open(self._pids(), device)
            grown = growth(self.root, start, stop_above=limit - hidden, abandon=self._stopped.is_set) + hidden
            self.grown = grown
            if grown > limit and not self._stopped.is_set() and not self._rebase.is_set():
                self._on_exceeded(grown)
                return
            # Between runs nothing should write: walk rarely unless the filesystem says otherwise.
            cost = _interval(time.monotonic() - t0)
            next_walk = time.monotonic() + (max(IDLE_WALK_S, cost) if idle else cost)

    def stirred(self, fs_now: int) -> bool:
        """The filesystem grew by an eighth of the budget left since this watch last looked: look
        closely again (also called by the idle watches' thread, which only reads these numbers)."""
        return fs_now - self.fs_before > (self.limit - self.grown) / 8


class _IdleWatches:
    """The kernels' watches that are idle and quiet, looked after by one thread of the process: one
    statvfs per filesystem every IDLE_POLL_MAX_S for all of them (a thread per watch waking four times
    a second cost 0.05% of a core each), waking a watch whose filesystem stirred; the watch then looks
    closely itself, and comes back once quiet again. The thread ends when no watch is left."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watches: set[GrowthWatch] = set()
        self._looking = False

    def add(self, watch: GrowthWatch) -> None:
        with self._lock:
            self._watches.add(watch)
            if not self._looking:
                self._looking = True
                threading.Thread(target=self._look, name="kernel-disk-watch-idle", daemon=True).start()

    def discard(self, watch: GrowthWatch) -> None:
        with self._lock:
            self._watches.discard(watch)

    def _look(self) -> None:
        while True:
            time.sleep(IDLE_POLL_MAX_S)
            with self._lock:
                watches = list(self._watches)
                if not watches:
                    self._looking = False
                    return
            levels: dict[int, int] = {}
            for watch in watches:
                try:
                    if watch.device not in levels:
                        levels[watch.device] = fs_used(watch.root)
                    stirred = watch.stirred(levels[watch.device])
                except OSError:  # its folder is gone: let it find out itself
                    stirred = True
                if stirred:
                    watch.wake()


_IDLE_WATCHES = _IdleWatches()
