"""The SQLite index: connections, transactions, retries, migrations and recovery.

Several processes (web workers, the CLI) use the file at once, so:
* WAL journal: readers never block the writer nor each other.
* Every write is a `BEGIN IMMEDIATE` transaction: it takes the write lock up front, so it can never
  fail half-way with SQLITE_BUSY when upgrading from reader to writer (which no busy handler can fix).
* SQLite's busy_timeout waits for the lock; on top of that a whole transaction that still gets
  "database is locked"/"busy" is rolled back and re-run with backoff, so that error never reaches a
  caller. Only after `busy_total_s` (60 s) do we give up with StorageBusy.
* An aiosqlite connection is one thread running one transaction at a time: a tiny pool hands each
  transaction a connection of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import sqlite3
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiosqlite

from ._lock import FileLock
from ._schema import CURRENT_VERSION, MIGRATIONS, statements
from .errors import StorageBusy, StorageError

log = logging.getLogger("code_sessions.storage")

T = TypeVar("T")
Row = tuple[Any, ...]


class Tx:
    """The statements of one transaction; handed to the function given to Database.read/write."""

    __slots__ = ("_conn",)

    def __init__(self, conn: aiosqlite.Connection) -> None:
        self._conn = conn

    async def all(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        return list(await self._conn.execute_fetchall(sql, params))

    async def one(self, sql: str, params: Sequence[Any] = ()) -> Row | None:
        rows = await self._conn.execute_fetchall(sql, params)
        return next(iter(rows), None)

    async def run(self, sql: str, params: Sequence[Any] = ()) -> int:
        async with self._conn.execute(sql, params) as cursor:
            return cursor.rowcount

    async def many(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        await self._conn.executemany(sql, rows)


@dataclass(frozen=True, slots=True)
class Opened:
    fresh: bool  # the database had no schema: the caller should rebuild it from disk
    moved_aside: Path | None  # where a corrupt file went, if one was found


class _Corrupt(Exception):
    pass


class Database:
    def __init__(self, path: Path, *, busy_total_s: float = 60.0, pool_size: int = 2) -> None:
        self.path = path
        self.busy_total_s = busy_total_s
        self.pool_size = pool_size
        # SQLite's own wait per statement; our retry loop covers the rest of busy_total_s.
        self._busy_timeout_ms = int(max(0.05, min(5.0, busy_total_s / 4)) * 1000)
        self._pool: asyncio.Queue[aiosqlite.Connection] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._all: list[aiosqlite.Connection] = []

    # ------------------------------------------------------------------ open / close

    async def open(self) -> Opened:
        try:
            return Opened(await self._open(), None)
        except (_Corrupt, sqlite3.DatabaseError, StorageError) as exc:
            await self.close()
            if not _is_corrupt(exc):
                if isinstance(exc, StorageError):
                    raise
                raise StorageError(f"cannot open the index {self.path}: {exc}") from exc
        # Several processes may find the same corrupt file at once: only one may move it aside, and
        # the others must then use the new file, not move that one aside too.
        lock = FileLock(self.path.with_name(self.path.name + ".lock"))
        await lock.acquire(self.busy_total_s, what="the index recovery")
        try:
            try:
                return Opened(await self._open(), None)  # someone else already recovered it
            except (_Corrupt, sqlite3.DatabaseError, StorageError) as exc:
                await self.close()
                if not _is_corrupt(exc):
                    raise
                moved = self._move_aside()
                log.warning(
                    "the index %s is corrupt (%s); moved it to %s, starting a new one rebuilt from disk",
                    self.path,
                    exc,
                    moved,
                )
            await self._open()
            return Opened(True, moved)
        finally:
            lock.release()

    async def _open(self) -> bool:
        first = await self._connect()
        self._all.append(first)
        await self._retry(lambda: first.execute("PRAGMA journal_mode = WAL"))
        check = await self._retry(lambda: first.execute_fetchall("PRAGMA quick_check(1)"))
        if not check or next(iter(check))[0] != "ok":
            raise _Corrupt(f"quick_check: {next(iter(check), ('?',))[0]}")
        for _ in range(self.pool_size - 1):
            self._all.append(await self._connect())
        self._pool = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        for conn in self._all:
            self._pool.put_nowait(conn)
        return await self.write(_migrate)

    async def _connect(self) -> aiosqlite.Connection:
        # isolation_level=None: the sqlite3 module must not open transactions behind our back.
        conn = aiosqlite.connect(self.path, isolation_level=None)
        # aiosqlite runs each connection in a non-daemon thread: a Store never closed (a web server's
        # lives as long as the process) would keep the interpreter from exiting. SQLite itself is
        # crash-safe, so the thread may simply die with the process.
        worker = getattr(conn, "_thread", None)
        if worker is not None and not worker.is_alive():
            worker.daemon = True
        conn = await conn
        try:
            await conn.execute(f"PRAGMA busy_timeout = {self._busy_timeout_ms}")
            await conn.execute("PRAGMA foreign_keys = ON")
            # NORMAL is safe with WAL (no corruption); a power cut may lose the last transactions, which
            # the next reconcile recovers from disk anyway.
            await conn.execute("PRAGMA synchronous = NORMAL")
        except BaseException:
            await conn.close()
            raise
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
                await conn.close()

    # ------------------------------------------------------------------ transactions

    async def read(self, fn: Callable[[Tx], Awaitable[T]]) -> T:
        """Run fn in a read transaction (one consistent snapshot, never blocks writers)."""
        return await self._transaction("BEGIN", fn)

    async def write(self, fn: Callable[[Tx], Awaitable[T]]) -> T:
        """Run fn in a write transaction; fn may be run again after a busy error, so it must only
        touch the database."""
        return await self._transaction("BEGIN IMMEDIATE", fn)

    async def _transaction(self, begin: str, fn: Callable[[Tx], Awaitable[T]]) -> T:
        if self._pool is None:
            raise StorageError("the store is not open; use `async with store:` or `await store.open()`")
        if asyncio.get_running_loop() is not self._loop:
            # The pool's queue belongs to one event loop; sharing it across loops fails obscurely.
            raise StorageError("a Store must be used from the event loop that opened it")
        pool = self._pool

        async def attempt() -> T:
            conn = await pool.get()
            try:
                await conn.execute(begin)
                result = await fn(Tx(conn))
                await conn.execute("COMMIT")
                return result
            except BaseException:
                await _rollback(conn)
                raise
            finally:
                pool.put_nowait(conn)

        try:
            return await self._retry(attempt)
        except sqlite3.Error as exc:
            raise StorageError(f"index error: {exc}") from exc

    async def _retry(self, op: Callable[[], Awaitable[T]]) -> T:
        deadline = time.monotonic() + self.busy_total_s
        delay = 0.01
        while True:
            try:
                return await op()
            except sqlite3.OperationalError as exc:
                if not _is_busy(exc):
                    raise
                if time.monotonic() + delay >= deadline:
                    raise StorageBusy(
                        f"the file index stayed locked by other processes for {self.busy_total_s:g} s; "
                        "try again in a moment"
                    ) from None
                await asyncio.sleep(delay * random.uniform(0.5, 1.5))
                delay = min(delay * 2, 1.0)


async def _rollback(conn: aiosqlite.Connection) -> None:
    # Shielded and unconditional: even if we are being cancelled, the ROLLBACK is queued on the
    # connection's thread before anyone else can use it, so it never goes back to the pool inside a
    # transaction. "no transaction is active" (BEGIN itself failed) is fine.
    with contextlib.suppress(sqlite3.Error):
        await asyncio.shield(conn.execute("ROLLBACK"))


def _is_busy(exc: sqlite3.OperationalError) -> bool:
    name = getattr(exc, "sqlite_errorname", "") or ""
    if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")):
        return True
    text = str(exc).lower()
    return "locked" in text or "busy" in text


def _is_corrupt(exc: BaseException) -> bool:
    if isinstance(exc, _Corrupt):
        return True
    if isinstance(exc, StorageError):
        return exc.__cause__ is not None and _is_corrupt(exc.__cause__)
    if not isinstance(exc, sqlite3.DatabaseError) or isinstance(exc, sqlite3.OperationalError):
        return False
    name = getattr(exc, "sqlite_errorname", "") or ""
    if name.startswith(("SQLITE_CORRUPT", "SQLITE_NOTADB")):
        return True
    text = str(exc).lower()
    return "malformed" in text or "not a database" in text


async def _migrate(tx: Tx) -> bool:
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
    return version == 0
