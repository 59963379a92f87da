"""tests/container: the deploy/ recipe built and run with podman. Built by scripts/test-container, which
sets CODE_SESSIONS_CONTAINER_IMAGE; without it these tests are skipped (./scripts/test builds nothing)."""

from __future__ import annotations

import shutil

import pytest

from .recipe import IMAGE


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if IMAGE and shutil.which("podman"):
        return
    skip = pytest.mark.skip(reason="container images not built: run ./scripts/test-container")
    for item in items:
        if item.get_closest_marker("container"):
            item.add_marker(skip)
