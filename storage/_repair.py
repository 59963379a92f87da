"""The disk is the truth: the store-wide modes of `Reconcile` (REBUILD: the index from every folder;
INTERRUPTED: what runs whose process died left behind; the sessions a full disk left unsaved), the
links taken back from their records, and `check` (the index against the disk, changing nothing)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import time
from typing import Any

from . import _index, _index_links
from ._backend import Tx
from ._core import Core
from ._keys import id_key
from ._layout import read_sidecar, write_sidecar
from ._publish import folder_copy_present, link_records
from ._reconcile import reconcile_folder
from ._scan import Scan, scan
from .errors import DiskFull
from .models import Drift, RebuildReport
from .publishing import DirectoryPublisher

log = logging.getLogger("code_sessions.storage")


async def reconcile_rebuild(core: Core) -> RebuildReport:
    """Reconcile every session folder (creating rows from sidecars) and drop rows without a folder.

    Sessions in use are skipped: their own reconcile at the end of the run will index them. Quotas are
    not enforced: a rebuild must never delete a user's files.
    """
    layout = core.layout
    on_disk = await asyncio.to_thread(layout.session_keys_on_disk)
    rows = {(r.user_key, r.chat_key): r for r in await core.read(_index.all_sessions)}
    totals = {"sessions": 0, "in_use": 0, "no_sidecar": 0, "files": 0, "bytes": 0}
    counts = {"added": 0, "changed": 0, "removed": 0}
    rejected, renamed = [], []

    for user_key, chat_key in on_disk:
        ids = await asyncio.to_thread(
            read_sidecar, layout.sidecar_path(user_key, chat_key), user_key, chat_key
        )
        row = rows.get((user_key, chat_key))
        temporary = row is not None and row.temporary
        if ids is not None:
            user_id, chat_id, created = ids["user_id"], ids["chat_id"], ids["created_at"]
            temporary = temporary or ids["temporary"]
        elif row is not None and (id_key(row.user_id), id_key(row.chat_id)) == (user_key, chat_key):
            # The index still knows the real ids: put the lost sidecar back.
            user_id, chat_id, created = row.user_id, row.chat_id, row.created_at
            await asyncio.to_thread(
                write_sidecar, layout.sidecar_path(user_key, chat_key), user_id, chat_id, created, temporary
            )
        elif row is not None:
            totals["no_sidecar"] += 1
            user_id, chat_id, created = row.user_id, row.chat_id, row.created_at
        else:
            # No way to know the real ids: keep the files, under ids that say so.
            totals["no_sidecar"] += 1
            user_id, chat_id, created = f"unknown:{user_key}", f"unknown:{chat_key}", None
        ref = core.ref_at(user_id, chat_id, user_key, chat_key, recorded_temporary=temporary)
        lock = core.lock_of(ref)
        if not await lock.try_acquire():
            totals["in_use"] += 1
            continue
        try:
            created_at = created if created is not None else time.time()
            sid = await core.write(functools.partial(core.session_id, ref=ref, created_at=created_at))
            report = await reconcile_folder(core, ref, quotas=None)
            # Repair the cached totals too, whatever happened to them, and report the repaired ones.
            files, size = await core.write(functools.partial(_index.refresh_totals, session_id=sid))
        finally:
            await lock.release()
        totals["sessions"] += 1
        totals["files"] += files
        totals["bytes"] += size
        counts["added"] += len(report.added)
        counts["changed"] += len(report.changed)
        counts["removed"] += len(report.removed)
        rejected.extend(report.rejected)
        renamed.extend(report.renamed)

    present = set(on_disk)
    rows_removed = 0
    for key, row in rows.items():
        if key in present:
            continue
        lock = core.backend.chat_lock(row.user_key, row.chat_key)
        if not await lock.try_acquire():
            continue
        try:
            if layout.session_dir(row.user_key, row.chat_key).is_dir():
                continue
            await core.write(functools.partial(_index.delete_session, session_id=row.id))
            rows_removed += 1
        finally:
            await lock.release()

    links = await reconcile_links(core)
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
        links=links,
    )
    detail = {k: v for k, v in result.to_dict().items() if k not in ("rejected", "renamed")}
    detail["rejected"] = len(rejected)
    await core.log("rebuild", detail=detail)
    return result


async def reconcile_links(core: Core) -> int:
    """Links of published copies the index does not know, taken back from their records (an index
    lost or replaced): old answers keep working. Returns how many were taken back."""
    records = await asyncio.to_thread(link_records, core)
    if not records:
        return 0
    known = {(kind, ref) for ref, kind, *_ in await core.read(_index_links.links_with_owners)}
    sessions = {(r.user_key, r.chat_key): r.id for r in await core.read(_index.all_sessions)}
    wanted = [
        rec
        for rec in records
        if (rec["kind"], rec["ref"]) not in known and (rec["user_key"], rec["chat_key"]) in sessions
    ]
    publisher = core.publisher
    others = [rec["ref"] for rec in wanted if rec["kind"] != DirectoryPublisher.kind]
    gone = await publisher.missing(others) if publisher is not None and others else set()

    def present(rec: dict[str, Any]) -> bool:
        if rec["kind"] == DirectoryPublisher.kind:
            return folder_copy_present(rec["directory"], rec["ref"], rec["name"])
        if publisher is None or rec["kind"] != publisher.kind:
            # No publisher of that kind here (the CLI rebuilding an index of an application that
            # publishes to Open WebUI's files): keep the record's word. A link row for a copy that is
            # gone only fails to open; a copy without a row would be deleted as a stray.
            return True
        return rec["ref"] not in gone

    adopt = [rec for rec in await asyncio.to_thread(lambda: [r for r in wanted if present(r)])]
    if not adopt:
        return 0

    async def write(tx: Tx) -> None:
        for rec in adopt:
            await _index_links.insert_link(
                tx,
                sessions[(rec["user_key"], rec["chat_key"])],
                ref=rec["ref"],
                kind=rec["kind"],
                path=rec["path"],
                name=rec["name"],
                url=rec["url"],
                directory=rec["directory"],
                size=int(rec["size"]),
                mtime_ns=int(rec["mtime_ns"]),
                inode=int(rec["inode"]),
                ctime_ns=int(rec["ctime_ns"]),
                sha256=str(rec["sha256"]),
                now=float(rec["created_at"]),
            )

    await core.write(write)
    return len(adopt)


async def reconcile_interrupted(core: Core) -> None:
    """Index the folders of runs whose process ended before their reconcile (a crash, a kill): their
    files would otherwise stay out of the index, the quotas and expiry until the chat's next run. A
    run still going on in another process holds its lock and is left alone."""
    layout = core.layout
    for user_key, chat_key in await asyncio.to_thread(layout.running_markers):
        lock = core.backend.chat_lock(user_key, chat_key)
        if not await lock.try_acquire():
            continue
        try:
            by_keys = functools.partial(_index.session_by_keys, user_key=user_key, chat_key=chat_key)
            row = await core.read(by_keys)
            if row is None or not layout.session_dir(user_key, chat_key).is_dir():
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(layout.running_marker(user_key, chat_key))
                continue
            ref = core.ref_at(row.user_id, row.chat_id, user_key, chat_key, recorded_temporary=row.temporary)
            # Like rebuild, recovery never deletes files: the totals count them, so a user over a
            # limit has nothing to spend at the next run.
            report = await reconcile_folder(core, ref, quotas=None)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(layout.running_marker(user_key, chat_key))
        finally:
            await lock.release()
        log.warning(
            "a run in chat %r of user %r ended with its process before its files were indexed; "
            "indexed them now: %s",
            row.chat_id,
            row.user_id,
            report.summary(),
        )
        await core.log("interrupted_run", row.user_id, row.chat_id, {"summary": report.summary()})


async def reconcile_unsaved(core: Core) -> None:
    """Write the sidecar and row of each session used while the disk was full, and index its folder
    (never deleting: like a rebuild). One in use elsewhere is left for a later call. Raises DiskFull
    when the disk is still full."""
    for key, ref in list(core.unsaved.items()):
        lock = core.lock_of(ref)
        if not await lock.try_acquire():
            continue
        try:
            if not ref.path.is_dir():
                core.unsaved.pop(key, None)
                continue
            try:
                created = await asyncio.to_thread(core.make_dirs, ref)
            except OSError as error:
                if error.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise DiskFull() from error
                log.warning("could not save the session of chat %r: %s", ref.chat_id, error)
                core.unsaved.pop(key, None)
                continue
            await core.write(functools.partial(core.session_id, ref=ref, created_at=created))
            await reconcile_folder(core, ref, quotas=None)
            core.unsaved.pop(key, None)
        finally:
            await lock.release()


async def check(core: Core) -> list[Drift]:
    """Differences between the index and the disk; changes nothing. Sessions in use are skipped."""
    layout = core.layout
    drift: list[Drift] = []
    on_disk = set(await asyncio.to_thread(layout.session_keys_on_disk))
    rows = await core.read(_index.all_sessions)
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
        if await core.backend.chat_locked(*key):
            continue  # a run is writing into it: differences are expected until its reconcile
        found = await asyncio.to_thread(scan, folder, fix=False)
        index_rows = await core.read(functools.partial(_index.file_rows, session_id=row.id))
        drift.extend(await asyncio.to_thread(_compare, row, found, index_rows))

    for user_key, chat_key, size in await asyncio.to_thread(layout.saved_states):
        if (user_key, chat_key) not in indexed:
            ids = read_sidecar(layout.sidecar_path(user_key, chat_key), user_key, chat_key) or {}
            drift.append(
                Drift(
                    "stray saved state",
                    ids.get("user_id", f"unknown:{user_key}"),
                    ids.get("chat_id", f"unknown:{chat_key}"),
                    detail=f"{layout.saved_state(user_key, chat_key)} ({size} B)",
                )
            )

    drift.extend(await _link_drift(core))
    return drift


def _compare(row: _index.ChatRow, found: Scan, index_rows: list[tuple[str, int, int]]) -> list[Drift]:
    drift: list[Drift] = []
    index = {p: (int(size), int(mtime_ns)) for p, size, mtime_ns in index_rows}
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
    for renamed in found.renamed:
        drift.append(Drift("bad name", *who, renamed.old, "not valid UTF-8"))
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
    return drift


async def _link_drift(core: Core) -> list[Drift]:
    """Links whose copy is missing (folder copies are looked at here; the publisher is asked about
    its own), and copies of ours that no link knows (strays)."""
    links = await core.read(_index_links.links_with_owners)
    drift: list[Drift] = []

    def folders() -> list[Drift]:
        return [
            Drift("link copy missing", user_id or "", chat_id or "", path, ref)
            for ref, kind, directory, name, path, user_id, chat_id in links
            if kind == DirectoryPublisher.kind and not folder_copy_present(directory, ref, name)
        ]

    drift.extend(await asyncio.to_thread(folders))
    publisher = core.publisher
    if publisher is not None and publisher.kind != DirectoryPublisher.kind:
        mine = [
            (ref, path, user_id, chat_id)
            for ref, kind, _, _, path, user_id, chat_id in links
            if kind == publisher.kind
        ]
        missing = await publisher.missing([ref for ref, *_ in mine])
        drift.extend(
            Drift("link copy missing", user_id or "", chat_id or "", path, ref)
            for ref, path, user_id, chat_id in mine
            if ref in missing
        )
    if publisher is not None:
        known = {ref for ref, kind, *_ in links if kind == publisher.kind}
        for ref in await publisher.strays(known, 0.0):
            drift.append(Drift("stray copy", "", "", detail=ref))
    return drift
