from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from storage import DirectoryPublisher, Store


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "root"


@pytest.fixture
def publisher(tmp_path: Path) -> DirectoryPublisher:
    return DirectoryPublisher(tmp_path / "published", "/cache/functions/code_sessions/")


@pytest.fixture
async def store(root: Path, publisher: DirectoryPublisher) -> AsyncIterator[Store]:
    async with Store(root, publisher=publisher, busy_timeout_s=20) as s:
        yield s
