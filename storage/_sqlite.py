"""The embedded backend: an SQLite file next to the session folders, and `flock` locks.

Several processes (web workers, the CLI) use the file at once, so:
* WAL journal: readers never block the writer nor each other.
* Every write is a `BEGIN IMMEDIATE` transaction: it takes the write lock up front, so it can never
  fail half-way with SQLITE_BUSY when upgrading from reader to writer (which no busy handler can fix),
  and it serialises every writer, so a quota decision made inside one sees no other writer.
* SQLite's busy_timeout waits for the lock; on top of that a whole transaction that still gets
  "database is locked"/"busy" is rolled back and re-run with backoff, so that error never reaches a
  caller. Only after `busy_total_s` (60 s) do we give up with StorageBusy.
* Each connection lives in a thread of its own, and a whole transaction runs there in one hand-off
  from the event loop (the transaction's function only awaits the database, whose calls complete at
  once in that thread): a step's few transactions cost a few thread hops, not one per statement. A
  tiny pool hands each transaction a connection of its own.
* A full disk is `DiskFull` (SQLite rolls the transaction back: nothing is half-written). A damaged
  file (truncated, overwritten, not a database) is `IndexDamaged`; `recover()` moves it aside and
  starts a new one, once for all the processes that share it.

Locks are `flock`s on files under the store's state folder (see _lock.py), so they hold across the
processes of one host. They do not hold across hosts: that is the PostgreSQL backend's job.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import sqlite3
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from ._backend import BusyBackoff, Opened, Row
from ._fsops import private_file
from ._lock import FileLock, is_locked
from ._schema import CURRENT_VERSION, MIGRATIONS, statements
from .errors import DiskFull, IndexDamaged, StorageError

log = logging.getLogger("code_sessions.storage")

T = TypeVar("T")

__all__ = ["SQLiteBackend"]


class _Tx:
    """The statements of one transaction, run in the connection's own thread (see _Connection)."""

    __slots__ = ("_conn",)

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    async def all(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        rows: list[Row] = self._conn.execute(sql, params).fetchall()
        return rows

    async def one(self, sql: str, params: Sequence[Any] = ()) -> Row | None:
        row: Row | None = self._conn.execute(sql, params).fetchone()
        return row

    async def one_later(self, sql: str, params: Sequence[Any] = ()) -> Callable[[], Awaitable[Row | None]]:
        row: Row | None = self._conn.execute(sql, params).fetchone()

        async def later() -> Row | None:
            return row

        return later

    async def run(self, sql: str, params: Sequence[Any] = ()) -> int:
        return self._conn.execute(sql, params).rowcount

    async def many(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        self._conn.executemany(sql, rows)

    async def serialise_user(self, user_key: str) -> None:
        # BEGIN IMMEDIATE already made this the only writer of the whole file.
        return None


class _Connection:
    """One SQLite connection and the one thread that uses it."""

    def __init__(self, path: Path, busy_timeout_ms: int) -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="code-sessions-index")
        self._path = path
        self._busy_timeout_ms = busy_timeout_ms
        self._conn: sqlite3.Connection | None = None

    async def call(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    def connect(self) -> None:
        # The index names every user's files: ours alone (0600), even in a root other users can
        # enter. SQLite gives the -wal and -shm files the database's own mode; ones left by an
        # earlier version with a looser mode are tightened too.
        # Best effort: what cannot be done here (a gone root, a full disk) sqlite meets and says itself.
        with contextlib.suppress(OSError):
            for path in (self._path, *(Path(f"{self._path}{suffix}") for suffix in ("-wal", "-shm"))):
                if path == self._path or path.exists():
                    private_file(path)
        # isolation_level=None: the sqlite3 module must not open transactions behind our back.
        conn = sqlite3.connect(self._path, isolation_level=None, check_same_thread=False)
        try:
            conn.execute(f"PRAGMA busy_timeout = {self._busy_timeout_ms}")
            conn.execute("PRAGMA foreign_keys = ON")
            # NORMAL is safe with WAL (no corruption); a power cut may lose the last transactions, which
            # the next reconcile recovers from disk anyway.
            conn.execute("PRAGMA synchronous = NORMAL")
        except BaseException:
            conn.close()
            raise
        self._conn = conn

    def execute(self, sql: str) -> list[Row]:
        assert self._conn is not None
        return self._conn.execute(sql).fetchall()

    def transaction(self, begin: str, fn: Callable[[_Tx], Coroutine[Any, Any, T]]) -> T:
        """Run in the connection's thread: BEGIN, the whole function, COMMIT (or ROLLBACK)."""
        conn = self._conn
        assert conn is not None
        conn.execute(begin)
        try:
            result = _complete(fn(_Tx(conn)))
            conn.execute("COMMIT")
            return result
        except BaseException:
            # "no transaction is active" (a failed COMMIT already ended it) is fine.
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            raise

    def close(self) -> None:
        def work() -> None:
            if self._conn is not None:
                with contextlib.suppress(sqlite3.Error):
                    self._conn.close()
                self._conn = None

        with contextlib.suppress(RuntimeError):  # the interpreter is shutting down
            self._executor.submit(work).result()
        self._executor.shutdown(wait=False)


def _complete(coroutine: Coroutine[Any, Any, T]) -> T:
    """Drive a transaction's function to its end in this thread: its database calls complete at
    once, so it never has to wait; one that does awaited something else, which is a bug."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coroutine.close()
    raise RuntimeError("a transaction's function awaited something other than the database")


class _Corrupt(Exception):
    pass


class _FlockLock:
    """`Lock` over a FileLock: the lock file is created on first use, unlinked by `forget`."""

    def __init__(self, path: Path) -> None:
        self._lock = FileLock(path)

    async def try_acquire(self) -> bool:
        return self._lock.try_acquire()

    async def acquire(self, timeout: float | None = None, *, what: str = "this chat") -> None:
        await self._lock.acquire(timeout, what=what)

    async def release(self, *, forget: bool = False) -> None:
        self._lock.release(unlink=forget)


class SQLiteBackend:
    kind = "sqlite"

    def __init__(self, path: Path, lock_dir: Path, *, busy_total_s: float = 60.0, pool_size: int = 2) -> None:
        self.path = path
        self.where = str(path)
        self.lock_dir = lock_dir
        self.busy_total_s = busy_total_s
        self.pool_size = pool_size
        # SQLite's own wait per statement; our retry loop covers the rest of busy_total_s.
        self._busy_timeout_ms = int(max(0.05, min(5.0, busy_total_s / 4)) * 1000)
        self._pool: asyncio.Queue[_Connection] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._all: list[_Connection] = []
        self._inode: tuple[int, int] | None = None  # the file our connections have open
        self._looked_at = 0.0  # when we last checked that the path still names it

    # ------------------------------------------------------------------ locks

    def chat_lock(self, user_key: str, chat_key: str) -> _FlockLock:
        return _FlockLock(self.lock_dir / user_key / f"{chat_key}.lock")

    def named_lock(self, name: str) -> _FlockLock:
        # Keys never contain a dot, so `.name.lock` can never be a user's folder or a chat's lock.
        return _FlockLock(self.lock_dir / f".{name}.lock")

    async def chat_locked(self, user_key: str, chat_key: str) -> bool:
        return is_locked(self.lock_dir / user_key / f"{chat_key}.lock")

    # ------------------------------------------------------------------ open / close / recover

    async def open(self) -> Opened:
        try:
            return Opened(await self._open())
        except (_Corrupt, sqlite3.DatabaseError, StorageError) as exc:
            await self.close()
            if not _is_corrupt(exc):
                if isinstance(exc, StorageError):
                    raise
                raise StorageError(f"cannot open the index {self.path}: {exc}") from exc
        return await self._replace("it is corrupt")

    async def recover(self) -> Opened:
        await self.close()
        return await self._replace("it was damaged while in use")

    async def _replace(self, why: str) -> Opened:
        # Several processes may find the same damaged file at once: only one may move it aside, and
        # the others must then use the new file, not move that one aside too. The file is opened
        # afresh first: a file that checks out (replaced by another process, or the error was not
        # the file's) is kept, so a sound index and its links are never thrown away.
        lock = FileLock(self.path.with_name(self.path.name + ".lock"))
        await lock.acquire(self.busy_total_s, what="the index recovery")
        try:
            try:
                return Opened(await self._open())
            except (_Corrupt, sqlite3.DatabaseError, StorageError) as exc:
                await self.close()
                if not _is_corrupt(exc):
                    raise
            moved = self._move_aside()
            log.info(
                "the index %s was moved to %s because %s; a new one is rebuilt from the folders",
                self.path,
                moved,
                why,
            )
            await self._open()
            return Opened(True, str(moved))
        finally:
            lock.release()

    async def _open(self) -> bool:
        first = await self._connect()
        self._all.append(first)
        await self._retry(lambda: first.call(lambda: first.execute("PRAGMA journal_mode = WAL")))
        check = await self._retry(lambda: first.call(lambda: first.execute("PRAGMA quick_check(1)")))
        if not check or check[0][0] != "ok":
            raise _Corrupt(f"quick_check: {check[0][0] if check else '?'}")
        for _ in range(self.pool_size - 1):
            self._all.append(await self._connect())
        self._pool = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        for conn in self._all:
            self._pool.put_nowait(conn)
        self._inode = _inode_of(self.path)
        try:
            return await self.write(_migrate)
        except IndexDamaged as exc:  # the version says current, but the tables are not there
            raise _Corrupt(str(exc)) from exc

    async def _connect(self) -> _Connection:
        conn = _Connection(self.path, self._busy_timeout_ms)
        try:
            await conn.call(conn.connect)
        except sqlite3.Error as exc:
            await asyncio.to_thread(conn.close)
            raise _storage_error(exc, self.path) from exc
        return conn

    def _move_aside(self) -> Path:
        stamp = time.strftime("%Y%m%dT%H%M%S")
        target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        n = 1
        while target.exists():
            n += 1
            target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{n}")
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.rename(f"{self.path}{suffix}", f"{target}{suffix}")
        return target

    async def close(self) -> None:
        conns, self._all, self._pool = self._all, [], None
        for conn in conns:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(conn.close)

    # ------------------------------------------------------------------ transactions

    async def read(self, fn: Callable[[_Tx], Coroutine[Any, Any, T]]) -> T:
        """Run fn in a read transaction (one consistent snapshot, never blocks writers)."""
        return await self._transaction("BEGIN", fn)

    async def write(self, fn: Callable[[_Tx], Coroutine[Any, Any, T]]) -> T:
        """Run fn in a write transaction; fn may be run again after a busy error, so it must only
        touch the database."""
        return await self._transaction("BEGIN IMMEDIATE", fn)

    async def _transaction(self, begin: str, fn: Callable[[_Tx], Coroutine[Any, Any, T]]) -> T:
        if self._pool is None:
            raise StorageError("the store is not open; use `async with store:` or `await store.open()`")
        if asyncio.get_running_loop() is not self._loop:
            # The pool's queue belongs to one event loop; sharing it across loops fails obscurely.
            raise StorageError("a Store must be used from the event loop that opened it")
        if time.monotonic() - self._looked_at >= _LOOK_EVERY_S:
            # An index deleted (or replaced) under open connections goes on working for them alone,
            # while another process makes a new one: two indexes, each enforcing quotas alone.
            self._looked_at = time.monotonic()
            if _inode_of(self.path) != self._inode:
                raise IndexDamaged(f"the index {self.path} was deleted or replaced while in use")
        pool = self._pool

        async def attempt() -> T:
            conn = await pool.get()
            try:
                return await conn.call(lambda: conn.transaction(begin, fn))
            finally:
                pool.put_nowait(conn)

        try:
            return await self._retry(attempt)
        except sqlite3.Error as exc:
            raise _storage_error(exc, self.path) from exc
        except OSError as exc:  # e.g. the -shm file could not be extended
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFull() from exc
            raise

    async def _retry(self, op: Callable[[], Awaitable[T]]) -> T:
        backoff = BusyBackoff(self.busy_total_s)
        while True:
            try:
                return await op()
            except sqlite3.OperationalError as exc:
                if not _is_busy(exc):
                    raise
                await backoff.wait()


_LOOK_EVERY_S = 1.0


def _inode_of(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _error_name(exc: BaseException) -> str:
    return getattr(exc, "sqlite_errorname", "") or ""


def _is_busy(exc: sqlite3.OperationalError) -> bool:
    if _error_name(exc).startswith(("SQLITE_BUSY", "SQLITE_LOCKED")):
        return True
    text = str(exc).lower()
    return "locked" in text or "busy" in text


def _is_full(exc: sqlite3.Error) -> bool:
    return _error_name(exc).startswith("SQLITE_FULL") or "database or disk is full" in str(exc).lower()


def _is_damage(exc: sqlite3.Error) -> bool:
    """Errors a sound database file does not give: corruption, a file that is not a database, I/O
    errors on a file cut short under us, or our tables gone."""
    name = _error_name(exc)
    if name.startswith(("SQLITE_CORRUPT", "SQLITE_NOTADB", "SQLITE_IOERR")):
        return True
    text = str(exc).lower()
    return (
        "malformed" in text or "not a database" in text or "disk i/o error" in text or "no such table" in text
    )


def _storage_error(exc: sqlite3.Error, path: Path) -> StorageError:
    if _is_full(exc):
        return DiskFull()
    if _is_damage(exc):
        return IndexDamaged(f"the index {path} is damaged: {exc}")
    return StorageError(f"index error: {exc}")


def _is_corrupt(exc: BaseException) -> bool:
    if isinstance(exc, _Corrupt | IndexDamaged):
        return True
    if isinstance(exc, StorageError):
        return exc.__cause__ is not None and _is_corrupt(exc.__cause__)
    if not isinstance(exc, sqlite3.DatabaseError) or isinstance(exc, sqlite3.OperationalError):
        return False
    name = _error_name(exc)
    if name.startswith(("SQLITE_CORRUPT", "SQLITE_NOTADB")):
        return True
    text = str(exc).lower()
    return "malformed" in text or "not a database" in text


async def _migrate(tx: _Tx) -> bool:
    row = await tx.one("PRAGMA user_version")
    version = int(row[0]) if row else 0
    if version > CURRENT_VERSION:
        raise StorageError(
            f"the index was written by a newer version of code-sessions (schema {version}, this one "
            f"knows up to {CURRENT_VERSION}); upgrade code-sessions or move the index aside"
        )
    for number in range(version + 1, CURRENT_VERSION + 1):
        for statement in statements(MIGRATIONS[number - 1]):
            await tx.run(statement)
        log.info("index schema upgraded to version %d", number)
    if version < CURRENT_VERSION:
        # PRAGMA takes no parameters; the value is our own integer.
        await tx.run(f"PRAGMA user_version = {CURRENT_VERSION}")
    # Sanity: a file whose version is current but whose tables are gone fails here (IndexDamaged).
    await tx.one("SELECT count(*) FROM sessions WHERE id = 0")
    return version == 0
