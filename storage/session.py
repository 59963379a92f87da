"""A chat's session, as callers see it: its folder, lock, budget, reconcile, files and links.

`Session` and `ChatFiles` are thin faces: the work is done by the modules of the storage core
(`_reconcile`, `_publish`, `_index`, `_fsops`) over the store's `Core` and this session's `ChatRef`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterator, Sequence
from pathlib import Path

from . import _exports, _index, _index_links, _publish, _reconcile, _reconcile_changed, _repair
from ._backend import Tx
from ._core import ChatRef, Core
from ._fsops import (
    atomic_write,
    fd_closing,
    lstat_at,
    open_dir,
    open_regular,
    read_all,
    remove_tree_at,
    rename_file,
    unlink_file,
    walk_dirs,
    write_unique,
)
from ._incoming import Incoming
from ._names import attachment_name, numbered, split_path
from .errors import DiskFull, FileExists, FileMissing, InvalidPath, disk_error
from .history import ChatHistory
from .models import FileEntry, Link, LinkInfo, Reconcile, ReconcileReport, RunBudget, Usage
from .policy import Policy

__all__ = ["ChatFiles", "Session"]

_MAX_NUMBERED = 10_000


class Session:
    """One chat's persistent folder. Get it from `await store.session(user_id, chat_id)`.

    `path` is the host folder to mount at /mnt/data. Run steps inside `async with session.lock():`
    so budget, run, reconcile and publish of one chat never interleave (across processes too).
    """

    def __init__(self, core: Core, ref: ChatRef, policy: Policy, *, unindexed: bool = False) -> None:
        self._core = core
        self._ref = ref
        self.policy = policy  # the quotas this session's operations apply (its message's)
        self.files = ChatFiles(core, ref, policy)
        self.history = ChatHistory(core, ref)
        # An earlier run was never indexed (its mark, or runs on a full disk): list the folder whole.
        self._unindexed_run = unindexed
        self._generation = core.generation  # the index this session's lock was taken with
        self._locked = False  # this object holds the chat's lock (inside `lock()`)
        # The session's totals as run_budget read them under the lock: while the lock is held nothing
        # else writes this session's rows, so a reconcile that finds nothing changed reports them
        # instead of reading them again.
        self._totals: Usage | None = None

    @property
    def user_id(self) -> str:
        return self._ref.user_id

    @property
    def chat_id(self) -> str:
        return self._ref.chat_id

    @property
    def user_key(self) -> str:
        return self._ref.user_key

    @property
    def chat_key(self) -> str:
        return self._ref.chat_key

    @property
    def temporary(self) -> bool:
        return self._ref.temporary

    @property
    def path(self) -> Path:
        return self._ref.path

    @property
    def state_path(self) -> Path:
        """The session's own folder for state kept beside its files (outside `path`, so the code that
        runs in the folder cannot reach it); removed with the session."""
        return self._core.layout.saved_state(self._ref.user_key, self._ref.chat_key)

    def __repr__(self) -> str:
        return f"Session(user_id={self.user_id!r}, chat_id={self.chat_id!r}, path={str(self.path)!r})"

    @contextlib.asynccontextmanager
    async def lock(
        self, timeout: float | None = None, *, waiting: Callable[[], Awaitable[None]] | None = None
    ) -> AsyncIterator[Session]:
        """Exclusive lock on this chat, across processes. Waits without blocking the event loop; with
        a timeout (seconds) raises StorageBusy when it expires; `waiting` is awaited once first when
        the lock is not free at once. Re-creates the folder and index row if a cleanup removed them
        while we waited."""
        lock = self._core.lock_of(self._ref)
        if not await lock.try_acquire():
            if waiting is not None:
                await waiting()
            await lock.acquire(timeout)
        self._generation = self._core.generation
        self._locked, self._totals = True, None
        try:
            if await self._core.ensure(self._ref, touch=True, cached=True):
                self._unindexed_run = True  # runs on the full disk were never indexed
            yield self
        finally:
            self._locked, self._totals = False, None
            await lock.release()

    async def run_budget(self) -> RunBudget:
        """What a run may write while it runs (never a refusal: see Policy.run_budget)."""
        core = self._core
        await core.remember_settings(self.policy)
        usage, totals = await core.read(
            lambda tx: _index.user_and_session_usage(tx, self.user_key, self.chat_key)
        )
        if self._locked:
            self._totals = totals
        return self.policy.run_budget(usage)

    async def begin_run(self) -> None:
        """Call under `lock()` just before something outside the store (a sandbox run) changes the
        folder. It leaves a mark that the next reconcile() removes: a process that dies in between
        leaves it behind, and the next Store.open() indexes the folder (crash recovery)."""
        marker = self._core.layout.running_marker(self.user_key, self.chat_key)

        def mark() -> bool:
            for _ in range(2):
                try:
                    os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
                    return False
                except FileExistsError:
                    return True
                except FileNotFoundError:
                    marker.parent.mkdir(mode=0o700, exist_ok=True)
            return False

        try:
            self._unindexed_run = await asyncio.to_thread(mark) or self._unindexed_run
        except OSError:  # a full disk: the run may still free space; its reconcile lists the whole folder
            self._unindexed_run = True

    async def reconcile(
        self, enforce_quotas: bool = True, changed: Collection[str] | None = None
    ) -> ReconcileReport:
        """Bring the index in line with the folder (call it under `lock()`, after a run), and remove
        what the run added beyond the quota.

        `changed`: the relative paths the run created, changed, removed or renamed (e.g. the
        runner's `RunResult.changed`): Reconcile.CHANGED looks only at those, and folders' subtrees,
        with the same rules, falling back to listing the whole folder (Reconcile.FOLDER) when
        anything is unusual; `report.full` tells which ran. None: Reconcile.FOLDER."""
        core = self._core
        if enforce_quotas:
            await core.remember_settings(self.policy)
        mode = Reconcile.CHANGED if changed is not None else Reconcile.FOLDER
        if self._unindexed_run:
            mode = Reconcile.FOLDER  # an earlier run was never indexed: its changes are not among these
        if core.generation != self._generation:
            # The index was rebuilt while this session was locked (a damaged index, found during the
            # run): the rebuild skipped it, so it is listed whole, and its links taken back.
            mode = Reconcile.FOLDER
        marker = core.layout.running_marker(self.user_key, self.chat_key)
        marked = True
        totals, self._totals = self._totals, None
        if mode is Reconcile.CHANGED and not changed and totals is not None and self._locked:
            # Nothing changed (print(1)), and run_budget read the totals under this lock: nothing to
            # read or write; only the mark goes.
            await asyncio.to_thread(_unlink_missing_ok, marker)
            report = ReconcileReport(files=totals.files, bytes=totals.bytes, full=False)
            marked = core.generation != self._generation
            if marked:
                await self.begin_run()  # the whole folder is listed below: marked until it is indexed
        elif mode is Reconcile.CHANGED and not changed:
            # Nothing changed: the index already matches the folder, so the mark can go while the
            # totals are read (two threads' hops at once instead of one after the other).
            report, _ = await asyncio.gather(
                self._reconcile(mode, (), enforce_quotas), asyncio.to_thread(_unlink_missing_ok, marker)
            )
            marked = core.generation != self._generation
            if marked:
                await self.begin_run()  # the whole folder is listed below: marked until it is indexed
        else:
            report = await self._reconcile(mode, changed or (), enforce_quotas)
        if core.generation != self._generation:  # replaced while this reconcile ran
            if mode is Reconcile.CHANGED:  # the rebuild skipped this locked session: list it whole
                report = await self._reconcile(Reconcile.FOLDER, (), enforce_quotas)
            await _repair.reconcile_links(core)
            self._generation = core.generation
        if marked:
            await asyncio.to_thread(_unlink_missing_ok, marker)
        self._unindexed_run = False
        return report

    async def _reconcile(self, mode: Reconcile, changed: Collection[str], enforce: bool) -> ReconcileReport:
        quotas = self.policy if enforce else None
        if mode is Reconcile.CHANGED:
            return await _reconcile_changed.reconcile_changed(self._core, self._ref, changed, quotas=quotas)
        return await _reconcile.reconcile_folder(self._core, self._ref, quotas=quotas)

    async def usage(self) -> Usage:
        """This chat's files and bytes, as last indexed."""
        return await self._core.read(lambda tx: _index.session_usage(tx, self.user_key, self.chat_key))

    async def user_usage(self) -> Usage:
        """What counts toward this user's quota across all chats (published copies included)."""
        return await self._core.read(lambda tx: _index.user_usage(tx, self.user_key))

    async def publish(self, path: str) -> Link:
        """Publish a copy of a file (reused while its bytes are the same); see storage.publishing."""
        return await _publish.publish(self._core, self._ref, path, self.policy)

    async def links(self) -> list[LinkInfo]:
        """This chat's published links, oldest first (its exports' too: `is_export(link.path)`)."""
        return await self._core.read(lambda tx: _index_links.link_listing(tx, self.user_key, self.chat_key))

    async def export_bytes(self, slot: str, name: str, data: bytes) -> tuple[Link, list[str]]:
        """Publish `data` as this chat's export in `slot` (storage/_exports.py), replacing the one there,
        within the session's quotas: (its link, the refs of the copies it replaced)."""
        try:
            with await asyncio.to_thread(_exports.scratch, self.state_path) as out:
                await asyncio.to_thread(out.write, data)
                await asyncio.to_thread(out.flush)
                return await _exports.publish_export(
                    self._core, self._ref, self.policy, slot, name, out.fileno()
                )
        except OSError as error:
            raise disk_error(error, f"{name} could not be made") from error

    async def export_zip(self, name: str, *, max_bytes: int | None) -> tuple[Link, int, int]:
        """The folder's files as one zip, published as this chat's `zip` export (the one before it
        replaced): (its link, files, bytes). Call it under `lock()`. StorageError with the sentence when
        the files take more than `max_bytes` or the copy does not fit the user's storage."""
        try:
            with await asyncio.to_thread(_exports.scratch, self.state_path) as out:
                files, size = await asyncio.to_thread(
                    _exports.zip_folder, self.path, out, max_bytes=max_bytes
                )
                link, _ = await _exports.publish_export(
                    self._core, self._ref, self.policy, "zip", name, out.fileno()
                )
        except OSError as error:
            raise disk_error(error, f"{name} could not be made") from error
        return link, files, size


def _unlink_missing_ok(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class ChatFiles:
    """File operations on a session folder that keep the index in step.

    Paths are relative POSIX strings (`report.csv`, `out/chart.png`); see InvalidPath for what is
    refused. No operation follows a symbolic link anywhere in a path.
    """

    def __init__(self, core: Core, ref: ChatRef, policy: Policy) -> None:
        self._core = core
        self._ref = ref
        self._policy = policy

    async def list(self) -> list[FileEntry]:
        """Every indexed file, sorted by path (the index as of the last reconcile or file operation)."""
        return await self._core.read(
            lambda tx: _index.file_entries(tx, self._ref.user_key, self._ref.chat_key)
        )

    async def read(self, path: str) -> bytes:
        parts = split_path(path)

        def work() -> bytes:
            with self._root() as root, fd_closing(open_regular(root, parts)) as fd:
                return read_all(fd)

        return await asyncio.to_thread(work)

    async def read_head(self, path: str, max_bytes: int) -> tuple[bytes, int]:
        """The first `max_bytes` of a file at most, and its size: a bounded look at a file of any size
        (a preview never reads the whole of a 100 MB CSV)."""
        parts = split_path(path)

        def work() -> tuple[bytes, int]:
            with self._root() as root, fd_closing(open_regular(root, parts)) as fd:
                size = os.fstat(fd).st_size
                chunks: list[bytes] = []
                left = max_bytes
                while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
                    chunks.append(chunk)
                    left -= len(chunk)
                return b"".join(chunks), size

        return await asyncio.to_thread(work)

    async def read_at(self, path: str, offset: int, max_bytes: int) -> bytes:
        """At most `max_bytes` of a file from `offset` on (with `read_head`, samples of a big file)."""
        parts = split_path(path)

        def work() -> bytes:
            with self._root() as root, fd_closing(open_regular(root, parts)) as fd:
                return os.pread(fd, max_bytes, max(0, offset))

        return await asyncio.to_thread(work)

    async def exists(self, path: str) -> bool:
        """True if a regular file is at path (reached without symlinks)."""
        parts = split_path(path)

        def work() -> bool:
            try:
                with self._root() as root, fd_closing(walk_dirs(root, parts[:-1])) as parent:
                    st = lstat_at(parent, parts[-1])
            except (FileMissing, InvalidPath):
                return False
            return st is not None and stat.S_ISREG(st.st_mode)

        return await asyncio.to_thread(work)

    async def write(self, path: str, data: bytes, *, enforce_quotas: bool = True) -> None:
        """Atomically create or replace a file (parent folders are created).

        Raises QuotaExceeded if the file is larger than the per-file limit or would take the user
        over a limit (unless enforce_quotas=False)."""
        parts = split_path(path)
        data = bytes(data)
        rel = "/".join(parts)
        if enforce_quotas:
            await self._refuse(len(data), replacing=rel)
        owner = self._core.owner

        def work() -> os.stat_result:
            with self._root(create=True) as root:
                parent = walk_dirs(root, parts[:-1], create=True, owner=owner)
                with fd_closing(parent):
                    return atomic_write(parent, parts[-1], data, owner, rel)

        try:
            st = await asyncio.to_thread(work)
        except OSError as error:
            raise disk_error(error, f"/mnt/data/{rel} could not be written") from error
        await self._index_new(rel, st, source=None, recheck=False)

    async def imported(self, source: str) -> str | None:
        """The path `write_new(..., source=source)` saved, "" if `refuse_import(source)` was called,
        or None if that source was never imported.

        The path may since have been renamed or deleted by the chat's code; the import still counts."""
        ref = self._ref
        return await self._core.read(lambda tx: _index.imported_path(tx, ref.user_key, ref.chat_key, source))

    async def write_new(self, name: str, data: bytes, *, source: str | None = None) -> str:
        """Save an uploaded file at the top of the folder under a safe, unused name and return it.

        `a.csv` taken -> `a (2).csv`; never overwrites. Enforces the per-file limit and the user
        quota (checked again when the file is indexed: two uploads at once cannot both take the last
        room). With `source` (an id of where the bytes came from), a second call for the same source
        saves nothing and returns the first path: see `imported`."""
        if source is not None:
            earlier = await self.imported(source)
            if earlier is not None:
                return earlier
        safe = attachment_name(name)
        data = bytes(data)
        await self._refuse(len(data), replacing=None)
        owner = self._core.owner

        def names() -> Iterator[str]:
            yield safe
            for n in range(2, _MAX_NUMBERED):
                yield numbered(safe, n)

        def work() -> tuple[str, os.stat_result]:
            with self._root(create=True) as root:
                return write_unique(root, names(), data, owner)

        try:
            used, st = await asyncio.to_thread(work)
        except OSError as error:
            raise disk_error(error, "the file could not be written") from error
        try:
            await self._index_new(used, st, source=source, recheck=True)
        except BaseException:
            await asyncio.shield(asyncio.to_thread(self._unlink_quietly, (used,)))
            raise
        return used

    async def incoming(self, path: str, *, policy: Policy | None = None) -> Incoming:
        """Start receiving a file in pieces for `path` (an upload link's): staged outside the folder,
        checked against the per-file limit and the quota as it arrives, put in place whole by
        `Incoming.finish` (under the session's lock), never over an existing file. Raises
        InvalidPath, FileExists or QuotaExceeded (with the sentence) before anything is written.
        `policy`: the limits to apply (the session's by default)."""
        parts = split_path(path)
        if await self.exists(path):
            raise FileExists(f"/mnt/data/{'/'.join(parts)} exists already; an upload never replaces a file")

        rules = policy or self._policy

        async def index(rel: str, st: os.stat_result) -> None:
            await self._index_new(rel, st, source=None, recheck=True, policy=rules)

        incoming = Incoming(self._core, self._ref, parts, index, rules)
        await incoming.open()
        return incoming

    async def refuse_import(self, source: str) -> None:
        """Remember that this source could not be taken (too large, over quota, unreadable), so that
        it is not tried, and its refusal not said, again."""
        core, ref = self._core, self._ref
        now = time.time()

        async def write(tx: Tx) -> None:
            sid = await core.session_id(tx, ref, now)
            await _index.record_import(tx, sid, source, "", now)

        await core.write(write)

    async def remove(self, path: str) -> None:
        """Delete a file (a symlink at that path is removed, not followed). Folders are refused."""
        parts = split_path(path)

        def work() -> None:
            with self._root() as root:
                unlink_file(root, parts)

        await asyncio.to_thread(work)
        rel = "/".join(parts)
        await self._core.write(lambda tx: self._forget(tx, [rel]))

    async def clear(self) -> Usage:
        """Delete everything in the folder, and the published copies of this chat's files (links in
        its earlier answers stop working): the user's "clear this chat's files". Returns what went.
        Call it under the session's lock."""
        core, ref = self._core, self._ref
        before = await core.read(lambda tx: _index.session_usage(tx, ref.user_key, ref.chat_key))
        marker = core.layout.running_marker(ref.user_key, ref.chat_key)

        def work() -> None:
            # Marked first, like a run: if the index cannot be told (a full disk), the next reconcile lists
            # the whole folder instead of trusting rows of files that are gone.
            with contextlib.suppress(OSError):
                os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
            with self._root() as root, os.scandir(root) as entries:
                names = [entry.name for entry in entries]
                for name in names:
                    remove_tree_at(root, name)

        with contextlib.suppress(FileMissing):
            await asyncio.to_thread(work)

        async def links_of(tx: Tx) -> list[tuple[str, str, str]]:
            row = await _index.session_by_keys(tx, ref.user_key, ref.chat_key)
            return [] if row is None else await _index_links.links_of_session(tx, row.id)

        try:
            await _reconcile.reconcile_folder(core, ref, quotas=None)
        except DiskFull:
            # The index cannot be told now, but the copies still go: the user asked for it, and it
            # frees space. Their rows, pointing at nothing, go at the next cleanup.
            await _publish.remove_copies(core, await core.read(links_of))
            raise
        await asyncio.to_thread(_unlink_missing_ok, marker)

        async def drop_links(tx: Tx) -> list[tuple[str, str, str]]:
            links = await links_of(tx)
            await _index_links.delete_links(tx, [r for r, _, _ in links])
            return links

        await _publish.remove_copies(core, await core.write(drop_links))
        return before

    async def rename(self, src: str, dst: str, *, overwrite: bool = False) -> None:
        """Move a regular file (parent folders of dst are created). Raises FileExists if dst exists,
        unless overwrite=True."""
        src_parts, dst_parts = split_path(src), split_path(dst)
        if src_parts == dst_parts:
            return
        owner = self._core.owner

        def work() -> os.stat_result:
            with self._root() as root:
                st, _old = rename_file(root, src_parts, dst_parts, overwrite=overwrite, owner=owner)
                return st

        st = await asyncio.to_thread(work)
        src_rel, dst_rel = "/".join(src_parts), "/".join(dst_parts)
        now = time.time()

        async def write(tx: Tx) -> None:
            sid = await self._core.session_id(tx, self._ref, now)
            await _index.move_file(tx, sid, src_rel, dst_rel, st.st_size, st.st_mtime_ns, now)

        await self._core.write(write)

    # ---------------------------------------------------------------- internals

    @contextlib.contextmanager
    def _root(self, *, create: bool = False) -> Iterator[int]:
        if create and not self._ref.path.is_dir():
            self._core.make_dirs(self._ref)
        try:
            fd = open_dir(self._ref.path)
        except FileMissing:
            raise FileMissing("this chat has no files yet (its folder does not exist)") from None
        with fd_closing(fd):
            yield fd

    async def _refuse(self, size: int, *, replacing: str | None) -> None:
        ref = self._ref

        async def read(tx: Tx) -> tuple[Usage, int | None]:
            usage = await _index.user_usage(tx, ref.user_key)
            old = None
            if replacing is not None:
                row = await _index.session_by_keys(tx, ref.user_key, ref.chat_key)
                old = None if row is None else await _index.file_size(tx, row.id, replacing)
            return usage, old

        usage, old = await self._core.read(read)
        self._policy.refuse_write(usage, size, replacing=old)

    async def _index_new(
        self, rel: str, st: os.stat_result, *, source: str | None, recheck: bool, policy: Policy | None = None
    ) -> None:
        core, ref = self._core, self._ref
        now = time.time()

        async def write(tx: Tx) -> None:
            if recheck:
                await tx.serialise_user(ref.user_key)
                (policy or self._policy).refuse_write(
                    await _index.user_usage(tx, ref.user_key), st.st_size, replacing=None
                )
            sid = await core.session_id(tx, ref, now)
            await _index.upsert_files(tx, sid, [(rel, st.st_size, st.st_mtime_ns, now)])
            if source is not None:
                await _index.record_import(tx, sid, source, rel, now)

        await core.write(write)

    async def _forget(self, tx: Tx, paths: Sequence[str]) -> None:
        sid = await self._core.session_id(tx, self._ref, time.time())
        await _index.delete_files(tx, sid, paths)

    def _unlink_quietly(self, paths: Collection[str]) -> None:
        with contextlib.suppress(FileMissing, InvalidPath, OSError), self._root() as root:
            for path in paths:
                with contextlib.suppress(FileMissing, InvalidPath, OSError):
                    unlink_file(root, tuple(path.split("/")))
