"""Reconcile: make the index match a session folder, then enforce quotas on what is new.

The cost follows the directory listing (one lstat per entry); only differences are written, in one
transaction. Quota enforcement never deletes a file the index already knew: only files that appeared
since the last reconcile (i.e. during this run) can be removed, in this order:
  1. any new file larger than max_file_bytes;
  2. new files beyond max_new_files_per_run (the oldest by mtime, then path, are kept);
  3. while the user's totals across all chats exceed max_files_per_user / max_bytes_per_user, the
     remaining new files, newest first.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ._db import Tx
from ._format import human_bytes
from ._fsops import fd_closing, open_dir, unlink_file, walk_dirs
from ._index import log_activity, session_by_keys, session_totals, user_totals
from ._scan import Listing, Scan, scan
from .errors import FileMissing, InvalidPath
from .models import QuotaRemoval, Quotas, ReconcileReport, Rejected

if TYPE_CHECKING:
    from .session import Session

_UPSERT = (
    "INSERT INTO files (session_id, path, size, mtime_ns, first_seen, last_changed) VALUES (?, ?, ?, ?, ?, ?)"
    " ON CONFLICT (session_id, path) DO UPDATE"
    " SET size = excluded.size, mtime_ns = excluded.mtime_ns, last_changed = excluded.last_changed"
)
_DELETE = "DELETE FROM files WHERE session_id = ? AND path = ?"
_AUDIT_ITEMS = 100
# Empty folders kept per reconcile (a full one: the whole session; a change-driven one: the folders
# a run made). Code can make folders without end, each a few KiB of disk that no quota counts.
MAX_EMPTY_FOLDERS = 1000


@dataclass(frozen=True, slots=True)
class NewFile:
    path: str
    size: int
    mtime_ns: int


def plan_quota(
    new: Sequence[NewFile],
    quotas: Quotas,
    *,
    user_files: int,
    user_bytes: int,
) -> list[QuotaRemoval]:
    """Which new files to remove. user_files/user_bytes are the user's totals with all new files counted."""
    removals: list[QuotaRemoval] = []
    max_file = quotas.max_file_bytes or None
    kept: list[NewFile] = []
    for f in new:
        if max_file is not None and f.size > max_file:
            reason = f"larger than the {human_bytes(max_file)} per-file limit"
            removals.append(QuotaRemoval(f.path, f.size, reason))
        else:
            kept.append(f)
    kept.sort(key=lambda f: (f.mtime_ns, f.path))
    per_run = quotas.max_new_files_per_run or None
    if per_run is not None and len(kept) > per_run:
        for f in kept[per_run:]:
            removals.append(
                QuotaRemoval(f.path, f.size, f"more than the {per_run} new files allowed in one run")
            )
        kept = kept[:per_run]
    files = user_files - len(removals)
    size = user_bytes - sum(r.size for r in removals)
    max_files = quotas.max_files_per_user or None
    max_bytes = quotas.max_bytes_per_user or None
    # Newest first: the files written last are the ones that pushed the user over.
    for f in sorted(kept, key=lambda f: (f.mtime_ns, f.path), reverse=True):
        if max_files is not None and files > max_files:
            reason = f"over the limit of {max_files} files across all your chats"
        elif max_bytes is not None and size > max_bytes:
            reason = f"over the {human_bytes(max_bytes)} storage limit across all your chats"
        else:
            break
        removals.append(QuotaRemoval(f.path, f.size, reason))
        files -= 1
        size -= f.size
    return removals


def diff(
    listing: Listing, index_rows: Iterable[tuple[str, int, int]], found: Scan
) -> tuple[list[str], list[str], list[str]]:
    """(added, changed, removed) paths. Walks the index rows once against the listing, without
    building a second dict (this loop is most of reconcile's Python time on big sessions)."""
    remaining = dict(listing)
    pop = remaining.pop
    changed: list[str] = []
    removed: list[str] = []
    unreadable = bool(found.unreadable)
    for path, size, mtime_ns in index_rows:
        seen = pop(path, None)
        if seen is None:
            if not (unreadable and found.is_unreadable(path)):
                removed.append(path)
        elif seen[0] != size or seen[1] != mtime_ns:
            changed.append(path)
    return list(remaining), changed, removed


async def reconcile(
    session: Session, *, enforce_quotas: bool, quotas: Quotas, prior: Scan | None = None
) -> ReconcileReport:
    """The full reconcile: list the whole folder. `prior`: what a change-driven attempt that fell
    back already rejected or renamed (those entries are gone now; the report still tells)."""
    db = session._store._db

    async def read(tx: Tx) -> tuple[list[tuple[str, int, int]], int, int]:
        row = await session_by_keys(tx, session.user_key, session.chat_key)
        rows: list[tuple[str, int, int]] = []
        if row is not None:
            rows = await tx.all("SELECT path, size, mtime_ns FROM files WHERE session_id = ?", (row.id,))  # type: ignore[assignment]
        _, files, size = await user_totals(tx, session.user_key, except_chat_key=session.chat_key)
        return rows, files, size

    # One after the other, not overlapped: the listing makes one system call per entry, each
    # releasing the GIL, and a second busy thread turns every one of those into a GIL hand-off
    # (measured: overlapping made a 100k-file reconcile about 50% slower).
    found = await asyncio.to_thread(scan, session.path, fix=True)
    if prior is not None:
        found.rejected[:0] = prior.rejected
        found.renamed[:0] = prior.renamed
    index_rows, other_files, other_bytes = await db.read(read)
    listing = found.files
    added, changed, removed = diff(listing, index_rows, found)
    del index_rows
    return await apply(
        session,
        found,
        added,
        changed,
        removed,
        enforce_quotas=enforce_quotas,
        quotas=quotas,
        user_files=other_files + len(listing),
        user_bytes=other_bytes + sum(size for size, _ in listing.values()),
        full=True,
    )


async def apply(
    session: Session,
    found: Scan,
    added: list[str],
    changed: list[str],
    removed: list[str],
    *,
    enforce_quotas: bool,
    quotas: Quotas,
    user_files: int,
    user_bytes: int,
    full: bool,
) -> ReconcileReport:
    """Enforce quotas on the added files, write the differences, report. Shared by the full and the
    change-driven reconcile: found.files holds (at least) every added and changed path;
    user_files / user_bytes are the user's totals with the session as found on disk."""
    db = session._store._db
    listing = found.files
    if len(found.empty_folders) > MAX_EMPTY_FOLDERS:
        await asyncio.to_thread(_prune_empty_folders, session, found)
    quota_removed: list[QuotaRemoval] = []
    if enforce_quotas and added:
        new = [NewFile(p, *listing[p]) for p in added]
        plan = plan_quota(new, quotas, user_files=user_files, user_bytes=user_bytes)
        if plan:
            gone = await asyncio.to_thread(_remove, session, [r.path for r in plan])
            quota_removed = [r for r in plan if r.path in gone]
            for path in gone:
                listing.pop(path, None)
            added = [p for p in added if p not in gone]

    now = time.time()
    upserts = [(p, *listing[p], now, now) for p in added + changed]

    async def write(tx: Tx) -> tuple[int, int]:
        sid = await session._session_id(tx, now)
        if full:  # only a full listing can tell that no file of the session has several links
            await tx.run(
                "UPDATE sessions SET linked_files = ? WHERE id = ? AND linked_files != ?",
                (len(found.linked), sid, len(found.linked)),
            )
        if upserts:
            await tx.many(_UPSERT, [(sid, *u) for u in upserts])
        if removed:
            await tx.many(_DELETE, [(sid, p) for p in removed])
        who = (session.user_id, session.chat_id)
        # The audit trail keeps the first _AUDIT_ITEMS of each list and the counts (a run can create
        # a million symlinks; the report has them all).
        if found.rejected or found.renamed:
            detail = {
                "rejected": [r.to_dict() for r in found.rejected[:_AUDIT_ITEMS]],
                "renamed": [r.to_dict() for r in found.renamed[:_AUDIT_ITEMS]],
                "rejected_count": len(found.rejected),
                "renamed_count": len(found.renamed),
            }
            await log_activity(tx, now, "rejected", *who, detail)
        if quota_removed:
            detail = {
                "removed": [r.to_dict() for r in quota_removed[:_AUDIT_ITEMS]],
                "removed_count": len(quota_removed),
                "bytes": sum(r.size for r in quota_removed),
            }
            await log_activity(tx, now, "quota_removed", *who, detail)
        return await session_totals(tx, sid)

    files, size = await db.write(write)
    return ReconcileReport(
        added=sorted(added),
        changed=sorted(changed),
        removed=sorted(removed),
        rejected=found.rejected,
        renamed=found.renamed,
        quota_removed=quota_removed,
        files=files,
        bytes=size,
        full=full,
    )


def _prune_empty_folders(session: Session, found: Scan) -> None:
    """Keep the MAX_EMPTY_FOLDERS shallowest empty folders, remove the others (reported as rejected)."""
    ordered = sorted(found.empty_folders, key=lambda p: (p.count("/"), p))
    with fd_closing(open_dir(session.path)) as root:
        for path in ordered[MAX_EMPTY_FOLDERS:]:
            parts = tuple(path.split("/"))
            try:
                with fd_closing(walk_dirs(root, parts[:-1])) as parent:
                    os.rmdir(parts[-1], dir_fd=parent)
            except (FileMissing, InvalidPath, OSError):
                continue
            found.rejected.append(Rejected(path + "/", "empty folder"))
    found.empty_folders = ordered[:MAX_EMPTY_FOLDERS]


def _remove(session: Session, paths: list[str]) -> set[str]:
    """Delete files chosen by quota enforcement; returns those gone from disk afterwards."""
    gone: set[str] = set()
    with fd_closing(open_dir(session.path)) as root:
        for path in paths:
            try:
                unlink_file(root, tuple(path.split("/")))
            except FileMissing:
                pass
            except (InvalidPath, OSError):
                continue
            gone.add(path)
    return gone
