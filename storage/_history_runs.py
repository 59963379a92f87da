"""The record of each run of an answer, kept beside the chat's saved states (storage/_history.py has
the layout): what ran (language, code), how it ended, what it printed and the figures it showed, as
they were, so that an answer's branch can be exported as a notebook long after its folder moved on.
Blocking: call it from a thread, holding the chat's lock.

    history/runs/<d>.jsonl  a header {format, message_id}, then one line per run: {language, code,
                            outcome, stdout, stderr, figures: [{path, type, data (base64)}], clipped}

Everything in a record came from the sandbox (code the model wrote, output, images) and is hostile:
it is kept as JSON strings, bounded, and checked line by line when read back. Bounds: a run's code and each
of its streams are clipped (`clipped` names what was), a run keeps its first figures of a bounded
size, an answer keeps its first runs and a bounded record, and a chat keeps the records of its newest
answers within a bounded total (the oldest go first). What they take counts with the chat's states
toward the user's storage (`stats.json`'s `run_bytes`)."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ._fsops import DIR_FLAGS, fd_closing
from ._history import RUNS_DIR, digest, digest_name, listing, open_live_file, write_bytes

__all__ = ["AnswerRuns", "Figure", "RunRecord", "RunRecords", "run_entry"]

FORMAT = 1
_SUFFIX = ".jsonl"
_SLACK = 64 * 1024  # what counts of runs past the bound may add to a record
MAX_CODE_CHARS = 256 * 1024
MAX_STREAM_CHARS = 64 * 1024
MAX_FIGURES_PER_RUN = 8
MAX_FIGURE_BYTES = 2 * 1024 * 1024
MAX_RUNS_PER_ANSWER = 100
MAX_RECORD_BYTES = 8 * 1024 * 1024  # one answer's record
MAX_CHAT_BYTES = 64 * 1024 * 1024  # all of a chat's records (at each answer's first run; the answer's
# own may add up to MAX_RECORD_BYTES until the next)
MAX_ANSWERS = 2000  # answers of one chat with a record
_FIGURE_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".svg": "image/svg+xml"}
_OUTCOME_CHARS = 40


@dataclass(frozen=True, slots=True)
class Figure:
    """A picture a run showed, as it was when the run ended: its path in the folder, its media type
    (one of the picture types a record keeps) and its bytes in base64."""

    path: str
    type: str
    data: str

    @classmethod
    def decode(cls, value: object) -> Figure | None:
        if not isinstance(value, dict):
            return None
        path, kind, data = value.get("path"), value.get("type"), value.get("data")
        if not isinstance(path, str) or not isinstance(data, str) or kind not in _FIGURE_TYPES.values():
            return None
        return cls(path, str(kind), data)

    def encode(self) -> dict[str, str]:
        return {"path": self.path, "type": self.type, "data": self.data}


@dataclass(frozen=True, slots=True)
class RunRecord:
    """One run of an answer: its language and code, how it ended, what it printed, the figures it
    showed, and which of those a bound clipped (`clipped`: "code", "stdout", "stderr", "figures",
    "outputs"). In a record's file: one JSON object per line."""

    language: str
    code: str
    outcome: str
    stdout: str = ""
    stderr: str = ""
    figures: tuple[Figure, ...] = ()
    clipped: tuple[str, ...] = ()

    @classmethod
    def decode(cls, value: object) -> RunRecord | None:
        """The run a line holds, checked whole (None: damaged, or not a run)."""
        if not isinstance(value, dict):
            return None
        texts = [value.get(key) for key in ("language", "code", "outcome", "stdout", "stderr")]
        figures, clipped = value.get("figures"), value.get("clipped")
        if not all(isinstance(text, str) for text in texts):
            return None
        if not isinstance(figures, list) or not isinstance(clipped, list):
            return None
        decoded = [Figure.decode(figure) for figure in figures]
        kept = tuple(figure for figure in decoded if figure is not None)
        if len(kept) != len(decoded) or not all(isinstance(item, str) for item in clipped):
            return None
        language, code, outcome, stdout, stderr = (str(text) for text in texts)
        return cls(language, code, outcome, stdout, stderr, kept, tuple(clipped))

    def encode(self) -> dict[str, Any]:
        return {
            "language": self.language,
            "code": self.code,
            "outcome": self.outcome,
            "stdout": self.stdout,
            "stderr": self.stderr,
            "figures": [figure.encode() for figure in self.figures],
            "clipped": list(self.clipped),
        }


@dataclass(frozen=True, slots=True)
class AnswerRuns:
    """The kept record of one answer's runs: its runs in order, and how many more ran past the
    answer's bound (counted, not kept)."""

    message_id: str
    runs: tuple[RunRecord, ...] = ()
    more_runs: int = 0


def _clip(text: str, limit: int) -> tuple[str, bool]:
    return (text, False) if len(text) <= limit else (text[:limit], True)


def run_entry(
    live_dir: Path,
    *,
    language: str,
    code: str,
    outcome: str,
    stdout: str,
    stderr: str,
    figures: Sequence[str],
) -> RunRecord:
    """One run's record, bounded; its figures read from the live folder now (without following a
    link), the first MAX_FIGURES_PER_RUN of at most MAX_FIGURE_BYTES each."""
    clipped: list[str] = []
    texts: dict[str, str] = {}
    for key, text, limit in (
        ("code", code, MAX_CODE_CHARS),
        ("stdout", stdout, MAX_STREAM_CHARS),
        ("stderr", stderr, MAX_STREAM_CHARS),
    ):
        texts[key], cut = _clip(text, limit)
        if cut:
            clipped.append(key)
    kept: list[Figure] = []
    for path in figures:
        kind = _FIGURE_TYPES.get(os.path.splitext(path)[1].lower())
        if kind is None:
            continue
        if len(kept) >= MAX_FIGURES_PER_RUN:
            clipped.append("figures")
            break
        data = _read_figure(live_dir, path)
        if data is None:
            clipped.append("figures")
            continue
        kept.append(Figure(path, kind, base64.b64encode(data).decode("ascii")))
    return RunRecord(
        language[:16],
        texts["code"],
        outcome[:_OUTCOME_CHARS],
        texts["stdout"],
        texts["stderr"],
        tuple(kept),
        tuple(sorted(set(clipped))),
    )


def _read_figure(live_dir: Path, path: str) -> bytes | None:
    try:
        with fd_closing(os.open(live_dir, DIR_FLAGS)) as root, fd_closing(open_live_file(root, path)) as fd:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_FIGURE_BYTES:
                return None
            data = os.pread(fd, MAX_FIGURE_BYTES + 1, 0)
    except OSError:
        return None
    return data if len(data) <= MAX_FIGURE_BYTES else None


class RunRecords:
    """The run records of one chat's history folder (`folder`: `<saved state>/history`). A record is
    JSON lines: a header (`format`, `message_id`), then one line per run, appended (a run's record
    costs its own bytes, never a rewrite of the answer's earlier runs); `{"more": n}` counts runs past
    the answer's bound."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder / RUNS_DIR

    def _path(self, message_id: str) -> Path:
        return self.folder / f"{digest(message_id)}{_SUFFIX}"

    def add(self, message_id: str, entry: RunRecord) -> None:
        """Append a run to the answer's record (the first run of an answer drops the oldest answers'
        records beyond the chat's bounds). A run that would make the record too large keeps a part of
        its code and no outputs; past that, or past MAX_RUNS_PER_ANSWER, it is only counted. What the
        records take is counted at the next state saved (`History.save`), not here: this is on every
        run's path."""
        if not self.folder.is_dir():
            _make(self.folder)
        path = self._path(message_id)
        before = _size(path)
        head = b"" if before else _encode({"format": FORMAT, "message_id": message_id})
        line = _encode(entry.encode())
        if before + len(head) + len(line) > MAX_RECORD_BYTES:
            slim = replace(
                entry,
                code=entry.code[: MAX_CODE_CHARS // 8],
                stdout="",
                stderr="",
                figures=(),
                clipped=("outputs",),
            )
            line = _encode(slim.encode())
        if before + len(head) + len(line) > MAX_RECORD_BYTES or self._runs_in(path) >= MAX_RUNS_PER_ANSWER:
            line = _encode({"more": 1})
            if before + len(line) > MAX_RECORD_BYTES + _SLACK:
                return
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with fd_closing(fd):
            os.write(fd, head + line)
        if before == 0:  # a new answer: the chat's bounds, kept once per answer
            self.bound()

    @staticmethod
    def _runs_in(path: Path) -> int:
        """Lines of the record after its header (MAX_RUNS_PER_ANSWER is about 100: a cheap count)."""
        try:
            with open(path, "rb") as fh:
                return max(0, fh.read(MAX_RECORD_BYTES + _SLACK).count(b"\n") - 1)
        except OSError:
            return 0

    def runs_of(self, message_ids: Iterable[str]) -> dict[str, AnswerRuns]:
        """The records of these answers that are kept, by message id, each line checked (a line that
        is not a well-formed run is no run)."""
        found: dict[str, AnswerRuns] = {}
        for message_id in message_ids:
            record = self._read(self._path(message_id), message_id)
            if record is not None:
                found[message_id] = record
        return found

    def bound(self) -> int:
        """Drop the oldest answers' records beyond the chat's bounds; returns the bytes left."""
        entries: list[tuple[float, str, int]] = []
        for name in listing(self.folder):
            if not name.endswith(_SUFFIX) or not digest_name(name[: -len(_SUFFIX)]):
                continue
            with contextlib.suppress(OSError):
                st = os.lstat(self.folder / name)
                entries.append((st.st_mtime, name, st.st_size))
        entries.sort()
        total = sum(size for _, _, size in entries)
        while entries and (total > MAX_CHAT_BYTES or len(entries) > MAX_ANSWERS):
            _, name, size = entries.pop(0)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.folder / name)
            total -= size
        return total

    def total(self) -> int:
        total = 0
        for name in listing(self.folder):
            with contextlib.suppress(OSError):
                total += os.lstat(self.folder / name).st_size
        return total

    def copy_to(self, other: RunRecords, message_ids: Iterable[str]) -> int:
        """Copy these answers' records into another chat's (a clone's), as read and checked; returns
        the bytes copied."""
        copied = 0
        for message_id, record in self.runs_of(message_ids).items():
            _make(other.folder)
            lines = [{"format": FORMAT, "message_id": message_id}, *(run.encode() for run in record.runs)]
            if record.more_runs:
                lines.append({"more": record.more_runs})
            data = b"".join(_encode(line) for line in lines)
            write_bytes(other._path(message_id), data)
            copied += len(data)
        return copied

    @staticmethod
    def _read(path: Path, message_id: str) -> AnswerRuns | None:
        try:
            with open(path, "rb") as fh:
                lines = fh.read(MAX_RECORD_BYTES + _SLACK).split(b"\n")
            header = json.loads(lines[0])
        except (OSError, ValueError):
            return None
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            return None
        if header.get("message_id") != message_id:
            return None
        runs: list[RunRecord] = []
        more = 0
        for line in lines[1:]:
            try:
                item = json.loads(line)
            except ValueError:
                continue  # the last line of a write cut short, or damage: not a run
            if isinstance(item, dict) and isinstance(item.get("more"), int) and len(item) == 1:
                more += max(0, item["more"])
            elif (run := RunRecord.decode(item)) is not None:
                runs.append(run)
        return AnswerRuns(message_id, tuple(runs), more)


def _make(folder: Path) -> None:
    """The records' folder, and the history and saved-state folders above it: private, all three."""
    for level in (folder.parent.parent, folder.parent, folder):
        level.mkdir(mode=0o700, exist_ok=True)


def _encode(record: dict[str, Any]) -> bytes:
    """One line of JSON, ASCII (non-ASCII escaped): a line break in it can only be the line's end."""
    return json.dumps(record, separators=(",", ":")).encode("ascii") + b"\n"


def _size(path: Path) -> int:
    try:
        return os.lstat(path).st_size
    except OSError:
        return 0
