"""Fixtures of the adversarial suite: the installed function with small limits, and a host secret."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.adversarial import crash_site
from tests.adversarial.attack import SMALL
from tests.support.pipe_harness import PipeHarness


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[PipeHarness]:
    found = PipeHarness(tmp_path / "data", valves=dict(SMALL))
    yield found
    # What an Open WebUI shutdown does: the background loop ends, the store closes.
    if found.pipe._background is not None:
        found.pipe._background.cancel()
    if found.pipe._services is not None:
        await found.pipe._services.close()


@pytest.fixture
def host_secret(harness: PipeHarness) -> Iterator[tuple[Path, bytes]]:
    """A stand-in for Open WebUI's database in DATA_DIR: a host file no chat may ever publish."""
    secret = b"owui-db-secret-" + secrets.token_hex(16).encode()
    path = harness.data_dir / "webui.db"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"SQLite format 3\x00" + secret)
    yield path, secret
    assert path.read_bytes() == b"SQLite format 3\x00" + secret, "the host file was modified"


def pytest_collection_finish(session: pytest.Session) -> None:
    """The crash test needs its own Open WebUI (~40 s to start): start it now, while other tests run."""
    if session.config.option.collectonly:
        return
    if any(item.nodeid.startswith("tests/adversarial/test_crash.py") for item in session.items):
        crash_site.begin_early()


def pytest_sessionfinish(session: pytest.Session) -> None:
    crash_site.stop_early_site()


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    """The in-process attacks first, while the crash test's Open WebUI starts in the background; the
    attacks through a real Open WebUI after them (same slots among all items, stable order)."""
    slots = [i for i, item in enumerate(items) if "tests/adversarial/" in item.nodeid]
    ours = sorted((items[i] for i in slots), key=lambda item: item.get_closest_marker("e2e") is not None)
    for slot, item in zip(slots, ours, strict=True):
        items[slot] = item
