"""A chat's session: its folder, lock, quota check, reconcile, files and links."""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import time
from collections.abc import AsyncIterator, Collection, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from . import _partial, _reconcile
from ._db import Tx
from ._format import human_bytes
from ._fsops import (
    atomic_write,
    fd_closing,
    lstat_at,
    open_dir,
    open_regular,
    read_all,
    rename_file,
    unlink_file,
    walk_dirs,
    write_unique,
)
from ._index import ensure_session, session_by_keys, user_totals
from ._keys import id_key, is_temporary
from ._lock import FileLock
from ._names import attachment_name, numbered, split_path
from .errors import FileMissing, InvalidPath, QuotaExceeded
from .models import FileEntry, Link, LinkInfo, ReconcileReport, RunBudget, Usage

if TYPE_CHECKING:
    from .store import Store

_MAX_NUMBERED = 10_000


class Session:
    """One chat's persistent folder. Get it from `await store.session(user_id, chat_id)`.

    `path` is the host folder to mount at /mnt/data. Run steps inside `async with session.lock():`
    so quota check, run, reconcile and publish of one chat never interleave (across processes too).
    """

    def __init__(self, store: Store, user_id: str, chat_id: str) -> None:
        self._store = store
        self.user_id = user_id
        self.chat_id = chat_id
        self.user_key = id_key(user_id)
        self.chat_key = id_key(chat_id)
        self.temporary = is_temporary(chat_id)
        self.path: Path = store._layout.session_dir(self.user_key, self.chat_key)
        self.files = SessionFiles(self)
        self._unindexed_run = False  # begin_run() found the mark of an earlier run never indexed

    @classmethod
    def _at_keys(cls, store: Store, user_id: str, chat_id: str, user_key: str, chat_key: str) -> Session:
        """A session whose folder is known by its keys (rebuild, CLI): the folder wins over the ids."""
        session = cls(store, user_id, chat_id)
        session.user_key, session.chat_key = user_key, chat_key
        session.path = store._layout.session_dir(user_key, chat_key)
        return session

    def __repr__(self) -> str:
        return f"Session(user_id={self.user_id!r}, chat_id={self.chat_id!r}, path={str(self.path)!r})"

    @contextlib.asynccontextmanager
    async def lock(self, timeout: float | None = None) -> AsyncIterator[Session]:
        """Exclusive cross-process lock on this chat. Waits without blocking the event loop; with a
        timeout (seconds) raises StorageBusy when it expires. Re-creates the folder and index row if a
        cleanup removed them while we waited."""
        lock = FileLock(self._store._layout.lock_path(self.user_key, self.chat_key))
        await lock.acquire(timeout)
        try:
            await self._store._ensure(self, touch=True)
            yield self
        finally:
            lock.release()

    async def check_quota(self) -> RunBudget:
        """Raise QuotaExceeded if the user (all chats) is at or over a limit; else what a run may add."""
        store = self._store
        quotas = store.quotas
        await store._remember_settings()
        usage = await store._usage_of(self.user_key)  # by key: a rebuilt session's ids may not hash to it
        max_files = quotas.max_files_per_user or None
        max_bytes = quotas.max_bytes_per_user or None
        if max_files is not None and usage.files >= max_files:
            raise QuotaExceeded(
                f"You have reached the limit of {max_files} files across your chats (you have "
                f"{usage.files}). Delete some files or old chats, then try again."
            )
        if max_bytes is not None and usage.bytes >= max_bytes:
            raise QuotaExceeded(
                f"You have reached your storage limit of {human_bytes(max_bytes)} across your chats "
                f"(you use {human_bytes(usage.bytes)}). Delete some files or old chats, then try again."
            )
        limits = [n for n in (quotas.max_new_files_per_run or None, _left(max_files, usage.files)) if n]
        max_write = _left(max_bytes, usage.bytes)
        max_file = quotas.max_file_bytes or None
        if max_write is not None:
            max_file = max_write if max_file is None else min(max_file, max_write)
        return RunBudget(min(limits) if limits else None, max_write, max_file)

    async def begin_run(self) -> None:
        """Call under `lock()` just before something outside the store (a sandbox run) changes the
        folder. It leaves a mark that the next reconcile() removes: a process that dies in between
        leaves it behind, and the next Store.open() reconciles the folder (crash recovery)."""
        marker = self._store._layout.running_marker(self.user_key, self.chat_key)

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

        self._unindexed_run = await asyncio.to_thread(mark)

    async def reconcile(
        self, enforce_quotas: bool = True, changed: Collection[str] | None = None
    ) -> ReconcileReport:
        """Bring the index in line with the folder (call it under `lock()`, after a run).

        `changed`: the relative paths the run created, changed, removed or renamed (e.g. the
        runner's `RunResult.changed`); only those, and folders' subtrees, are looked at, with the
        same rules, falling back to listing the whole folder when anything is unusual
        (`report.full` tells which ran). None: list the whole folder."""
        if enforce_quotas:
            await self._store._remember_settings()
        quotas = self._store.quotas
        if changed is not None and self._unindexed_run:
            changed = None  # an earlier run was never indexed: its changes are not among these
        if changed is not None:
            report = await _partial.reconcile(self, changed, enforce_quotas=enforce_quotas, quotas=quotas)
        else:
            report = await _reconcile.reconcile(self, enforce_quotas=enforce_quotas, quotas=quotas)
        marker = self._store._layout.running_marker(self.user_key, self.chat_key)
        await asyncio.to_thread(_unlink_missing_ok, marker)
        self._unindexed_run = False
        return report

    async def usage(self) -> Usage:
        """This chat's files and bytes, as last reconciled."""

        async def read(tx: Tx) -> Usage:
            row = await session_by_keys(tx, self.user_key, self.chat_key)
            return Usage(0, 0) if row is None else Usage(row.file_count, row.bytes)

        return await self._store._db.read(read)

    async def publish(self, path: str) -> Link:
        """Publish a copy of a file under an unguessable URL (reused while the file is unchanged)."""
        from ._publish import publish

        return await publish(self, path)

    async def download_url(self, path: str) -> str:
        return (await self.publish(path)).url

    async def links(self) -> list[LinkInfo]:
        """This chat's published links, oldest first."""
        return await self._store._links(self.user_key, self.chat_key)

    # ---------------------------------------------------------------- helpers for SessionFiles

    @contextlib.contextmanager
    def _root(self, *, create: bool = False) -> Iterator[int]:
        if create and not self.path.is_dir():
            self._store._make_dirs(self)
        try:
            fd = open_dir(self.path)
        except FileMissing:
            raise FileMissing("this chat has no files yet (its folder does not exist)") from None
        with fd_closing(fd):
            yield fd

    async def _session_id(self, tx: Tx, created_at: float, used_at: float | None = None) -> int:
        """This session's row id, creating the row (created at ``created_at``) if it is missing."""
        return await ensure_session(
            tx,
            user_id=self.user_id,
            chat_id=self.chat_id,
            user_key=self.user_key,
            chat_key=self.chat_key,
            temporary=self.temporary,
            created_at=created_at,
            used_at=used_at,
        )


def _unlink_missing_ok(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _left(limit: int | None, used: int) -> int | None:
    return None if limit is None else max(0, limit - used)


class SessionFiles:
    """File operations on a session folder that keep the index in step.

    Paths are relative POSIX strings (`report.csv`, `out/chart.png`); see InvalidPath for what is
    refused. No operation follows a symbolic link anywhere in a path.
    """

    def __init__(self, session: Session) -> None:
        self._session = session

    async def list(self) -> list[FileEntry]:
        """Every indexed file, sorted by path (the index as of the last reconcile or file operation)."""
        s = self._session

        async def read(tx: Tx) -> list[FileEntry]:
            rows = await tx.all(
                "SELECT f.path, f.size, f.mtime_ns, f.first_seen, f.last_changed FROM files f"
                " JOIN sessions s ON s.id = f.session_id WHERE s.user_key = ? AND s.chat_key = ?"
                " ORDER BY f.path",
                (s.user_key, s.chat_key),
            )
            return [FileEntry(p, size, ns / 1e9, first, last) for p, size, ns, first, last in rows]

        return await s._store._db.read(read)

    async def read(self, path: str) -> bytes:
        parts = split_path(path)

        def work() -> bytes:
            with self._session._root() as root, fd_closing(open_regular(root, parts)) as fd:
                return read_all(fd)

        return await asyncio.to_thread(work)

    async def exists(self, path: str) -> bool:
        """True if a regular file is at path (reached without symlinks)."""
        parts = split_path(path)

        def work() -> bool:
            try:
                with self._session._root() as root, fd_closing(walk_dirs(root, parts[:-1])) as parent:
                    st = lstat_at(parent, parts[-1])
            except (FileMissing, InvalidPath):
                return False
            return st is not None and stat.S_ISREG(st.st_mode)

        return await asyncio.to_thread(work)

    async def write(self, path: str, data: bytes, *, enforce_quotas: bool = True) -> None:
        """Atomically create or replace a file (parent folders are created).

        Raises QuotaExceeded if the file is larger than max_file_bytes or would take the user over a
        limit (unless enforce_quotas=False)."""
        parts = split_path(path)
        data = bytes(data)
        rel = "/".join(parts)
        if enforce_quotas:
            await self._check_room(len(data), replacing=rel)
        s = self._session
        owner = s._store.owner

        def work() -> os.stat_result:
            with s._root(create=True) as root:
                parent = walk_dirs(root, parts[:-1], create=True, owner=owner)
                with fd_closing(parent):
                    return atomic_write(parent, parts[-1], data, owner, rel)

        st = await asyncio.to_thread(work)
        await self._index_upsert(rel, st)

    async def imported(self, source: str) -> str | None:
        """The path `write_new(..., source=source)` saved, or None if that source was never imported.

        The path may since have been renamed or deleted by the chat's code; the import still counts."""
        s = self._session

        async def read(tx: Tx) -> str | None:
            row = await tx.one(
                "SELECT i.path FROM imports i JOIN sessions s ON s.id = i.session_id "
                "WHERE s.user_key = ? AND s.chat_key = ? AND i.source = ?",
                (s.user_key, s.chat_key, source),
            )
            return None if row is None else row[0]

        return await s._store._db.read(read)

    async def write_new(self, name: str, data: bytes, *, source: str | None = None) -> str:
        """Save an uploaded file at the top of the folder under a safe, unused name and return it.

        `a.csv` taken -> `a (2).csv`; never overwrites. Enforces max_file_bytes and the user quota.
        With `source` (an id of where the bytes came from), a second call for the same source saves
        nothing and returns the first path: see `imported`."""
        if source is not None:
            earlier = await self.imported(source)
            if earlier is not None:
                return earlier
        safe = attachment_name(name)
        data = bytes(data)
        await self._check_room(len(data), replacing=None)
        s = self._session
        owner = s._store.owner

        def names() -> Iterator[str]:
            yield safe
            for n in range(2, _MAX_NUMBERED):
                yield numbered(safe, n)

        def work() -> tuple[str, os.stat_result]:
            with s._root(create=True) as root:
                return write_unique(root, names(), data, owner)

        used, st = await asyncio.to_thread(work)
        await self._index_upsert(used, st, source=source)
        return used

    async def remove(self, path: str) -> None:
        """Delete a file (a symlink at that path is removed, not followed). Folders are refused."""
        parts = split_path(path)

        def work() -> None:
            with self._session._root() as root:
                unlink_file(root, parts)

        await asyncio.to_thread(work)
        await self._index_delete(["/".join(parts)])

    async def rename(self, src: str, dst: str, *, overwrite: bool = False) -> None:
        """Move a regular file (parent folders of dst are created). Raises FileExists if dst exists,
        unless overwrite=True."""
        src_parts, dst_parts = split_path(src), split_path(dst)
        if src_parts == dst_parts:
            return
        s = self._session
        owner = s._store.owner

        def work() -> os.stat_result:
            with s._root() as root:
                st, _old = rename_file(root, src_parts, dst_parts, overwrite=overwrite, owner=owner)
                return st

        st = await asyncio.to_thread(work)
        src_rel, dst_rel = "/".join(src_parts), "/".join(dst_parts)
        now = time.time()

        async def write(tx: Tx) -> None:
            sid = await s._session_id(tx, now)
            row = await tx.one(
                "SELECT first_seen, last_changed FROM files WHERE session_id = ? AND path = ?", (sid, src_rel)
            )
            first, last = row if row else (now, now)
            await tx.run("DELETE FROM files WHERE session_id = ? AND path IN (?, ?)", (sid, src_rel, dst_rel))
            await tx.run(
                "INSERT INTO files (session_id, path, size, mtime_ns, first_seen, last_changed)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (sid, dst_rel, st.st_size, st.st_mtime_ns, first, last),
            )

        await s._store._db.write(write)

    # ---------------------------------------------------------------- internals

    async def _check_room(self, size: int, *, replacing: str | None) -> None:
        s = self._session
        quotas = s._store.quotas
        max_file = quotas.max_file_bytes or None
        if max_file is not None and size > max_file:
            raise QuotaExceeded(
                f"The file is {human_bytes(size)}, larger than the {human_bytes(max_file)} per-file limit."
            )
        max_files = quotas.max_files_per_user or None
        max_bytes = quotas.max_bytes_per_user or None
        if max_files is None and max_bytes is None:
            return

        async def read(tx: Tx) -> tuple[int, int, int | None]:
            _, files, used = await user_totals(tx, s.user_key)
            old = None
            if replacing is not None:
                row = await tx.one(
                    "SELECT f.size FROM files f JOIN sessions x ON x.id = f.session_id"
                    " WHERE x.user_key = ? AND x.chat_key = ? AND f.path = ?",
                    (s.user_key, s.chat_key, replacing),
                )
                old = None if row is None else int(row[0])
            return files, used, old

        files, used, old = await s._store._db.read(read)
        new_files = files + (0 if old is not None else 1)
        new_bytes = used - (old or 0) + size
        if max_files is not None and new_files > max_files:
            raise QuotaExceeded(
                f"You have reached the limit of {max_files} files across your chats. "
                "Delete some files or old chats, then try again."
            )
        if max_bytes is not None and new_bytes > max_bytes:
            raise QuotaExceeded(
                f"Saving this {human_bytes(size)} file would exceed your storage limit of "
                f"{human_bytes(max_bytes)} across your chats (you use {human_bytes(used)}). "
                "Delete some files or old chats, then try again."
            )

    async def _index_upsert(self, rel: str, st: os.stat_result, *, source: str | None = None) -> None:
        s = self._session
        now = time.time()

        async def write(tx: Tx) -> None:
            sid = await s._session_id(tx, now)
            await tx.run(_reconcile._UPSERT, (sid, rel, st.st_size, st.st_mtime_ns, now, now))
            if source is not None:
                await tx.run(
                    "INSERT OR IGNORE INTO imports (session_id, source, path, imported_at) "
                    "VALUES (?, ?, ?, ?)",
                    (sid, source, rel, now),
                )

        await s._store._db.write(write)

    async def _index_delete(self, paths: list[str]) -> None:
        s = self._session
        now = time.time()

        async def write(tx: Tx) -> None:
            sid = await s._session_id(tx, now)
            await tx.many(_reconcile._DELETE, [(sid, p) for p in paths])

        await s._store._db.write(write)
