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
import hashlib
import json
import os
import shutil
import stat
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii
from pathlib import Path
from typing import Any

from ._fsops import DIR_FLAGS, Owner, fd_closing, remove_tree_at
from ._history_files import (
    clear_live,
    copy_in,
    copy_out,
    digest_name,
    listing,
    make_dirs,
    object_name,
    safe_path,
    tree_bytes,
    unchanged,
    walk,
    write_bytes,
)

FORMAT = 1
HEAD = "head.json"
STATS = "stats.json"
# Dropped states whose objects are collected together (a collection reads every state's object list).
_COLLECT_EVERY = 5
MAX_FILES = 100_000  # a state of more files than this is not kept (the quota's default is 5,000)
_MAX_STATE = 64 << 20
# The records of the state each of the last chats wrote, with each record's JSON: the next save of that
# chat neither reads them back nor encodes again what did not change (of a state of 10,000 files, ~25 ms
# of the ~65). At most _CACHED_FILES records in all (~600 B each with its path: ~12 MB), the chats
# saved longest ago forgotten first; a larger state is not kept.
_CACHED_FILES = 20_000


@dataclass(frozen=True, slots=True)
class _Written:
    state: str  # the digest whose file was written
    # That file's inode, size and ctime as written. Not its mtime, which is set to the state's age (a
    # restore writes the same again); the ctime of another write, here or in another worker, differs.
    identity: tuple[int, int, int]
    records: dict[str, list[Any]]
    pieces: dict[str, str]  # path -> '"path":[record]', as in the file


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


def _piece(path: str, record: list[Any]) -> str:
    """One file's entry in a state's JSON, as json.dumps with separators (",", ":") writes it."""
    obj, size, mtime_ns, mode, ino, ctime_ns = record
    return (
        f"{encode_basestring_ascii(path)}:[{encode_basestring_ascii(obj)},{int(size)},{int(mtime_ns)},"
        f"{int(mode)},{int(ino)},{int(ctime_ns)}]"
    )


class HistoryError(Exception):
    """A state cannot be saved or restored; the message says why, for the user."""


@dataclass(frozen=True, slots=True)
class Head:
    """Which message's state the folder holds ("": none recorded yet); whether the folder may have
    changed since that state was saved; whether a restore of it began and did not finish; and the
    state whose records say what the live folder's files are (`live`, a digest; "": none)."""

    message_id: str = ""
    dirty: bool = False
    restoring: bool = False
    live: str = ""


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


def digest(message_id: str) -> str:
    return hashlib.sha256(message_id.encode("utf-8", "surrogatepass")).hexdigest()[:32]


class History:
    """The history folder of one chat (`folder`, created on first save) and its live folder.

    Files: `head.json` (the Head), `states/<d>.json` (one state: its files with each one's object,
    size, mtime, mode, and the inode and ctime of the live file it was read from), `states/<d>.objects`
    (its objects' names, one per line: what a collection reads), `objects/<name>`, `kernels/<d>/`,
    and `stats.json` (the bytes the objects take, and how many states were dropped since the last
    collection). A state's file records the live files' inodes and ctimes as of its save, or of its
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
            live = data.get("live", "")
            return Head(
                str(data["head"]),
                bool(data["dirty"]),
                bool(data["restoring"]),
                live if isinstance(live, str) and digest_name(live) else "",
            )
        except FileNotFoundError:
            return Head(dirty=(self.folder / "states").exists())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return Head(dirty=True)  # damaged: the folder may be anything, and belongs to no state

    def claim(self, message_id: str) -> None:
        """The folder is about to change for `message_id`'s answer: the head is its, and dirty."""
        head = self.read_head()
        if head.message_id == message_id and head.dirty and not head.restoring:
            return
        self._write_head(Head(message_id, True, False, head.live))

    def has_state(self, message_id: str) -> bool:
        return self._state_path(message_id).is_file()

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
        room_bytes: int | None,
    ) -> Saved:
        """Record the live folder as `message_id`'s state (replacing an older one of it); then keep the
        newest `keep_states` states and the kernels of the newest `keep_kernels`, and drop the oldest
        while the history takes more than `room_bytes` (None: no bound), never the new one."""
        head = self.read_head()
        known, pieces = self._live_records(head)
        self._make_folder()
        stats = self._read_stats()
        objects = self.folder / "objects"
        objects.mkdir(mode=0o700, exist_ok=True)
        (self.folder / "states").mkdir(mode=0o700, exist_ok=True)
        files: dict[str, list[Any]] = {}
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
                        if was is not None and unchanged(was, st):  # and so its mode, which sets the ctime
                            files[path] = was
                        else:
                            made = copy_in(parent, name, st, objects_fd)
                            if made is None:
                                continue  # gone, or not a regular file any more
                            copied_files += 1
                            copied_bytes += st.st_size
                            mode = stat.S_IMODE(st.st_mode)
                            files[path] = [made, st.st_size, st.st_mtime_ns, mode, st.st_ino, st.st_ctime_ns]
                        live_bytes += st.st_size
                        if len(files) > MAX_FILES:
                            raise HistoryError(f"the folder holds more than {MAX_FILES:,} files")
        self._write_state(message_id, files, dirs, imports, known=(known, pieces))
        self._write_head(Head(message_id, False, False, digest(message_id)))
        stats["object_bytes"] += copied_bytes
        dropped = self._prune(message_id, keep_states, keep_kernels, room_bytes, stats, live_bytes)
        self._write_stats(stats)
        history = max(0, stats["object_bytes"] - live_bytes) + self._kernel_bytes()
        return Saved(message_id, len(files), copied_files, copied_bytes, history, dropped)

    def _prune(
        self,
        newest: str,
        keep_states: int,
        keep_kernels: int,
        room_bytes: int | None,
        stats: dict[str, int],
        live_bytes: int,
    ) -> int:
        """Drop the states beyond `keep_states` (oldest first), the kernels beyond `keep_kernels`, and
        more while the history is over `room_bytes`; objects no state needs go at a collection, which
        runs once enough states went (its cost is shared by them) or when the room is short."""
        order = self._states_oldest_first(newest)
        dropped = [order.pop(0)[1] for _ in range(max(0, len(order) - max(1, keep_states)))]
        with_kernel = [d for _, d in order if (self.folder / "kernels" / d / "kernel").is_dir()]
        for d in with_kernel[: max(0, len(with_kernel) - keep_kernels)]:
            shutil.rmtree(self.folder / "kernels" / d, ignore_errors=True)
        for d in dropped:
            self._drop(d)
        stats["uncollected"] += len(dropped)
        if stats["uncollected"] >= _COLLECT_EVERY:
            self._collect(stats)
        if room_bytes is not None:
            while max(0, stats["object_bytes"] - live_bytes) + self._kernel_bytes() > room_bytes:
                kernels = [d for _, d in order if (self.folder / "kernels" / d / "kernel").is_dir()]
                if kernels:  # a Python state costs more than a file state: they go first
                    shutil.rmtree(self.folder / "kernels" / kernels[0], ignore_errors=True)
                    continue
                if stats["uncollected"]:
                    self._collect(stats)
                    continue
                if len(order) <= 1:
                    break
                d = order.pop(0)[1]
                dropped.append(d)
                self._drop(d)
                stats["uncollected"] += 1
        return len(dropped)

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

    def _collect(self, stats: dict[str, int]) -> None:
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
        stats["object_bytes"], stats["uncollected"] = total, 0

    def _kernel_bytes(self) -> int:
        return tree_bytes(self.folder / "kernels")

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
        head = self.read_head()
        self._write_head(Head(message_id, True, True, head.live))
        return state

    def restore(self, message_id: str, state: dict[str, Any]) -> Restored:
        """Make the live folder hold exactly the state's files and folders (after begin_restore).
        Files already there as the head's live records say, with the state's version, stay; the rest
        is copied back from the objects. The state's records then describe the live files."""
        head = self.read_head()
        known, _ = self._live_records(head)
        wanted: dict[str, list[Any]] = state["files"]
        wanted_dirs: dict[str, int] = state["dirs"]
        keep_dirs = set(wanted_dirs)
        for path in wanted:
            parts = path.split("/")
            keep_dirs.update("/".join(parts[:i]) for i in range(1, len(parts)))
        kept: dict[str, list[Any]] = {}
        with (
            fd_closing(os.open(self.folder / "objects", DIR_FLAGS)) as objects_fd,
            fd_closing(os.open(self.live_dir, DIR_FLAGS)) as root,
        ):
            removed = clear_live(root, "", 0, wanted, keep_dirs, known, kept)
            for path in sorted(keep_dirs, key=lambda p: p.count("/")):
                with fd_closing(make_dirs(root, path.split("/"), wanted_dirs.get(path, 0o755), self.owner)):
                    pass
            copied = 0
            files: dict[str, list[Any]] = {}
            for path, (obj, size, mtime_ns, mode, *_) in wanted.items():
                if path in kept:
                    st_ino, st_ctime = kept[path][4], kept[path][5]
                    files[path] = [obj, size, mtime_ns, mode, st_ino, st_ctime]
                    continue
                parts = path.split("/")
                with fd_closing(make_dirs(root, parts[:-1], 0o755, self.owner)) as parent:
                    st = copy_out(objects_fd, obj, parent, parts[-1], mode, mtime_ns, self.owner)
                files[path] = [obj, st.st_size, st.st_mtime_ns, mode, st.st_ino, st.st_ctime_ns]
                copied += 1
        self._write_state(message_id, files, wanted_dirs, self.imports_of(state), saved_at=state["saved_at"])
        self._write_head(Head(message_id, False, False, digest(message_id)))
        return Restored(message_id, len(wanted), copied, removed)

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
        return Restored(message_id, 0, 0, removed)

    def imports_of(self, state: dict[str, Any]) -> list[tuple[str, str]]:
        return [(str(s), str(p)) for s, p in state.get("imports", [])]

    # ------------------------------------------------------------------ files of the history

    def _state_path(self, message_id: str) -> Path:
        return self.folder / "states" / f"{digest(message_id)}.json"

    def _read_state(self, message_id: str) -> dict[str, Any] | None:
        state = self._read_state_file(self._state_path(message_id))
        if state is None or state.get("message_id") != message_id:
            return None
        return state

    def _live_records(self, head: Head) -> tuple[dict[str, list[Any]], dict[str, str]]:
        """The records of the state the live folder's files are described by, and their JSON where
        this process wrote that state last (else read back from its file, with no JSON)."""
        if not head.live:
            return {}, {}
        path = self.folder / "states" / f"{head.live}.json"
        written = _recent.get(self.folder, head.live, path)
        if written is not None:
            return written.records, written.pieces
        return self._records(path), {}

    @staticmethod
    def _records(path: Path) -> dict[str, list[Any]]:
        """The file records of a state, read only to tell which live files are unchanged: a record
        that is not well formed is no record (its file is then copied again)."""
        try:
            with open(path, "rb") as fh:
                files = json.loads(fh.read(_MAX_STATE)).get("files")
        except (OSError, ValueError, AttributeError):
            return {}
        if not isinstance(files, dict):
            return {}
        return {p: v for p, v in files.items() if isinstance(v, list) and len(v) == 6}

    @staticmethod
    def _read_state_file(path: Path) -> dict[str, Any] | None:
        """A state, checked whole before its paths and objects name anything on disk."""
        try:
            with open(path, "rb") as fh:
                state = json.loads(fh.read(_MAX_STATE))
        except (OSError, ValueError):
            return None
        try:
            ok = (
                state.get("format") == FORMAT
                and isinstance(state.get("message_id"), str)
                and isinstance(state.get("saved_at"), int | float)
                and isinstance(state.get("files"), dict)
                and isinstance(state.get("dirs"), dict)
                and all(
                    safe_path(p)
                    and isinstance(v, list)
                    and len(v) == 6
                    and object_name(v[0])
                    and all(isinstance(n, int) for n in v[1:])
                    for p, v in state["files"].items()
                )
                and all(safe_path(p) and isinstance(m, int) for p, m in state["dirs"].items())
            )
        except (AttributeError, TypeError):
            return None
        return state if ok else None

    def _write_state(
        self,
        message_id: str,
        files: dict[str, list[Any]],
        dirs: dict[str, int],
        imports: list[tuple[str, str]],
        *,
        saved_at: float | None = None,
        known: tuple[dict[str, list[Any]], dict[str, str]] = ({}, {}),
    ) -> None:
        """Write a state's file. `known`: the records of the state the save compared with, and their
        JSON where this process has it: a record of `files` that is the very same is written as it was."""
        stamp = time.time() if saved_at is None else saved_at
        state = {
            "format": FORMAT,
            "message_id": message_id,
            "saved_at": stamp,
            "files": {},
            "dirs": dirs,
            "imports": [list(pair) for pair in imports],
        }
        records, pieces = known
        new_pieces = {}
        for name, record in files.items():
            piece = pieces.get(name)
            new_pieces[name] = (
                piece if piece is not None and records.get(name) is record else _piece(name, record)
            )
        text = json.dumps(state, separators=(",", ":"))
        head, tail = text.split('"files":{}', 1)  # the one place it can be: no string holds a quote bare
        text = head + '"files":{' + ",".join(new_pieces.values()) + "}" + tail
        d = digest(message_id)
        names = "".join(f"{entry[0]}\n" for entry in files.values())
        write_bytes(self.folder / "states" / f"{d}.objects", names.encode("ascii"))
        path = self.folder / "states" / f"{d}.json"
        _recent.put(self.folder, None)  # written or not, what this process held is no longer the file
        write_bytes(path, text.encode())
        # The file's mtime is the state's age, which pruning orders by: a restore rewrites the file (the
        # live files' new inodes) without making the state any newer.
        os.utime(path, (stamp, stamp))
        _recent.put(self.folder, _Written(d, _identity(os.stat(path)), files, new_pieces))

    def _make_folder(self) -> None:
        # Its parent (the chat's saved-state folder) may not exist yet; both are ours alone.
        self.folder.parent.mkdir(mode=0o700, exist_ok=True)
        self.folder.mkdir(mode=0o700, exist_ok=True)

    def _write_head(self, head: Head) -> None:
        self._make_folder()
        data = {"head": head.message_id, "dirty": head.dirty, "restoring": head.restoring, "live": head.live}
        write_bytes(self.folder / HEAD, json.dumps(data).encode())

    def _read_stats(self) -> dict[str, int]:
        try:
            with open(self.folder / STATS, "rb") as fh:
                data = json.loads(fh.read(1 << 16))
            return {"object_bytes": int(data["object_bytes"]), "uncollected": int(data["uncollected"])}
        except (OSError, ValueError, KeyError, TypeError):
            stats = {"object_bytes": 0, "uncollected": 0}
            self._collect(stats)  # lost or damaged: counted again from the disk
            return stats

    def _write_stats(self, stats: dict[str, int]) -> None:
        write_bytes(self.folder / STATS, json.dumps(stats).encode())
