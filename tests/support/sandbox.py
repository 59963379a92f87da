"""What a sandbox run may leave behind on the host, for the tests that prove it leaves nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from runner import Runner, RunnerConfig, RunResult
from runner._disk import MAX_DEPTH, folder_sizes

RUNSC = os.environ.get("RUNSC", "runsc")


def live_processes(needle: str) -> list[str]:
    """Host processes (zombies excluded) whose command line mentions ``needle``."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in cmdline and state != "Z":
            found.append(f"{name}: {cmdline}")
    return found


def runsc_containers(state_dir: Path) -> list[str]:
    listed = subprocess.run(
        [RUNSC, "--root", str(state_dir), "list", "-quiet"], capture_output=True, text=True, check=True
    )
    return listed.stdout.split()


def leftovers(cid: str, state_dir: Path, bundle_dir: Path, cgroup_parent: str = "code-sessions") -> list[str]:
    """Everything of run ``cid`` still on the host: its runsc container, processes, cgroups, bundle."""
    found = ["runsc container"] if cid in runsc_containers(state_dir) else []
    found += [f"process {p}" for p in live_processes(cid)]
    found += [str(p) for p in Path("/sys/fs/cgroup").glob(f"*/{cgroup_parent}/{cid}")]
    if (bundle_dir / cid).exists():
        found.append("bundle")
    return found


def assert_nothing_left(runner: Runner, result: RunResult) -> None:
    assert result.container_id
    left = leftovers(result.container_id, runner.state_dir, runner.bundle_dir, runner.config.cgroup_parent)
    assert left == [], f"run {result.container_id} left {left}"


def disk_usage(root: Path | str, max_depth: int = MAX_DEPTH) -> int:
    """Bytes under ``root``, measured the way the runner's write limit measures them."""
    return sum(folder_sizes(str(root), max_depth).values())


_KERNEL_WORKER = """
import asyncio, sys
from pathlib import Path
from runner import KernelPool, Limits, Runner, RunnerConfig

async def main(config, registry, workdir):
    pool = KernelPool(Runner(RunnerConfig.model_validate_json(config)), Path(registry))
    result = await pool.run("u/c", Path(workdir), "x = 1", "python", Limits())
    print(result.container_id, flush=True)
    await asyncio.sleep(3600)

asyncio.run(main(*sys.argv[1:4]))
"""


def kill_a_worker_holding_a_kernel(config: RunnerConfig, scratch: Path) -> str:
    """A worker process (another Open WebUI worker) starts a kernel with ``config`` and is SIGKILLed;
    once its sandbox's processes are gone (they die with it), returns the kernel's container id."""
    workdir = scratch / "dead-worker-chat"
    workdir.mkdir(exist_ok=True)
    worker = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(_KERNEL_WORKER),
            config.model_dump_json(),
            str(scratch / "dead-worker-registry"),
            str(workdir),
        ],
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        cid = worker.stdout.readline().strip()
    finally:
        worker.kill()
        worker.wait()
    assert cid.startswith("cs-k-"), f"the worker did not start a kernel: {cid!r}"
    deadline = time.monotonic() + 10
    while live_processes(cid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert live_processes(cid) == [], "the kernel did not die with its worker"
    return cid
