"""Turn what gVisor says when it fails into plain words and a concrete fix.

Shared by the runner (``RunResult.reason`` on a sandbox failure) and the doctor (each check's fix).
Rules are tried in order; the first whose every keyword group matches the (lower-cased) text wins.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

DOCKER_UNCONFINED = "--security-opt seccomp=unconfined --security-opt apparmor=unconfined"


@dataclass(frozen=True)
class Diagnosis:
    problem: str
    fix: str


_EPERM = ("operation not permitted", "permission denied")
# (keyword groups: every group needs at least one match, problem, fix)
_RULES: tuple[tuple[tuple[tuple[str, ...], ...], str, str], ...] = (
    (
        (("cgroup",), (*_EPERM, "read-only file system")),
        "cgroups are not writable, so gVisor cannot apply memory/process limits",
        "give the container a writable cgroup tree (docker: --cgroupns=host "
        "-v /sys/fs/cgroup:/sys/fs/cgroup:rw, or --privileged), "
        "or set RunnerConfig(use_cgroups=False) to fall back to RLIMIT_AS",
    ),
    (
        (("/proc",), ("mount", "masked", "obstructed")),
        "/proc is obstructed (masked paths), so gVisor cannot mount a fresh /proc for the sandbox",
        "docker: add --security-opt systempaths=unconfined (or run --privileged)",
    ),
    (
        (("ptrace",), (*_EPERM, "not supported", "no such process")),
        "the ptrace platform cannot trace its own processes (ptrace is blocked)",
        "docker: add --cap-add SYS_PTRACE and " + DOCKER_UNCONFINED + "; or use platform 'systrap' "
        "(needs a gVisor release from 2023 or later)",
    ),
    (
        (("kvm",), ("no such file", *_EPERM, "not supported")),
        "the kvm platform needs /dev/kvm, which is missing or not accessible",
        "use RunnerConfig(platform='ptrace') or 'systrap', or pass /dev/kvm into the container "
        "(--device /dev/kvm)",
    ),
    (
        (("platform",), ("invalid", "unknown", "not found", "not registered", "unsupported", "not offered")),
        "this runsc does not offer the configured platform",
        "leave RunnerConfig.platform unset (auto) or pick one from `runsc help platforms`",
    ),
    (
        (("systrap",), ("seccomp", "not supported", "failed")),
        "the systrap platform could not start here",
        "use RunnerConfig(platform='ptrace'); inside docker also add " + DOCKER_UNCONFINED,
    ),
    (
        (("flag provided but not defined",),),
        "this runsc is too old for a flag the runner was asked to pass",
        "remove it from RunnerConfig.extra_runsc_flags, or upgrade gVisor",
    ),
    (
        (("apparmor",),),
        "AppArmor blocks gVisor's mounts",
        "docker: add --security-opt apparmor=unconfined",
    ),
    (
        (("newosproc", "error initializing first thread", "failed to create new os thread"),),
        "the host refused gVisor a new thread (a pids/threads limit is too low)",
        "raise the container's pids limit (docker --pids-limit) and ulimit -u; "
        "the runner's own pids backstop is 128 x max_processes",
    ),
    (
        (("failed to load",), ("no such file",)),
        "the interpreter does not exist inside the sandbox",
        "build the sandbox environment (sandbox/build), or set RunnerConfig.python/bash",
    ),
    (
        (("minimal chroot",), ("cap_sys_admin",)),
        "runsc lacks CAP_SYS_ADMIN to build the sandbox's chroot",
        "run as root; inside docker add --cap-add SYS_ADMIN (and " + DOCKER_UNCONFINED + "), "
        "or run --privileged",
    ),
    (
        (
            _EPERM,
            (
                "unshare",
                "clone",
                "namespace",
                "fork/exec /proc/self/exe",
                "pivot_root",
                "chroot",
                "setns",
                "mount",
            ),
        ),
        "the kernel refused to create the sandbox's namespaces (seccomp, AppArmor, or missing capabilities)",
        "run as root; inside docker add "
        + DOCKER_UNCONFINED
        + " and --cap-add SYS_ADMIN, or run --privileged",
    ),
)


def explain(text: str) -> Diagnosis | None:
    low = text.lower()
    for groups, problem, fix in _RULES:
        if all(any(k in low for k in group) for group in groups):
            return Diagnosis(problem, fix)
    return None


_NOISE = re.compile(r"^(running container|creating container|starting container|starting root container): ")


def tidy(message: str, limit: int = 400) -> str:
    """Drop runsc's repetitive wrapper prefixes and cap the length."""
    msg = message.strip()
    while (stripped := _NOISE.sub("", msg)) != msg:
        msg = stripped
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


def read_runsc_errors(log_path: Path, panic_path: Path | None = None, limit: int = 64 * 1024) -> list[str]:
    """Error-level messages runsc wrote to its --log file, plus the first lines of a Go panic."""
    found: list[str] = []
    for path in (log_path, panic_path):
        if path is None:
            continue
        try:
            with open(path, encoding="utf-8", errors="replace") as fh:
                text = fh.read(limit)
        except OSError:
            continue
        if path == panic_path:
            lines = [ln for ln in text.splitlines() if ln.strip()]
            if lines:
                found.append("gVisor crashed: " + " / ".join(lines[:3]))
            continue
        for line in text.splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                # Text-format logs: "W1130 05:55:31 ... msg". Keep only error/fatal lines.
                if line[:1] in ("E", "F") and re.match(r"^[EF]\d{4} ", line):
                    found.append(line.split("] ", 1)[-1])
                continue
            if isinstance(entry, dict) and str(entry.get("level", "")).lower() in ("error", "fatal", "panic"):
                found.append(str(entry.get("msg", "")))
    return found


def sandbox_failure_reason(errors: list[str]) -> str:
    text = " | ".join(tidy(e) for e in errors)
    diag = explain(text)
    if diag is None:
        return f"gVisor failed to run the sandbox: {text}"
    return f"gVisor failed to run the sandbox: {diag.problem} ({text}). Fix: {diag.fix}"
