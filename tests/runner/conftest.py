"""Fixtures for the runner suite. Everything here uses the REAL runsc: a missing runsc fails the
suite (the fixture raises RunscNotFound), it is never skipped."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner import Runner, RunnerConfig
from tests.support.sandbox import RUNSC, assert_nothing_left, live_processes, runsc_containers

__all__ = ["RUNSC", "assert_nothing_left", "live_processes", "runsc_containers"]


@pytest.fixture(scope="session")
def runner_config(tmp_path_factory: pytest.TempPathFactory) -> RunnerConfig:
    base = tmp_path_factory.mktemp("runner")
    return RunnerConfig(runsc_path=RUNSC, state_dir=base / "state", bundle_dir=base / "bundles")


@pytest.fixture(scope="session")
def runner(runner_config: RunnerConfig) -> Runner:
    return Runner(runner_config)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    d = tmp_path / "session"
    d.mkdir()
    return d
