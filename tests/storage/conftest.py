from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from storage import DirectoryPublisher, Store
from tests.storage.storage_helpers import BACKENDS, run_index_sql, temporary_chat


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "root"


@pytest.fixture
def publisher(tmp_path: Path) -> DirectoryPublisher:
    return DirectoryPublisher(tmp_path / "published", "/cache/functions/code_sessions/")


@pytest.fixture(params=BACKENDS)
def backend_kind(request: pytest.FixtureRequest) -> str:
    """Which index the test's store uses; a test that is about one backend parametrizes this itself
    (`@sqlite_only`)."""
    return request.param


@pytest.fixture
def database_url(backend_kind: str, request: pytest.FixtureRequest) -> str:
    """The `database_url` of the test's stores: "" (SQLite under root) or a fresh PostgreSQL database."""
    if backend_kind == "sqlite":
        return ""
    return request.getfixturevalue("postgres_url")


@pytest.fixture
def index_sql(root: Path, database_url: str) -> Callable[..., list[tuple[Any, ...]]]:
    """Run SQL (`?` placeholders) on the test's index directly, whichever backend it is: to age rows,
    or to look at what was written."""
    return lambda statement, params=(): run_index_sql(root, database_url, statement, params)


@pytest.fixture
async def store(root: Path, publisher: DirectoryPublisher, database_url: str) -> AsyncIterator[Store]:
    async with Store(
        root, publisher=publisher, busy_timeout_s=20, database_url=database_url, temporary_chat=temporary_chat
    ) as s:
        yield s
