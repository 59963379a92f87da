"""tests/container: the deploy/ recipe built and run with podman. Built and run by scripts/test-container,
which sets CODE_SESSIONS_CONTAINER_IMAGE. Without it these tests are deselected, not skipped: ./scripts/test
builds no image, and CI runs scripts/test-container on its own before the suite."""

from __future__ import annotations

import shutil

import pytest

from .recipe import IMAGE


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if IMAGE and shutil.which("podman"):
        return
    container = [item for item in items if item.get_closest_marker("container")]
    if not container:
        return
    config.hook.pytest_deselected(items=container)
    items[:] = [item for item in items if not item.get_closest_marker("container")]


def pytest_report_header(config: pytest.Config) -> str | None:
    if IMAGE and shutil.which("podman"):
        return None
    return "tests/container: deselected here, run by ./scripts/test-container (builds the images)"
