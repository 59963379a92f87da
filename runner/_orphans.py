"""What runs leave behind when the process supervising them dies (an Open WebUI crash, an OOM kill).

runsc dies with its supervisor (see _supervise.die_with), which takes the sandbox with it, but its
container state, the run's bundle and its cgroups stay. Every bundle records its owner (pid and that
process's start time, so a reused pid is not mistaken for it); at the first run of a new Runner, and
at every `Runner.sweep_leftovers` (the function's background tick), the leftovers of runs whose owner
is gone are killed and removed. Runs of live processes (other workers
sharing these directories) are never touched.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import time
from pathlib import Path

from . import _cgroups
from ._procs import pids_by_marker, sigkill

log = logging.getLogger("code_sessions.runner")

OWNER_FILE = "owner"
_UNOWNED_GRACE_S = 60.0  # a bundle this young without an owner file may be being written right now
_HELPER_TIMEOUT_S = 10.0


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


def owner_stamp() -> str:
    """`<pid> <start time>` of this process, written into each bundle."""
    return f"{os.getpid()} {_start_time(os.getpid())}"


def _owner_alive(bundle: Path) -> bool:
    try:
        pid, started = (bundle / OWNER_FILE).read_text(encoding="ascii").split()
    except FileNotFoundError:
        try:
            return time.time() - bundle.stat().st_mtime < _UNOWNED_GRACE_S
        except FileNotFoundError:
            return True  # removed meanwhile: nothing to do
    except (OSError, ValueError):
        return False
    return _start_time(int(pid)) == started


def _runsc(runsc: str, state_dir: Path, *args: str) -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        return subprocess.run(
            [runsc, "--root", str(state_dir), *args],
            capture_output=True,
            text=True,
            timeout=_HELPER_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        ).stdout
    return ""


def sweep(
    runsc: str,
    state_dir: Path,
    bundle_dir: Path,
    cgroups: _cgroups.CgroupSupport | None,
    cgroup_parent: str,
) -> list[str]:
    """Kill and remove what runs of dead owners left: processes, container state, cgroups, bundles.
    Returns their container ids."""
    removed = []
    for bundle in sorted(bundle_dir.glob("cs-*")):
        if not bundle.is_dir() or _owner_alive(bundle):
            continue
        cid = bundle.name
        _runsc(runsc, state_dir, "kill", "--all", cid, "KILL")
        _runsc(runsc, state_dir, "delete", "--force", cid)
        if cgroups is not None:
            cgroup = _cgroups.RunCgroup(cgroups, cgroup_parent, cid)
            for _ in range(50):
                cgroup.kill_all()
                if cgroup.remove():
                    break
                time.sleep(0.02)
        sigkill(pids_by_marker(str(bundle)))
        shutil.rmtree(bundle, ignore_errors=True)
        removed.append(cid)
    # Container state whose bundle is gone: runsc died after its run had already been cleaned up.
    for cid in _runsc(runsc, state_dir, "list", "-quiet").split():
        if cid.startswith("cs-") and not (bundle_dir / cid).exists():
            _runsc(runsc, state_dir, "delete", "--force", cid)
            removed.append(cid)
    if removed:
        log.warning(
            "removed what %d sandbox runs of a process that died left behind: %s", len(removed), removed
        )
    return removed
