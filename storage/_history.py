"""A chat folder's history by message: the folder's state at the end of each answer, kept so that a
branch of the conversation (a regenerated or edited message) continues from the files of the message
it continues from. Pure file work, blocking: call it from a thread, holding the chat's lock.

Layout, inside the chat's saved-state folder (outside /mnt/data, ours alone):

    history/
      index.json          the head, the states kept, and every object's references and size
      states/<d>.json     one state: {message_id, saved_at, files: {path: [object, size, mtime_ns, mode]},
                          dirs: {path: mode}, imports: [[source, path], ...]}  (<d>: a digest of the id)
      objects/<id>        one version of one file, a private copy (a reflink where the disk has them)
      kernels/<d>/        the kernel's image for that state, written by the caller (opaque here)

A state never shares an inode with the live folder: code in the sandbox may write a file in place
(`open(p, 'r+')`, `mmap`), which would change a hard-linked copy. So a version is copied once, when it
is first seen, and every later state whose file is unchanged refers to the same object. "Unchanged"
is the file's inode, size, mtime and ctime all as recorded when it was copied or restored (the ctime
cannot be set back by the sandbox's code).

The head says which message's state the folder holds now, and whether it may have changed since that
state was saved (`dirty`); `restoring` marks a restore in progress, so a crash mid-way is finished by
the next restore rather than left half done.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import secrets
import shutil
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._fsops import DIR_FLAGS, Owner, copy_fd, fd_closing, remove_tree_at
from ._names import MAX_DEPTH, MAX_PATH_BYTES

FORMAT = 1
INDEX = "index.json"
HEAD = "head.json"
MAX_FILES = 100_000  # a state of more files than this is not kept (the quota's default is 5,000)
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_FICLONE = 0x40049409  # linux/fs.h: share the blocks of a file (XFS, Btrfs); ext4 refuses
_MAX_INDEX = 64 << 20
_RESTORE_TEMP = ".cs-restore-"

# path -> [object, inode, size, mtime_ns, ctime_ns]
Live = dict[str, list[Any]]


class HistoryError(Exception):
    """A state cannot be saved or restored; the message says why, for the user."""


@dataclass
class Index:
    head: str = ""  # the message whose state the folder holds ("": none recorded yet)
    dirty: bool = False  # the folder may have changed since that state was saved
    restoring: bool = False  # a restore of `head` began and did not finish
    live: Live = field(default_factory=dict)
    states: dict[str, float] = field(default_factory=dict)  # message id -> saved_at
    objects: dict[str, list[int]] = field(default_factory=dict)  # object -> [references, size]

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "live": self.live,
            "states": self.states,
            "objects": self.objects,
        }


@dataclass(frozen=True, slots=True)
class Saved:
    """One state saved: its files, what had to be copied for it, and the states dropped to make room."""

    message_id: str
    files: int
    copied_files: int
    copied_bytes: int
    history_bytes: int
    dropped: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Restored:
    """One state restored into the folder: what was copied back and what was removed."""

    message_id: str
    files: int
    copied_files: int
    removed: int


def digest(message_id: str) -> str:
    return hashlib.sha256(message_id.encode("utf-8", "surrogatepass")).hexdigest()[:32]


class History:
    """The history folder of one chat (`folder`, created on first save) and its live folder."""

    def __init__(self, folder: Path, live: Path, owner: Owner) -> None:
        self.folder = folder
        self.live_dir = live
        self.owner = owner

    # ------------------------------------------------------------------ reading

    def read_head(self) -> tuple[str, bool, bool]:
        """(message, dirty, restoring), from the head's own small file: read before every step."""
        try:
            with open(self.folder / HEAD, "rb") as fh:
                data = json.loads(fh.read(1 << 16))
            return str(data["head"]), bool(data["dirty"]), bool(data["restoring"])
        except FileNotFoundError:
            return "", (self.folder / INDEX).exists(), False
        except (OSError, ValueError, KeyError, TypeError):
            return "", True, False  # damaged: the folder may be anything, and belongs to no state

    def load(self) -> Index:
        head, dirty, restoring = self.read_head()
        try:
            with open(self.folder / INDEX, "rb") as fh:
                data = json.loads(fh.read(_MAX_INDEX))
        except FileNotFoundError:
            return Index(head, dirty, restoring)
        except (OSError, ValueError):
            return self._rebuilt_index()
        try:
            if data.get("format") != FORMAT:
                raise ValueError("format")
            return Index(
                head=head,
                dirty=dirty,
                restoring=restoring,
                live={str(k): list(v) for k, v in data["live"].items()},
                states={str(k): float(v) for k, v in data["states"].items()},
                objects={str(k): [int(v[0]), int(v[1])] for k, v in data["objects"].items()},
            )
        except (AttributeError, KeyError, TypeError, ValueError, IndexError):
            return self._rebuilt_index()

    def _rebuilt_index(self) -> Index:
        """A damaged index: the states on disk are read back (their objects recounted); the head is
        unknown, so the next save copies what it needs and nothing is restored over the live folder
        without a state of its own."""
        index = Index(dirty=True)
        for name in _listing(self.folder / "states"):
            state = self._read_state_file(self.folder / "states" / name)
            if state is None:
                continue
            index.states[state["message_id"]] = float(state.get("saved_at", 0.0))
            for obj, size, *_ in state["files"].values():
                ref = index.objects.setdefault(obj, [0, int(size)])
                ref[0] += 1
        return index

    def has_state(self, message_id: str) -> bool:
        return (self._state_path(message_id)).is_file()

    def kernel_dir(self, message_id: str) -> Path:
        """Where the kernel's image of a state lives (the caller writes it; made here, private)."""
        self._make_folder()
        folder = self.folder / "kernels" / digest(message_id)
        folder.parent.mkdir(mode=0o700, exist_ok=True)
        folder.mkdir(mode=0o700, exist_ok=True)
        return folder

    def kernel_of(self, message_id: str) -> Path | None:
        folder = self.folder / "kernels" / digest(message_id)
        return folder if (folder / "kernel").is_dir() else None

    def bytes_on_disk(self) -> int:
        total = 0
        for dirpath, _, names in os.walk(self.folder):
            for name in names:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(dirpath, name)).st_size
        return total

    # ------------------------------------------------------------------ the head

    def claim(self, message_id: str) -> None:
        """The folder is about to change for `message_id`'s answer: the head is its, and dirty."""
        head, dirty, restoring = self.read_head()
        if head == message_id and dirty and not restoring:
            return
        self._write_head(message_id, True, False)

    # ------------------------------------------------------------------ saving

    def save(
        self,
        message_id: str,
        imports: list[tuple[str, str]],
        *,
        keep_states: int,
        keep_kernels: int,
        room_bytes: int | None,
    ) -> Saved:
        """Record the live folder as `message_id`'s state (replacing an older one of it); then keep the
        newest `keep_states` states and the kernels of the newest `keep_kernels`, and drop the oldest
        while the history takes more than `room_bytes` (None: no bound), never the new one."""
        index = self.load()
        self._make_folder()
        objects = self.folder / "objects"
        objects.mkdir(mode=0o700, exist_ok=True)
        (self.folder / "states").mkdir(mode=0o700, exist_ok=True)
        files: dict[str, list[Any]] = {}
        dirs: dict[str, int] = {}
        live: Live = {}
        copied_files = copied_bytes = 0
        with fd_closing(os.open(objects, DIR_FLAGS)) as objects_fd:
            try:
                root = os.open(self.live_dir, DIR_FLAGS)
            except FileNotFoundError:
                root = -1
            if root >= 0:
                with fd_closing(root):
                    for path, st, parent, name in _walk(root):
                        if stat.S_ISDIR(st.st_mode):
                            dirs[path] = stat.S_IMODE(st.st_mode)
                            continue
                        signature = [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
                        before = index.live.get(path)
                        if before is not None and before[1:] == signature and before[0] in index.objects:
                            obj = before[0]
                        else:
                            obj = _copy_in(parent, name, st, objects_fd)
                            if obj is None:
                                continue  # gone, or not a regular file any more
                            copied_files += 1
                            copied_bytes += st.st_size
                            index.objects.setdefault(obj, [0, st.st_size])
                        files[path] = [obj, st.st_size, st.st_mtime_ns, stat.S_IMODE(st.st_mode)]
                        live[path] = [obj, *signature]
                        if len(files) > MAX_FILES:
                            raise HistoryError(f"the folder holds more than {MAX_FILES:,} files")
        saved_at = time.time()
        state = {
            "format": FORMAT,
            "message_id": message_id,
            "saved_at": saved_at,
            "files": files,
            "dirs": dirs,
            "imports": [list(pair) for pair in imports],
        }
        old = self._read_state(message_id) if message_id in index.states else None
        _write_json(self._state_path(message_id), state)
        for entry in files.values():
            index.objects[entry[0]][0] += 1
        if old is not None:
            self._release(index, old)
        index.states[message_id] = saved_at
        index.head, index.dirty, index.restoring, index.live = message_id, False, False, live
        dropped = self._prune(index, message_id, keep_states, keep_kernels, room_bytes)
        self._collect(index, objects)
        self._write_index(index)
        return Saved(
            message_id, len(files), copied_files, copied_bytes, self._history_bytes(index), tuple(dropped)
        )

    def drop_kernel(self, message_id: str) -> None:
        shutil.rmtree(self.folder / "kernels" / digest(message_id), ignore_errors=True)

    def _prune(
        self, index: Index, newest: str, keep_states: int, keep_kernels: int, room_bytes: int | None
    ) -> list[str]:
        order = sorted(index.states, key=lambda m: (index.states[m], m != newest))  # oldest first
        dropped: list[str] = []
        while len(order) > max(1, keep_states):
            dropped.append(order.pop(0))
        for message in dropped:
            self._drop_state(index, message)
        kept_kernels = [m for m in order if self.kernel_of(m) is not None]
        for message in kept_kernels[: max(0, len(kept_kernels) - keep_kernels)]:
            self.drop_kernel(message)
        if room_bytes is not None:
            while self._history_bytes(index) > room_bytes:
                with_kernel = [m for m in order if self.kernel_of(m) is not None]
                if with_kernel:  # a Python state costs more than a file state: they go first
                    self.drop_kernel(with_kernel[0])
                    continue
                if len(order) <= 1:
                    break
                message = order.pop(0)
                self._drop_state(index, message)
                dropped.append(message)
        return dropped

    def _drop_state(self, index: Index, message_id: str) -> None:
        state = self._read_state(message_id)
        if state is not None:
            self._release(index, state)
        index.states.pop(message_id, None)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._state_path(message_id))
        self.drop_kernel(message_id)

    @staticmethod
    def _release(index: Index, state: dict[str, Any]) -> None:
        for entry in state["files"].values():
            ref = index.objects.get(entry[0])
            if ref is not None:
                ref[0] -= 1

    def _collect(self, index: Index, objects: Path) -> None:
        """Remove the objects no state refers to (the live folder's versions are a state's too)."""
        in_live = {entry[0] for entry in index.live.values()}
        for obj, (refs, _size) in list(index.objects.items()):
            if refs <= 0 and obj not in in_live:
                del index.objects[obj]
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(objects / obj)

    def _history_bytes(self, index: Index) -> int:
        """What the history adds to the live folder: the versions the folder no longer holds, and
        the kernels' images."""
        in_live = {entry[0] for entry in index.live.values()}
        versions = sum(size for obj, (_refs, size) in index.objects.items() if obj not in in_live)
        kernels = 0
        for dirpath, _, names in os.walk(self.folder / "kernels"):
            for name in names:
                with contextlib.suppress(OSError):
                    kernels += os.lstat(os.path.join(dirpath, name)).st_size
        return versions + kernels

    # ------------------------------------------------------------------ restoring

    def begin_restore(self, message_id: str) -> dict[str, Any]:
        """The state of `message_id`, checked whole (every object present, of its size), with the
        head marked as restoring it. HistoryError when it cannot be restored."""
        state = self._read_state(message_id)
        if state is None:
            raise HistoryError("its saved files are no longer kept")
        objects = self.folder / "objects"
        for obj, size, *_ in state["files"].values():
            try:
                st = os.lstat(objects / obj)
            except OSError:
                raise HistoryError("its saved files are damaged (a version is missing)") from None
            if not stat.S_ISREG(st.st_mode) or st.st_size != size:
                raise HistoryError("its saved files are damaged (a version has another size)")
        self._write_head(message_id, True, True)
        return state

    def restore(self, message_id: str, state: dict[str, Any]) -> Restored:
        """Make the live folder hold exactly the state's files and folders (after begin_restore).
        Files already there unchanged stay; the rest is copied back from the objects."""
        index = self.load()
        wanted: dict[str, list[Any]] = state["files"]
        wanted_dirs: dict[str, int] = state["dirs"]
        keep_dirs = set(wanted_dirs)
        for path in wanted:
            parts = path.split("/")
            keep_dirs.update("/".join(parts[:i]) for i in range(1, len(parts)))
        live: Live = {}
        with (
            fd_closing(os.open(self.folder / "objects", DIR_FLAGS)) as objects_fd,
            fd_closing(os.open(self.live_dir, DIR_FLAGS)) as root,
        ):
            removed = _clear_live(root, "", 0, wanted, keep_dirs, index.live, live)
            for path in sorted(keep_dirs, key=lambda p: p.count("/")):
                with fd_closing(_make_dirs(root, path.split("/"), wanted_dirs.get(path, 0o755), self.owner)):
                    pass
            copied = 0
            for path, (obj, _size, mtime_ns, mode) in wanted.items():
                if path in live:
                    continue
                parts = path.split("/")
                with fd_closing(_make_dirs(root, parts[:-1], 0o755, self.owner)) as parent:
                    st = _copy_out(objects_fd, obj, parent, parts[-1], mode, mtime_ns, self.owner)
                live[path] = [obj, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
                copied += 1
        index = self.load()
        index.head, index.dirty, index.restoring, index.live = message_id, False, False, live
        self._write_index(index)
        return Restored(message_id, len(wanted), copied, removed)

    def restore_empty(self, message_id: str) -> Restored:
        """The folder as at the start of a chat: empty."""
        self._write_head(message_id, True, True)
        removed = 0
        with fd_closing(os.open(self.live_dir, DIR_FLAGS)) as root:
            for name in os.listdir(root):
                with contextlib.suppress(OSError):
                    remove_tree_at(root, name)
                    removed += 1
        index = self.load()
        index.head, index.dirty, index.restoring, index.live = message_id, False, False, {}
        self._write_index(index)
        return Restored(message_id, 0, 0, removed)

    def imports_of(self, state: dict[str, Any]) -> list[tuple[str, str]]:
        return [(str(s), str(p)) for s, p in state.get("imports", [])]

    # ------------------------------------------------------------------ helpers

    def _state_path(self, message_id: str) -> Path:
        return self.folder / "states" / f"{digest(message_id)}.json"

    def _read_state(self, message_id: str) -> dict[str, Any] | None:
        state = self._read_state_file(self._state_path(message_id))
        if state is None or state.get("message_id") != message_id:
            return None
        return state

    @staticmethod
    def _read_state_file(path: Path) -> dict[str, Any] | None:
        try:
            with open(path, "rb") as fh:
                state = json.loads(fh.read(_MAX_INDEX))
        except (OSError, ValueError):
            return None
        try:
            ok = (
                state.get("format") == FORMAT
                and isinstance(state.get("message_id"), str)
                and isinstance(state.get("files"), dict)
                and isinstance(state.get("dirs"), dict)
                and all(
                    _safe_path(p) and isinstance(v, list) and len(v) == 4 and _object_name(v[0])
                    for p, v in state["files"].items()
                )
                and all(_safe_path(p) and isinstance(m, int) for p, m in state["dirs"].items())
            )
        except (AttributeError, TypeError):
            return None
        return state if ok else None

    def _make_folder(self) -> None:
        # Its parent (the chat's saved-state folder) may not exist yet; both are ours alone.
        self.folder.parent.mkdir(mode=0o700, exist_ok=True)
        self.folder.mkdir(mode=0o700, exist_ok=True)

    def _write_index(self, index: Index) -> None:
        self._make_folder()
        _write_json(self.folder / INDEX, index.to_json())
        self._write_head(index.head, index.dirty, index.restoring)

    def _write_head(self, message_id: str, dirty: bool, restoring: bool) -> None:
        self._make_folder()
        _write_json(self.folder / HEAD, {"head": message_id, "dirty": dirty, "restoring": restoring})


def _safe_path(path: object) -> bool:
    """A relative path of plain components, as the state's own walk wrote it (a damaged or forged
    state could otherwise name a place outside the folder)."""
    if not isinstance(path, str) or not path or len(path.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES:
        return False
    parts = path.split("/")
    return len(parts) <= MAX_DEPTH and all(p not in ("", ".", "..") and "\0" not in p for p in parts)


def _object_name(name: object) -> bool:
    return isinstance(name, str) and len(name) == 24 and all(c in "0123456789abcdef" for c in name)


def _listing(folder: Path) -> list[str]:
    try:
        return os.listdir(folder)
    except FileNotFoundError:
        return []


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(tmp, _NEW, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh, separators=(",", ":"))
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _walk(fd: int, prefix: str = "", depth: int = 0) -> Iterator[tuple[str, os.stat_result, int, str]]:
    """(path, lstat, parent fd, name) of every folder and regular file under the folder `fd`, each
    folder before what it holds. Never follows a link; names that are not UTF-8 are skipped
    (reconcile renames them), and so is what lies deeper than MAX_DEPTH. One open folder per level."""
    try:
        names = sorted(os.listdir(fd))
    except OSError:
        return
    for name in names:
        if name.startswith(_RESTORE_TEMP) or not _utf8(name):
            continue
        st = _lstat(fd, name)
        if st is None:
            continue
        path = f"{prefix}{name}"
        if stat.S_ISREG(st.st_mode):
            yield path, st, fd, name
        elif stat.S_ISDIR(st.st_mode):
            yield path, st, fd, name
            if depth + 1 >= MAX_DEPTH:
                continue
            try:
                sub = os.open(name, DIR_FLAGS, dir_fd=fd)
            except OSError:
                continue
            with fd_closing(sub):
                yield from _walk(sub, f"{path}/", depth + 1)


def _utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _clear_live(
    fd: int,
    prefix: str,
    depth: int,
    wanted: dict[str, list[Any]],
    keep_dirs: set[str],
    before: Live,
    kept: Live,
) -> int:
    """Remove from the live folder `fd` what the state being restored does not hold (links, FIFOs,
    names that are not UTF-8 and folders it lacks included, never followed); note in `kept` the files
    that are already the state's version. Returns how many entries went."""
    removed = 0
    try:
        names = os.listdir(fd)
    except OSError:
        return removed
    for name in names:
        st = _lstat(fd, name)
        if st is None:
            continue
        path = f"{prefix}{name}"
        if not _utf8(name) or name.startswith(_RESTORE_TEMP):
            remove_tree_at(fd, name)
            removed += 1
        elif stat.S_ISDIR(st.st_mode):
            if path not in keep_dirs or depth + 1 >= MAX_DEPTH:
                remove_tree_at(fd, name)
                removed += 1
                continue
            try:
                sub = os.open(name, DIR_FLAGS, dir_fd=fd)
            except OSError:
                continue
            with fd_closing(sub):
                removed += _clear_live(sub, f"{path}/", depth + 1, wanted, keep_dirs, before, kept)
        else:
            entry, seen = wanted.get(path), before.get(path)
            if (
                entry is not None
                and stat.S_ISREG(st.st_mode)
                and seen is not None
                and seen[0] == entry[0]
                and seen[1:] == [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
            ):
                kept[path] = seen
            elif entry is None or not stat.S_ISREG(st.st_mode):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=fd)
                    removed += 1
    return removed


def _lstat(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None


def _clone_or_copy(src: int, dst: int) -> None:
    try:
        fcntl.ioctl(dst, _FICLONE, src)
        return
    except OSError as error:
        if error.errno not in (errno.EOPNOTSUPP, errno.EXDEV, errno.EINVAL, errno.ENOTTY, errno.EBADF):
            raise
    copy_fd(src, dst)


def _copy_in(parent: int, name: str, seen: os.stat_result, objects_fd: int) -> str | None:
    """A private copy of the live file `name` as a new object; None when it is gone or is no longer
    the regular file the walk saw."""
    try:
        src = os.open(name, _READ, dir_fd=parent)
    except OSError:
        return None
    with fd_closing(src):
        st = os.fstat(src)
        if not stat.S_ISREG(st.st_mode) or st.st_ino != seen.st_ino:
            return None
        obj = secrets.token_hex(12)
        dst = os.open(obj, _NEW, 0o400, dir_fd=objects_fd)
        try:
            with fd_closing(dst):
                _clone_or_copy(src, dst)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(obj, dir_fd=objects_fd)
            raise
    return obj


def _copy_out(
    objects_fd: int, obj: str, parent: int, name: str, mode: int, mtime_ns: int, owner: Owner
) -> os.stat_result:
    """Put the object back at `name` in the live folder: a new file beside it, renamed over it."""
    temp = f"{_RESTORE_TEMP}{secrets.token_hex(6)}"
    with fd_closing(os.open(obj, _READ, dir_fd=objects_fd)) as src:
        dst = os.open(temp, _NEW, 0o600, dir_fd=parent)
        try:
            with fd_closing(dst):
                _clone_or_copy(src, dst)
                if owner is not None and os.geteuid() == 0:
                    os.fchown(dst, owner[0], owner[1])
                os.fchmod(dst, mode & 0o777)
                os.utime(dst, ns=(mtime_ns, mtime_ns))
            st = _lstat(parent, name)
            if st is not None and stat.S_ISDIR(st.st_mode):
                remove_tree_at(parent, name)
            os.rename(temp, name, src_dir_fd=parent, dst_dir_fd=parent)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp, dir_fd=parent)
            raise
        done = _lstat(parent, name)
        assert done is not None
        return done


def _make_dirs(root: int, parts: list[str], mode: int, owner: Owner) -> int:
    """Open (making what is missing) the folder `parts` under root; a non-folder in the way goes."""
    fd = os.dup(root)
    for part in parts:
        try:
            sub = os.open(part, DIR_FLAGS, dir_fd=fd)
        except OSError as error:
            if error.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                os.close(fd)
                raise
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                os.unlink(part, dir_fd=fd)
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, mode & 0o777, dir_fd=fd)
            sub = os.open(part, DIR_FLAGS, dir_fd=fd)
            if owner is not None and os.geteuid() == 0:
                os.fchown(sub, owner[0], owner[1])
            os.fchmod(sub, mode & 0o777)
        os.close(fd)
        fd = sub
    return fd
