"""What tests/adversarial found in the runner, pinned here: writes the disk watcher could not see (paths
longer than PATH_MAX, folders nested without end, files deleted while open), and a supervisor that dies
mid-run (the sandbox ran on forever; its state, bundle and cgroup stayed)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from runner import Runner, RunnerConfig
from runner._disk import TooDeep, deleted_but_open
from runner._orphans import OWNER_FILE, owner_stamp, sweep
from tests.support.sandbox import disk_usage, kill_a_worker_holding_a_kernel, leftovers

from .conftest import RUNSC, live_processes, runsc_containers

REPO = Path(__file__).resolve().parents[2]


def _descend(top: Path, name: str, levels: int) -> int:
    """An fd of top/name/name/... (levels deep), made without ever using a long path."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(levels):
        os.mkdir(name, dir_fd=fd)
        child = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = child
    return fd


def test_disk_usage_sees_files_below_path_max(tmp_path: Path) -> None:
    fd = _descend(tmp_path, "n" * 200, 30)  # a path of ~6,000 bytes
    try:
        out = os.open("big", os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=fd)
        os.write(out, b"x" * (1 << 20))
        os.close(out)
    finally:
        os.close(fd)
    assert disk_usage(str(tmp_path)) >= 1 << 20


def test_disk_usage_refuses_what_is_too_deep_to_measure(tmp_path: Path) -> None:
    os.close(_descend(tmp_path, "d", 200))
    with pytest.raises(TooDeep):
        disk_usage(str(tmp_path))
    assert disk_usage(str(tmp_path), max_depth=300) > 0


def test_deleted_but_open_files_are_counted(tmp_path: Path) -> None:
    path = tmp_path / "hidden"
    with open(path, "wb") as held:
        held.write(b"x" * (3 << 20))
        held.flush()
        path.unlink()
        device = os.stat(tmp_path).st_dev
        assert deleted_but_open([os.getpid()], device) >= 3 << 20
        assert deleted_but_open([os.getpid()], device + 1) == 0


def test_sweep_removes_only_the_runs_of_dead_owners(tmp_path: Path) -> None:
    state, bundles = tmp_path / "state", tmp_path / "bundles"
    state.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    for cid, owner in (("cs-dead", f"{int(dead.stdout)} 1"), ("cs-live", owner_stamp())):
        (bundles / cid).mkdir(parents=True)
        (bundles / cid / OWNER_FILE).write_text(owner)
    assert sweep(RUNSC, state, bundles, None, "code-sessions") == ["cs-dead"]
    assert sorted(p.name for p in bundles.iterdir()) == ["cs-live"]


def test_a_supervisor_killed_mid_run_takes_its_sandbox_with_it(tmp_path: Path) -> None:
    """Before: the orphaned sandbox ran past its timeout for ever; its container, bundle and cgroup stayed."""
    config = RunnerConfig(runsc_path=RUNSC, state_dir=tmp_path / "state", bundle_dir=tmp_path / "bundles")
    workdir = tmp_path / "work"
    workdir.mkdir()
    script = f"""
        import asyncio, os, signal, threading
        from pathlib import Path
        from runner import Limits, Runner, RunnerConfig
        config = RunnerConfig.model_validate_json({config.model_dump_json()!r})
        def kill_once_running():  # mid-run: once the code has written, however slow the start
            beat = Path({str(workdir / "beat")!r})
            for _ in range(600):
                if beat.exists():
                    break
                threading.Event().wait(0.1)
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Thread(target=kill_once_running, daemon=True).start()
        code = "import time\\nwhile True:\\n    open('/mnt/data/beat', 'w').write(str(time.time()))"
        asyncio.run(Runner(config).run(code, "python", Path({str(workdir)!r}), Limits(timeout_s=60)))
    """
    killed = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=REPO, timeout=60)
    assert killed.returncode == -9
    [bundle] = list((tmp_path / "bundles").glob("cs-*"))
    deadline = time.monotonic() + 10
    while live_processes(bundle.name) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert live_processes(bundle.name) == []
    beat = (workdir / "beat").read_text()
    time.sleep(0.5)
    assert (workdir / "beat").read_text() == beat  # the code stopped with its supervisor

    runner = Runner(config)  # the next start cleans up
    asyncio.run(runner.setup())
    assert not bundle.exists()
    assert bundle.name not in runsc_containers(runner.state_dir)
    assert not list(Path("/sys/fs/cgroup").glob(f"*/{config.cgroup_parent}/{bundle.name}"))


def test_a_runner_already_set_up_sweeps_a_dead_workers_kernel_when_asked(tmp_path: Path) -> None:
    """A worker SIGKILLed with a live kernel: its sandbox dies with it, but its bundle and cgroups stay,
    and its runsc container state too unless runsc deleted it on its way out (a race we do not control).
    A Runner set up before that (another worker) removes them at its periodic sweep, without waiting
    for some later Runner's setup."""
    # A short base: the kernels' sockets live under the bundle folder, and pytest's own temporary
    # paths are too long for a unix socket's 108 bytes.
    base = Path(tempfile.mkdtemp(prefix="cs-sweep-", dir="/tmp"))
    config = RunnerConfig(runsc_path=RUNSC, state_dir=base / "state", bundle_dir=base / "bundles")
    survivor = Runner(config)
    asyncio.run(survivor.setup())
    cid = kill_a_worker_holding_a_kernel(config, tmp_path)
    left = leftovers(cid, config.state_dir, config.bundle_dir)
    assert "bundle" in left, left  # only our supervisor removes a bundle, and it was SIGKILLed

    assert cid in asyncio.run(survivor.sweep_leftovers())
    assert leftovers(cid, config.state_dir, config.bundle_dir) == []
