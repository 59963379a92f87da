"""Per-run cgroups for memory and process limits, owned by the runner rather than by runsc.

Why pre-create them: when runsc creates a cgroup it also deletes it as soon as the sandbox dies, so
the kernel's OOM-kill counter is gone before anyone can read it. A cgroup that already exists is
joined as-is by runsc (and left alone at exit), so the runner sets the limits itself, reads
``oom_kill`` after the run, kills anything still in it, and removes it.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from ._procs import sigkill


@dataclass(frozen=True)
class CgroupSupport:
    version: int  # 1 or 2
    memory_root: str  # v1: memory hierarchy mount; v2: the unified mount
    pids_root: str
    v1_roots: tuple[str, ...]  # every v1 hierarchy (runsc creates its own dirs in each)


def _cgroup_mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, fs type, super options) of each cgroup mount, from /proc/self/mountinfo."""
    mounts = []
    with open("/proc/self/mountinfo", encoding="utf-8") as fh:
        for line in fh:
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
                mount_point = fields[4].replace("\\040", " ")
                mounts.append((mount_point, tail[0], set(tail[2].split(","))))
    return mounts


def detect(parent: str) -> CgroupSupport | str:
    """The usable cgroup setup, or a plain-words reason why memory/pids cgroups cannot be used."""
    try:
        mounts = _cgroup_mounts()
    except OSError as exc:
        return f"cannot read /proc/self/mountinfo: {exc}"
    v1 = {opt: mp for mp, fs, opts in mounts if fs == "cgroup" for opt in opts}
    v1_roots = tuple(mp for mp, fs, _ in mounts if fs == "cgroup")
    unified = [mp for mp, fs, _ in mounts if fs == "cgroup2"]
    # Hybrid hosts keep the memory controller on v1, and runsc then uses v1 too.
    if "memory" in v1 and "pids" in v1:
        support = CgroupSupport(1, v1["memory"], v1["pids"], v1_roots)
    elif unified:
        root = unified[0]
        try:
            with open(os.path.join(root, "cgroup.controllers"), encoding="ascii") as fh:
                available = fh.read().split()
        except OSError as exc:
            return f"cannot read {root}/cgroup.controllers: {exc}"
        if not {"memory", "pids"} <= set(available):
            return f"the memory and pids controllers are not available in {root} (have: {available})"
        support = CgroupSupport(2, root, root, ())
    else:
        return "no cgroup filesystem with the memory and pids controllers is mounted"
    probe = RunCgroup(support, parent, f"probe-{os.getpid()}")
    try:
        probe.create(memory_bytes=256 << 20, pids_max=64)
    except OSError as exc:
        probe.remove()
        return f"cgroups are not writable ({exc.strerror or exc} on {exc.filename or 'a cgroup file'})"
    probe.remove()
    return support


def _write(path: str, value: str, optional: bool = False) -> None:
    try:
        with open(path, "w", encoding="ascii") as fh:
            fh.write(value)
    except OSError:
        if not optional:
            raise


class RunCgroup:
    """The cgroup of one sandbox: ``/<parent>/<name>`` in the memory and pids hierarchies."""

    def __init__(self, support: CgroupSupport, parent: str, name: str) -> None:
        self.support = support
        self.path = f"/{parent}/{name}"  # what goes into the OCI spec's linux.cgroupsPath
        self._parent = parent
        self.memory_dir = support.memory_root + self.path
        self.pids_dir = support.pids_root + self.path

    def create(self, memory_bytes: int, pids_max: int) -> None:
        if self.support.version == 2:
            root = self.support.memory_root
            # v2 only offers a controller in a child if every ancestor delegates it.
            _write(os.path.join(root, "cgroup.subtree_control"), "+memory +pids")
            os.makedirs(os.path.join(root, self._parent), exist_ok=True)
            _write(os.path.join(root, self._parent, "cgroup.subtree_control"), "+memory +pids")
            os.mkdir(self.memory_dir)
            _write(f"{self.memory_dir}/memory.max", str(memory_bytes))
            _write(f"{self.memory_dir}/memory.swap.max", "0", optional=True)
            # Kill the whole sandbox (sentry, gofer, stubs) together rather than one process of it.
            _write(f"{self.memory_dir}/memory.oom.group", "1", optional=True)
            _write(f"{self.pids_dir}/pids.max", str(pids_max))
            return
        os.makedirs(self.memory_dir)
        _write(f"{self.memory_dir}/memory.limit_in_bytes", str(memory_bytes))
        # Without this the limit only bounds RAM, and a host with swap lets the sandbox swap freely.
        _write(f"{self.memory_dir}/memory.memsw.limit_in_bytes", str(memory_bytes), optional=True)
        os.makedirs(self.pids_dir, exist_ok=True)
        _write(f"{self.pids_dir}/pids.max", str(pids_max))

    def oom_kills(self) -> int:
        name = "memory.events" if self.support.version == 2 else "memory.oom_control"
        try:
            with open(f"{self.memory_dir}/{name}", encoding="ascii") as fh:
                for line in fh:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def memory_bytes(self) -> int | None:
        """What is charged to the sandbox's memory cgroup now (what its limit counts: gVisor's memory
        file, which no host process need map, included), or None when it cannot be read."""
        name = "memory.current" if self.support.version == 2 else "memory.usage_in_bytes"
        try:
            with open(f"{self.memory_dir}/{name}", encoding="ascii") as fh:
                return int(fh.read())
        except (OSError, ValueError):
            return None

    def pids(self) -> list[int]:
        found: set[int] = set()
        for d in {self.memory_dir, self.pids_dir}:
            with contextlib.suppress(OSError, ValueError), open(f"{d}/cgroup.procs", encoding="ascii") as fh:
                found.update(int(p) for p in fh.read().split())
        return sorted(found)

    def kill_all(self) -> None:
        sigkill(self.pids())

    def remove(self) -> bool:
        """rmdir the run's cgroup everywhere runsc or we made it; False if something is still in it."""
        dirs = {self.memory_dir, self.pids_dir} | {root + self.path for root in self.support.v1_roots}
        clean = True
        for d in dirs:
            try:
                os.rmdir(d)
            except FileNotFoundError:
                pass
            except OSError:
                clean = False
        return clean
