"""Which paths of the workdir a run touched, seen from the host with inotify.

The bookkeeping after a run (the caller's index of the folder) only needs to look at what changed;
listing a folder of 100k files to find one change costs a second here. gVisor's gofer, and the
sentry through host files the gofer opened for it, change the bind-mounted workdir with ordinary
host system calls, so the host kernel reports each create, write, attribute change, delete and
rename to an inotify watch on the directory holding the name.

Before the sandbox starts (so sandboxed code cannot race the setup), every directory already in the
workdir gets a watch. Events are drained every 50 ms during the run, so the kernel's queue
(fs.inotify.max_queued_events) does not overflow, and once more after every sandbox process has
exited.

The answer is the sorted set of relative paths named by events, or None for "unknown, list
everything": on a queue overflow, a watch that could not be added, a name that is not UTF-8, more
than MAX_PATHS paths (listing is then about as cheap), more than MAX_DIRS directories at setup, no
inotify, or any unexpected error. A superset is fine (a path that did not really change costs one
lstat); a missed path is not, so anything doubtful gives None.

Hard links are the limit of watching names: a write through one name of a file changes every other
name without an event naming them. A link that still exists at the end has a link count above 1
(the caller checks that on the paths it looks at). Two patterns could hide a link that no longer
exists, so they also give None: a directory created during the run (it has no watch, so a link
made and removed inside it is never seen) and a name created during the run and removed again.
A file that had several links before the run and is written through one name is the caller's to
check (the other names existed before, so the caller's own records show them).

Paths of a directory renamed during the run go stale (its watch keeps the old name), but every
path under its new name is covered: the rename named the new path, whose subtree the caller scans.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import errno
import logging
import os
import struct
import threading

log = logging.getLogger("code_sessions.runner")

MAX_PATHS = 5000  # distinct paths; beyond that a full listing is about as cheap as the lookups
MAX_DIRS = 20_000  # directories watched at setup (one kernel watch each, ~1 KiB of kernel memory)
DRAIN_S = 0.05

IN_MODIFY = 0x2
IN_ATTRIB = 0x4
IN_CLOSE_WRITE = 0x8
IN_MOVED_FROM = 0x40
IN_MOVED_TO = 0x80
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_UNMOUNT = 0x2000
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ISDIR = 0x40000000
IN_ONLYDIR = 0x01000000
IN_DONT_FOLLOW = 0x02000000
IN_EXCL_UNLINK = 0x04000000

# IN_CLOSE_WRITE as well as IN_MODIFY: a write through a shared mapping raises no IN_MODIFY, but the
# close of the host file (at the latest when the sandbox exits) raises IN_CLOSE_WRITE.
MASK = (
    IN_CREATE
    | IN_DELETE
    | IN_MODIFY
    | IN_ATTRIB
    | IN_CLOSE_WRITE
    | IN_MOVED_FROM
    | IN_MOVED_TO
    | IN_DELETE_SELF
    | IN_MOVE_SELF
    | IN_DONT_FOLLOW
    | IN_ONLYDIR
    | IN_EXCL_UNLINK
)
_ROOT_GONE = IN_DELETE_SELF | IN_MOVE_SELF | IN_UNMOUNT | IN_IGNORED

_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len; then len bytes of name
_READ_SIZE = 64 * 1024

# Filesystems whose directory link count is 2 + the number of subdirectories, so a directory with a
# link count of 2 has none and need not be listed (find(1)'s "leaf optimisation"). Elsewhere (btrfs
# reports 1, FUSE anything) every directory is listed.
_NLINK_COUNTS_SUBDIRS = {
    0xEF53,  # ext2/3/4
    0x01021994,  # tmpfs
    0x58465342,  # xfs
}


class _Libc:
    """inotify and statfs through ctypes: the standard library has no binding for them."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.init1 = libc.inotify_init1
        self.init1.argtypes = [ctypes.c_int]
        self.init1.restype = ctypes.c_int
        self.add_watch = libc.inotify_add_watch
        self.add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        self.add_watch.restype = ctypes.c_int
        self.statfs = libc.statfs
        self.statfs.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
        self.statfs.restype = ctypes.c_int


_libc: _Libc | None = None


def _lib() -> _Libc:
    global _libc
    if _libc is None:
        _libc = _Libc()
    return _libc


def _fs_type(path: bytes) -> int | None:
    # struct statfs starts with f_type (a long on every Linux ABI); the rest is not needed.
    buf = ctypes.create_string_buffer(256)
    if _lib().statfs(path, buf) != 0:
        return None
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


_closer: concurrent.futures.ThreadPoolExecutor | None = None
_closer_lock = threading.Lock()


def _close_soon(fd: int) -> None:
    """Close an inotify fd off the caller's thread: the kernel waits for an RCU grace period when
    an inotify instance is released (measured 8-15 ms here), which must not delay the run's result
    or block the event loop. Nothing waits for it."""
    global _closer
    try:
        with _closer_lock:
            if _closer is None:
                _closer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="inotify-close")
        _closer.submit(_close_quietly, fd)
    except RuntimeError:  # interpreter shutting down: close here
        _close_quietly(fd)


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


class _GiveUp(Exception):
    """The answer would be unknown: stop watching and report None."""


class ChangeWatch:
    """Watch a workdir for changes; `start()` before the sandbox, `pump()` during it, `finish()` after."""

    _fd = -1  # also a class attribute: __del__ may run on an instance whose __init__ failed

    def __init__(self, root: str, *, max_paths: int | None = None, max_dirs: int | None = None) -> None:
        self.root = root
        self.max_paths = MAX_PATHS if max_paths is None else max_paths
        self.max_dirs = MAX_DIRS if max_dirs is None else max_dirs
        self.why_unknown: str | None = None  # set once we gave up
        self._fd = -1
        self._root_wd = -1
        self._dirs: dict[int, str] = {}  # wd -> relative dir path ("" = the workdir)
        self._seen: set[tuple[int, bytes]] = set()  # (wd, name) of each event, names as the kernel gave them
        self._created: set[tuple[int, bytes]] = set()  # names created or moved in during the run

    @classmethod
    def start(cls, root: str, *, max_paths: int | None = None, max_dirs: int | None = None) -> ChangeWatch:
        """Set up the watches. Never raises: a failure makes the result unknown (None)."""
        watch = cls(root, max_paths=max_paths, max_dirs=max_dirs)
        try:
            watch._setup()
        except _GiveUp as exc:
            watch._give_up(str(exc))
        except Exception as exc:  # ctypes missing, odd filesystem...: the caller lists everything
            watch._give_up(f"{type(exc).__name__}: {exc}")
        return watch

    @property
    def active(self) -> bool:
        return self._fd >= 0

    def _setup(self) -> None:
        lib = _lib()
        fd = lib.init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            raise _GiveUp(f"inotify_init1: {os.strerror(ctypes.get_errno())}")
        self._fd = fd
        root = os.fsencode(self.root)
        leaf_ok = _fs_type(root) in _NLINK_COUNTS_SUBDIRS
        # A directories-only walk, never following symlinks; files are never stat-ed (d_type says
        # what an entry is), so a folder of 10k files in a few directories costs a few listings.
        stack: list[tuple[bytes, str, int]] = [(root, "", os.lstat(root).st_nlink)]
        while stack:
            path, rel, nlink = stack.pop()
            wd = lib.add_watch(fd, path, MASK)
            if wd < 0:
                err = ctypes.get_errno()
                if err == errno.ENOSPC:
                    raise _GiveUp("inotify watch limit reached (fs.inotify.max_user_watches)")
                raise _GiveUp(f"inotify_add_watch {rel or '.'}: {os.strerror(err)}")
            if wd in self._dirs:  # the same directory twice (a bind mount inside?): paths ambiguous
                raise _GiveUp(f"directory {rel} is watched twice")
            self._dirs[wd] = rel
            if not rel:
                self._root_wd = wd
            if len(self._dirs) > self.max_dirs:
                raise _GiveUp(f"more than {self.max_dirs} directories")
            if leaf_ok and nlink == 2:
                continue  # no subdirectories: no need to list its files
            with os.scandir(path) as entries:
                for entry in entries:
                    if not entry.is_dir(follow_symlinks=False):
                        continue
                    try:
                        name = entry.name.decode("utf-8")
                    except UnicodeDecodeError:
                        raise _GiveUp("a directory name is not valid UTF-8") from None
                    child_nlink = entry.stat(follow_symlinks=False).st_nlink if leaf_ok else 0
                    stack.append((entry.path, f"{rel}/{name}" if rel else name, child_nlink))

    def drain(self) -> None:
        """Read every queued event (non-blocking; called on the event loop, it is a few reads)."""
        if self._fd < 0:
            return
        try:
            while True:
                try:
                    data = os.read(self._fd, _READ_SIZE)
                except BlockingIOError:
                    return
                self._parse(data)
        except _GiveUp as exc:
            self._give_up(str(exc))
        except Exception as exc:
            self._give_up(f"{type(exc).__name__}: {exc}")

    def _parse(self, data: bytes) -> None:
        seen = self._seen
        created = self._created
        unpack = _EVENT.unpack_from
        offset, end = 0, len(data)
        while offset < end:
            wd, mask, _cookie, length = unpack(data, offset)
            offset += _EVENT.size
            name = data[offset : offset + length].rstrip(b"\0")
            offset += length
            if mask & IN_Q_OVERFLOW:
                raise _GiveUp("the inotify queue overflowed")
            if name:
                key = (wd, name)
                seen.add(key)
                if len(seen) > self.max_paths:
                    raise _GiveUp(f"more than {self.max_paths} paths changed")
                if mask & IN_CREATE and mask & IN_ISDIR:
                    raise _GiveUp("a folder was created (a hard link made and removed in it is not seen)")
                if mask & (IN_CREATE | IN_MOVED_TO):
                    created.add(key)
                elif mask & IN_MOVED_FROM:
                    created.discard(key)  # the file lives on under the name its IN_MOVED_TO gives
                elif mask & IN_DELETE and key in created:
                    raise _GiveUp("a name created during the run was removed (it may have been a hard link)")
            elif wd == self._root_wd and mask & _ROOT_GONE:
                raise _GiveUp("the workdir itself was moved or removed")
            # Other events without a name concern a watched directory itself: its own attributes
            # (not indexed), or its deletion or move, which its parent reports by name.

    async def pump(self) -> None:
        """Drain periodically until cancelled or until the answer is known to be unknown."""
        while self._fd >= 0:
            await asyncio.sleep(DRAIN_S)
            self.drain()

    def finish(self) -> tuple[str, ...] | None:
        """Final drain (call it once every sandbox process has exited), close, and the answer."""
        self.drain()
        self.close()
        return self._answer()

    def harvest(self) -> tuple[str, ...] | None:
        """The answer so far, and start over without closing (a persistent kernel: its watch stays
        for its whole life, so what happens between runs is seen too). After None the watch is
        closed: the caller sets up a new one before the next run."""
        self.drain()
        answer = self._answer()
        self._seen = set()
        self._created = set()
        return answer

    def _answer(self) -> tuple[str, ...] | None:
        if self.why_unknown is not None:
            return None
        paths: set[str] = set()
        for wd, raw in self._seen:
            base = self._dirs.get(wd)
            if base is None:
                self._give_up(f"an event for an unknown watch {wd}")
                return None
            try:
                name = raw.decode("utf-8")
            except UnicodeDecodeError:
                self._give_up("a changed name is not valid UTF-8")
                return None
            paths.add(f"{base}/{name}" if base else name)
        return tuple(sorted(paths))

    def _give_up(self, why: str) -> None:
        if self.why_unknown is None:
            self.why_unknown = why
            log.debug("changes of %s unknown: %s", self.root, why)
        self._seen.clear()
        self._created.clear()
        self.close()

    def close(self) -> None:
        """Idempotent; closing the inotify fd removes every watch at once."""
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            _close_soon(fd)

    def __del__(self) -> None:
        # A watch set up in a worker thread whose caller was cancelled must not leak its fd
        # (fs.inotify.max_user_instances is 128 per user).
        self.close()
