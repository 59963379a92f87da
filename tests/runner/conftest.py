"""Fixtures for the runner suite. Everything here uses the REAL runsc: a missing runsc fails the
suite (the fixture raises RunscNotFound), it is never skipped."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from runner import Runner, RunnerConfig, RunResult

RUNSC = os.environ.get("RUNSC", "runsc")


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


def live_processes(needle: str) -> list[str]:
    """Host processes (zombies excluded) whose command line mentions ``needle``."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in cmdline and state != "Z":
            found.append(f"{name}: {cmdline}")
    return found


def runsc_containers(runner: Runner) -> list[str]:
    out = subprocess.run(
        [RUNSC, "--root", str(runner.state_dir), "list", "-quiet"], capture_output=True, text=True, check=True
    ).stdout
    return out.split()


def assert_nothing_left(runner: Runner, result: RunResult) -> None:
    cid = result.container_id
    assert cid
    assert cid not in runsc_containers(runner)
    assert live_processes(cid) == []
    assert not list(Path("/sys/fs/cgroup").glob(f"*/{runner.config.cgroup_parent}/{cid}"))
    assert not (runner.bundle_dir / cid).exists()
