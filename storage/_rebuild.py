"""Rebuilding the index from disk, and checking the index against disk without changing anything."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ._db import Tx
from ._index import all_sessions, log_activity, refresh_totals
from ._keys import id_key
from ._layout import read_sidecar, write_sidecar
from ._lock import FileLock, is_locked
from ._publish import copy_present
from ._scan import scan
from .models import Drift, RebuildReport, ReconcileReport

if TYPE_CHECKING:
    from .store import Store


async def rebuild(store: Store) -> RebuildReport:
    """Reconcile every session folder (creating rows from sidecars) and drop rows without a folder.

    Sessions in use are skipped: their own reconcile at the end of the run will index them.
    Quotas are not enforced: a rebuild must never delete a user's files.
    """
    from .session import Session

    layout = store._layout
    on_disk = await asyncio.to_thread(layout.session_keys_on_disk)
    rows = {(r.user_key, r.chat_key): r for r in await store._db.read(all_sessions)}
    totals = {"sessions": 0, "in_use": 0, "no_sidecar": 0, "files": 0, "bytes": 0}
    counts = {"added": 0, "changed": 0, "removed": 0}
    rejected, renamed = [], []

    for user_key, chat_key in on_disk:
        ids = await asyncio.to_thread(
            read_sidecar, layout.sidecar_path(user_key, chat_key), user_key, chat_key
        )
        row = rows.get((user_key, chat_key))
        if ids is not None:
            user_id, chat_id, created = ids["user_id"], ids["chat_id"], ids["created_at"]
        elif row is not None and (id_key(row.user_id), id_key(row.chat_id)) == (user_key, chat_key):
            # The index still knows the real ids: put the lost sidecar back.
            user_id, chat_id, created = row.user_id, row.chat_id, row.created_at
            await asyncio.to_thread(
                write_sidecar, layout.sidecar_path(user_key, chat_key), user_id, chat_id, created
            )
        elif row is not None:
            totals["no_sidecar"] += 1
            user_id, chat_id, created = row.user_id, row.chat_id, row.created_at
        else:
            # No way to know the real ids: keep the files, under ids that say so.
            totals["no_sidecar"] += 1
            user_id, chat_id, created = f"unknown:{user_key}", f"unknown:{chat_key}", None
        # The folder decides where the files are, whatever the ids hash to.
        session = Session._at_keys(store, user_id, chat_id, user_key, chat_key)
        lock = FileLock(layout.lock_path(user_key, chat_key))
        if not lock.try_acquire():
            totals["in_use"] += 1
            continue
        try:
            created_at = created if created is not None else time.time()
            sid = await store._db.write(lambda tx, s=session, c=created_at: s._session_id(tx, c))
            report: ReconcileReport = await session.reconcile(enforce_quotas=False)
            # Repair the cached totals too, whatever happened to them, and report the repaired ones.
            files, size = await store._db.write(lambda tx, i=sid: refresh_totals(tx, i))
        finally:
            lock.release()
        totals["sessions"] += 1
        totals["files"] += files
        totals["bytes"] += size
        counts["added"] += len(report.added)
        counts["changed"] += len(report.changed)
        counts["removed"] += len(report.removed)
        rejected.extend(report.rejected)
        renamed.extend(report.renamed)

    present = set(on_disk)
    gone = [r for key, r in rows.items() if key not in present]
    rows_removed = 0
    for row in gone:
        lock = FileLock(layout.lock_path(row.user_key, row.chat_key))
        if not lock.try_acquire():
            continue
        try:
            if layout.session_dir(row.user_key, row.chat_key).is_dir():
                continue

            async def drop(tx: Tx, sid: int = row.id) -> None:
                await tx.run("DELETE FROM sessions WHERE id = ?", (sid,))

            await store._db.write(drop)
            rows_removed += 1
        finally:
            lock.release()

    result = RebuildReport(
        sessions=totals["sessions"],
        sessions_in_use=totals["in_use"],
        sessions_without_sidecar=totals["no_sidecar"],
        rows_removed=rows_removed,
        files=totals["files"],
        bytes=totals["bytes"],
        added=counts["added"],
        changed=counts["changed"],
        removed=counts["removed"],
        rejected=rejected,
        renamed=renamed,
    )
    now = time.time()
    detail = {k: v for k, v in result.to_dict().items() if k not in ("rejected", "renamed")}
    detail["rejected"] = len(rejected)

    async def record(tx: Tx) -> None:
        await log_activity(tx, now, "rebuild", detail=detail)

    await store._db.write(record)
    return result


async def check(store: Store) -> list[Drift]:
    layout = store._layout
    drift: list[Drift] = []
    on_disk = set(await asyncio.to_thread(layout.session_keys_on_disk))
    rows = await store._db.read(all_sessions)
    indexed = {(r.user_key, r.chat_key) for r in rows}

    for user_key, chat_key in sorted(on_disk - indexed):
        ids = read_sidecar(layout.sidecar_path(user_key, chat_key), user_key, chat_key) or {}
        drift.append(
            Drift(
                "session not indexed",
                ids.get("user_id", f"unknown:{user_key}"),
                ids.get("chat_id", f"unknown:{chat_key}"),
                detail=str(layout.session_dir(user_key, chat_key)),
            )
        )

    for row in rows:
        key = (row.user_key, row.chat_key)
        folder = layout.session_dir(*key)
        if key not in on_disk:
            drift.append(Drift("session folder missing", row.user_id, row.chat_id, detail=str(folder)))
            continue
        if is_locked(layout.lock_path(*key)):
            continue  # a run is writing into it: differences are expected until its reconcile
        found = await asyncio.to_thread(scan, folder, fix=False)
        index = {
            p: (size, mtime_ns)
            for p, size, mtime_ns in await store._db.read(
                lambda tx, sid=row.id: tx.all(
                    "SELECT path, size, mtime_ns FROM files WHERE session_id = ?", (sid,)
                )
            )
        }
        who = (row.user_id, row.chat_id)
        for path in sorted(found.files.keys() - index.keys()):
            drift.append(Drift("file not indexed", *who, path))
        for path in sorted(index.keys() - found.files.keys()):
            if not found.is_unreadable(path):
                drift.append(Drift("file missing", *who, path))
        for path in sorted(found.files.keys() & index.keys()):
            if found.files[path] != index[path]:
                (size, mtime_ns), (isize, imtime) = found.files[path], index[path]
                drift.append(
                    Drift(
                        "file changed",
                        *who,
                        path,
                        f"disk {size} B mtime {mtime_ns}, index {isize} B mtime {imtime}",
                    )
                )
        for item in found.rejected:
            drift.append(Drift("special file", *who, item.path, item.kind))
        for item in found.renamed:
            drift.append(Drift("bad name", *who, item.old, "not valid UTF-8"))
        files, size = len(index), sum(s for s, _ in index.values())
        if (files, size) != (row.file_count, row.bytes):
            drift.append(
                Drift(
                    "totals mismatch",
                    *who,
                    detail=f"session row says {row.file_count} files / {row.bytes} B, "
                    f"rows sum to {files} / {size}",
                )
            )

    links = await store._db.read(
        lambda tx: tx.all(
            "SELECT l.token, l.directory, l.name, l.path, s.user_id, s.chat_id"
            " FROM links l LEFT JOIN sessions s ON s.id = l.session_id"
        )
    )

    def missing_copies() -> list[Drift]:
        return [
            Drift("link copy missing", user_id or "", chat_id or "", path, token)
            for token, directory, name, path, user_id, chat_id in links
            if not copy_present(Path(directory), token, name)
        ]

    drift.extend(await asyncio.to_thread(missing_copies))
    return drift
