"""Value types of the public API: settings in, reports out.

All are frozen dataclasses (positional or keyword construction, cheap enough to build by the
hundred thousand for `ChatFiles.list()`). Settings validate themselves in `__post_init__`.
Reports convert to plain JSON-able dicts with `to_dict()`.

The settings here (`Quotas`, `Expiry`) are the one home of the storage defaults: the function's valves
take theirs from them. "No limit" is None: a 0 given for a limit (a valve's "0: no limit", a policy
recorded by an older version) is held as None.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from ._format import human_bytes

__all__ = [
    "ActivityEntry",
    "ChatInfo",
    "CleanupAction",
    "CleanupReport",
    "Drift",
    "Expiry",
    "FileEntry",
    "Growth",
    "Link",
    "LinkInfo",
    "Purge",
    "QuotaRemoval",
    "Quotas",
    "RebuildReport",
    "Reconcile",
    "ReconcileReport",
    "Rejected",
    "Renamed",
    "RunBudget",
    "Usage",
    "UserUsage",
]

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
DAY = 86400.0


def _check_limits(settings: object) -> None:
    """Refuse what is not a limit, and hold 0 ("no limit") as None, the one way it is said."""
    for f in dataclasses.fields(settings):  # type: ignore[arg-type]
        value = getattr(settings, f.name)
        if value is None:
            continue
        # bool is an int subclass; True as a limit is always a mistake in a valve.
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            owner = type(settings).__name__
            raise ValueError(f"{owner}.{f.name} must be a number >= 0 or None (got {value!r})")
        if value == 0:
            object.__setattr__(settings, f.name, None)  # frozen: only construction may set it


class _Dictable:
    __slots__ = ()

    def to_dict(self) -> dict[str, Any]:
        # Only dataclasses derive from _Dictable.
        result: dict[str, Any] = _jsonable(dataclasses.asdict(cast(Any, self)))
        return result


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True, slots=True)
class Quotas(_Dictable):
    """Per-user limits. None (or 0, held as None) disables a limit.

    * max_files_per_user: files across all of the user's chats (default 5000).
    * max_bytes_per_user: bytes across all of the user's chats (default 1 GiB).
    * max_file_bytes: size of any one new file (default 100 MiB).
    * max_new_files_per_run: files one run may add to a session (default 500).
    """

    max_files_per_user: int | None = 5000
    max_bytes_per_user: int | None = 1 * GiB
    max_file_bytes: int | None = 100 * MiB
    max_new_files_per_run: int | None = 500

    def __post_init__(self) -> None:
        _check_limits(self)


@dataclass(frozen=True, slots=True)
class Expiry(_Dictable):
    """Ages after which cleanup deletes things, in seconds. None (or 0, held as None) means never.

    * file_max_age_s: a file unchanged (as seen by the index) for this long is deleted (30 days).
    * session_idle_s: a chat session not used for this long is deleted with its files (30 days).
    * temporary_idle_s: same for temporary chats (1 hour).
    * activity_max_age_s: audit trail entries older than this are pruned (90 days).
    """

    file_max_age_s: float | None = 30 * DAY
    session_idle_s: float | None = 30 * DAY
    temporary_idle_s: float | None = 3600.0
    activity_max_age_s: float | None = 90 * DAY

    def __post_init__(self) -> None:
        _check_limits(self)


@dataclass(frozen=True, slots=True)
class Purge(_Dictable):
    """Selects sessions to delete entirely. Several criteria combine with AND; `everything` wins.

    * everything: every session.
    * user_id / chat_id: sessions of that user / with that chat id.
    * idle_longer_than_s: sessions not used for longer than this (temporary or not).
    An empty Purge() selects nothing.
    """

    everything: bool = False
    user_id: str | None = None
    chat_id: str | None = None
    idle_longer_than_s: float | None = None

    @property
    def selects_anything(self) -> bool:
        return (
            self.everything
            or self.user_id is not None
            or self.chat_id is not None
            or self.idle_longer_than_s is not None
        )


# --------------------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class Usage(_Dictable):
    files: int
    bytes: int


@dataclass(frozen=True, slots=True)
class UserUsage(_Dictable):
    user_id: str
    sessions: int
    files: int
    bytes: int
    saved_state_bytes: int = 0  # the sessions' saved states on disk (kernels and branch states)
    # The states of the answers kept for the conversations' branches, and what they count against the
    # user's storage limit (after the files: the oldest go when the files leave too little room).
    branch_states: int = 0
    branch_state_bytes: int = 0


@dataclass(frozen=True, slots=True)
class RunBudget(_Dictable):
    """What one run may write while it runs, from the policy (None means no limit).

    * max_write_bytes: how much the session folder may grow during the run: the bytes the user has
      left across all chats, but never less than a small floor, so a run over quota can still work
      (whatever is over the quota when it ends is removed);
    * max_file_bytes: size of any one file;
    * note: set when the user starts the run with nothing to spend: a sentence for the user and the
      model (the run can delete or shrink files; what it adds is removed).
    """

    max_write_bytes: int | None
    max_file_bytes: int | None
    note: str | None = None


@dataclass(frozen=True, slots=True)
class Growth(_Dictable):
    """A file a run added (`new`) or grew, as the policy weighs it after the run."""

    path: str
    size: int
    mtime_ns: int
    new: bool
    old_size: int = 0


@dataclass(frozen=True, slots=True)
class FileEntry(_Dictable):
    """One indexed file. `path` is relative and POSIX; times are Unix seconds.

    first_seen / last_changed are when the index first saw the file and last saw it change;
    expiry uses last_changed because the sandbox can forge mtime.
    """

    path: str
    size: int
    mtime: float
    first_seen: float
    last_changed: float


@dataclass(frozen=True, slots=True)
class Rejected(_Dictable):
    """An entry reconcile removed because it is not a regular file or directory, or is too deep, or
    its path too long.

    kind is one of: symlink, fifo, socket, char device, block device, unknown, too deep, path too long,
    empty folder.
    Non-UTF-8 bytes in `path` are shown as \\xNN.
    """

    path: str
    kind: str


@dataclass(frozen=True, slots=True)
class Renamed(_Dictable):
    """A name that was not valid UTF-8, renamed so it can be indexed and shown (\\xNN in `old`)."""

    old: str
    new: str


@dataclass(frozen=True, slots=True)
class QuotaRemoval(_Dictable):
    path: str
    size: int
    reason: str


class Reconcile(enum.Enum):
    """How the index is brought in line with the disk (the disk is the truth): the modes of
    `Session.reconcile` (one chat, after a run) and `Store.reconcile` (the whole store)."""

    # One chat, after a run: only the paths it changed (`changed=`); the whole folder when anything
    # is unusual. Report: ReconcileReport with full=False.
    CHANGED = "changed"
    # One chat: its whole folder listed (no `changed=`, or CHANGED fell back). full=True.
    FOLDER = "folder"
    # Every chat whose run ended with its process (a crash): its mark in running/ is left.
    INTERRUPTED = "interrupted"
    # What a full disk put off: the chats used meanwhile (sidecar, row, folder) and the start-up modes.
    AFTER_FULL_DISK = "after_full_disk"
    # Every session folder on disk, ids from the sidecars; rows without a folder dropped, links taken
    # back from their records (a new or replaced index). Report: RebuildReport.
    REBUILD = "rebuild"


@dataclass(frozen=True, slots=True)
class ReconcileReport(_Dictable):
    """What `Session.reconcile` found and did. files / bytes are the session totals afterwards."""

    added: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)
    renamed: list[Renamed] = field(default_factory=list)
    quota_removed: list[QuotaRemoval] = field(default_factory=list)
    files: int = 0
    bytes: int = 0
    # True: the whole folder was listed (Reconcile.FOLDER). False: only the paths a run changed were
    # looked at (Reconcile.CHANGED).
    full: bool = True

    def summary(self) -> str:
        parts = [f"{len(self.added)} added", f"{len(self.changed)} changed", f"{len(self.removed)} removed"]
        if self.rejected:
            parts.append(f"{len(self.rejected)} rejected")
        if self.renamed:
            parts.append(f"{len(self.renamed)} renamed")
        if self.quota_removed:
            parts.append(f"{len(self.quota_removed)} removed by quota")
        return ", ".join(parts) + f"; now {self.files} files, {human_bytes(self.bytes)}"


@dataclass(frozen=True, slots=True)
class RebuildReport(_Dictable):
    """Summary of `Store.reconcile(Reconcile.REBUILD)` over every session folder.

    sessions_without_sidecar: folders whose real ids are unknown (sidecar lost and no index row);
    they are indexed under `unknown:<folder name>` ids and keep their files.
    """

    sessions: int = 0
    sessions_in_use: int = 0
    sessions_without_sidecar: int = 0
    rows_removed: int = 0
    files: int = 0
    bytes: int = 0
    added: int = 0
    changed: int = 0
    removed: int = 0
    rejected: list[Rejected] = field(default_factory=list)
    renamed: list[Renamed] = field(default_factory=list)
    links: int = 0  # links taken back from their records (the index had lost them)

    def summary(self) -> str:
        text = (
            f"{self.sessions} sessions, {self.files} files, {human_bytes(self.bytes)}; "
            f"{self.added} added, {self.changed} changed, {self.removed} removed"
        )
        if self.links:
            text += f", {self.links} links taken back"
        if self.rejected:
            text += f", {len(self.rejected)} rejected"
        if self.sessions_in_use:
            text += f"; {self.sessions_in_use} in use (skipped)"
        return text


@dataclass(frozen=True, slots=True)
class Link(_Dictable):
    """A published copy of a session file.

    `ref` is the publisher's id of the copy (a random token, or a file id of the web server),
    `url` where the user's browser fetches it, `name` the file name the copy was given."""

    ref: str
    url: str
    path: str
    name: str
    size: int
    is_image: bool
    created_at: float


@dataclass(frozen=True, slots=True)
class LinkInfo(_Dictable):
    ref: str
    kind: str  # the publisher that holds the copy (see storage.publishing)
    user_id: str | None
    chat_id: str | None
    path: str
    name: str
    url: str
    size: int
    created_at: float


@dataclass(frozen=True, slots=True)
class ChatInfo(_Dictable):
    """A chat's session as `Store.sessions()` lists it: ids, folder keys, times and totals."""

    user_id: str
    chat_id: str
    user_key: str
    chat_key: str
    temporary: bool
    created_at: float
    last_used_at: float
    files: int
    bytes: int


@dataclass(frozen=True, slots=True)
class CleanupAction(_Dictable):
    """One line of a cleanup report. action: removed, files expired, in use, vanished."""

    user_id: str
    chat_id: str
    action: str
    files: int = 0
    bytes: int = 0
    reason: str = ""
    # The session's folder keys (what other parts name a session by, e.g. its kernel).
    user_key: str = ""
    chat_key: str = ""


@dataclass(frozen=True, slots=True)
class CleanupReport(_Dictable):
    dry_run: bool = False
    sessions_removed: int = 0
    files_removed: int = 0
    bytes_freed: int = 0
    links_removed: int = 0
    sessions_in_use: int = 0
    details: list[CleanupAction] = field(default_factory=list)

    def summary(self) -> str:
        verb = "would remove" if self.dry_run else "removed"
        return (
            f"{verb} {self.sessions_removed} sessions, {self.files_removed} files "
            f"({human_bytes(self.bytes_freed)}), {self.links_removed} links; "
            f"{self.sessions_in_use} in use (skipped)"
        )


@dataclass(frozen=True, slots=True)
class Drift(_Dictable):
    """A difference between the index and the disk found by `Store.check()`.

    kind: file not indexed, file missing, file changed, totals mismatch, session folder missing,
    session not indexed, special file, bad name, link copy missing, stray copy, stray saved state.
    """

    kind: str
    user_id: str
    chat_id: str
    path: str = ""
    detail: str = ""


@dataclass(frozen=True, slots=True)
class ActivityEntry(_Dictable):
    at: float
    event: str
    user_id: str | None
    chat_id: str | None
    detail: dict[str, Any]
