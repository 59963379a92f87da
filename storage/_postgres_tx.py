"""One PostgreSQL transaction's statements (`PgTx`, the `Tx` of _backend.py): `?` placeholders made
psycopg's, NUL kept out of text, many rows sent as one statement, and pipelining.

`PostgresBackend` (_postgres.py) opens the connection and the transaction and hands a `PgTx` to the
function it runs; why each of these is so is told there.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Iterable, Sequence
from functools import lru_cache
from typing import Any

from ._backend import Row

__all__ = ["BatchShape", "NeedsTransaction", "PgTx", "batch_shape", "no_nul", "to_pyformat"]


@lru_cache(maxsize=4096)
def to_pyformat(sql: str) -> str:
    """`?` placeholders (outside quotes) become psycopg's `%s`, and a literal `%` becomes `%%`."""
    out: list[str] = []
    quote = ""
    for ch in sql:
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch == "?":
            out.append("%s")
            continue
        out.append("%%" if ch == "%" else ch)
    return "".join(out)


_INSERT = re.compile(r"(INSERT INTO \w+ \(([^)]*)\) VALUES )(\(\?(?:, \?)*\))(.*)", re.S)
_UPSERT_KEY = re.compile(r"\s*ON CONFLICT \(([^)]*)\) DO UPDATE ", re.S)
_DELETE = re.compile(r"DELETE FROM (\w+) WHERE (\w+ = \?(?: AND \w+ = \?)*)")
_BATCH_ROWS = 1000
_BATCH_PARAMS = 30_000  # PostgreSQL takes at most 65,535 parameters per statement


class BatchShape:
    """How `PgTx.many` sends many rows of one statement as a few statements.

    * `INSERT INTO t (cols) VALUES (?, ...) [ON CONFLICT ...]`: a multi-row VALUES. With `ON CONFLICT
      (key) DO UPDATE`, rows with the same key keep the last one (one statement may not update a row
      twice; the ones before would have been overwritten anyway).
    * `DELETE FROM t WHERE a = ? AND b = ?`: `... WHERE a = ? AND b IN (?, ...)` per value of a.
    """

    def __init__(self, insert: re.Match[str] | None, delete: re.Match[str] | None) -> None:
        self._insert = insert
        self._delete = delete
        self._key: list[int] | None = None
        if insert is not None:
            columns = [c.strip() for c in insert.group(2).split(",")]
            upsert = _UPSERT_KEY.match(insert.group(4))
            if upsert is not None:
                self._key = [columns.index(c.strip()) for c in upsert.group(1).split(",")]
            self._width = len(columns)

    def statements(self, rows: list[Sequence[Any]]) -> Iterable[tuple[str, list[Any]]]:
        if self._insert is not None:
            if self._key is not None:
                key = self._key
                rows = list({tuple(r[i] for i in key): r for r in rows}.values())
            size = max(1, min(_BATCH_ROWS, _BATCH_PARAMS // self._width))
            for i in range(0, len(rows), size):
                chunk = rows[i : i + size]
                yield self._insert_sql(len(chunk)), [v for r in chunk for v in r]
            return
        assert self._delete is not None
        groups: dict[tuple[Any, ...], list[Any]] = {}
        for r in rows:
            groups.setdefault(tuple(r[:-1]), []).append(r[-1])
        for prefix, last in groups.items():
            for i in range(0, len(last), _BATCH_ROWS):
                chunk = last[i : i + _BATCH_ROWS]
                yield self._delete_sql(len(chunk)), [*prefix, *chunk]

    @lru_cache(maxsize=64)  # noqa: B019 (one shape per statement of _index, a handful in all)
    def _insert_sql(self, n: int) -> str:
        head, _, row, tail = self._insert.groups()  # type: ignore[union-attr]
        return to_pyformat(head + ", ".join([row] * n) + tail)

    @lru_cache(maxsize=64)  # noqa: B019
    def _delete_sql(self, n: int) -> str:
        table, condition = self._delete.groups()  # type: ignore[union-attr]
        head, _, last = condition.rpartition(" AND ")
        column = (last or condition).split(" = ")[0]
        keep = f"{head} AND " if head else ""
        return to_pyformat(f"DELETE FROM {table} WHERE {keep}{column} IN ({', '.join('?' * n)})")


@lru_cache(maxsize=256)
def batch_shape(sql: str) -> BatchShape | None:
    insert, delete = _INSERT.fullmatch(sql), _DELETE.fullmatch(sql)
    return None if insert is None and delete is None else BatchShape(insert, delete)


def no_nul(params: Sequence[Any]) -> Sequence[Any]:
    for value in params:
        if type(value) is str and "\x00" in value:
            return [v.replace("\x00", "\\x00") if type(v) is str else v for v in params]
    return params


class PgTx:
    """The statements of one transaction; handed to the function given to read/write.

    A transaction runs in psycopg's pipeline mode: a statement is sent when its answer is needed,
    together with those queued before it. So BEGIN travels with the first query, and what returns
    nothing the caller reads (a user's lock, executemany) with the next one or with the COMMIT.

    A read whose function has only ever made one query runs that query alone, outside a transaction
    (one statement is one snapshot): no BEGIN, no COMMIT, one round trip. If the function asks for a
    second statement, it is stopped (`NeedsTransaction`) and run again in a real transaction, and its
    code is remembered as one that needs it (reads only read, so running one again is harmless)."""

    __slots__ = ("_conn", "_pipeline", "_single", "_used", "_user_key")

    def __init__(
        self, conn: Any, pipeline: Any, user_key: Callable[[str], int], *, single: bool = False
    ) -> None:
        self._conn = conn
        self._pipeline = pipeline  # None: no pipeline (a single-statement read, or an old libpq)
        self._user_key = user_key  # the advisory key of a user's quota lock (PostgresBackend.user_key)
        self._single = single
        self._used = False

    def _statement(self) -> None:
        if self._single:
            if self._used:
                raise NeedsTransaction()
            self._used = True

    async def all(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        self._statement()
        cursor = await self._conn.execute(to_pyformat(sql), no_nul(params))
        rows: list[Row] = await cursor.fetchall()
        return rows

    async def one(self, sql: str, params: Sequence[Any] = ()) -> Row | None:
        self._statement()
        cursor = await self._conn.execute(to_pyformat(sql), no_nul(params))
        row: Row | None = await cursor.fetchone()
        return row

    async def one_later(self, sql: str, params: Sequence[Any] = ()) -> Callable[[], Awaitable[Row | None]]:
        self._statement()
        # Queued in a pipeline: its answer comes with the COMMIT's (leaving the pipeline reads both).
        cursor = await self._conn.execute(to_pyformat(sql), no_nul(params))

        async def later() -> Row | None:
            row: Row | None = await cursor.fetchone()
            return row

        return later

    async def run(self, sql: str, params: Sequence[Any] = ()) -> int:
        if self._single:
            raise NeedsTransaction()  # a read that writes must meet READ ONLY
        cursor = await self._conn.execute(to_pyformat(sql), no_nul(params))
        if self._pipeline is not None:
            await self._pipeline.sync()  # the row count is the server's answer
        return int(cursor.rowcount)

    async def many(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        if self._single:
            raise NeedsTransaction()
        # Queued: sent with the next statement that needs an answer, or the COMMIT. An INSERT or a
        # DELETE by key goes as one statement per batch of rows, not one per row (the totals'
        # triggers run once per statement: see the schema).
        rows = [no_nul(r) for r in rows]
        shape = batch_shape(sql)
        if shape is None or len(rows) < 2:
            async with self._conn.cursor() as cursor:
                await cursor.executemany(to_pyformat(sql), rows)
            return
        for statement, params in shape.statements(rows):
            await self._conn.execute(statement, params)

    async def serialise_user(self, user_key: str) -> None:
        if self._single:
            raise NeedsTransaction()
        # Held until this transaction ends. Only queued: the server runs the statements after it
        # once it has the lock (waiting up to lock_timeout, then the transaction is run again).
        await self._conn.execute(
            "SELECT pg_advisory_xact_lock(%s::bigint)", (self._user_key(user_key),)
        )


class NeedsTransaction(BaseException):
    """A single-statement read asked for a second statement. A BaseException: the function's own
    `except Exception` must not swallow it."""
