"""The PostgreSQL backend: the index in a schema of its own, and advisory locks, for several hosts.

When Open WebUI runs on PostgreSQL across replicas, every replica mounts the same session folders and
shares one index in that database. What differs from the embedded backend (_sqlite.py), and why:

* Our own tables only: they live in a dedicated schema (`code_sessions` by default), created if
  missing, and every connection's search_path names only that schema, so the unqualified table names
  of _index.py resolve there and nothing we run can reach Open WebUI's tables.
* Migrations are ours (`MIGRATIONS` in _postgres_schema.py, versioned in `<schema>.schema_version`),
  applied at open in one transaction behind a transaction-level advisory lock, so two replicas
  starting at once do not both migrate. A database written by a newer release is refused, like SQLite's.
* Paths and ids are `COLLATE "C"`: byte order, as SQLite compares them, which the range reads of
  _index.rows_at_and_under (`path >= 'a/' AND path < 'a0'`) rely on, whatever the database's locale.
* Writes are READ COMMITTED: each statement sees what others committed, and the triggers' counter
  updates (`bytes = bytes + ...`) apply to the newest row version, so concurrent chats never lose an
  increment. What SQLite gets from BEGIN IMMEDIATE (one writer at a time) is only needed for the
  quota decisions, and `serialise_user` gives exactly that: a transaction-level advisory lock per
  user. (Any other decision that reads, then writes what it read, across processes, needs a lock:
  the chat's, a named one, or `serialise_user`.) Reads are REPEATABLE READ, READ ONLY: one snapshot
  for all their statements, and such a transaction never fails with a serialization error.
* Round trips are what a network database costs, so: a transaction's statements are pipelined (sent
  when an answer is needed), a read of one statement goes alone without BEGIN/COMMIT, `many` sends
  batches of rows as one statement, and `one_later` reads an answer with the COMMIT's. Statements are
  prepared on first use and planned once (see `_connect`). The totals' triggers run per statement (a
  row updated again and again in one transaction costs PostgreSQL more each time).
* A write that meets a serialization failure, a deadlock or a lock wait longer than `lock_timeout`
  is rolled back and run again with backoff (its function only touches the database), up to
  `busy_total_s`, then StorageBusy. A full disk (SQLSTATE 53100) is DiskFull.
* A connection found dead (the server restarted) is replaced, and a transaction that had not
  committed is run again on the new one; a server that cannot be reached is a StorageError, and the
  next transaction tries again, so a replica lives through a database restart.
* `synchronous_commit = off` on our connections: a crash of the server may lose the last few commits,
  never consistency, the same promise as SQLite's `synchronous = NORMAL` (the next reconcile indexes
  from disk whatever was lost), and a commit does not wait for a disk flush.
* Locks are session-level advisory locks, each held on a connection of its own for as long as it is
  held: if the process dies or its connection drops, the server releases them, so a replica killed
  mid-run never keeps its chat locked. Keys are 64-bit hashes of a prefix (with the schema) and the
  name: distinct from the user keys of `serialise_user` and from anyone else's advisory locks.

psycopg (3, with asyncio) is imported when a backend opens, not with this module: the package keeps
working where psycopg is not installed. PostgreSQL text cannot hold NUL: a NUL in a parameter is
stored as the four characters `\\x00`, the way SQLite's backend stores a lone surrogate (ids are found
by key, the hash of the exact id, so the stored form is only for display).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from ._backend import BusyBackoff, Opened
from ._postgres_schema import CURRENT_VERSION, migration_statements, quoted
from ._postgres_tx import NeedsTransaction, PgTx
from .errors import DiskFull, IndexDamaged, StorageBusy, StorageError

log = logging.getLogger("code_sessions.storage")

T = TypeVar("T")

__all__ = ["DEFAULT_SCHEMA", "PostgresBackend", "advisory_key", "is_postgres_url", "libpq_url", "redact_url"]

DEFAULT_SCHEMA = "code_sessions"
_SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")

_BEGIN_READ = "BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY"
_BEGIN_WRITE = "BEGIN ISOLATION LEVEL READ COMMITTED, READ WRITE"
# SQLSTATEs after which a write transaction is simply run again: serialization failure, deadlock,
# and a lock wait longer than lock_timeout (another transaction holds a row or a user's lock).
_RETRY = frozenset({"40001", "40P01", "55P03"})
# Our tables or schema are gone (dropped by hand): recover() migrates again, and the store rebuilds.
_MISSING = frozenset({"42P01", "3F000"})
# The server is going away or not there yet (shutdown, crash, starting up): the connection is lost.
_GONE = frozenset({"57P01", "57P02", "57P03"})


# ---------------------------------------------------------------------------- URLs


def is_postgres_url(url: str) -> bool:
    """postgresql://, postgres:// and SQLAlchemy's postgresql+<driver>:// (Open WebUI's DATABASE_URL)."""
    scheme = url.partition("://")[0].lower()
    return scheme in ("postgresql", "postgres") or scheme.startswith("postgresql+")


def libpq_url(url: str) -> str:
    """The URL as libpq reads it: the SQLAlchemy driver suffix dropped (`postgresql+psycopg://`)."""
    scheme, sep, rest = url.partition("://")
    if not sep or not is_postgres_url(url):
        raise StorageError(f"not a PostgreSQL URL: {redact_url(url)!r}")
    return "postgresql://" + rest if scheme.lower() != "postgresql" else url


def redact_url(url: str) -> str:
    """The URL without its password (in the user part or a `password=` parameter), for messages."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if "@" in netloc:
            user, _, host = netloc.rpartition("@")
            netloc = f"{user.partition(':')[0]}@{host}"
        query = urlencode([(k, v) for k, v in parse_qsl(parts.query) if k.lower() != "password"])
        return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    except ValueError:
        return "<an unreadable database URL>"


# ---------------------------------------------------------------------------- keys


def advisory_key(text: str) -> int:
    """A signed 64-bit key (PostgreSQL's bigint) from a hash of `text`."""
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def _split_key(key: int) -> tuple[int, int]:
    """(classid, objid) under which pg_locks shows a lock on a bigint key (objsubid 1)."""
    unsigned = key & 0xFFFF_FFFF_FFFF_FFFF
    return unsigned >> 32, unsigned & 0xFFFF_FFFF


class _Conflict(Exception):
    """The transaction met another one (serialization, deadlock, lock timeout): run it again."""


class _Lost(Exception):
    """The connection died before the transaction committed: nothing was written; run it again."""


# ---------------------------------------------------------------------------- locks


class _AdvisoryLock:
    """`Lock` over a session-level advisory lock, held on a connection of its own while held."""

    def __init__(self, backend: PostgresBackend, key: int, label: str) -> None:
        self._backend = backend
        self._key = key
        self._label = label
        self._conn: Any = None

    async def try_acquire(self) -> bool:
        if self._conn is not None:
            raise RuntimeError("lock already held by this object")
        await self._backend.unlocked(self._key)
        conn = await self._backend.lock_connection()
        got, conn = await self._attempt(conn)
        if got:
            self._conn = conn
            return True
        await self._backend.park(conn)
        return False

    async def acquire(self, timeout: float | None = None, *, what: str = "this chat") -> None:
        if self._conn is not None:
            raise RuntimeError("lock already held by this object")
        # Polled with a short, growing sleep like _lock.FileLock: cancellable, honours the timeout, and
        # never leaves a server-side wait behind that could take the lock after its caller gave up.
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.005
        await self._backend.unlocked(self._key)
        conn = await self._backend.lock_connection()
        try:
            while True:
                got, conn = await self._attempt(conn)
                if got:
                    self._conn, conn = conn, None
                    return
                if deadline is not None and time.monotonic() >= deadline:
                    raise StorageBusy(
                        f"{what} is busy with another request (waited {timeout:g} s); try again in a moment"
                    )
                wait = delay if deadline is None else min(delay, max(0.0, deadline - time.monotonic()))
                await asyncio.sleep(wait)
                delay = min(delay * 2, 0.2)
        finally:
            if conn is not None:
                await self._backend.park(conn)

    async def _attempt(self, conn: Any) -> tuple[bool, Any]:
        """pg_try_advisory_lock on conn (a dead connection is replaced once). On any interruption the
        connection is closed: the server may have granted the lock without our knowing, and closing
        its session is what surely releases it."""
        psycopg = _psycopg()
        for attempt in range(2):
            try:
                cursor = await conn.execute("SELECT pg_try_advisory_lock(%s::bigint)", (self._key,))
                row = await cursor.fetchone()
                return bool(row and row[0]), conn
            except psycopg.Error as exc:
                lost = _is_lost(exc, conn)
                await self._backend.drop(conn)
                if attempt or not lost:
                    raise self._backend.error(exc) from exc
                conn = await self._backend.lock_connection()  # an idle one the server dropped
            except BaseException:
                await self._backend.drop(conn)
                raise
        raise AssertionError("unreachable")

    async def release(self, *, forget: bool = False) -> None:
        # `forget` has nothing to drop: an advisory lock is a name, not a file. The unlock is sent,
        # and its answer awaited in the background: the caller goes on a round trip sooner. This
        # process's next lock on the same key waits for that answer first (PostgresBackend.unlocked);
        # another process may find the lock held for that round trip longer, as if we had been slower.
        conn, self._conn = self._conn, None
        if conn is None:
            return
        self._backend.unlocking(self._key, asyncio.ensure_future(self._unlock(conn)))

    async def _unlock(self, conn: Any) -> None:
        psycopg = _psycopg()
        try:
            cursor = await conn.execute("SELECT pg_advisory_unlock(%s::bigint)", (self._key,))
            row = await cursor.fetchone()
        except psycopg.Error as exc:
            await self._backend.drop(conn)
            if not self._backend.closed:
                log.warning(
                    "the lock on %s went with its connection to the index database (%s): someone else "
                    "may have taken it while this process believed it held it",
                    self._label,
                    exc,
                )
            return
        except BaseException:
            await self._backend.drop(conn)  # closing the session releases its locks
            raise
        if row and row[0]:
            await self._backend.park(conn)
        else:
            await self._backend.drop(conn)
            log.warning("the lock on %s was no longer held when released", self._label)


# ---------------------------------------------------------------------------- the backend


class PostgresBackend:
    kind = "postgresql"

    def __init__(
        self,
        url: str,
        *,
        busy_total_s: float = 60.0,
        pool_size: int = 4,
        schema: str = DEFAULT_SCHEMA,
        connect_timeout_s: float = 10.0,
    ) -> None:
        if not _SCHEMA_NAME.fullmatch(schema):
            raise StorageError(f"invalid PostgreSQL schema name {schema!r} (lower-case letters, digits, _)")
        self.url = libpq_url(url)
        self.where = redact_url(self.url)
        self.schema = schema
        self.busy_total_s = busy_total_s
        self.pool_size = max(1, pool_size)
        self.connect_timeout_s = connect_timeout_s
        # The server's wait for a lock per statement; our retry loop covers the rest of busy_total_s.
        self._lock_timeout_ms = int(max(0.05, min(5.0, busy_total_s / 4)) * 1000)
        self._pool: asyncio.Queue[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._all: set[Any] = set()
        self._idle_locks: list[Any] = []
        self._unlocks: dict[int, asyncio.Future[None]] = {}  # key -> its unlock's answer, awaited
        self._multi_reads: set[Any] = set()  # code of read functions that make several statements
        self._pipelined = True  # libpq >= 14 (psycopg's binary wheels bundle one); checked at open
        self.closed = True
        # Our keys name the schema: two stores in one database (two schemas) never share a lock.
        self._prefix = f"code-sessions:{schema}:"

    # ------------------------------------------------------------------ keys and locks

    def user_key(self, user_key: str) -> int:
        return advisory_key(self._prefix + "user:" + user_key)

    def chat_key(self, user_key: str, chat_key: str) -> int:
        return advisory_key(f"{self._prefix}chat:{user_key}/{chat_key}")

    def chat_lock(self, user_key: str, chat_key: str) -> _AdvisoryLock:
        return _AdvisoryLock(self, self.chat_key(user_key, chat_key), f"chat {user_key}/{chat_key}")

    def named_lock(self, name: str) -> _AdvisoryLock:
        return _AdvisoryLock(self, advisory_key(self._prefix + "lock:" + name), f"the {name} lock")

    async def chat_locked(self, user_key: str, chat_key: str) -> bool:
        classid, objid = _split_key(self.chat_key(user_key, chat_key))
        row = await self.read(
            lambda tx: tx.one(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1"
                " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
                " AND classid = CAST(CAST(? AS BIGINT) AS OID) AND objid = CAST(CAST(? AS BIGINT) AS OID)",
                (classid, objid),
            )
        )
        return bool(row and row[0])

    def unlocking(self, key: int, answer: asyncio.Future[None]) -> None:
        """An unlock of `key` is on its way (see _AdvisoryLock.release)."""
        self._unlocks[key] = answer

        def answered(future: asyncio.Future[None]) -> None:
            if self._unlocks.get(key) is future:
                del self._unlocks[key]
            if not future.cancelled() and future.exception() is not None:
                log.warning("unlocking an advisory lock failed: %s", future.exception())

        answer.add_done_callback(answered)

    async def unlocked(self, key: int) -> None:
        """Wait until an unlock of `key` this process sent has been answered."""
        answer = self._unlocks.get(key)
        if answer is not None:
            await asyncio.wait({answer})

    async def lock_connection(self) -> Any:
        """A connection for one lock: an idle one if there is one, else a new one."""
        self._check_open()
        while self._idle_locks:
            conn = self._idle_locks.pop()
            if not conn.closed:
                return conn
        return await self._connect()

    async def park(self, conn: Any) -> None:
        """Keep a lock connection that holds nothing for the next lock (a few; the others close)."""
        if self.closed or conn.closed or len(self._idle_locks) >= self.pool_size:
            await self.drop(conn)
            return
        self._idle_locks.append(conn)

    async def drop(self, conn: Any) -> None:
        """Close a connection and forget it (closing a session releases whatever it held)."""
        self._all.discard(conn)
        await _close(conn)

    # ------------------------------------------------------------------ open / close / recover

    async def open(self) -> Opened:
        await self.close()
        self._loop = asyncio.get_running_loop()
        self._pool = asyncio.Queue()
        self._pipelined = bool(_psycopg().Pipeline.is_supported())
        self.closed = False
        try:
            first = await self._connect()
            self._pool.put_nowait(first)
            for _ in range(self.pool_size - 1):
                self._pool.put_nowait(None)  # connected when first needed
            fresh = await self.write(self._migrate)
        except BaseException:
            await self.close()
            raise
        return Opened(fresh)

    async def recover(self) -> Opened:
        # Not a file to move aside: connect again, and create our tables again if they were dropped
        # (then fresh=True and the store rebuilds them from the folders).
        return await self.open()

    async def close(self) -> None:
        if self._unlocks:  # (closing their connections would release them too, less politely)
            await asyncio.gather(*self._unlocks.values(), return_exceptions=True)
        self.closed = True
        conns, self._all, self._idle_locks, self._pool = self._all, set(), [], None
        for conn in conns:
            await _close(conn)

    async def _connect(self) -> Any:
        psycopg = _psycopg()
        try:
            # Every statement prepared on its first use (psycopg's default waits for the fifth, on each
            # connection of the pool): a step's statements are parsed and planned once per connection.
            conn = await psycopg.AsyncConnection.connect(
                self.url, autocommit=True, prepare_threshold=0, **self._connect_options(psycopg)
            )
        except psycopg.Error as exc:
            raise StorageError(
                f"cannot connect to the index database {self.where}: {_first_line(exc)}"
            ) from exc
        try:
            # Only our schema: unqualified names are our tables, never Open WebUI's. Our statements are
            # key and range lookups whose plan does not depend on the values: planned once, not at
            # every execution (plan_cache_mode exists from PostgreSQL 12 on).
            generic = (
                ", set_config('plan_cache_mode', 'force_generic_plan', false)"
                if conn.info.server_version >= 120000
                else ""
            )
            await conn.execute(
                "SELECT set_config('search_path', %s, false), set_config('synchronous_commit', 'off', false),"
                f" set_config('lock_timeout', %s, false){generic}",
                (quoted(self.schema), f"{self._lock_timeout_ms}ms"),
            )
        except BaseException as exc:
            await _close(conn)
            if isinstance(exc, psycopg.Error):
                raise self.error(exc) from exc
            raise
        self._all.add(conn)
        return conn

    def _connect_options(self, psycopg: Any) -> dict[str, Any]:
        try:
            given = psycopg.conninfo.conninfo_to_dict(self.url)
        except psycopg.Error as exc:
            raise StorageError(f"cannot read the database URL {self.where}: {_first_line(exc)}") from exc
        options: dict[str, Any] = {}
        if "application_name" not in given:
            options["application_name"] = "code-sessions"
        if "connect_timeout" not in given:
            options["connect_timeout"] = max(1, round(self.connect_timeout_s))
        return options

    async def _migrate(self, tx: PgTx) -> bool:
        schema = self.schema
        # One process migrates at a time; the others wait here and then find the schema current.
        await tx.one(
            "SELECT pg_advisory_xact_lock(CAST(? AS BIGINT))", (advisory_key(self._prefix + "migrate"),)
        )
        if await tx.one("SELECT 1 FROM pg_namespace WHERE nspname = ?", (schema,)) is None:
            await tx.run(f"CREATE SCHEMA {quoted(schema)}")
        table = f"{quoted(schema)}.schema_version"
        if (await tx.one("SELECT to_regclass(?) IS NOT NULL", (table,)) or (False,))[0]:
            row = await tx.one(f"SELECT max(version) FROM {table}")
            version = int(row[0]) if row and row[0] is not None else 0
        else:
            await tx.run(f"CREATE TABLE {table} (version INTEGER NOT NULL)")
            version = 0
        if version > CURRENT_VERSION:
            raise StorageError(
                f"the index in schema {schema} of {self.where} was written by a newer version of "
                f"code-sessions (schema {version}, this one knows up to {CURRENT_VERSION}); upgrade "
                "code-sessions"
            )
        for number in range(version + 1, CURRENT_VERSION + 1):
            for statement in migration_statements(number, schema):
                await tx.run(statement)
            log.info("index schema %s upgraded to version %d", schema, number)
        if version < CURRENT_VERSION:
            await tx.run(f"DELETE FROM {table}")
            await tx.run(f"INSERT INTO {table} (version) VALUES (?)", (CURRENT_VERSION,))
        return version == 0

    # ------------------------------------------------------------------ transactions

    async def read(self, fn: Callable[[PgTx], Coroutine[Any, Any, T]]) -> T:
        """Run fn in a read transaction: one snapshot, never blocks writers nor fails to serialize."""
        code = getattr(fn, "__code__", fn)
        if code not in self._multi_reads:
            try:
                return await self._transaction(None, fn)
            except NeedsTransaction:
                if len(self._multi_reads) > 10_000:
                    self._multi_reads.clear()
                self._multi_reads.add(code)
        return await self._transaction(_BEGIN_READ, fn)

    async def write(self, fn: Callable[[PgTx], Coroutine[Any, Any, T]]) -> T:
        """Run fn in a write transaction; fn may be run again after a conflict, so it must only touch
        the database."""
        return await self._transaction(_BEGIN_WRITE, fn)

    def _check_open(self) -> None:
        if self._pool is None:
            raise StorageError("the store is not open; use `async with store:` or `await store.open()`")
        if asyncio.get_running_loop() is not self._loop:
            # The pool's queue and connections belong to one event loop.
            raise StorageError("a Store must be used from the event loop that opened it")

    async def _transaction(self, begin: str | None, fn: Callable[[PgTx], Coroutine[Any, Any, T]]) -> T:
        """begin=None: fn's one statement alone (see PgTx)."""
        self._check_open()
        backoff = BusyBackoff(self.busy_total_s)
        lost = 0
        while True:
            try:
                return await self._attempt(begin, fn)
            except _Conflict:
                await backoff.wait()
            except _Lost as exc:
                # Every pooled connection may be dead after a server restart: each is replaced once.
                lost += 1
                if lost > self.pool_size + 1:
                    raise StorageError(
                        f"the index database {self.where} keeps dropping connections: {exc}"
                    ) from exc.__cause__

    async def _attempt(self, begin: str | None, fn: Callable[[PgTx], Coroutine[Any, Any, T]]) -> T:
        psycopg = _psycopg()
        pool = self._pool
        assert pool is not None
        conn = await pool.get()
        try:
            if conn is None or conn.closed:
                self._all.discard(conn)
                conn = await self._connect()
            committing = False
            try:
                if begin is None:
                    return await fn(PgTx(conn, None, self.user_key, single=True))
                if not self._pipelined:
                    await conn.execute(begin)
                    result = await fn(PgTx(conn, None, self.user_key))
                    committing = True
                    await conn.execute("COMMIT")
                    return result
                async with conn.pipeline() as pipeline:
                    await conn.execute(begin)
                    result = await fn(PgTx(conn, pipeline, self.user_key))
                    committing = True
                    await conn.execute("COMMIT")
                # Leaving the pipeline waited for every answer, the COMMIT's included.
                return result
            except psycopg.Error as exc:
                lost = _is_lost(exc, conn)
                await _rollback(conn)
                if lost:
                    if committing:  # the COMMIT may or may not have happened: not safe to run again
                        raise StorageError(
                            f"lost the connection to the index database {self.where} while committing: "
                            f"{_first_line(exc)}"
                        ) from exc
                    raise _Lost(_first_line(exc)) from exc
                if exc.sqlstate in _RETRY:
                    raise _Conflict() from exc
                raise self.error(exc) from exc
            except BaseException:
                await _rollback(conn)
                raise
        finally:
            if pool is self._pool and conn is not None and not conn.closed:
                pool.put_nowait(conn)
            elif pool is self._pool:
                self._all.discard(conn)
                pool.put_nowait(None)
            elif conn is not None:
                await _close(conn)

    def error(self, exc: BaseException) -> StorageError:
        """The StorageError a psycopg error is for the caller."""
        sqlstate = getattr(exc, "sqlstate", None)
        if sqlstate == "53100":
            return DiskFull()
        if sqlstate in _MISSING:
            return IndexDamaged(
                f"the index tables in schema {self.schema} of {self.where} are missing: {exc}"
            )
        if sqlstate in _RETRY:
            return StorageBusy(f"the file index is busy ({_first_line(exc)}); try again in a moment")
        return StorageError(f"index error: {_first_line(exc)}")


def _psycopg() -> Any:
    # Imported on first use: `storage` works on the standard library's sqlite3 without it.
    try:
        import psycopg
    except ImportError as exc:
        raise StorageError(
            "a PostgreSQL index needs psycopg 3 (`pip install 'psycopg[binary]'`); it is not installed"
        ) from exc
    return psycopg


def _is_lost(exc: BaseException, conn: Any) -> bool:
    psycopg = _psycopg()
    if getattr(exc, "sqlstate", None) in _GONE:
        return True
    return isinstance(exc, psycopg.OperationalError) and (conn.closed or conn.broken)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


async def _rollback(conn: Any) -> None:
    # Shielded: even when we are being cancelled the ROLLBACK is sent before anyone else gets the
    # connection (psycopg serialises its use), so it never goes back to the pool inside a transaction.
    if conn.closed or conn.broken or conn.info.transaction_status == _psycopg().pq.TransactionStatus.IDLE:
        return  # nothing to roll back (a single-statement read, or BEGIN never ran)
    try:
        await asyncio.shield(conn.execute("ROLLBACK"))
    except asyncio.CancelledError:
        raise
    except Exception:
        await _close(conn)


async def _close(conn: Any) -> None:
    with contextlib.suppress(Exception):
        await asyncio.shield(conn.close())
