"""What a sandbox run may leave behind on the host, for the tests that prove it leaves nothing."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from runner import Runner, RunResult
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
