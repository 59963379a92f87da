"""Helpers shared by the storage tests."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
BACKENDS = ("sqlite", "postgresql")
# For a test about the SQLite file itself (PRAGMAs, a corrupted file, old SQLite schemas).
sqlite_only = pytest.mark.parametrize("backend_kind", ["sqlite"])
postgres_only = pytest.mark.parametrize("backend_kind", ["postgresql"])


def temporary_chat(chat_id: str) -> bool:
    """A host's rule for which chats are temporary, as a store is given it (Open WebUI's: webui/host.py)."""
    return chat_id.startswith("temporary:")


def sql(root: Path, statement: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Run SQL on a store's SQLite index file directly (to age rows, or to look at what was written)."""
    conn = sqlite3.connect(root / "index.sqlite3", timeout=30, isolation_level=None)
    try:
        return conn.execute(statement, params).fetchall()
    finally:
        conn.close()


def run_index_sql(
    root: Path, database_url: str, statement: str, params: Sequence[Any] = ()
) -> list[tuple[Any, ...]]:
    """`sql` for either backend: the SQLite file under root, or the store's PostgreSQL schema."""
    if not database_url:
        return sql(root, statement, tuple(params))
    import psycopg

    from storage._postgres import DEFAULT_SCHEMA
    from storage._postgres_tx import to_pyformat

    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("SELECT set_config('search_path', %s, false)", (DEFAULT_SCHEMA,))
        # Without parameters the statement goes as it is (simple protocol: several statements allowed).
        cursor = conn.execute(to_pyformat(statement), tuple(params)) if params else conn.execute(statement)
        while cursor.nextset():  # the result of the last statement
            pass
        return cursor.fetchall() if cursor.description else []


def lose_index(root: Path, database_url: str) -> None:
    """The index is gone (a deleted file; a dropped schema): the next open rebuilds it from the folders."""
    if not database_url:
        for suffix in ("", "-wal", "-shm"):
            (root / f"index.sqlite3{suffix}").unlink(missing_ok=True)
        return
    import psycopg

    from storage._postgres import DEFAULT_SCHEMA

    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA {DEFAULT_SCHEMA} CASCADE")


def stored_id(value: str, database_url: str) -> str:
    """An id as the index shows it: PostgreSQL text cannot hold NUL, stored as the characters `\\x00`."""
    return value.replace("\x00", "\\x00") if database_url else value


def run_python(code: str, *args: str, timeout: float = 60, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """Run a small script in a separate process (true cross-process behaviour, and a hang guard)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )


def start_python(code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


class FifoGuard:
    """Unblocks anyone stuck opening/reading a FIFO after `timeout` s, and remembers that it had to.

    Used around code that must never open a FIFO: if it did block, the guard opens the write end
    (which releases the reader with EOF) so the test fails on `guard.fired` instead of hanging.
    """

    def __init__(self, path: Path, timeout: float = 10.0) -> None:
        import threading

        self.path = path
        self.fired = False
        self._timer = threading.Timer(timeout, self._release)

    def _release(self) -> None:
        import os

        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            return  # ENXIO: nobody is reading, so nobody was blocked
        self.fired = True
        os.close(fd)

    def __enter__(self) -> FifoGuard:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()


async def user_usage(store: Any, user_id: str) -> Any:
    """A user's totals across chats, as the quota sees them (files, bytes incl. published copies)."""
    from storage import Usage

    for row in await store.users_usage():
        if row.user_id == user_id:
            return Usage(row.files, row.bytes)
    return Usage(0, 0)
