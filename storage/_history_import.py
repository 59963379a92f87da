"""One chat's saved state copied into another chat's history (a clone): its files, and its Python state
when asked, as private copies (a reflink where the disk has them, else bytes; never a hard link, which
the two chats would share). Pure file work, blocking: call it from a thread, holding the target chat's
lock (and the source's, so its states are not pruned mid-way).

Whether a chat's start from another was done, and what it brought, is kept beside its history
(`CloneStart`, in `<saved state>/origin.json`), so that it happens once."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import stat
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from ._fsops import DIR_FLAGS, fd_closing
from ._history import FileRecord, History, State, copy_file, write_bytes
from .errors import HistoryError

__all__ = ["CloneStart", "Imported", "Room", "import_state", "read_start", "write_start"]

_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_IMAGE = "kernel"  # the runner's saved image inside a state's kernel folder
_MAX_IMAGE_FILES = 64


@dataclass(frozen=True, slots=True)
class Room:
    """What the target's owner may still take: files, bytes (None: no bound), the largest file; the
    bytes a Python state may take with the files (`python_bytes`), and the largest one (`image_bytes`)."""

    files: int | None = None
    bytes: int | None = None
    file_bytes: int | None = None
    python_bytes: int | None = None
    image_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class Imported:
    """What a clone received: the state (its message id; "" when none of the candidates is kept), the
    files copied and those that did not fit, and whether its Python state came (or why not)."""

    message_id: str = ""
    files: int = 0
    bytes: int = 0
    skipped: int = 0
    skipped_bytes: int = 0
    python: bool = False
    python_why: str = ""


@dataclass(frozen=True, slots=True)
class CloneStart:
    """What a chat's start from another chat did, once: whether it is a clone (`source`: the chat it
    came from; "": it is none), whether the Python state was its to take, the message whose state came
    ("": none) with how many files, and why nothing came when nothing did (`why`: "deleted", "not
    kept", "the folder has files already")."""

    source: str = ""
    python: bool = False
    state: str = ""
    files: int = 0
    why: str = ""

    @classmethod
    def decode(cls, data: object) -> CloneStart:
        """The start as its file holds it; a damaged one still says the start was done."""
        if not isinstance(data, dict):
            return cls(why="damaged")
        source, python, state = data.get("source"), data.get("python"), data.get("state")
        files, why = data.get("files"), data.get("why")
        if not isinstance(source, str) or not isinstance(python, bool) or not isinstance(state, str):
            return cls(why="damaged")
        if not isinstance(files, int) or not isinstance(why, str):
            return cls(why="damaged")
        return cls(source, python, state, files, why)

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()


def read_start(path: Path) -> CloneStart | None:
    """The start recorded at `path`, or None when none was (the chat never took a state from another)."""
    try:
        with open(path, "rb") as fh:
            data = json.loads(fh.read(1 << 16))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return CloneStart(why="damaged")
    return CloneStart.decode(data)


def write_start(path: Path, start: CloneStart) -> None:
    """Record the start (its folder, the chat's saved-state folder, made private if missing)."""
    path.parent.mkdir(mode=0o700, exist_ok=True)
    write_bytes(path, start.encode())


def import_state(
    source: History, target: History, candidates: Sequence[str], room: Room, *, python: bool
) -> Imported:
    """Copy the first of `candidates` (message ids, nearest first) the source keeps a state of into
    the target's history, as that message's state: the files that fit `room`, in path order, and its
    Python state when `python` and it fits. Imported() when no candidate is kept."""
    for message_id in candidates:
        if source.has_state(message_id):
            break
    else:
        return Imported()
    state = source.state_of(message_id)
    if state is None:
        return Imported()
    chosen, skipped, skipped_bytes = _choose(state.files, room)
    objects = target.objects_folder()
    copied: dict[str, FileRecord] = {}
    total = 0
    with (
        fd_closing(os.open(source.folder / "objects", DIR_FLAGS)) as source_fd,
        fd_closing(os.open(objects, DIR_FLAGS)) as objects_fd,
    ):
        for path in chosen:
            record = state.files[path]
            try:
                src = os.open(record.obj, _READ, dir_fd=source_fd)
            except OSError:
                raise HistoryError("its saved files are damaged (a version is missing)") from None
            with fd_closing(src):
                st = os.fstat(src)
                if not stat.S_ISREG(st.st_mode) or st.st_size != record.size:
                    raise HistoryError("its saved files are damaged (a version has another size)")
                made = copy_file(src, objects_fd)
            # No live file of the target is this version (no inode, no ctime): a restore copies it out.
            copied[path] = FileRecord(made, record.size, record.mtime_ns, record.mode)
            total += record.size
    # The clone's state starts its own chain: no parent, the source's imports as they were.
    target.put_state(State(message_id, state.saved_at, copied, dict(state.dirs), state.imports))
    came, why = False, ""
    if python:
        left = None if room.python_bytes is None else room.python_bytes - total
        bounds = [b for b in (left, room.image_bytes) if b is not None]
        came, why = _copy_image(source, target, message_id, min(bounds) if bounds else None)
    return Imported(message_id, len(copied), total, skipped, skipped_bytes, came, why)


def _choose(files: dict[str, FileRecord], room: Room) -> tuple[list[str], int, int]:
    """The paths that fit, in path order; and how many did not, with their bytes."""
    chosen: list[str] = []
    count = size = skipped = skipped_bytes = 0
    for path in sorted(files):
        need = files[path].size
        fits = (
            (room.file_bytes is None or need <= room.file_bytes)
            and (room.files is None or count + 1 <= room.files)
            and (room.bytes is None or size + need <= room.bytes)
        )
        if fits:
            chosen.append(path)
            count += 1
            size += need
        else:
            skipped += 1
            skipped_bytes += need
    return chosen, skipped, skipped_bytes


def _copy_image(source: History, target: History, message_id: str, room: int | None) -> tuple[bool, str]:
    """The source state's Python state (the runner's image), copied file by file into the target's."""
    folder = source.kernel_of(message_id)
    if folder is None:
        return False, "not kept"
    image = folder / _IMAGE
    try:
        entries = [e for e in os.scandir(image) if e.is_file(follow_symlinks=False)]
    except OSError:
        return False, "not kept"
    size = sum(e.stat(follow_symlinks=False).st_size for e in entries)
    if len(entries) > _MAX_IMAGE_FILES:
        return False, "not kept"
    if room is not None and size > room:
        return False, "too large"
    into = target.kernel_dir(message_id)
    staging = into / f".{_IMAGE}-{secrets.token_hex(6)}"
    staging.mkdir(mode=0o700)
    try:
        for entry in entries:
            shutil.copyfile(entry.path, staging / entry.name, follow_symlinks=False)
        shutil.rmtree(into / _IMAGE, ignore_errors=True)
        os.rename(staging, into / _IMAGE)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return True, ""
