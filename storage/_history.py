"""A chat folder's history by message: the folder's state at the end of each answer, kept so that a
branch of the conversation (a regenerated or edited message) continues from the files of the message
it continues from. Pure file work, blocking: call it from a thread, holding the chat's lock
(storage/history.py's `ChatHistory` does, and turns an OSError into a StorageError).

Layout, inside the chat's saved-state folder (outside /mnt/data, ours alone):

    history/
      head.json           the head (below)
      states/<d>.json     one state (`State`): {format, parent, message_id, saved_at, files: {path:
                          [object, size, mtime_ns, mode, ino, ctime_ns]} (`FileRecord`), dirs: {path:
                          mode}, imports: [[source, path], ...]}  (<d>: a digest of the id; `parent`:
                          the message whose state the folder held when this message first changed it)
      objects/<id>        one version of one file, a private copy (a reflink where the disk has them)
      kernels/<d>/        the kernel's image for that state, written by the caller (opaque here)
      runs/<d>.jsonl      the records of that answer's runs (storage/_history_runs.py)

A state never shares an inode with the live folder: code in the sandbox may write a file in place
(`open(p, 'r+')`, `mmap`), which would change a hard-linked copy. So a version is copied once, when it
is first seen, and every later state whose file is unchanged refers to the same object. "Unchanged"
is the file's inode, size, mtime and ctime all as recorded when it was copied or restored (the ctime
cannot be set back by the sandbox's code).

The head says which message's state the folder holds now, and whether it may have changed since that
state was saved (`dirty`); `restoring` marks a restore in progress, so a crash mid-way is finished by
the next restore rather than left half done. The head's `parent` is the message whose state the
folder held when the head's message first changed it: states chain to the states they came from, so a
file that arrives late for one message (an upload link's) can tell whether the folder as it is now
descends from that message's state.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, replace
from json.encoder import encode_basestring_ascii
from pathlib import Path

from ._fsops import DIR_FLAGS, Owner, copy_fd, fd_closing, remove_tree_at
from ._names import MAX_DEPTH, MAX_PATH_BYTES, is_utf8
from .errors import FileExists, HistoryError

HEAD = "head.json"
STATS = "stats.json"
RUNS_DIR = "runs"  # the runs' records (storage/_history_runs.py): counted here, written there
# Dropped states whose objects are collected together (a collection reads every state's object list).
_COLLECT_EVERY = 5
MAX_FILES = 100_000  # a state of more files than this is not kept (the quota's default is 5,000)
_MAX_CHAIN = 10_000  # states walked up at most when a chain of parents is followed
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_FICLONE = 0x40049409  # linux/fs.h: share the blocks of a file (XFS, Btrfs); ext4 refuses


# ------------------------------------------------------------------ the records

FORMAT = 1
_MAX_STATE = 64 << 20
_OBJECT = re.compile(r"[0-9a-f]{24}")
_PLAIN_PATH = re.compile(r"[^/\0]+(?:/[^/\0]+)*")
_DOT_PART = re.compile(r"(?:^|/)\.\.?(?:/|$)")
# A state's file starts with its parent (see `State.encode`): read from its first bytes alone.
_PARENT = re.compile(rb'\{"format":1,"parent":("(?:[^"\\]|\\.)*")')
_PARENT_BYTES = 1 << 16


def digest(message_id: str) -> str:
    return hashlib.sha256(message_id.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def digest_name(name: str) -> bool:
    return len(name) == 32 and all(c in "0123456789abcdef" for c in name)


def object_name(name: object) -> bool:
    return isinstance(name, str) and _OBJECT.fullmatch(name) is not None


def safe_path(path: object) -> bool:
    """A relative path of plain components, as the state's own walk wrote it (a damaged or forged
    state could otherwise name a place outside the folder)."""
    return (
        isinstance(path, str)
        and _PLAIN_PATH.fullmatch(path) is not None
        and _DOT_PART.search(path) is None
        and path.count("/") < MAX_DEPTH
        and len(path.encode("utf-8", "surrogatepass")) <= MAX_PATH_BYTES
    )


@dataclass(frozen=True, slots=True)
class FileRecord:
    """One file of a state: its version (`obj`, a private copy under objects/), its size, mtime and
    mode, and the inode and ctime of the live file it was read from or restored to (0 when no live
    file is this version). In a state's file: the JSON array of the six, in this order."""

    obj: str
    size: int
    mtime_ns: int
    mode: int
    ino: int = 0
    ctime_ns: int = 0

    @classmethod
    def of(cls, obj: str, st: os.stat_result) -> FileRecord:
        """The record of the live file `st` whose version is `obj`."""
        return cls(obj, st.st_size, st.st_mtime_ns, stat.S_IMODE(st.st_mode), st.st_ino, st.st_ctime_ns)

    @classmethod
    def decode(cls, value: object) -> FileRecord | None:
        """The record a state's file holds, or None when it is not one (damaged, forged)."""
        if (
            not isinstance(value, list)
            or len(value) != 6
            or not object_name(value[0])
            or not all(isinstance(n, int) and not isinstance(n, bool) for n in value[1:])
        ):
            return None
        return cls(value[0], value[1], value[2], value[3], value[4], value[5])

    def encode(self) -> str:
        """The record as json.dumps writes it with separators (",", ":")."""
        return (
            f"[{encode_basestring_ascii(self.obj)},{self.size},{self.mtime_ns},{self.mode},{self.ino},"
            f"{self.ctime_ns}]"
        )

    def unchanged(self, st: os.stat_result) -> bool:
        """The live file is still the one this record describes: its size, mtime, inode and ctime
        (which the sandbox's code cannot set back) are as recorded."""
        return (self.size, self.mtime_ns, self.ino, self.ctime_ns) == (
            st.st_size,
            st.st_mtime_ns,
            st.st_ino,
            st.st_ctime_ns,
        )


@dataclass(frozen=True, slots=True)
class State:
    """One message's state: its files and folders, the chat's imports then, when it was saved, and the
    message whose state the folder held when this message first changed it (`parent`)."""

    message_id: str
    saved_at: float
    files: dict[str, FileRecord]
    dirs: dict[str, int]
    imports: tuple[tuple[str, str], ...] = ()
    parent: str = ""

    @classmethod
    def decode(cls, data: object) -> State | None:
        """A state read from its file, checked whole before its paths and objects name anything on disk
        (None: damaged, forged, or of another format)."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            return None
        message_id, saved_at = data.get("message_id"), data.get("saved_at")
        files, dirs = data.get("files"), data.get("dirs")
        if (
            not isinstance(message_id, str)
            or not isinstance(saved_at, int | float)
            or isinstance(saved_at, bool)
        ):
            return None
        if not isinstance(files, dict) or not isinstance(dirs, dict):
            return None
        records: dict[str, FileRecord] = {}
        for path, value in files.items():
            record = FileRecord.decode(value)
            if record is None or not safe_path(path):
                return None
            records[path] = record
        if not all(safe_path(p) and isinstance(m, int) and not isinstance(m, bool) for p, m in dirs.items()):
            return None
        imports = data.get("imports")
        pairs = tuple(
            (str(pair[0]), str(pair[1]))
            for pair in (imports if isinstance(imports, list) else ())
            if isinstance(pair, list) and len(pair) == 2
        )
        parent = data.get("parent", "")
        return cls(
            message_id, float(saved_at), records, dirs, pairs, parent if isinstance(parent, str) else ""
        )

    def encode(self, pieces: dict[str, str]) -> str:
        """The state's file, as json.dumps writes it with separators (",", ":"): the format first, then
        the parent (where `read_parent` finds it). `pieces`: each file's `"path":[record]` (the
        caller's, made or reused by `Pieces`)."""
        return (
            f'{{"format":{FORMAT},"parent":{encode_basestring_ascii(self.parent)},'
            f'"message_id":{encode_basestring_ascii(self.message_id)},"saved_at":{json.dumps(self.saved_at)},'
            f'"files":{{{",".join(pieces.values())}}},"dirs":{json.dumps(self.dirs, separators=(",", ":"))},'
            f'"imports":{json.dumps([list(pair) for pair in self.imports], separators=(",", ":"))}}}'
        )


def _piece(path: str, record: FileRecord) -> str:
    """One file's entry in a state's JSON."""
    return f"{encode_basestring_ascii(path)}:{record.encode()}"


@dataclass(frozen=True, slots=True)
class Head:
    """Which message's state the folder holds ("": none recorded yet); whether the folder may have
    changed since that state was saved; whether a restore of it began and did not finish; the state
    whose records say what the live folder's files are (`live`, a digest; "": none); and the message
    whose state the folder held when this message first changed it (`parent`; "": the start, or not
    known)."""

    message_id: str = ""
    dirty: bool = False
    restoring: bool = False
    live: str = ""
    parent: str = ""

    @classmethod
    def decode(cls, data: object) -> Head:
        """The head as its file holds it; a damaged one is a folder that may be anything (dirty)."""
        if not isinstance(data, dict):
            return cls(dirty=True)
        message_id, dirty, restoring = data.get("head"), data.get("dirty"), data.get("restoring")
        if not isinstance(message_id, str) or not isinstance(dirty, bool) or not isinstance(restoring, bool):
            return cls(dirty=True)
        live, parent = data.get("live", ""), data.get("parent", "")
        return cls(
            message_id,
            dirty,
            restoring,
            live if isinstance(live, str) and digest_name(live) else "",
            parent if isinstance(parent, str) else "",
        )

    def encode(self) -> bytes:
        fields = {
            "head": self.message_id,
            "dirty": self.dirty,
            "restoring": self.restoring,
            "live": self.live,
            "parent": self.parent,
        }
        return json.dumps(fields).encode()


@dataclass(slots=True)
class Stats:
    """What the history's objects take (`object_bytes`), the states dropped since the last collection
    (`uncollected`), the live folder's bytes at the last save or restore (`live_bytes`: what of the
    objects the user's files already count), and what the runs' records took then (`run_bytes`).
    Kept in `stats.json`; a count not recorded is None (counted from the disk when read)."""

    object_bytes: int = 0
    uncollected: int = 0
    live_bytes: int | None = None
    run_bytes: int | None = None

    @classmethod
    def decode(cls, data: object) -> Stats | None:
        if not isinstance(data, dict):
            return None
        objects, uncollected, live = data.get("object_bytes"), data.get("uncollected"), data.get("live_bytes")
        runs = data.get("run_bytes")
        if not isinstance(objects, int) or not isinstance(uncollected, int):
            return None
        return cls(
            objects,
            uncollected,
            live if isinstance(live, int) else None,
            runs if isinstance(runs, int) else None,
        )

    def encode(self) -> bytes:
        fields = {"object_bytes": self.object_bytes, "uncollected": self.uncollected}
        return json.dumps({**fields, "live_bytes": self.live_bytes, "run_bytes": self.run_bytes}).encode()

    @property
    def charge(self) -> int:
        """What the objects take beyond the live folder's own files, and the runs' records."""
        return max(0, self.object_bytes - (self.live_bytes or 0)) + (self.run_bytes or 0)


# ------------------------------------------------------------------ what this process remembers


@dataclass(frozen=True, slots=True)
class _Written:
    """The records of the state a chat wrote last in this process, with each record's JSON: the next
    save of that chat neither reads them back nor encodes again what did not change (of a state of
    10,000 files, ~25 ms of the ~65)."""

    state: str  # the digest whose file was written
    # That file's inode, size and ctime as written. Not its mtime, which is set to the state's age (a
    # restore writes the same again); the ctime of another write, here or in another worker, differs.
    identity: tuple[int, int, int]
    records: dict[str, FileRecord]
    pieces: dict[str, str]  # path -> '"path":[record]', as in the file


# At most this many records in all (~600 B each with its path: ~12 MB), the chats saved longest ago
# forgotten first; a larger state is not kept.
_CACHED_FILES = 20_000


def _identity(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_ino, st.st_size, st.st_ctime_ns


class _RecentStates:
    """What _Written holds, for the history folders this process wrote last."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_folder: OrderedDict[Path, _Written] = OrderedDict()

    def put(self, folder: Path, written: _Written | None) -> None:
        with self._lock:
            self._by_folder.pop(folder, None)
            if written is None or len(written.records) > _CACHED_FILES:
                return
            self._by_folder[folder] = written
            held = sum(len(w.records) for w in self._by_folder.values())
            while held > _CACHED_FILES:
                _, gone = self._by_folder.popitem(last=False)
                held -= len(gone.records)

    def get(self, folder: Path, state: str, path: Path) -> _Written | None:
        with self._lock:
            written = self._by_folder.get(folder)
        if written is None or written.state != state:
            return None
        try:
            return written if _identity(os.stat(path)) == written.identity else None
        except OSError:
            return None


_recent = _RecentStates()


# ------------------------------------------------------------------ one chat's history


@dataclass(frozen=True, slots=True)
class Saved:
    """One state saved: its files, what had to be copied for it, and what the history now takes."""

    message_id: str
    files: int
    copied_files: int
    copied_bytes: int
    history_bytes: int  # what the history takes on disk beyond the folder's own files
    dropped: int  # older states dropped to keep within the count and the room


@dataclass(frozen=True, slots=True)
class Restored:
    """One state restored into the folder: what was copied back and what was removed."""

    message_id: str
    files: int
    copied_files: int
    removed: int


class History:
    """The history folder of one chat (`folder`, created on first save) and its live folder.

    Files: `head.json` (the Head), `states/<d>.json` (one State), `states/<d>.objects` (its objects'
    names, one per line: what a collection reads), `objects/<name>`, `kernels/<d>/`, and `stats.json`
    (the Stats). A state's file records the live files' inodes and ctimes as of its save, or of its
    restore (a restore rewrites them): the next save compares the folder with the head's `live` state
    and copies only what is not as recorded there."""

    def __init__(self, folder: Path, live: Path, owner: Owner) -> None:
        self.folder = folder
        self.live_dir = live
        self.owner = owner

    # ------------------------------------------------------------------ the head

    def read_head(self) -> Head:
        """The head, from its own small file: read before every step."""
        try:
            with open(self.folder / HEAD, "rb") as fh:
                data = json.loads(fh.read(1 << 16))
        except FileNotFoundError:
            return Head(dirty=(self.folder / "states").exists())
        except (OSError, ValueError):
            return Head(dirty=True)  # damaged: the folder may be anything, and belongs to no state
        return Head.decode(data)

    def claim(self, message_id: str) -> None:
        """The folder is about to change for `message_id`'s answer: the head is its, and dirty."""
        head = self.read_head()
        if head.message_id == message_id and head.dirty and not head.restoring:
            return
        self._write_head(Head(message_id, True, False, head.live, _parent_for(head, message_id)))

    def has_state(self, message_id: str) -> bool:
        return self._state_path(message_id).is_file()

    def descends(self, message_id: str, ancestor: str) -> bool:
        """Whether the folder's state for `message_id` came, through the states it was made from, from
        `ancestor`'s (or is it). False when the chain is broken (a state no longer kept) before it."""
        head = self.read_head()
        current, seen = message_id, set[str]()
        while current and current not in seen and len(seen) < _MAX_CHAIN:
            if current == ancestor:
                return True
            seen.add(current)
            current = head.parent if current == head.message_id else read_parent(self._state_path(current))
        return False

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

    def drop_kernel(self, message_id: str) -> None:
        shutil.rmtree(self.folder / "kernels" / digest(message_id), ignore_errors=True)

    def bytes_on_disk(self) -> int:
        return tree_bytes(self.folder)

    # ------------------------------------------------------------------ saving

    def save(
        self,
        message_id: str,
        imports: list[tuple[str, str]],
        *,
        keep_states: int,
        keep_kernels: int,
    ) -> Saved:
        """Record the live folder as `message_id`'s state (replacing an older one of it); then keep the
        newest `keep_states` states and the kernels of the newest `keep_kernels`. (What all of a
        user's states may take together is bounded across their chats: storage/history.py.)"""
        head = self.read_head()
        known, pieces = self._live_records(head)
        self._make_folder()
        stats = self._read_stats()
        objects = self.folder / "objects"
        objects.mkdir(mode=0o700, exist_ok=True)
        (self.folder / "states").mkdir(mode=0o700, exist_ok=True)
        files: dict[str, FileRecord] = {}
        dirs: dict[str, int] = {}
        copied_files = copied_bytes = live_bytes = 0
        with fd_closing(os.open(objects, DIR_FLAGS)) as objects_fd:
            try:
                root = os.open(self.live_dir, DIR_FLAGS)
            except FileNotFoundError:
                root = -1
            if root >= 0:
                with fd_closing(root):
                    for path, st, parent, name in walk(root):
                        if stat.S_ISDIR(st.st_mode):
                            dirs[path] = stat.S_IMODE(st.st_mode)
                            continue
                        was = known.get(path)
                        if was is not None and was.unchanged(st):  # and so its mode, which sets the ctime
                            files[path] = was
                        else:
                            made = _copy_in(parent, name, st, objects_fd)
                            if made is None:
                                continue  # gone, or not a regular file any more
                            copied_files += 1
                            copied_bytes += st.st_size
                            files[path] = FileRecord.of(made, st)
                        live_bytes += st.st_size
                        if len(files) > MAX_FILES:
                            raise HistoryError(f"the folder holds more than {MAX_FILES:,} files")
        origin = _parent_for(head, message_id)
        state = State(message_id, time.time(), files, dirs, tuple(imports), origin)
        self._write_state(state, known=(known, pieces))
        self._write_head(Head(message_id, False, False, digest(message_id), origin))
        stats.object_bytes += copied_bytes
        dropped = self._prune(message_id, keep_states, keep_kernels, stats)
        stats.live_bytes = live_bytes
        stats.run_bytes = tree_bytes(self.folder / RUNS_DIR)  # the runs recorded since the last save
        self._write_stats(stats)
        return Saved(message_id, len(files), copied_files, copied_bytes, self._charge(stats), dropped)

    def _prune(self, newest: str, keep_states: int, keep_kernels: int, stats: Stats) -> int:
        """Drop the states beyond `keep_states` (oldest first) and the kernels beyond `keep_kernels`;
        objects no state needs go at a collection, which runs once enough states went (its cost is
        shared by them)."""
        order = self._states_oldest_first(newest)
        dropped = [order.pop(0)[1] for _ in range(max(0, len(order) - max(1, keep_states)))]
        with_kernel = [d for _, d in order if (self.folder / "kernels" / d / "kernel").is_dir()]
        for d in with_kernel[: max(0, len(with_kernel) - keep_kernels)]:
            shutil.rmtree(self.folder / "kernels" / d, ignore_errors=True)
        for d in dropped:
            self._drop(d)
        stats.uncollected += len(dropped)
        if stats.uncollected >= _COLLECT_EVERY:
            self._collect(stats)
        return len(dropped)

    # ------------------------------------------------------------------ what the states take

    def charge(self) -> int:
        """What the states take beyond the folder's own files (what the user's storage counts them as):
        the versions the folder did not have at its last save, each once, the Python states, and the
        runs' records."""
        return self._charge(self._read_stats())

    def _charge(self, stats: Stats) -> int:
        return stats.charge + tree_bytes(self.folder / "kernels")

    def sheddable(self) -> list[tuple[float, str, bool]]:
        """(age, digest, has a Python state) of every state kept, oldest first."""
        return [
            (mtime, d, (self.folder / "kernels" / d / "kernel").is_dir())
            for mtime, d in sorted(self._states_oldest_first(""))
        ]

    def shed(self, state: str, *, python_only: bool) -> int:
        """Drop one state (a digest), or only its Python state; returns the charge left. Objects no
        state needs are collected at once: the room is short."""
        if python_only:
            shutil.rmtree(self.folder / "kernels" / state, ignore_errors=True)
            return self.charge()
        stats = self._read_stats()
        self._drop(state)
        self._collect(stats)
        self._write_stats(stats)
        return self._charge(stats)

    def _states_oldest_first(self, newest: str) -> list[tuple[float, str]]:
        found = []
        newest_digest = digest(newest)
        for name in listing(self.folder / "states"):
            if not name.endswith(".json") or not digest_name(name[:-5]):
                continue
            with contextlib.suppress(OSError):
                st = os.lstat(self.folder / "states" / name)
                found.append((st.st_mtime, name[:-5]))
        return sorted(found, key=lambda item: (item[1] == newest_digest, item[0]))

    def _drop(self, state: str) -> None:
        for suffix in (".json", ".objects"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.folder / "states" / f"{state}{suffix}")
        shutil.rmtree(self.folder / "kernels" / state, ignore_errors=True)

    def _collect(self, stats: Stats) -> None:
        """Remove the objects no state refers to, and count exactly what the rest take."""
        wanted: set[str] = set()
        for name in listing(self.folder / "states"):
            if name.endswith(".objects"):
                path = self.folder / "states" / name
                with contextlib.suppress(OSError), open(path, encoding="ascii") as fh:
                    wanted.update(line.strip() for line in fh)
        objects = self.folder / "objects"
        total = 0
        for name in listing(objects):
            if name in wanted:
                with contextlib.suppress(OSError):
                    total += os.lstat(objects / name).st_size
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(objects / name)
        stats.object_bytes, stats.uncollected = total, 0

    # ------------------------------------------------------------------ a file for a saved state

    def add_file(self, message_id: str, path: str, src: int) -> None:
        """Put the open regular file `src` into `message_id`'s saved state at `path`, leaving the live
        folder alone: a file that belongs to that message (an upload through the link it offered)
        while the folder holds another branch. HistoryError when the state is no longer kept;
        FileExists when the state has something at that path (a file is never replaced)."""
        state = self._read_state(message_id)
        if state is None:
            raise HistoryError("its saved files are no longer kept")
        parts = path.split("/")
        above = ["/".join(parts[:i]) for i in range(1, len(parts))]
        taken = path in state.files or path in state.dirs or any(p in state.files for p in above)
        if not safe_path(path) or taken:
            raise FileExists(
                f"/mnt/data/{path} exists already in the files of the message that offered the link; an "
                "upload never replaces a file"
            )
        st = os.fstat(src)
        objects = self.folder / "objects"
        objects.mkdir(mode=0o700, exist_ok=True)
        with fd_closing(os.open(objects, DIR_FLAGS)) as objects_fd:
            obj = copy_file(src, objects_fd)
        # No live file is this version: the inode and ctime match none, so a save copies it afresh.
        record = FileRecord(obj, st.st_size, st.st_mtime_ns, stat.S_IMODE(st.st_mode))
        stats = self._read_stats()
        self._write_state(replace(state, files={**state.files, path: record}))
        stats.object_bytes += st.st_size
        self._write_stats(stats)

    def add_live_file(self, message_id: str, path: str) -> None:
        """`add_file` with the live folder's file at `path` (a file that arrived on a branch that
        descends from `message_id`'s state, and belongs to that state too)."""
        with (
            fd_closing(os.open(self.live_dir, DIR_FLAGS)) as root,
            fd_closing(open_live_file(root, path)) as src,
        ):
            self.add_file(message_id, path, src)

    # ------------------------------------------------------------------ a state from another chat

    def state_of(self, message_id: str) -> State | None:
        """`message_id`'s state, checked whole (None: not kept, damaged or forged)."""
        return self._read_state(message_id)

    def objects_folder(self) -> Path:
        """The folder of the versions (made, with the states' folder, if missing)."""
        self._make_folder()
        objects = self.folder / "objects"
        objects.mkdir(mode=0o700, exist_ok=True)
        (self.folder / "states").mkdir(mode=0o700, exist_ok=True)
        return objects

    def put_state(self, state: State) -> None:
        """Record a state whose versions the caller put into `objects_folder()`: a state copied from
        another chat's history (storage/_history_import.py), once, into a chat with no state of its
        own yet. What the objects take is counted again from the disk (a collection finds them)."""
        self._write_state(state)
        stats = self._read_stats()
        self._collect(stats)
        self._write_stats(stats)

    # ------------------------------------------------------------------ restoring

    def begin_restore(self, message_id: str) -> State:
        """The state of `message_id`, checked whole (every object present, of its size), with the
        head marked as restoring it. HistoryError when it cannot be restored."""
        state = self._read_state(message_id)
        if state is None:
            raise HistoryError("its saved files are no longer kept")
        objects = self.folder / "objects"
        for record in state.files.values():
            try:
                st = os.lstat(objects / record.obj)
            except OSError:
                raise HistoryError("its saved files are damaged (a version is missing)") from None
            if not stat.S_ISREG(st.st_mode) or st.st_size != record.size:
                raise HistoryError("its saved files are damaged (a version has another size)")
        head = self.read_head()
        self._write_head(Head(message_id, True, True, head.live, state.parent))
        return state

    def restore(self, state: State) -> Restored:
        """Make the live folder hold exactly the state's files and folders (after begin_restore).
        Files already there as the head's live records say, with the state's version, stay; the rest
        is copied back from the objects. The state's records then describe the live files."""
        head = self.read_head()
        known, _ = self._live_records(head)
        keep_dirs = set(state.dirs)
        for path in state.files:
            parts = path.split("/")
            keep_dirs.update("/".join(parts[:i]) for i in range(1, len(parts)))
        kept: dict[str, FileRecord] = {}
        with (
            fd_closing(os.open(self.folder / "objects", DIR_FLAGS)) as objects_fd,
            fd_closing(os.open(self.live_dir, DIR_FLAGS)) as root,
        ):
            removed = _clear_live(root, "", 0, state.files, keep_dirs, known, kept)
            for path in sorted(keep_dirs, key=lambda p: p.count("/")):
                with fd_closing(_make_dirs(root, path.split("/"), state.dirs.get(path, 0o755), self.owner)):
                    pass
            copied = 0
            files: dict[str, FileRecord] = {}
            for path, record in state.files.items():
                live = kept.get(path)
                if live is not None:
                    files[path] = replace(record, ino=live.ino, ctime_ns=live.ctime_ns)
                    continue
                parts = path.split("/")
                with fd_closing(_make_dirs(root, parts[:-1], 0o755, self.owner)) as parent:
                    st = _copy_out(objects_fd, record, parent, parts[-1], self.owner)
                files[path] = FileRecord(
                    record.obj, st.st_size, st.st_mtime_ns, record.mode, st.st_ino, st.st_ctime_ns
                )
                copied += 1
        self._write_state(replace(state, files=files))
        self._write_head(Head(state.message_id, False, False, digest(state.message_id), state.parent))
        self._note_live_bytes(sum(record.size for record in files.values()))
        return Restored(state.message_id, len(state.files), copied, removed)

    def restore_empty(self, message_id: str) -> Restored:
        """The folder as at the start of a chat: empty."""
        head = self.read_head()
        self._write_head(Head(message_id, True, True, head.live))
        removed = 0
        with fd_closing(os.open(self.live_dir, DIR_FLAGS)) as root:
            for name in os.listdir(root):
                with contextlib.suppress(OSError):
                    remove_tree_at(root, name)
                    removed += 1
        self._write_head(Head(message_id, True, False, ""))
        self._note_live_bytes(0)
        return Restored(message_id, 0, 0, removed)

    # ------------------------------------------------------------------ files of the history

    def _state_path(self, message_id: str) -> Path:
        return self.folder / "states" / f"{digest(message_id)}.json"

    def _read_state(self, message_id: str) -> State | None:
        state = read_state(self._state_path(message_id))
        if state is None or state.message_id != message_id:
            return None
        return state

    def _live_records(self, head: Head) -> tuple[dict[str, FileRecord], dict[str, str]]:
        """The records of the state (the head's `live`) the live folder's files are described by, and
        their JSON where this process wrote that state last (else read back from its file, no JSON)."""
        if not head.live:
            return {}, {}
        path = self.folder / "states" / f"{head.live}.json"
        written = _recent.get(self.folder, head.live, path)
        if written is not None:
            return written.records, written.pieces
        return _records(path), {}

    def _write_state(
        self, state: State, *, known: tuple[dict[str, FileRecord], dict[str, str]] = ({}, {})
    ) -> None:
        """Write a state's file (and its list of objects). `known`: the records of the state the save
        compared with, and their JSON where this process has it: a record of the state that is the very
        same is written as it was."""
        records, pieces = known
        new_pieces = {}
        for name, record in state.files.items():
            piece = pieces.get(name)
            if piece is None or records.get(name) is not record:
                piece = _piece(name, record)
            new_pieces[name] = piece
        d = digest(state.message_id)
        names = "".join(f"{record.obj}\n" for record in state.files.values())
        write_bytes(self.folder / "states" / f"{d}.objects", names.encode("ascii"))
        path = self.folder / "states" / f"{d}.json"
        _recent.put(self.folder, None)  # written or not, what this process held is no longer the file
        write_bytes(path, state.encode(new_pieces).encode())
        # The file's mtime is the state's age, which pruning orders by: a restore rewrites the file (the
        # live files' new inodes) without making the state any newer.
        os.utime(path, (state.saved_at, state.saved_at))
        _recent.put(self.folder, _Written(d, _identity(os.stat(path)), state.files, new_pieces))

    def _make_folder(self) -> None:
        # Its parent (the chat's saved-state folder) may not exist yet; both are ours alone.
        self.folder.parent.mkdir(mode=0o700, exist_ok=True)
        self.folder.mkdir(mode=0o700, exist_ok=True)

    def _write_head(self, head: Head) -> None:
        self._make_folder()
        write_bytes(self.folder / HEAD, head.encode())

    def _read_stats(self) -> Stats:
        try:
            with open(self.folder / STATS, "rb") as fh:
                stats = Stats.decode(json.loads(fh.read(1 << 16)))
        except (OSError, ValueError):
            stats = None
        if stats is None:
            stats = Stats()
            self._collect(stats)  # lost or damaged: counted again from the disk
        if stats.live_bytes is None:  # not recorded (an older history, a damaged file): as it is now
            stats.live_bytes = tree_bytes(self.live_dir)
        if stats.run_bytes is None:
            stats.run_bytes = tree_bytes(self.folder / RUNS_DIR)
        return stats

    def _note_live_bytes(self, live_bytes: int) -> None:
        stats = self._read_stats()
        stats.live_bytes = live_bytes
        self._write_stats(stats)

    def note_run_bytes(self, run_bytes: int) -> None:
        """What the runs' records take now (storage/_history_runs.py), counted before the next save."""
        stats = self._read_stats()
        stats.run_bytes = run_bytes
        self._write_stats(stats)

    def _write_stats(self, stats: Stats) -> None:
        write_bytes(self.folder / STATS, stats.encode())


def _parent_for(head: Head, message_id: str) -> str:
    """The parent of `message_id`'s state when it changes the folder the head describes: the head's
    own parent when it is the head already, else the head's message (the state the folder held)."""
    return head.parent if head.message_id == message_id else head.message_id


def read_state(path: Path) -> State | None:
    """A state's file, checked whole (None: missing, damaged or forged)."""
    try:
        with open(path, "rb") as fh:
            return State.decode(json.loads(fh.read(_MAX_STATE)))
    except (OSError, ValueError):
        return None


def read_parent(path: Path) -> str:
    """The parent a state records, read from the first bytes of its file ("" when not known)."""
    try:
        with open(path, "rb") as fh:
            found = _PARENT.match(fh.read(_PARENT_BYTES))
    except OSError:
        return ""
    if found is None:
        return ""
    try:
        parent = json.loads(found.group(1))
    except ValueError:
        return ""
    return parent if isinstance(parent, str) else ""


def _records(path: Path) -> dict[str, FileRecord]:
    """The file records of a state, read only to tell which live files are unchanged: a record that is
    not well formed is no record (its file is then copied again)."""
    try:
        with open(path, "rb") as fh:
            files = json.loads(fh.read(_MAX_STATE)).get("files")
    except (OSError, ValueError, AttributeError):
        return {}
    if not isinstance(files, dict):
        return {}
    found = {}
    for path_in_state, value in files.items():
        record = FileRecord.decode(value)
        if record is not None:
            found[path_in_state] = record
    return found


# ------------------------------------------------------------------ the file work
#
# Walking the live folder without following links, copying a version in as a private object (a reflink
# where the disk has them) and out into the live folder, clearing what a restored state does not have.
# File descriptors relative to open folders throughout, so a folder swapped for a link mid-way is never
# followed.


def listing(folder: Path) -> list[str]:
    try:
        return os.listdir(folder)
    except FileNotFoundError:
        return []


def write_bytes(path: Path, data: bytes) -> None:
    """Write a file of the history whole: a new file renamed over the old one."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(tmp, _NEW, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def tree_bytes(folder: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(folder):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def walk(fd: int, prefix: str = "", depth: int = 0) -> Iterator[tuple[str, os.stat_result, int, str]]:
    """(path, lstat, parent fd, name) of every folder and regular file under the folder `fd`, each
    folder before what it holds. Never follows a link; names that are not UTF-8 are skipped
    (reconcile renames them), and so is what lies deeper than MAX_DEPTH. One open folder per level."""
    try:
        names = os.listdir(fd)
    except OSError:
        return
    for name in names:
        st = _lstat(fd, name)
        if st is None:
            continue
        if not name.isascii() and not is_utf8(name):
            continue
        path = f"{prefix}{name}"
        if stat.S_ISREG(st.st_mode):
            yield path, st, fd, name
        elif stat.S_ISDIR(st.st_mode):
            yield path, st, fd, name
            if depth + 1 >= MAX_DEPTH:
                continue
            sub = _open_folder(fd, name)
            if sub is not None:
                with fd_closing(sub):
                    yield from walk(sub, f"{path}/", depth + 1)


def _open_folder(fd: int, name: str) -> int | None:
    """The folder `name` of the folder `fd`, opened without following a link; None when it cannot be
    (gone meanwhile, or a link or a file by now)."""
    try:
        return os.open(name, DIR_FLAGS, dir_fd=fd)
    except OSError:
        return None


def _clear_live(
    fd: int,
    prefix: str,
    depth: int,
    wanted: dict[str, FileRecord],
    keep_dirs: set[str],
    before: dict[str, FileRecord],
    kept: dict[str, FileRecord],
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
        if not is_utf8(name):
            remove_tree_at(fd, name)
            removed += 1
        elif stat.S_ISDIR(st.st_mode):
            if path not in keep_dirs or depth + 1 >= MAX_DEPTH:
                remove_tree_at(fd, name)
                removed += 1
                continue
            sub = _open_folder(fd, name)
            if sub is not None:
                with fd_closing(sub):
                    removed += _clear_live(sub, f"{path}/", depth + 1, wanted, keep_dirs, before, kept)
        else:
            entry, seen = wanted.get(path), before.get(path)
            if (
                entry is not None
                and stat.S_ISREG(st.st_mode)
                and seen is not None
                and seen.obj == entry.obj
                and seen.unchanged(st)
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
        return copy_file(src, objects_fd)


def copy_file(src: int, objects_fd: int) -> str:
    """A private copy of the open regular file `src` as a new object; returns its name."""
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


def open_live_file(root: int, path: str) -> int:
    """The regular file at `path` under the folder `root`, opened for reading without following a link
    anywhere on the way. OSError when it is not there or is not a regular file."""
    parts = path.split("/")
    fd = os.dup(root)
    try:
        for part in parts[:-1]:
            sub = os.open(part, DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = sub
        src = os.open(parts[-1], _READ, dir_fd=fd)
    finally:
        os.close(fd)
    if not stat.S_ISREG(os.fstat(src).st_mode):
        os.close(src)
        raise OSError(errno.EINVAL, f"{path} is not a regular file")
    return src


def _copy_out(objects_fd: int, record: FileRecord, parent: int, name: str, owner: Owner) -> os.stat_result:
    """Put the record's version back at `name` in the live folder, in place of what is there. Written
    straight at its name, with no temporary name beside it: every name in the folder is one the user's
    code can write too, so a scratch name there could be (and would be taken for) a user's file. A
    restore cut short leaves the head `restoring`, and the next restore copies what is not as recorded."""
    with fd_closing(os.open(record.obj, _READ, dir_fd=objects_fd)) as src:
        for _ in range(3):
            st = _lstat(parent, name)
            if st is not None:
                if stat.S_ISDIR(st.st_mode):
                    remove_tree_at(parent, name)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name, dir_fd=parent)
            try:
                dst = os.open(name, _NEW, 0o600, dir_fd=parent)
                break
            except FileExistsError:  # made again between the unlink and the open
                continue
        else:
            raise OSError(errno.EEXIST, f"{name} keeps being made again while it is restored")
        try:
            with fd_closing(dst):
                _clone_or_copy(src, dst)
                if owner is not None and os.geteuid() == 0:
                    os.fchown(dst, owner[0], owner[1])
                os.fchmod(dst, record.mode & 0o777)
                os.utime(dst, ns=(record.mtime_ns, record.mtime_ns))
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=parent)
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
