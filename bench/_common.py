"""Shared pieces of the benchmarks: the context every section gets, statistics, scratch files, RSS."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runner import Runner, RunnerConfig, _hibernate
from runner._procs import pss_bytes, rss_bytes
from storage import DirectoryPublisher, Quotas, Store

CGROUP_PARENT = "code-sessions-bench"
# The benchmark stores hold sessions of 10k-100k files: the default per-user quota (5000 files) would
# refuse those runs. The limit stays active (the check and the SUM still run), just out of the way.
BENCH_QUOTAS = Quotas(max_files_per_user=1_000_000, max_bytes_per_user=64 * 1024**3)
ANSWER_WITHOUT_PATHS = "The script printed 1, as expected. Nothing was saved."


@dataclass
class Context:
    """What a section needs: the mode, where to put scratch data, and where to report errors."""

    quick: bool
    scratch: Path  # on the real disk (default /var/tmp/...)
    runner_base: Path  # runsc state and bundles, on tmpfs like the runner's defaults (/run)
    tmpfs_scratch: Path | None = None  # also measure the index on tmpfs (/dev/shm) when set
    errors: list[str] = field(default_factory=list)
    _runner: Runner | None = None

    def log(self, message: str) -> None:
        print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    def error(self, section: str, message: str) -> None:
        self.errors.append(f"{section}: {message}")
        self.log(f"ERROR {section}: {message}")

    def runner_config(self) -> RunnerConfig:
        return RunnerConfig(
            state_dir=self.runner_base / "state",
            bundle_dir=self.runner_base / "bundles",
            cgroup_parent=CGROUP_PARENT,
        )

    def runner(self) -> Runner:
        """One Runner for the in-process sections (its host setup and image are built once)."""
        if self._runner is None:
            self._runner = Runner(self.runner_config())
        return self._runner

    def store(self, name: str, *, base: Path | None = None) -> Store:
        """A fresh store under the scratch folder, publishing into a folder next to it."""
        root = (base or self.scratch) / name
        runner = self.runner()
        return Store(
            root / "sessions-root",
            quotas=BENCH_QUOTAS,
            publisher=DirectoryPublisher(root / "cache", f"/cache/functions/bench-{name}/"),
            owner=(runner.sandbox_uid, runner.sandbox_gid),
        )


# ---------------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); q in [0, 1]."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summary(seconds: Sequence[float]) -> dict[str, Any]:
    """Median and spread of durations, in milliseconds."""
    ms = [s * 1000 for s in seconds]
    return {
        "n": len(ms),
        "median_ms": round(percentile(ms, 0.5), 3),
        "p25_ms": round(percentile(ms, 0.25), 3),
        "p75_ms": round(percentile(ms, 0.75), 3),
        "min_ms": round(min(ms), 3) if ms else None,
        "max_ms": round(max(ms), 3) if ms else None,
    }


def ratio_summary(ratios: Sequence[float]) -> dict[str, Any]:
    return {
        "n": len(ratios),
        "median": round(percentile(ratios, 0.5), 4),
        "p25": round(percentile(ratios, 0.25), 4),
        "p75": round(percentile(ratios, 0.75), 4),
    }


# ---------------------------------------------------------------------------- files


def make_files(folder: Path, count: int, *, per_dir: int = 1000, prefix: str = "d") -> list[Path]:
    """`count` files of one byte, `per_dir` to a folder (d000/f0000.txt ...); returns the folders."""
    folders = []
    for d in range((count + per_dir - 1) // per_dir):
        sub = folder / f"{prefix}{d:03}"
        sub.mkdir(parents=True, exist_ok=True)
        folders.append(sub)
        dir_fd = os.open(sub, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for i in range(min(per_dir, count - d * per_dir)):
                fd = os.open(f"f{i:04}.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600, dir_fd=dir_fd)
                os.write(fd, b"x")
                os.close(fd)
        finally:
            os.close(dir_fd)
    return folders


def bare_walk(folder: Path) -> int:
    """The floor of a reconcile: the same scandir + one lstat per file, with none of its work."""
    n = 0
    stack = [str(folder)]
    while stack:
        with os.scandir(stack.pop()) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                else:
                    entry.stat(follow_symlinks=False)
                    n += 1
    return n


def bare_rename(folders: Sequence[Path], aside: Path) -> list[Path]:
    """The floor of moving expired folders out of a session: one rename per folder, nothing else."""
    moved = []
    for sub in folders:
        target = aside / sub.name
        os.rename(sub, target)
        moved.append(target)
    return moved


def bare_unlink(folders: Sequence[Path]) -> int:
    """The floor of expiring files: one unlinkat per file, nothing else."""
    n = 0
    for sub in folders:
        dir_fd = os.open(sub, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for name in os.listdir(dir_fd):
                os.unlink(name, dir_fd=dir_fd)
                n += 1
        finally:
            os.close(dir_fd)
    return n


def filesystem_of(path: Path) -> str:
    """The type of the filesystem `path` is on (ext4, tmpfs, ...), from /proc/self/mounts."""
    best, kind = "", "?"
    real = os.path.realpath(path)
    with contextlib.suppress(OSError), open("/proc/self/mounts", encoding="utf-8") as fh:
        for line in fh:
            parts = line.split()
            if len(parts) >= 3:
                mount = parts[1].replace("\\040", " ")
                inside = real == mount or real.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, kind = mount, parts[2]
    return kind


# ---------------------------------------------------------------------------- memory


def status_kib(field_name: str) -> int | None:
    """A field of /proc/self/status in KiB (VmRSS, VmHWM)."""
    with contextlib.suppress(OSError), open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    return None


def rss_kib(pids: list[int]) -> int:
    """The summed VmRSS of these processes in KiB (a kernel's runsc, sentry and gofer); gone ones count 0."""
    return rss_bytes(pids) // 1024


def pss_kib(pids: list[int]) -> int:
    """The proportional set size of these processes (shared pages split among their sharers), KiB."""
    return pss_bytes(pids) // 1024


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux: write 5 to clear_refs); False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")
    except OSError:
        return False
    return True


# ---------------------------------------------------------------------------- saved images


def evict_image(state: Path) -> None:
    """Drop a saved image's files from the page cache (written back first), as hours of other work
    would: its next resume reads them from the disk."""
    for item in _hibernate.image_dir(state).iterdir():
        fd = os.open(item, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
