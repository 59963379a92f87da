"""The one seam between the store and its database.

Everything above this seam (`_index.py` and `_index_links.py` hold every SQL statement) speaks a
small portable SQL dialect with `?` placeholders, and needs from a backend only:

* transactions: `read(fn)` / `write(fn)` run `fn(tx)` in one transaction; a write transaction may be
  run again after a transient conflict, so `fn` must only touch the database;
* locks that hold across every process that shares the store (and across hosts, where the backend
  spans hosts): a chat's steps and a session's deletion, the one background cleanup at a time;
* recovery: `open()` says when the database is new (the caller rebuilds it from the folders), and
  `recover()` replaces a database found damaged while running.

`_sqlite.py` is the embedded default (one host: a file, `flock` locks). A second backend
(PostgreSQL, for several hosts) is a new module implementing these protocols.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from .errors import StorageBusy

__all__ = ["Backend", "Lock", "Opened", "Row", "Tx"]

T = TypeVar("T")
Row = tuple[Any, ...]


class Tx(Protocol):
    """The statements of one transaction (placeholders are `?`)."""

    async def all(self, sql: str, params: Sequence[Any] = ()) -> list[Row]: ...

    async def one(self, sql: str, params: Sequence[Any] = ()) -> Row | None: ...

    async def one_later(self, sql: str, params: Sequence[Any] = ()) -> Callable[[], Awaitable[Row | None]]:
        """`one`, read once the transaction is over (await what it returns after read/write returned):
        on a network database the statement then travels with the COMMIT, not in a round trip of its
        own. It runs where it is in the transaction and sees what the statements before it wrote."""

    async def run(self, sql: str, params: Sequence[Any] = ()) -> int: ...

    async def many(self, sql: str, rows: Iterable[Sequence[Any]]) -> None: ...

    async def serialise_user(self, user_key: str) -> None:
        """Make this write transaction the only one deciding about this user's totals until it ends
        (quota decisions read the totals and write the result in one transaction)."""


class Lock(Protocol):
    """An exclusive lock shared by every process of the store. Not reentrant."""

    async def try_acquire(self) -> bool: ...

    async def acquire(self, timeout: float | None = None, *, what: str = "this chat") -> None:
        """Wait for the lock without blocking the event loop; StorageBusy after `timeout` seconds."""

    async def release(self, *, forget: bool = False) -> None:
        """Release; `forget=True` also drops what the lock is kept in (its session was deleted)."""


@dataclass(frozen=True, slots=True)
class Opened:
    fresh: bool  # the database had no schema: the caller should rebuild it from the folders
    moved_aside: str | None = None  # where a damaged database went, if one was found


class Backend(Protocol):
    kind: str  # "sqlite" or "postgresql"
    where: str  # for messages: the file, or the server without credentials

    async def open(self) -> Opened: ...

    async def close(self) -> None: ...

    # Coroutines, not any awaitable: the SQLite backend drives them in its connection's thread.
    async def read(self, fn: Callable[[Tx], Coroutine[Any, Any, T]]) -> T: ...

    async def write(self, fn: Callable[[Tx], Coroutine[Any, Any, T]]) -> T: ...

    async def recover(self) -> Opened:
        """The database was found damaged (IndexDamaged): replace it with a working one. Another
        process may have done it already, then this only reconnects (fresh=False)."""

    def chat_lock(self, user_key: str, chat_key: str) -> Lock: ...

    def named_lock(self, name: str) -> Lock: ...

    async def chat_locked(self, user_key: str, chat_key: str) -> bool:
        """Whether someone holds the chat's lock; creates nothing (dry runs, check)."""


class BusyBackoff:
    """Waits between attempts at a transaction that another process holds up: jittered (so processes
    that collided do not collide again) and doubling up to 1 s, until `total_s` has gone, then
    StorageBusy with a sentence."""

    def __init__(self, total_s: float) -> None:
        self._total_s = total_s
        self._deadline = time.monotonic() + total_s
        self._delay = 0.01

    async def wait(self) -> None:
        if time.monotonic() + self._delay >= self._deadline:
            raise StorageBusy(
                f"the file index stayed locked by other processes for {self._total_s:g} s; "
                "try again in a moment"
            ) from None
        await asyncio.sleep(self._delay * random.uniform(0.5, 1.5))
        self._delay = min(self._delay * 2, 1.0)
