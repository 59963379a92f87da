"""Paths off the main road: cancellation, no cgroups (RLIMIT_AS), and refused network setup."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from runner import Limits, Outcome, Runner, RunnerConfig, RunnerError

from .conftest import RUNSC, live_processes, runsc_containers


async def test_cancelled_run_still_kills_the_sandbox(runner: Runner, workdir: Path) -> None:
    task = asyncio.create_task(runner.run("sleep 30", "bash", workdir, Limits(timeout_s=30)))
    deadline = time.monotonic() + 30
    # The sandbox's processes are up: there is something for the cancel to kill.
    while True:
        bundles_during = {p.name for p in runner.bundle_dir.glob("cs-*")}
        if any(live_processes(cid) for cid in bundles_during):
            break
        assert time.monotonic() < deadline and not task.done(), "the run should be in progress"
        await asyncio.sleep(0.05)
    t0 = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(live_processes(cid) for cid in bundles_during):
        await asyncio.sleep(0.1)
    assert time.monotonic() - t0 < 10
    for cid in bundles_during:
        assert live_processes(cid) == []
        assert cid not in runsc_containers(runner.state_dir)


async def test_without_cgroups_memory_falls_back_to_rlimit_as(tmp_path: Path, workdir: Path) -> None:
    config = RunnerConfig(
        runsc_path=RUNSC, state_dir=tmp_path / "state", bundle_dir=tmp_path / "bundles", use_cgroups=False
    )
    runner = Runner(config)
    setup = await runner.setup()
    assert setup.cgroups is None and "RLIMIT_AS" in setup.memory_enforcement
    hog = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))"
    res = await runner.run(hog, "python", workdir, Limits(memory_mb=128))
    assert res.outcome is Outcome.OOM, res
    assert "MemoryError" in res.stderr
    slow = await runner.run(":(){ :|:& };:\nsleep 60", "bash", workdir, Limits(timeout_s=2))
    assert slow.outcome is Outcome.TIMEOUT
    assert live_processes(slow.container_id) == []
    assert runsc_containers(runner.state_dir) == []


async def test_network_needs_a_prepared_namespace(tmp_path: Path, workdir: Path) -> None:
    config = RunnerConfig(runsc_path=RUNSC, state_dir=tmp_path / "s", bundle_dir=tmp_path / "b", network=True)
    with pytest.raises(RunnerError, match="netns_path"):
        await Runner(config).run("print(1)", "python", workdir)
