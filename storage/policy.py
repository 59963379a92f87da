"""Every limit the admin sets, decided in one place, each with the sentence a user reads.

The rest of the package asks the `Policy` and acts on the answer; nothing else compares a size or a
count with a limit. A decision is a pure function of the settings and of usage figures the caller
read from the index, so the callers decide *when* (inside which transaction) and this module decides
*what*:

* the per-file size: `file_too_large`;
* the per-user quota, across all of a user's chats (files and bytes, published copies included):
  `over_quota`, used before a run (`run_budget`), on writes (`refuse_write`), after a run
  (`plan_removals`) and when publishing (`refuse_publish`);
* new files per run: inside `plan_removals`;
* expiry: `session_expired`, `file_cutoff`, `activity_cutoff`.

Not here: the fixed bounds of what the index can key, which no setting changes and which refuse a
name rather than usage: a path's length (`_names.MAX_PATH_BYTES`) and an id's (`_core.MAX_ID_CHARS`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ._format import human_bytes, human_duration
from .errors import QuotaExceeded
from .models import Expiry, Growth, QuotaRemoval, Quotas, RunBudget, Usage

__all__ = ["CLEAR_FILES_COMMAND", "Policy"]

# What a user types in a chat to empty its folder (the function handles it; named here because the
# quota sentences tell the user about it).
CLEAR_FILES_COMMAND = "!clear-files"
# A run over quota still gets this much room to write in /mnt/data while it runs (temporary files,
# a small summary); whatever is over the quota when it ends is removed.
RUN_FLOOR_BYTES = 1024 * 1024
_WAY_OUT = f"Delete some files or old chats (or send {CLEAR_FILES_COMMAND} to empty this chat's folder)"


@dataclass(frozen=True, slots=True)
class Policy:
    """Quotas and expiry, and every decision made from them. Replace it to change the settings."""

    quotas: Quotas = field(default_factory=Quotas)
    expiry: Expiry = field(default_factory=Expiry)

    # ------------------------------------------------------------------ per-file size

    @property
    def max_file_bytes(self) -> int | None:
        return self.quotas.max_file_bytes

    def file_too_large(self, size: int) -> str | None:
        """Why a file of this size may not be kept, or None."""
        limit = self.max_file_bytes
        if limit is not None and size > limit:
            return f"larger than the {human_bytes(limit)} per-file limit"
        return None

    # ------------------------------------------------------------------ per-user quota

    def over_quota(self, usage: Usage) -> str | None:
        """Why a user with these totals (all chats) is over a limit, as a phrase, or None."""
        max_files = self.quotas.max_files_per_user
        max_bytes = self.quotas.max_bytes_per_user
        if max_files is not None and usage.files > max_files:
            return f"over the limit of {max_files} files across all your chats"
        if max_bytes is not None and usage.bytes > max_bytes:
            return f"over the {human_bytes(max_bytes)} storage limit across all your chats"
        return None

    def room(self, usage: Usage) -> int | None:
        """Bytes the user may still add across all chats; None when there is no byte limit."""
        max_bytes = self.quotas.max_bytes_per_user
        return None if max_bytes is None else max(0, max_bytes - usage.bytes)

    def run_budget(self, usage: Usage) -> RunBudget:
        """What one run may write while it runs. A run is never refused for the quota: one that
        starts with nothing to spend can still delete or shrink files, and `note` says so."""
        room = self.room(usage)
        max_files = self.quotas.max_files_per_user
        full = (room is not None and room == 0) or (max_files is not None and usage.files >= max_files)
        note = None
        if full:
            limits = []
            if max_files is not None and usage.files >= max_files:
                limits.append(f"{max_files} files (you have {usage.files})")
            if room == 0:
                limits.append(
                    f"{human_bytes(self.quotas.max_bytes_per_user)} (you use {human_bytes(usage.bytes)})"
                )
            note = (
                f"You are at your storage limit of {' and '.join(limits)} across your chats: this run "
                "can read, delete or shrink files, but anything it adds is removed when it ends. "
                f"{_WAY_OUT}."
            )
        write = None if room is None else max(room, RUN_FLOOR_BYTES)
        return RunBudget(max_write_bytes=write, max_file_bytes=self.max_file_bytes, note=note)

    def refuse_write(self, usage: Usage, size: int, *, replacing: int | None) -> None:
        """Raise QuotaExceeded if saving a file of `size` (replacing one of `replacing` bytes, or a new
        one) is not allowed for a user with these totals."""
        too_large = self.file_too_large(size)
        if too_large is not None:
            raise QuotaExceeded(f"The file is {human_bytes(size)}, {too_large}.")
        after = Usage(
            usage.files + (0 if replacing is not None else 1), usage.bytes - (replacing or 0) + size
        )
        if self.over_quota(after) is None:
            return
        max_files = self.quotas.max_files_per_user
        if max_files is not None and after.files > max_files:
            raise QuotaExceeded(
                f"You have reached the limit of {max_files} files across your chats. {_WAY_OUT}."
            )
        raise QuotaExceeded(
            f"Saving this {human_bytes(size)} file would exceed your storage limit of "
            f"{human_bytes(self.quotas.max_bytes_per_user)} across your chats (you use "
            f"{human_bytes(usage.bytes)}). {_WAY_OUT}."
        )

    def plan_removals(self, candidates: Sequence[Growth], usage_after: Usage) -> list[QuotaRemoval]:
        """Which of a run's new or grown files go, with why. `usage_after` is the user's totals with
        every candidate kept. Files the index already knew and that did not grow are never candidates.

        Order: any file larger than the per-file limit; new files beyond the per-run count (the oldest
        by mtime, then path, are kept); then, while the user is over the quota, the remaining
        candidates newest first (the files written last are the ones that pushed the user over):
        over the file count, only new files; over the bytes, new or grown ones. A removed file goes
        whole, a grown one with the bytes it had before the run."""
        removals: list[QuotaRemoval] = []
        kept: list[Growth] = []
        for item in candidates:
            reason = self.file_too_large(item.size)
            if reason is not None:
                removals.append(QuotaRemoval(item.path, item.size, reason))
            else:
                kept.append(item)
        kept.sort(key=lambda g: (g.mtime_ns, g.path))
        per_run = self.quotas.max_new_files_per_run
        if per_run is not None:
            new = [g for g in kept if g.new]
            if len(new) > per_run:
                extra = {g.path for g in new[per_run:]}
                reason = f"more than the {per_run} new files allowed in one run"
                removals.extend(QuotaRemoval(g.path, g.size, reason) for g in new[per_run:])
                kept = [g for g in kept if g.path not in extra]
        # A removed file goes whole (a grown one with its old bytes too), and leaves the file count.
        files = usage_after.files - len(removals)
        size = usage_after.bytes - sum(r.size for r in removals)
        max_files = self.quotas.max_files_per_user
        newest = list(reversed(kept))
        newest_new = [g for g in newest if g.new]
        gone: set[str] = set()
        any_at = new_at = 0  # next candidate in each list (both only move forward)
        while (reason := self.over_quota(Usage(files, size))) is not None:
            # Growing a file adds no file: only new files answer for the file count.
            if max_files is not None and files > max_files:
                while new_at < len(newest_new) and newest_new[new_at].path in gone:
                    new_at += 1
                if new_at == len(newest_new):
                    break
                item = newest_new[new_at]
            else:
                while any_at < len(newest) and newest[any_at].path in gone:
                    any_at += 1
                if any_at == len(newest):
                    break
                item = newest[any_at]
            gone.add(item.path)
            removals.append(QuotaRemoval(item.path, item.size, reason))
            files -= 1
            size -= item.size
        return removals

    def publish_ceiling(self, size: int) -> int | None:
        """The most bytes a user may use already for a copy of `size` bytes to be allowed (None: any);
        what `refuse_publish` decides, as a number a database can compare with."""
        max_bytes = self.quotas.max_bytes_per_user
        return None if max_bytes is None or size <= 0 else max_bytes - size

    def refuse_publish(self, usage: Usage, size: int, path: str) -> None:
        """Published copies count toward the user's storage limit."""
        room = self.room(usage)
        ceiling = self.publish_ceiling(size)
        if ceiling is not None and usage.bytes > ceiling:
            raise QuotaExceeded(
                f"{path} was not linked: a copy for download would take {human_bytes(size)} and your "
                f"storage limit of {human_bytes(self.quotas.max_bytes_per_user)} across your chats has "
                f"{human_bytes(room)} left (copies count toward it). {_WAY_OUT}."
            )

    # ------------------------------------------------------------------ expiry

    def session_expired(self, *, temporary: bool, idle_s: float) -> str | None:
        """Why a session idle this long is deleted by the expiry policy, or None."""
        limit = self.expiry.temporary_idle_s if temporary else self.expiry.session_idle_s
        if limit and idle_s > limit:
            kind = "temporary chat " if temporary else ""
            return f"{kind}idle for {human_duration(round(idle_s))} (limit {human_duration(limit)})"
        return None

    def file_cutoff(self, now: float) -> float | None:
        """Files the index last saw change before this time are deleted; None: files never expire."""
        age = self.expiry.file_max_age_s
        return now - age if age else None

    def file_expiry_reason(self) -> str:
        return f"files unchanged for more than {human_duration(self.expiry.file_max_age_s)}"

    def activity_cutoff(self, now: float) -> float | None:
        age = self.expiry.activity_max_age_s
        return now - age if age else None
