"""Expiry and purges: deleting what the policy or an admin says must go, safely while runs go on.

Every session is deleted only while we hold its lock, taken without waiting: a session whose lock
is held (a sandbox is running in it) is skipped and counted as in use, never deleted under it. Under
the lock the decision is re-checked against the index (the chat may have been used meanwhile).

Deleting a session: its folder is renamed into trash/ (atomic for everyone else), its index rows and
links are removed, then its published copies, the trash entry and the sidecar; the lock is released
with `forget` (the flock backend unlinks the lock file while still holding it; lockers verify the
inode after acquiring, see _lock).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from . import _index, _index_links
from ._backend import Tx
from ._core import ChatRef, Core
from ._exports import is_export
from ._format import human_duration
from ._fsops import DIR_FLAGS, fd_closing, move_aside_unchanged, open_dir, remove_tree
from ._index import ChatRow
from ._keys import id_key
from ._layout import Layout
from ._publish import drain_unpublished, folder_copy_present, link_records, remove_copies
from .errors import FileMissing, InvalidPath
from .models import CleanupAction, CleanupReport, Purge
from .policy import Policy
from .publishing import DirectoryPublisher

log = logging.getLogger("code_sessions.storage")

# Published copies not in the index are removed only after this long, so a publish that has stored
# its copy but not yet written its row is never swept.
STRAY_GRACE_S = 600.0
# Links whose file is missing from / changed in the index are kept this long, for a publish that ran
# before the reconcile of the same step.
STALE_LINK_GRACE_S = 600.0
_EXPIRY_BATCH = 2000
_BATCHES_PER_HOLD = 4  # batches of a session expired per hold of its lock
_Expired = tuple[str, int, int]  # an expired file as the index saw it: (path, size, mtime_ns)
_ByFolder = dict[tuple[str, ...], list[_Expired]]  # by the path of their folder in the session


@dataclass
class _Tally:
    dry_run: bool
    sessions_removed: int = 0
    files_removed: int = 0
    bytes_freed: int = 0
    links_removed: int = 0
    in_use: set[int] = field(default_factory=set)
    details: list[CleanupAction] = field(default_factory=list)

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

    def busy(self, row: ChatRow, reason: str) -> None:
        if row.id not in self.in_use:
            self.in_use.add(row.id)
            self.details.append(
                CleanupAction(
                    row.user_id,
                    row.chat_id,
                    "in use",
                    reason=reason,
                    user_key=row.user_key,
                    chat_key=row.chat_key,
                )
            )

    def removed(self, row: ChatRow, reason: str, links: int, action: str = "removed") -> None:
        self.sessions_removed += 1
        self.files_removed += row.file_count
        freed = row.bytes if action == "removed" else 0
        self.bytes_freed += freed
        self.links_removed += links
        self.details.append(
            CleanupAction(
                row.user_id, row.chat_id, action, row.file_count, freed, reason, row.user_key, row.chat_key
            )
        )


async def cleanup(core: Core, purge: Purge | None, policy: Policy, *, dry_run: bool) -> CleanupReport:
    """The expiry policy (purge=None) or a purge, then the links and copies nothing needs."""
    now = time.time()
    tally = _Tally(dry_run)
    rows = await core.read(_index.all_sessions)
    removed: set[int] = set()

    def reason_of(row: ChatRow, at: float) -> str | None:
        return _selected(row, purge, policy, at)

    for row in rows:
        reason = reason_of(row, now)
        if reason is not None and await _remove_session(core, row, reason, reason_of, tally):
            removed.add(row.id)

    cutoff = policy.file_cutoff(now) if purge is None else None
    if cutoff is not None:
        await _expire_files(core, cutoff, policy.file_expiry_reason(), removed, tally)

    await _vanished_sessions(core, removed, tally)
    await _stale_links(core, now, tally)
    await _stray_copies(core, tally)

    if dry_run:
        return tally.report()
    empty_trash_soon(core)  # what this and any earlier, interrupted cleanup moved there
    await drain_unpublished(core)
    report = tally.report()
    pruned = policy.activity_cutoff(now)

    async def write(tx: Tx) -> None:
        if pruned is not None:
            await _index.prune_activity(tx, pruned)
        detail = {k: v for k, v in report.to_dict().items() if k not in ("details", "dry_run")}
        detail["purge"] = purge.to_dict() if purge is not None else None
        await _index.log_activity(tx, time.time(), "cleanup", detail=detail)

    await core.write(write)
    return report


async def delete_sessions(core: Core, keys: Iterable[tuple[str, str]], reason: str) -> CleanupReport:
    """Delete these sessions (by user key, chat key) now, whatever their age: e.g. chats deleted in
    the web UI. One pass, however many; a session in use is skipped and counted."""
    tally = _Tally(False)
    wanted = set(keys)
    rows = [r for r in await core.read(_index.all_sessions) if (r.user_key, r.chat_key) in wanted]
    for row in rows:
        await _remove_session(core, row, reason, lambda fresh, at: reason, tally)
    if rows:
        empty_trash_soon(core)
    return tally.report()


def _selected(row: ChatRow, purge: Purge | None, policy: Policy, now: float) -> str | None:
    """Why this session should go, or None."""
    idle = now - row.last_used_at
    if purge is None:
        return policy.session_expired(temporary=row.temporary, idle_s=idle)
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
    core: Core,
    row: ChatRow,
    reason: str,
    still: Callable[[ChatRow, float], str | None],
    tally: _Tally,
) -> bool:
    if tally.dry_run:
        if await core.backend.chat_locked(row.user_key, row.chat_key):
            tally.busy(row, reason)
            return False
        tally.removed(row, reason, await core.read(lambda tx: _index_links.count_links(tx, row.id)))
        return True
    lock = core.backend.chat_lock(row.user_key, row.chat_key)
    if not await lock.try_acquire():
        tally.busy(row, reason)
        return False
    deleted = False
    try:
        fresh = await core.read(lambda tx: _index.session_by_keys(tx, row.user_key, row.chat_key))
        if fresh is None or still(fresh, time.time()) is None:
            return False  # used again (or removed by someone else) since we looked
        links = await delete_session(core, fresh, reason)
        tally.removed(fresh, reason, links)
        deleted = True
        return True
    finally:
        await lock.release(forget=deleted)
        if deleted:
            await asyncio.to_thread(_prune_parents, core, row)


async def delete_session(core: Core, row: ChatRow, reason: str) -> int:
    """Delete a session whose lock we hold; returns how many links went with it."""
    core.forget_ensured(row.user_key, row.chat_key)
    layout = core.layout
    folder = layout.session_dir(row.user_key, row.chat_key)
    trash = layout.trash / f"{row.chat_key}.{secrets.token_hex(6)}"

    def move() -> bool:
        try:
            os.rename(folder, trash)
        except FileNotFoundError:
            return False
        return True

    moved = await asyncio.to_thread(move)
    now = time.time()

    async def write(tx: Tx) -> list[tuple[str, str, str]]:
        links = await _index_links.links_of_session(tx, row.id)
        await _index_links.delete_links(tx, [ref for ref, _, _ in links])
        await _index.delete_session(tx, row.id)
        await _index.log_activity(
            tx,
            now,
            "session_removed",
            row.user_id,
            row.chat_id,
            {"reason": reason, "files": row.file_count, "bytes": row.bytes, "links": len(links)},
        )
        return links

    links = await core.write(write)
    await remove_copies(core, links)

    def remove_files() -> None:
        if moved:
            remove_tree(trash)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(layout.sidecar_path(row.user_key, row.chat_key))
        remove_saved_state(layout, row.user_key, row.chat_key)

    await asyncio.to_thread(remove_files)
    return len(links)


def remove_saved_state(layout: Layout, user_key: str, chat_key: str) -> None:
    """The session's saved state goes with it (renamed aside first, so a reader sees all or nothing)."""
    saved = layout.saved_state(user_key, chat_key)
    aside = layout.trash / f"{chat_key}.kernel.{secrets.token_hex(6)}"
    try:
        os.rename(saved, aside)
    except FileNotFoundError:
        return
    except OSError:
        aside = saved
    remove_tree(aside)


def _prune_parents(core: Core, row: ChatRow) -> None:
    # Empty per-user folders go too; creators retry if we remove one under them (see Core.make_dirs).
    layout = core.layout
    for folder in (layout.sessions / row.user_key, layout.state / row.user_key):
        with contextlib.suppress(OSError):
            os.rmdir(folder)


async def _expire_files(core: Core, cutoff: float, reason: str, skip: set[int], tally: _Tally) -> None:
    rows = await core.read(lambda tx: _index.expired_files(tx, cutoff))
    by_session: dict[int, list[tuple[str, int, int]]] = defaultdict(list)
    for sid, path, size, mtime_ns in rows:
        if sid not in skip:
            by_session[sid].append((path, int(size), int(mtime_ns)))
    if not by_session:
        return
    sessions = {r.id: r for r in await core.read(_index.all_sessions)}
    for sid, files in by_session.items():
        row = sessions.get(sid)
        if row is None:
            continue
        if tally.dry_run:
            if await core.backend.chat_locked(row.user_key, row.chat_key):
                tally.busy(row, reason)
                continue
            await _count_files(core, tally, row, files, reason)
            continue
        ref = core.ref_at(
            row.user_id, row.chat_id, row.user_key, row.chat_key, recorded_temporary=row.temporary
        )
        removed_files, removed_bytes = 0, 0
        # The chat's lock is held a few batches at a time (_BATCHES_PER_HOLD), so a user's next step
        # waits for at most those, not for an old session's whole expiry. A batch is whole folders: a
        # folder whose files all expired leaves in one rename; of a folder that cannot, a batch moves
        # _EXPIRY_BATCH files. While the lock is held, the index write of one batch runs while the
        # next batch is moved (two threads: the index's and the files'), and all are written before
        # the lock is let go.
        pending = deque(_batches(files))
        while pending:
            lock = core.lock_of(ref)
            if not await lock.try_acquire():
                tally.busy(row, reason)
                break
            writing: asyncio.Future[int] | None = None
            try:
                for _ in range(_BATCHES_PER_HOLD):
                    if not pending:
                        break
                    batch = pending.popleft()
                    gone, absent = await asyncio.to_thread(
                        _move_unchanged, ref.path, core.layout.trash, batch
                    )
                    if writing is not None:
                        tally.links_removed += await writing
                        writing = None
                    if gone or absent:
                        writing = asyncio.ensure_future(
                            _forget_files(core, ref, row.id, gone + absent, reason)
                        )
                    removed_files += len(gone) + len(absent)
                    removed_bytes += sum(size for _, size in gone) + sum(size for _, size in absent)
                    if len(batch) == 1 and len(gone) == _EXPIRY_BATCH:
                        ((parent, entries),) = batch.items()
                        if len(entries) > _EXPIRY_BATCH:  # a large folder moved file by file: the rest next
                            moved = {path for path, _ in gone}
                            pending.appendleft({parent: [e for e in entries if e[0] not in moved]})
                if writing is not None:
                    tally.links_removed += await writing
                    writing = None
            finally:
                if writing is not None:  # something failed meanwhile: the write ends before the lock goes
                    await asyncio.gather(writing, return_exceptions=True)
                await lock.release()
        if removed_files:
            tally.files_removed += removed_files
            tally.bytes_freed += removed_bytes
            tally.details.append(
                CleanupAction(row.user_id, row.chat_id, "files expired", removed_files, removed_bytes, reason)
            )


def _batches(files: list[_Expired]) -> Iterator[_ByFolder]:
    """The expired files by folder, in batches of whole folders of about _EXPIRY_BATCH files."""
    by_parent: _ByFolder = defaultdict(list)
    for entry in files:
        by_parent[tuple(entry[0].split("/")[:-1])].append(entry)
    batch: _ByFolder = {}
    count = 0
    for parent, entries in by_parent.items():
        batch[parent] = entries
        count += len(entries)
        if count >= _EXPIRY_BATCH:
            yield batch
            batch, count = {}, 0
    if batch:
        yield batch


async def _count_files(
    core: Core, tally: _Tally, row: ChatRow, files: list[tuple[str, int, int]], reason: str
) -> None:
    links = await core.read(lambda tx: _index_links.links_of_paths(tx, row.id, [p for p, _, _ in files]))
    size = sum(s for _, s, _ in files)
    tally.files_removed += len(files)
    tally.bytes_freed += size
    tally.links_removed += len(links)
    tally.details.append(CleanupAction(row.user_id, row.chat_id, "files expired", len(files), size, reason))


def _move_unchanged(
    folder: Path, trash: Path, by_parent: _ByFolder
) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """Move the expired files that still match the index out of the session into the trash (one rename
    per folder whose files all expired, else one per file); the trash is emptied in the background.
    Returns (moved, absent): (path, size) of the files moved, and of those already gone from the
    folder (a cleanup that moved them died before it wrote the index: the disk is the truth)."""
    gone: list[tuple[str, int]] = []
    absent: list[tuple[str, int]] = []
    try:
        root = open_dir(folder)
    except (FileMissing, InvalidPath):
        return gone, absent
    with fd_closing(root), fd_closing(os.open(trash, DIR_FLAGS)) as trash_fd:
        for parent_parts, entries in by_parent.items():
            wanted = {path.rsplit("/", 1)[-1]: (size, mtime_ns) for path, size, mtime_ns in entries}
            missing: list[str] = []
            moved = move_aside_unchanged(
                root, parent_parts, wanted, trash_fd, _bin_name(), _EXPIRY_BATCH, missing
            )
            if moved is None:  # the folder itself is gone
                missing = list(wanted)
            prefix = "/".join(parent_parts)
            sizes = {path: size for path, size, _ in entries}
            for names, into in ((moved or (), gone), (missing, absent)):
                for name in names:
                    path = f"{prefix}/{name}" if prefix else name
                    into.append((path, sizes[path]))
    return gone, absent


def _bin_name() -> str:
    return f"expired.{time.time_ns()}.{secrets.token_hex(6)}"


async def _forget_files(
    core: Core, ref: ChatRef, session_id: int, gone: list[tuple[str, int]], reason: str
) -> int:
    """Drop index rows of deleted files, and their links. Returns the number of links removed."""
    paths = [p for p, _ in gone]
    now = time.time()

    async def write(tx: Tx) -> list[tuple[str, str, str]]:
        links = await _index_links.forget_files(tx, session_id, paths)
        await _index.log_activity(
            tx,
            now,
            "files_expired",
            ref.user_id,
            ref.chat_id,
            {"reason": reason, "files": len(gone), "bytes": sum(s for _, s in gone), "paths": paths[:100]},
        )
        return links

    links = await core.write(write)
    await remove_copies(core, links)
    return len(links)


async def _vanished_sessions(core: Core, removed: set[int], tally: _Tally) -> None:
    """Index rows whose session folder no longer exists (deleted by hand, or a crash mid-delete)."""
    layout = core.layout
    rows = [r for r in await core.read(_index.all_sessions) if r.id not in removed]
    missing = await asyncio.to_thread(
        lambda: [r for r in rows if not layout.session_dir(r.user_key, r.chat_key).is_dir()]
    )
    reason = "session folder no longer exists"
    for row in missing:
        if tally.dry_run:
            if await core.backend.chat_locked(row.user_key, row.chat_key):
                tally.busy(row, reason)
            else:
                tally.removed(row, reason, 0, action="vanished")
            continue
        lock = core.backend.chat_lock(row.user_key, row.chat_key)
        if not await lock.try_acquire():
            tally.busy(row, reason)
            continue
        deleted = False
        try:
            if layout.session_dir(row.user_key, row.chat_key).is_dir():
                continue  # re-created meanwhile
            links = await delete_session(core, row, reason)
            deleted = True
            tally.removed(row, reason, links, action="vanished")
        finally:
            await lock.release(forget=deleted)
            if deleted:
                await asyncio.to_thread(_prune_parents, core, row)


async def _stale_links(core: Core, now: float, tally: _Tally) -> None:
    """Links whose session is gone, whose file is gone or changed, or whose folder copy vanished."""
    rows = await core.read(_index_links.link_health)

    def judge() -> list[tuple[str, str, str]]:
        stale: list[tuple[str, str, str]] = []
        for ref, kind, directory, name, created_at, no_session, no_file, changed, path in rows:
            if is_export(path):  # an export has no file: it lives with its session
                no_file = changed = False
            old = now - created_at > STALE_LINK_GRACE_S
            gone = kind == DirectoryPublisher.kind and not folder_copy_present(directory, ref, name)
            if no_session or (old and (no_file or changed)) or gone:
                stale.append((ref, kind, directory))
        return stale

    stale = await asyncio.to_thread(judge)
    # Copies the publisher holds (Open WebUI files) whose bytes are gone: a dead link, dropped so the
    # next answer that names the file publishes it again (`check` reports the same as drift).
    publisher = core.publisher
    if publisher is not None and publisher.kind != DirectoryPublisher.kind:
        theirs = [(ref, kind, directory) for ref, kind, directory, *_ in rows if kind == publisher.kind]
        judged = {ref for ref, _, _ in stale}
        try:
            gone = await publisher.missing([ref for ref, _, _ in theirs if ref not in judged])
        except Exception as error:  # the publisher's store (Open WebUI's database) failed: next time
            log.warning("cleanup: could not ask the publisher which copies are gone: %s", error)
            gone = set()
        stale += [link for link in theirs if link[0] in gone]
    if not stale:
        return
    tally.links_removed += len(stale)
    if tally.dry_run:
        return
    await core.write(lambda tx: _index_links.delete_links(tx, [ref for ref, _, _ in stale]))
    await remove_copies(core, stale)


async def _stray_copies(core: Core, tally: _Tally) -> None:
    """Copies with no link row (a crash between storing a copy and writing its row), and link
    records with no row, older than the grace."""
    publisher = core.publisher
    if publisher is not None:
        known = await core.read(lambda tx: _index_links.all_link_refs(tx, publisher.kind))
        strays = await publisher.strays(known, STRAY_GRACE_S)
        tally.links_removed += len(strays)
        if strays and not tally.dry_run:
            await publisher.remove(strays)
    if tally.dry_run:
        return
    rows = {(kind, ref) for ref, kind, *_ in await core.read(_index_links.links_with_owners)}
    cutoff = time.time() - STRAY_GRACE_S

    def forget() -> None:
        for rec in link_records(core):
            if (rec["kind"], rec["ref"]) not in rows and rec["_mtime"] < cutoff:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(core.layout.link_record(rec["kind"], rec["ref"]))

    await asyncio.to_thread(forget)


def empty_trash_soon(core: Core) -> None:
    """Empty the trash in a background thread: expired files are out of the sessions once renamed
    there, and the kernel's unlinks (10 s for 100k files on a disk mounted with `discard`) need not
    hold up the cleanup that moved them. One task per store; what is moved while it runs is emptied
    by it too. What a crash leaves in the trash is emptied by the next cleanup."""
    core.trash_wanted = True
    if core.trash_task is None or core.trash_task.done():
        core.trash_task = asyncio.get_running_loop().create_task(_empty_trash_while_wanted(core))


async def trash_emptied(core: Core) -> None:
    """Wait for the background emptying of the trash, if one is under way (closing the store)."""
    task = core.trash_task
    if task is not None:
        await asyncio.shield(task)


async def _empty_trash_while_wanted(core: Core) -> None:
    while core.trash_wanted:  # (set and cleared on the event loop: no wish is lost between rounds)
        core.trash_wanted = False
        try:
            await asyncio.to_thread(_empty_trash, core)
        except OSError as exc:
            log.warning("emptying the trash of %s failed (the next cleanup tries again): %s", core.root, exc)
            return


def _empty_trash(core: Core) -> None:
    with contextlib.suppress(FileNotFoundError), os.scandir(core.layout.trash) as entries:
        for entry in list(entries):
            remove_tree(Path(entry.path))
