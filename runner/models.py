"""The runner's typed public data: configuration, per-run limits, the kernels' settings, and the result
of a run.

These models are the one home of the runner's defaults: the function's valves take theirs from them.
"No limit" is None wherever a limit can be lifted."""

from __future__ import annotations

import enum
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB


class Outcome(enum.StrEnum):
    """How a run ended. Exactly one per run; the first limit that fired wins."""

    OK = "ok"  # exit status 0
    ERROR = "error"  # non-zero exit status
    TIMEOUT = "timeout"
    OOM = "out_of_memory"
    OUTPUT_LIMIT = "output_limit"
    DISK_LIMIT = "disk_limit"
    SANDBOX_FAILURE = "sandbox_failure"  # gVisor itself failed; the code may not have run at all
    KERNEL_LOST = "kernel_lost"  # a persistent kernel died or broke its protocol during the run


class Limits(BaseModel):
    """Per-run limits. Defaults suit an interactive chat; tests use much smaller ones."""

    model_config = ConfigDict(frozen=True)

    timeout_s: float = Field(30.0, gt=0, description="wall time; the whole sandbox is killed at the deadline")
    memory_mb: int = Field(
        512, ge=64, description="memory of the whole sandbox (gVisor's own overhead included)"
    )
    max_processes: int = Field(64, ge=4, description="processes + threads of the sandbox user (RLIMIT_NPROC)")
    # None by default: the per-file size is the storage's quota (the engine passes it down with each run).
    max_file_bytes: int | None = Field(
        None, gt=0, description="size of any one file written (RLIMIT_FSIZE); None: no limit"
    )
    max_write_bytes: int = Field(GIB, gt=0, description="growth of the workdir during the run")
    max_output_bytes: int = Field(64 * KIB, gt=0, description="kept per stream; more stops the run")


class KernelSettings(BaseModel):
    """How a KernelPool keeps its kernels. Frozen: an admin's change replaces the whole value."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Five minutes: a live kernel holds its memory (about 18 MiB plain, 97 MiB with pandas imported),
    # and a saved one comes back in about 0.6 s (docs/benchmarks.md#current-figures, capacity rows).
    idle_s: float = Field(5 * 60.0, gt=0, description="a kernel unused this long is saved and stopped")
    max_kernels: int = Field(20, ge=1, description="kernels alive at once in this process")
    # 0: kernels are never saved (they stop as they would without a state folder); None: no limit
    # beyond the kernel's memory.
    max_image_bytes: int | None = Field(2 * GIB, ge=0, description="largest saved kernel")
    # The saved images of one owner's chats together (one state folder per owner, as the store lays
    # them out); None: no such bound.
    max_saved_bytes_together: int | None = Field(4 * GIB, gt=0, description="one owner's saved kernels")
    # Saved images compressed with zstd where it is installed (runner/_hibernate.py); the two bounds
    # above are of what is on disk.
    compress: bool = Field(True, description="compress saved kernels")


class RunnerConfig(BaseModel):
    """How to reach gVisor on this host. One per process is plenty; it is immutable."""

    model_config = ConfigDict(frozen=True)

    runsc_path: str = "runsc"
    # None = newest supported platform the installed runsc offers: systrap, else ptrace.
    platform: str | None = None
    # The platform of live kernels (long-lived sandboxes: KernelPool) and their saved images. ptrace,
    # because an idle systrap sandbox is never idle: its sentry wakes every 400 us to tune its fast
    # paths (1.5% of a core per kernel, measured), where an idle ptrace one uses none; a warm step
    # costs about 0.1 ms more (docs/benchmarks.md). None: the same as `platform`. If the runsc here does
    # not offer the default, kernels use `platform` (one set explicitly must be offered).
    kernel_platform: str | None = "ptrace"
    # runsc --root (container state). Default: /run/code-sessions-runsc, mode 0700.
    state_dir: Path | None = None
    # Where per-run OCI bundles and the shared read-only root skeleton live. Default:
    # /run/code-sessions-runner, mode 0700.
    bundle_dir: Path | None = None
    # False: --network=none (loopback only). True: runsc's own network stack (--network=sandbox) in a
    # fresh network namespace (loopback only too) or in ``netns_path``, a namespace the operator wired up.
    network: bool = False
    netns_path: Path | None = None
    sandbox_uid: int = Field(65534, gt=0)
    sandbox_gid: int = Field(65534, gt=0)
    # The sandbox environment (runner/environment.py): an environments folder or one build. None:
    # $CODE_SESSIONS_SANDBOX_ENV, else /opt/code-sessions/sandbox-env, else the host's own /usr.
    environment: Path | None = None
    # Interpreters, as paths inside the sandbox; None = python3/bash in /usr/bin, /usr/local/bin.
    python: Path | None = None
    bash: Path | None = None
    # None = use cgroups for memory/pids when they are writable; False = never (RLIMIT_AS fallback).
    use_cgroups: bool | None = None
    cgroup_parent: str = Field("code-sessions", pattern=r"^[A-Za-z0-9_.-]+$")
    # Set to a directory to get gVisor debug logs (off by default: they are large and slow runs down).
    debug_log_dir: Path | None = None
    # Escape hatch for flags the runner does not know about, e.g. ("--directfs=false",).
    extra_runsc_flags: tuple[str, ...] = ()


class RunResult(BaseModel):
    """What happened. ``reason`` is plain words for a human (or a model) to read."""

    model_config = ConfigDict(frozen=True)

    outcome: Outcome
    exit_code: int | None
    stdout: str
    stderr: str
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    duration_s: float
    reason: str | None = None
    container_id: str = ""
    # Relative POSIX paths (sorted) that the run created, changed, removed or renamed in the workdir,
    # from host-side inotify; None = unknown (list the whole workdir). See runner/_changes.py.
    changed: tuple[str, ...] | None = None
    # A persistent kernel's claims (untrusted: check them against the disk): figures it saved.
    figures: tuple[str, ...] = ()
    # Figures past the kernel's bound per run, left open and not saved (said in the same answer).
    figures_more: int = 0
    # Persistent kernels: whether the Python state lives on after this run (False: it was lost).
    state_kept: bool = False
    # Sentences for the user and the model about the kernel (its state was reset, and why).
    notes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK
