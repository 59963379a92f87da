"""Cleanup: expiry policy and purges, in one routine that is safe while runs are in progress.

Every session is deleted only while we hold its lock, taken without waiting: a session whose lock
is held (a sandbox is running in it) is skipped and counted as in use, never deleted under it. Under
the lock the decision is re-checked against the index (the chat may have been used meanwhile).

Deleting a session: its folder is renamed into trash/ (atomic for everyone else), its published
copies and index rows are removed, then the trash entry, sidecar and lock file. The lock file is
unlinked while still held; lockers verify the inode after acquiring (see _lock), so this is safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ._db import Tx
from ._format import human_duration
from ._fsops import fd_closing, open_dir, remove_tree, unlink_name_if_unchanged, walk_dirs
from ._index import SessionRow, all_sessions, get_meta, log_activity, session_by_keys
from ._keys import id_key
from ._lock import FileLock, is_locked
from ._publish import STAGING_PREFIX, TOKEN_RE, copy_present, remove_copy
from .errors import FileMissing, InvalidPath
from .models import CleanupReport, Purge, SessionCleanup

if TYPE_CHECKING:
    from .store import Store

# Published folders not in the index are removed only after this long, so a publish that has
# renamed its copy into place but not yet written its row is never swept.
STRAY_GRACE_S = 600.0
# Links whose file is missing from / changed in the index are kept this long, for a publish that ran
# before the reconcile of the same step.
STALE_LINK_GRACE_S = 600.0


@dataclass
class _Tally:
    dry_run: bool
    sessions_removed: int = 0
    files_removed: int = 0
    bytes_freed: int = 0
    links_removed: int = 0
    in_use: set[int] = field(default_factory=set)
    details: list[SessionCleanup] = field(default_factory=list)

    def report(self) -> CleanupReport:
        return CleanupReport(
            self.dry_run,
            self.sessions_removed,
            self.files_removed,
            self.bytes_freed,
            self.links_removed,
            len(self.in_use),
            self.details,
        )

    def busy(self, row: SessionRow, reason: str) -> None:
        if row.id not in self.in_use:
            self.in_use.add(row.id)
            self.details.append(SessionCleanup(row.user_id, row.chat_id, "in use", reason=reason))


async def cleanup(store: Store, purge: Purge | None, *, dry_run: bool) -> CleanupReport:
    now = time.time()
    tally = _Tally(dry_run)
    rows = await store._db.read(all_sessions)
    removed: set[int] = set()

    for row in rows:
        reason = _selected(row, purge, store, now)
        if reason is None:
            continue
        if await _remove_session(store, row, reason, purge, now, tally):
            removed.add(row.id)

    if purge is None and store.expiry.file_max_age_s:
        await _expire_files(store, now - store.expiry.file_max_age_s, removed, tally)

    await _vanished_sessions(store, removed, now, tally)
    await _stale_links(store, now, tally)
    await _stray_copies(store, now, tally)

    if not dry_run:
        await asyncio.to_thread(_empty_trash, store)
        report = tally.report()
        max_age = store.expiry.activity_max_age_s

        async def write(tx: Tx) -> None:
            if max_age:
                await tx.run("DELETE FROM activity WHERE at < ?", (now - max_age,))
            detail = {k: v for k, v in report.to_dict().items() if k not in ("details", "dry_run")}
            detail["purge"] = purge.to_dict() if purge is not None else None
            await log_activity(tx, now, "cleanup", detail=detail)

        await store._db.write(write)
        return report
    return tally.report()


def _selected(row: SessionRow, purge: Purge | None, store: Store, now: float) -> str | None:
    """Why this session should go, or None."""
    idle = now - row.last_used_at
    if purge is None:
        limit = store.expiry.temporary_idle_s if row.temporary else store.expiry.session_idle_s
        if limit and idle > limit:
            kind = "temporary chat " if row.temporary else ""
            return f"{kind}idle for {human_duration(round(idle))} (limit {human_duration(limit)})"
        return None
    if not purge.selects_anything:
        return None
    if purge.everything:
        return "purge: everything"
    if purge.user_id is not None and row.user_key != id_key(purge.user_id):
        return None
    if purge.chat_id is not None and row.chat_key != id_key(purge.chat_id):
        return None
    if purge.idle_longer_than_s is not None and not idle > purge.idle_longer_than_s:
        return None
    parts = []
    if purge.user_id is not None:
        parts.append("user")
    if purge.chat_id is not None:
        parts.append("chat")
    if purge.idle_longer_than_s is not None:
        parts.append(f"idle longer than {human_duration(purge.idle_longer_than_s, zero='0s')}")
    return "purge: " + ", ".join(parts)


async def _remove_session(
    store: Store, row: SessionRow, reason: str, purge: Purge | None, now: float, tally: _Tally
) -> bool:
    layout = store._layout
    lock_path = layout.lock_path(row.user_key, row.chat_key)
    if tally.dry_run:
        if is_locked(lock_path):
            tally.busy(row, reason)
            return False
        links = await store._db.read(
            lambda tx: tx.one("SELECT count(*) FROM links WHERE session_id = ?", (row.id,))
        )
        _count_session(tally, row, reason, int(links[0]) if links else 0)
        return True

    lock = FileLock(lock_path)
    if not lock.try_acquire():
        tally.busy(row, reason)
        return False
    deleted = False
    try:
        fresh = await store._db.read(lambda tx: session_by_keys(tx, row.user_key, row.chat_key))
        if fresh is None or _selected(fresh, purge, store, time.time()) is None:
            return False  # used again (or removed by someone else) since we looked
        links = await _delete_session(store, fresh, reason, now)
        _count_session(tally, fresh, reason, links)
        deleted = True
        return True
    finally:
        lock.release(unlink=deleted)
        if deleted:
            await asyncio.to_thread(_prune_parents, store, row)


def _count_session(tally: _Tally, row: SessionRow, reason: str, links: int) -> None:
    tally.sessions_removed += 1
    tally.files_removed += row.file_count
    tally.bytes_freed += row.bytes
    tally.links_removed += links
    tally.details.append(
        SessionCleanup(row.user_id, row.chat_id, "removed", row.file_count, row.bytes, reason)
    )


async def _delete_session(store: Store, row: SessionRow, reason: str, now: float) -> int:
    """Delete a session we hold the lock of; returns how many links went with it."""
    layout = store._layout
    folder = layout.session_dir(row.user_key, row.chat_key)
    trash = layout.trash / f"{row.chat_key}.{secrets.token_hex(6)}"

    def move() -> bool:
        try:
            os.rename(folder, trash)
        except FileNotFoundError:
            return False
        return True

    moved = await asyncio.to_thread(move)
    links = await store._db.read(
        lambda tx: tx.all("SELECT token, directory FROM links WHERE session_id = ?", (row.id,))
    )

    def remove_files() -> None:
        for token, directory in links:
            remove_copy(directory, token)
        if moved:
            remove_tree(trash)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(layout.sidecar_path(row.user_key, row.chat_key))

    async def write(tx: Tx) -> None:
        await tx.run("DELETE FROM links WHERE session_id = ?", (row.id,))
        await tx.run("DELETE FROM sessions WHERE id = ?", (row.id,))
        await log_activity(
            tx,
            now,
            "session_removed",
            row.user_id,
            row.chat_id,
            {"reason": reason, "files": row.file_count, "bytes": row.bytes, "links": len(links)},
        )

    await store._db.write(write)
    await asyncio.to_thread(remove_files)
    return len(links)


def _prune_parents(store: Store, row: SessionRow) -> None:
    # Empty per-user folders go too; creators retry if we remove one under them (see Store._make_dirs).
    layout = store._layout
    for folder in (layout.sessions / row.user_key, layout.state / row.user_key):
        with contextlib.suppress(OSError):
            os.rmdir(folder)


_EXPIRY_BATCH = 2000


async def _expire_files(store: Store, cutoff: float, skip: set[int], tally: _Tally) -> None:
    rows = await store._db.read(
        lambda tx: tx.all(
            "SELECT session_id, path, size, mtime_ns FROM files WHERE last_changed < ? ORDER BY session_id",
            (cutoff,),
        )
    )
    by_session: dict[int, list[tuple[str, int, int]]] = defaultdict(list)
    for sid, path, size, mtime_ns in rows:
        if sid not in skip:
            by_session[sid].append((path, size, mtime_ns))
    if not by_session:
        return
    sessions = {r.id: r for r in await store._db.read(all_sessions)}
    for sid, files in by_session.items():
        row = sessions.get(sid)
        if row is None:
            continue
        reason = f"files unchanged for more than {human_duration(store.expiry.file_max_age_s)}"
        lock_path = store._layout.lock_path(row.user_key, row.chat_key)
        if tally.dry_run:
            if is_locked(lock_path):
                tally.busy(row, reason)
                continue
            await _count_files(store, tally, row, files, reason)
            continue
        folder = store._layout.session_dir(row.user_key, row.chat_key)
        removed_files, removed_bytes = 0, 0
        # The chat's lock is held one batch at a time, so a user's next step waits for at most one
        # batch of unlinks, not for an old session's whole expiry.
        for start in range(0, len(files), _EXPIRY_BATCH):
            lock = FileLock(lock_path)
            if not lock.try_acquire():
                tally.busy(row, reason)
                break
            try:
                batch = files[start : start + _EXPIRY_BATCH]
                gone = await asyncio.to_thread(_unlink_unchanged, folder, batch)
                if gone:
                    tally.links_removed += await _forget_files(store, row, gone, reason)
            finally:
                lock.release()
            removed_files += len(gone)
            removed_bytes += sum(size for _, size in gone)
        if removed_files:
            tally.files_removed += removed_files
            tally.bytes_freed += removed_bytes
            cleanup = SessionCleanup(
                row.user_id, row.chat_id, "files expired", removed_files, removed_bytes, reason
            )
            tally.details.append(cleanup)


async def _count_files(
    store: Store, tally: _Tally, row: SessionRow, files: list[tuple[str, int, int]], reason: str
) -> None:
    paths = {p for p, _, _ in files}
    links = await store._db.read(lambda tx: tx.all("SELECT path FROM links WHERE session_id = ?", (row.id,)))
    size = sum(s for _, s, _ in files)
    tally.files_removed += len(files)
    tally.bytes_freed += size
    tally.links_removed += sum(1 for (p,) in links if p in paths)
    tally.details.append(SessionCleanup(row.user_id, row.chat_id, "files expired", len(files), size, reason))


def _unlink_unchanged(folder: Path, files: list[tuple[str, int, int]]) -> list[tuple[str, int]]:
    """Delete expired files that still match the index; each parent folder is opened once."""
    gone: list[tuple[str, int]] = []
    try:
        root = open_dir(folder)
    except (FileMissing, InvalidPath):
        return gone
    by_parent: dict[tuple[str, ...], list[tuple[str, int, int]]] = defaultdict(list)
    for path, size, mtime_ns in files:
        parts = tuple(path.split("/"))
        by_parent[parts[:-1]].append((path, size, mtime_ns))
    with fd_closing(root):
        for parent_parts, entries in by_parent.items():
            try:
                parent = walk_dirs(root, parent_parts)
            except (FileMissing, InvalidPath):
                continue
            with fd_closing(parent):
                for path, size, mtime_ns in entries:
                    if unlink_name_if_unchanged(parent, path.rsplit("/", 1)[-1], size, mtime_ns):
                        gone.append((path, size))
    return gone


async def _forget_files(store: Store, row: SessionRow, gone: list[tuple[str, int]], reason: str) -> int:
    """Drop index rows of deleted files, and their links. Returns the number of links removed."""
    paths = [p for p, _ in gone]
    now = time.time()

    async def write(tx: Tx) -> list[tuple[str, str]]:
        links: list[tuple[str, str]] = []
        await tx.run("CREATE TEMP TABLE IF NOT EXISTS _gone (path TEXT PRIMARY KEY) WITHOUT ROWID")
        await tx.run("DELETE FROM _gone")
        await tx.many("INSERT OR IGNORE INTO _gone (path) VALUES (?)", [(p,) for p in paths])
        links = [
            (t, d)
            for t, d in await tx.all(
                "SELECT token, directory FROM links"
                " WHERE session_id = ? AND path IN (SELECT path FROM _gone)",
                (row.id,),
            )
        ]
        await tx.run("DELETE FROM links WHERE session_id = ? AND path IN (SELECT path FROM _gone)", (row.id,))
        await tx.run("DELETE FROM files WHERE session_id = ? AND path IN (SELECT path FROM _gone)", (row.id,))
        await tx.run("DELETE FROM _gone")
        await log_activity(
            tx,
            now,
            "files_expired",
            row.user_id,
            row.chat_id,
            {"reason": reason, "files": len(gone), "bytes": sum(s for _, s in gone), "paths": paths[:100]},
        )
        return links

    links = await store._db.write(write)

    def remove() -> None:
        for token, directory in links:
            remove_copy(directory, token)

    await asyncio.to_thread(remove)
    return len(links)


async def _vanished_sessions(store: Store, removed: set[int], now: float, tally: _Tally) -> None:
    """Index rows whose session folder no longer exists (deleted by hand, or a crash mid-delete)."""
    layout = store._layout
    rows = [r for r in await store._db.read(all_sessions) if r.id not in removed]
    missing = await asyncio.to_thread(
        lambda: [r for r in rows if not layout.session_dir(r.user_key, r.chat_key).is_dir()]
    )
    for row in missing:
        reason = "session folder no longer exists"
        lock_path = layout.lock_path(row.user_key, row.chat_key)
        if tally.dry_run:
            if is_locked(lock_path):
                tally.busy(row, reason)
                continue
            tally.sessions_removed += 1
            tally.details.append(
                SessionCleanup(row.user_id, row.chat_id, "vanished", row.file_count, 0, reason)
            )
            continue
        lock = FileLock(lock_path)
        if not lock.try_acquire():
            tally.busy(row, reason)
            continue
        deleted = False
        try:
            if layout.session_dir(row.user_key, row.chat_key).is_dir():
                continue  # re-created meanwhile
            links = await _delete_session(store, row, reason, now)
            deleted = True
            tally.sessions_removed += 1
            tally.links_removed += links
            tally.details.append(
                SessionCleanup(row.user_id, row.chat_id, "vanished", row.file_count, 0, reason)
            )
        finally:
            lock.release(unlink=deleted)
            if deleted:
                await asyncio.to_thread(_prune_parents, store, row)


async def _stale_links(store: Store, now: float, tally: _Tally) -> None:
    """Links whose session is gone, whose file is gone or changed, expired, or whose copy vanished."""
    rows = await store._db.read(
        lambda tx: tx.all(
            "SELECT l.token, l.directory, l.name, l.created_at, l.expires_at,"
            " s.id IS NULL, f.path IS NULL, (f.size != l.size OR f.mtime_ns != l.mtime_ns)"
            " FROM links l LEFT JOIN sessions s ON s.id = l.session_id"
            " LEFT JOIN files f ON f.session_id = l.session_id AND f.path = l.path"
        )
    )

    def judge() -> list[tuple[str, str]]:
        stale: list[tuple[str, str]] = []
        for token, directory, name, created_at, expires_at, no_session, no_file, changed in rows:
            old = now - created_at > STALE_LINK_GRACE_S
            if (
                no_session
                or (expires_at is not None and expires_at <= now)
                or (old and (no_file or changed))
                or not copy_present(Path(directory), token, name)
            ):
                stale.append((token, directory))
        return stale

    stale = await asyncio.to_thread(judge)
    if not stale:
        return
    tally.links_removed += len(stale)
    if tally.dry_run:
        return

    async def write(tx: Tx) -> None:
        await tx.many("DELETE FROM links WHERE token = ?", [(t,) for t, _ in stale])

    await store._db.write(write)

    def remove() -> None:
        for token, directory in stale:
            remove_copy(directory, token)

    await asyncio.to_thread(remove)


async def _stray_copies(store: Store, now: float, tally: _Tally) -> None:
    """Published folders with no link row (crash after copying), and abandoned staging folders."""
    directory: Path | None = store.publisher.directory if store.publisher else None
    if directory is None:
        recorded = await store._db.read(lambda tx: get_meta(tx, "publish_dir"))
        directory = Path(recorded) if recorded else None
    if directory is None:
        return
    known = {t for (t,) in await store._db.read(lambda tx: tx.all("SELECT token FROM links"))}

    def find() -> list[Path]:
        strays: list[Path] = []
        with contextlib.suppress(FileNotFoundError, NotADirectoryError), os.scandir(directory) as entries:
            for entry in entries:
                name = entry.name
                ours = TOKEN_RE.fullmatch(name) or (
                    name.startswith(STAGING_PREFIX) and TOKEN_RE.fullmatch(name[len(STAGING_PREFIX) :])
                )
                if not ours or name in known or not entry.is_dir(follow_symlinks=False):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    if now - entry.stat(follow_symlinks=False).st_mtime > STRAY_GRACE_S:
                        strays.append(Path(entry.path))
        return strays

    strays = await asyncio.to_thread(find)
    tally.links_removed += len(strays)
    if strays and not tally.dry_run:

        def remove() -> None:
            for path in strays:
                remove_tree(path)

        await asyncio.to_thread(remove)


def _empty_trash(store: Store) -> None:
    with contextlib.suppress(FileNotFoundError), os.scandir(store._layout.trash) as entries:
        for entry in list(entries):
            remove_tree(Path(entry.path))
