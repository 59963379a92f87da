"""Reconciling one session folder with its index (the disk is the truth), and the quota after a run.

Two ways to find what differs (the chat's modes of `models.Reconcile`), one way to apply it:

* `reconcile_folder` (FOLDER): list the whole folder (one lstat per entry) and compare with the
  session's rows;
* `_reconcile_changed.reconcile_changed` (CHANGED): look only at the paths a run changed;
* `apply`: write the differences in ONE write transaction that also makes the quota decision: it
  reads the user's totals across all chats inside that transaction (serialised per user), weighs
  the run's new and grown files with `Policy.plan_removals`, and indexes only what is kept; the files
  that go are unlinked right after. Two chats of one user finishing at once therefore cannot both
  spend the last room: the second one sees the first one's files.

Quota enforcement only ever removes files a run added or grew; files the index already knew and that
did not grow are never touched.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from . import _index
from ._backend import Tx
from ._core import ChatRef, Core
from ._fsops import fd_closing, open_dir, unlink_file, walk_dirs
from ._scan import Listing, Scan, scan
from .errors import FileMissing, InvalidPath
from .models import Growth, QuotaRemoval, ReconcileReport, Rejected, Usage
from .policy import Policy

_AUDIT_ITEMS = 100
# Empty folders kept per reconcile (a full one: the whole session; a change-driven one: the folders a run
# made). Code can make folders without end, each a few KiB of disk that no quota counts.
MAX_EMPTY_FOLDERS = 1000


@dataclass(slots=True)
class Differences:
    """What differs between a folder (as found) and its index rows.

    `found.files` holds (at least) every added and changed path; `old_sizes` the indexed size of
    every changed and removed path, `old_mtimes` the indexed mtime of every removed one."""

    found: Scan
    added: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    old_sizes: dict[str, int] = field(default_factory=dict)
    old_mtimes: dict[str, int] = field(default_factory=dict)
    full: bool = True

    def usage_delta(self) -> Usage:
        listing = self.found.files
        files = len(self.added) - len(self.removed)
        size = (
            sum(listing[p][0] for p in self.added)
            + sum(listing[p][0] - self.old_sizes[p] for p in self.changed)
            - sum(self.old_sizes[p] for p in self.removed)
        )
        return Usage(files, size)

    def growth(self) -> list[Growth]:
        """The files the quota weighs: every added one, and every changed one that grew. An added
        file with the size and mtime of a removed one is that file moved (a rename keeps both): it
        adds nothing, so it is not weighed."""
        listing = self.found.files
        moved_from: dict[tuple[int, int], int] = {}
        for path in self.removed:
            stat = (self.old_sizes[path], self.old_mtimes.get(path, -1))
            moved_from[stat] = moved_from.get(stat, 0) + 1
        items = []
        for path in self.added:
            stat = listing[path]
            if moved_from.get(stat):
                moved_from[stat] -= 1
                continue
            items.append(Growth(path, *stat, new=True))
        for path in self.changed:
            size, mtime_ns = listing[path]
            old = self.old_sizes[path]
            if size > old:
                items.append(Growth(path, size, mtime_ns, new=False, old_size=old))
        return items


def compare(found: Scan, index_rows: Iterable[tuple[str, int, int]]) -> Differences:
    """Walk the index rows once against the listing (this loop is most of a full reconcile's Python
    time on a big session; it runs in a worker thread)."""
    remaining = dict(found.files)
    pop = remaining.pop
    differences = Differences(found)
    changed, removed, old = differences.changed, differences.removed, differences.old_sizes
    unreadable = bool(found.unreadable)
    for path, size, mtime_ns in index_rows:
        seen = pop(path, None)
        if seen is None:
            if not (unreadable and found.is_unreadable(path)):
                removed.append(path)
                old[path] = size
                differences.old_mtimes[path] = mtime_ns
        elif seen[0] != size or seen[1] != mtime_ns:
            changed.append(path)
            old[path] = size
    differences.added = list(remaining)
    return differences


async def reconcile_folder(
    core: Core, ref: ChatRef, *, quotas: Policy | None, prior: Scan | None = None
) -> ReconcileReport:
    """List the whole folder and apply what differs. `prior`: what a change-driven attempt that fell
    back already rejected or renamed (those entries are gone now; the report still tells)."""

    async def read(tx: Tx) -> list[tuple[str, int, int]]:
        row = await _index.session_by_keys(tx, ref.user_key, ref.chat_key)
        return [] if row is None else await _index.file_rows(tx, row.id)

    # One after the other, not overlapped: the listing makes one system call per entry, each
    # releasing the GIL, and a second busy thread turns every one of those into a GIL hand-off
    # (measured: overlapping made a 100k-file reconcile about 50% slower).
    found = await asyncio.to_thread(scan, ref.path, fix=True)
    if prior is not None:
        found.rejected[:0] = prior.rejected
        found.renamed[:0] = prior.renamed
    index_rows = await core.read(read)
    differences = await asyncio.to_thread(compare, found, index_rows)
    return await apply(core, ref, differences, quotas=quotas)


# Up to this many changed paths, a reconcile's write names the session by its keys (write_by_keys).
_BY_KEYS_MAX = 64


async def apply(
    core: Core, ref: ChatRef, differences: Differences, *, quotas: Policy | None
) -> ReconcileReport:
    """Decide the quota and write the differences in one transaction; then unlink what goes."""
    found = differences.found
    listing: Listing = found.files
    if not differences.full and not (
        differences.added or differences.changed or differences.removed or found.rejected or found.renamed
    ):
        # Nothing changed (print(1)): nothing to write, only the totals to report.
        usage = await core.read(lambda tx: _index.session_usage(tx, ref.user_key, ref.chat_key))
        return ReconcileReport(files=usage.files, bytes=usage.bytes, full=False)
    if len(found.empty_folders) > MAX_EMPTY_FOLDERS:
        await asyncio.to_thread(_prune_empty_folders, ref, found)
    candidates = differences.growth() if quotas is not None else []
    delta = differences.usage_delta() if candidates else Usage(0, 0)
    now = time.time()

    # A step's few changes name the session by its keys: no statement waits for its id, and the
    # transaction is one round trip on PostgreSQL (two when the quota must be decided).
    by_keys = not differences.full and (
        len(differences.added) + len(differences.changed) + len(differences.removed) <= _BY_KEYS_MAX
    )

    async def write(tx: Tx) -> tuple[list[QuotaRemoval], Callable[[], Awaitable[tuple[int, int]]]]:
        sid = None
        if by_keys:
            await _index.ensure_session_queued(
                tx,
                user_id=ref.user_id,
                chat_id=ref.chat_id,
                user_key=ref.user_key,
                chat_key=ref.chat_key,
                temporary=ref.temporary,
                created_at=now,
            )
        else:
            sid = await core.session_id(tx, ref, now)
        removals: list[QuotaRemoval] = []
        if candidates and quotas is not None:
            await tx.serialise_user(ref.user_key)
            usage = await _index.user_usage(tx, ref.user_key)
            removals = quotas.plan_removals(
                candidates, Usage(usage.files + delta.files, usage.bytes + delta.bytes)
            )
        going = {r.path for r in removals}
        if sid is not None and differences.full:  # only a full listing tells no file has several links
            await _index.set_linked_files(tx, sid, len(found.linked))
        kept = [(p, *listing[p], now) for p in differences.added + differences.changed if p not in going]
        dropped = differences.removed + [p for p in differences.changed if p in going]
        if sid is None:
            if kept:
                await _index.upsert_files_by_keys(tx, ref.user_key, ref.chat_key, kept)
            if dropped:
                await _index.delete_files_by_keys(tx, ref.user_key, ref.chat_key, dropped)
        else:
            if kept:
                await _index.upsert_files(tx, sid, kept)
            if dropped:
                await _index.delete_files(tx, sid, dropped)
        await _audit(tx, ref, found, removals, now)
        if sid is None:
            return removals, await _index.session_usage_later(tx, ref.user_key, ref.chat_key)
        return removals, await _index.session_totals_later(tx, sid)

    removals, totals = await core.write(write)
    files, size = await totals()
    quota_removed: list[QuotaRemoval] = []
    if removals:
        # After the commit: a file that cannot be unlinked stays on disk, unindexed, and the next
        # reconcile weighs it again.
        gone = await asyncio.to_thread(_remove, ref, [r.path for r in removals])
        quota_removed = [r for r in removals if r.path in gone]
    going = {r.path for r in removals}
    return ReconcileReport(
        added=sorted(p for p in differences.added if p not in going),
        changed=sorted(p for p in differences.changed if p not in going),
        removed=sorted(differences.removed),
        rejected=found.rejected,
        renamed=found.renamed,
        quota_removed=quota_removed,
        files=files,
        bytes=size,
        full=differences.full,
    )


async def _audit(tx: Tx, ref: ChatRef, found: Scan, removals: list[QuotaRemoval], now: float) -> None:
    # The audit trail keeps the first _AUDIT_ITEMS of each list and the counts (a run can create a
    # million symlinks; the report has them all).
    who = (ref.user_id, ref.chat_id)
    if found.rejected or found.renamed:
        detail = {
            "rejected": [r.to_dict() for r in found.rejected[:_AUDIT_ITEMS]],
            "renamed": [r.to_dict() for r in found.renamed[:_AUDIT_ITEMS]],
            "rejected_count": len(found.rejected),
            "renamed_count": len(found.renamed),
        }
        await _index.log_activity(tx, now, "rejected", *who, detail)
    if removals:
        detail = {
            "removed": [r.to_dict() for r in removals[:_AUDIT_ITEMS]],
            "removed_count": len(removals),
            "bytes": sum(r.size for r in removals),
        }
        await _index.log_activity(tx, now, "quota_removed", *who, detail)


def _prune_empty_folders(ref: ChatRef, found: Scan) -> None:
    """Keep the MAX_EMPTY_FOLDERS shallowest empty folders, remove the others (reported as rejected)."""
    ordered = sorted(found.empty_folders, key=lambda p: (p.count("/"), p))
    with fd_closing(open_dir(ref.path)) as root:
        for path in ordered[MAX_EMPTY_FOLDERS:]:
            parts = tuple(path.split("/"))
            try:
                with fd_closing(walk_dirs(root, parts[:-1])) as parent:
                    os.rmdir(parts[-1], dir_fd=parent)
            except (FileMissing, InvalidPath, OSError):
                continue
            found.rejected.append(Rejected(path + "/", "empty folder"))
    found.empty_folders = ordered[:MAX_EMPTY_FOLDERS]


def _remove(ref: ChatRef, paths: list[str]) -> set[str]:
    """Delete files chosen by the quota; returns those gone from disk afterwards."""
    gone: set[str] = set()
    with fd_closing(open_dir(ref.path)) as root:
        for path in paths:
            try:
                unlink_file(root, tuple(path.split("/")))
            except FileMissing:
                pass
            except (InvalidPath, OSError):
                continue
            gone.add(path)
    return gone
