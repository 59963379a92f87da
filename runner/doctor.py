"""Is gVisor usable here? Each check says what it found and, when something is wrong, what to fix.

Usable as ``await doctor(config)``, ``python -m runner doctor [--json]`` or ``code-sessions-doctor``.
The decisive check starts a real tiny sandbox; the others exist to explain why it failed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

from pydantic import BaseModel

from . import _bundle, _cgroups, _hibernate, environment
from ._diagnose import DOCKER_UNCONFINED, explain
from .capabilities import detect_runsc
from .errors import RunnerError, RunscNotFound
from .kernels import KernelPool
from .models import Outcome, RunnerConfig
from .runner import DATA_PACKAGES, PROBE_LIMITS, Runner


class Check(BaseModel):
    name: str
    ok: bool
    detail: str
    fix: str | None = None
    warning: bool = False  # ok, but something is degraded or likely to bite


class DoctorReport(BaseModel):
    ok: bool
    checks: list[Check]
    runsc_version: str | None = None
    platform: str | None = None

    def check(self, name: str) -> Check | None:
        return next((c for c in self.checks if c.name == name), None)

    def to_text(self) -> str:
        lines = []
        for c in self.checks:
            mark = "FAIL" if not c.ok else ("WARN" if c.warning else " ok ")
            lines.append(f"[{mark}] {c.name}: {c.detail}")
            if c.fix and (not c.ok or c.warning):
                lines.append(f"       fix: {c.fix}")
        verdict = (
            "gVisor sandbox works." if self.ok else "gVisor sandbox does NOT work here; fix the FAIL lines."
        )
        return "\n".join([*lines, "", verdict])


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return ""


def _status_field(name: str) -> str:
    for line in _read("/proc/self/status").splitlines():
        if line.startswith(name + ":"):
            return line.split(":", 1)[1].strip()
    return ""


def _host_checks(config: RunnerConfig) -> list[Check]:
    checks = []
    root = os.geteuid() == 0
    checks.append(
        Check(
            name="root",
            ok=root,
            detail="running as root" if root else f"running as uid {os.geteuid()}",
            fix=None
            if root
            else "run the runner as root (the Open WebUI image's default user); "
            "runsc needs root to create the sandbox's namespaces and cgroups",
        )
    )
    userns = _read("/proc/sys/user/max_user_namespaces").strip()
    userns_ok = userns != "0"
    checks.append(
        Check(
            name="user namespaces",
            ok=userns_ok,
            detail=f"user.max_user_namespaces = {userns or 'unknown'}",
            fix=None if userns_ok else "sysctl -w user.max_user_namespaces=15000 on the host",
        )
    )
    _, nofile = resource.getrlimit(resource.RLIMIT_NOFILE)
    few = nofile != resource.RLIM_INFINITY and nofile < _NOFILE_WANTED
    checks.append(
        Check(
            name="open files",
            ok=True,
            warning=few,
            detail=f"hard limit {'unlimited' if nofile == resource.RLIM_INFINITY else nofile}"
            + (
                " (gVisor's sentry holds host descriptors for the sandbox's files: at 1024, "
                "`import pandas` in the sandbox fails with 'Too many open files')"
                if few
                else ""
            ),
            fix=f"raise the hard limit: docker run --ulimit nofile=1024:{_NOFILE_WANTED * 8}"
            if few
            else None,
        )
    )
    seccomp = _status_field("Seccomp")
    apparmor = _read("/proc/self/attr/current").strip()
    confined = seccomp == "2" or (apparmor not in ("", "unconfined"))
    checks.append(
        Check(
            name="security profile",
            ok=True,
            warning=confined,
            detail=f"seccomp mode {seccomp or '?'} (2 = filtered), AppArmor {apparmor or 'none'}",
            fix="inside docker: " + DOCKER_UNCONFINED if confined else None,
        )
    )
    masked = [
        line.split()[4]
        for line in _read("/proc/self/mountinfo").splitlines()
        if len(line.split()) > 4 and line.split()[4].startswith("/proc/")
    ]
    checks.append(
        Check(
            name="/proc",
            ok=True,
            warning=bool(masked),
            detail=(
                f"{len(masked)} paths under /proc are over-mounted ({', '.join(masked[:3])} ...)"
                if masked
                else "/proc is not obstructed"
            ),
            fix="inside docker: --security-opt systempaths=unconfined" if masked else None,
        )
    )
    cap_eff = int(_status_field("CapEff") or "0", 16)
    has_ptrace = bool(cap_eff & (1 << 19))
    checks.append(
        Check(
            name="CAP_SYS_PTRACE",
            ok=True,
            warning=not has_ptrace,
            detail="present" if has_ptrace else "missing (the ptrace platform may be refused)",
            fix=None if has_ptrace else "docker: --cap-add SYS_PTRACE, or use platform systrap",
        )
    )
    if config.use_cgroups is not False:
        found = _cgroups.detect(config.cgroup_parent)
        usable = not isinstance(found, str)
        checks.append(
            Check(
                name="cgroups",
                ok=usable or not config.use_cgroups,
                warning=not usable,
                detail=(
                    f"{found}; memory falls back to RLIMIT_AS per process"
                    if isinstance(found, str)
                    else f"cgroup v{found.version}: memory and pids limits are writable"
                ),
                fix=None
                if usable
                else "docker: --cgroupns=host -v /sys/fs/cgroup:/sys/fs/cgroup:rw (or --privileged)",
            )
        )
    checks.append(_compression_check())
    try:
        env = environment.locate(config.environment)
    except RunnerError as exc:
        checks.append(Check(name="environment", ok=False, detail=str(exc), fix=_BUILD_ENV))
        return checks
    checks.append(
        Check(name="environment", ok=True, warning=not env.built, detail=env.describe(), fix=_BUILD_ENV)
    )
    for language in ("python", "bash"):
        try:
            configured = config.python if language == "python" else config.bash
            path = _bundle.find_interpreter(language, configured, env)
            checks.append(Check(name=language, ok=True, detail=path))
        except RunnerError as exc:
            checks.append(Check(name=language, ok=False, detail=str(exc), fix=_BUILD_ENV))
    return checks


def _compression_check() -> Check:
    """Saved kernels are compressed by Debian's `zstd` command (runner/_hibernate.py)."""
    try:
        found = _hibernate.codec_works()
    except (OSError, subprocess.SubprocessError) as exc:
        return Check(
            name="compression",
            ok=True,
            warning=True,
            detail=f"{exc}: saved kernels are kept as runsc writes them (about 4 times the disk), "
            "and a compressed one saved by another server cannot be resumed here",
            fix="install zstd: `apt-get install zstd` (deploy/Dockerfile and scripts/setup install it)",
        )
    return Check(name="compression", ok=True, detail=f"{found}: saved kernels are compressed")


_BUILD_ENV = (
    "build the sandbox environment: sandbox/build (scripts/setup and deploy/Dockerfile run it), "
    "or set CODE_SESSIONS_SANDBOX_ENV to where it was built"
)


async def _sandbox_checks(config: RunnerConfig) -> tuple[list[Check], str | None]:
    runner = Runner(config)
    try:
        setup = await runner.setup()
    except RunnerError as exc:
        diag = explain(str(exc))
        return [Check(name="sandbox", ok=False, detail=str(exc), fix=diag.fix if diag else None)], None
    checks = [
        Check(
            name="platform", ok=True, detail=f"{setup.platform} (offered: {', '.join(setup.runsc.platforms)})"
        ),
        Check(name="memory limit", ok=True, warning=setup.cgroups is None, detail=setup.memory_enforcement),
    ]
    with tempfile.TemporaryDirectory(prefix="runner-doctor-") as tmp:
        res = await runner.run("print('sandbox-ok')", "python", Path(tmp), PROBE_LIMITS)
        if res.outcome is Outcome.OK and res.stdout.strip() == "sandbox-ok":
            checks.append(
                Check(name="sandbox", ok=True, detail=f"python ran in gVisor in {res.duration_s:.2f} s")
            )
            issues = await runner.known_issues()
            checks.append(
                Check(
                    name="coreutils",
                    ok=not issues,
                    detail="; ".join(issues) or "`ls` and `stat` work in the sandbox",
                    fix="install gVisor 20240729 or newer: Debian 13's runsc (scripts/setup fetches it on "
                    "Debian 12; deploy/Dockerfile's Debian 13 base has it)"
                    if issues
                    else None,
                )
            )
            checks.append(await _checkpoint_check(runner))
            imported = dict(await runner.data_packages())
            absent = [name for name in DATA_PACKAGES if name not in imported]
            listed = ", ".join(f"{name} {version}" for name, version in await runner.packages()) or "none"
            env = await runner.environment()
            if env.built:
                listed = f"{len(env.packages)} packages asked for ({env.distributions} in all): {listed}"
            checks.append(
                Check(
                    name="packages",
                    ok=True,
                    warning=bool(absent),
                    detail=f"the sandbox's Python has {listed}"
                    + (f"; does not import: {', '.join(absent)}" if absent else ""),
                    fix=_BUILD_ENV if absent else None,
                )
            )
        else:
            # A sandbox failure's reason already ends with the diagnosed fix; do not diagnose twice.
            found, _, fix = (res.reason or "").partition(" Fix: ")
            detail = f"{res.outcome.value}: {found}"
            if not fix:
                detail = f"{detail} {res.stderr[-500:]}".strip()
                diag = explain(detail)
                fix = diag.fix if diag else "set RunnerConfig(debug_log_dir=...) and read gVisor's logs"
            checks.append(Check(name="sandbox", ok=False, detail=detail, fix=fix.strip()))
    return checks, setup.platform


def storage_root_check(root: Path) -> Check:
    """The folder the chats' files (and an SQLite index) live in should be ours alone. The store makes
    what it creates there private, but it does not change the mode of a root it was given: a volume
    made beforehand with 0755 lets every local user list it (and read anything an older version left
    readable)."""
    try:
        st = os.stat(root)
    except FileNotFoundError:
        return Check(name="storage root", ok=True, detail=f"{root} does not exist yet (it is made 0700)")
    except OSError as exc:
        return Check(name="storage root", ok=False, detail=f"{root}: {exc}", fix=f"check the path {root}")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        return Check(
            name="storage root",
            ok=True,
            warning=True,
            detail=f"{root} is mode {mode:04o}: other local users can enter it and list what is in it",
            fix=f"chmod 700 {root}",
        )
    return Check(name="storage root", ok=True, detail=f"{root} is mode {mode:04o}, ours alone")


async def _checkpoint_check(runner: Runner) -> Check:
    """A kernel saved to disk and resumed, as an idle chat's is: `runsc checkpoint` and `runsc restore`
    work here, and the state comes back."""
    fix = (
        "kernels are then stopped instead of saved (their state is lost, and said); a runsc whose "
        "checkpoint and restore work (gVisor's releases since 2022 do) keeps them"
    )
    with tempfile.TemporaryDirectory(prefix="runner-doctor-") as tmp:
        base = Path(tmp)
        (base / "chat").mkdir()
        pool = KernelPool(runner, base / "registry", socket_dir=base / "sockets")
        limits = PROBE_LIMITS.model_copy(update={"timeout_s": 30})
        try:
            first = await pool.run(
                "doctor", base / "chat", "kept = 41", "python", limits, state_dir=base / "state"
            )
            kernel = pool.kernels().get("doctor")
            if not first.ok or kernel is None:
                return Check(
                    name="checkpoint", ok=True, warning=True, detail=f"no kernel: {first.reason}", fix=fix
                )
            started = asyncio.get_running_loop().time()
            why = await pool.hibernate("doctor")
            saved = asyncio.get_running_loop().time() - started
            size = await asyncio.to_thread(_hibernate.size_of, base / "state")
            if why is not None:
                return Check(
                    name="checkpoint", ok=True, warning=True, detail=f"cannot save a kernel: {why}", fix=fix
                )
            started = asyncio.get_running_loop().time()
            again = await pool.run(
                "doctor", base / "chat", "print(kept + 1)", "python", limits, state_dir=base / "state"
            )
            if again.stdout != "42\n" or again.notes:
                detail = f"a saved kernel did not resume: {' '.join(again.notes) or again.stdout[:200]}"
                return Check(name="checkpoint", ok=True, warning=True, detail=detail, fix=fix)
            return Check(
                name="checkpoint",
                ok=True,
                detail=f"a kernel was saved in {saved:.2f} s ({size / 2**20:.1f} MiB on disk) and resumed "
                "to its next answer in "
                f"{asyncio.get_running_loop().time() - started:.2f} s "
                "(runsc checkpoint and restore work)",
            )
        finally:
            await pool.close()


async def doctor(config: RunnerConfig | None = None, storage_root: Path | None = None) -> DoctorReport:
    """Check the host and start one real sandbox (and, given one, the storage root's mode). Never
    raises for a broken setup: that is the report."""
    config = config or RunnerConfig()
    folders = [storage_root_check(storage_root)] if storage_root is not None else []
    try:
        info = await detect_runsc(config.runsc_path)
    except RunnerError as exc:
        fix = (
            "install gVisor: `apt-get install runsc` (Debian/Ubuntu) or the release binary from "
            "https://gvisor.dev/docs/user_guide/install/, then set RunnerConfig.runsc_path"
            if isinstance(exc, RunscNotFound)
            else "check that runsc_path points at gVisor's runsc"
        )
        checks = [Check(name="runsc", ok=False, detail=str(exc), fix=fix), *_host_checks(config), *folders]
        return DoctorReport(ok=False, checks=checks)
    checks = [Check(name="runsc", ok=True, detail=f"{info.path}, version {info.version}")]
    checks += _host_checks(config) + folders
    sandbox, platform = await _sandbox_checks(config)
    if any(c.name == "sandbox" and c.ok for c in sandbox):
        checks = [_settled(c) for c in checks]
    checks += sandbox
    ok = all(c.ok for c in checks)
    return DoctorReport(ok=ok, checks=checks, runsc_version=info.version, platform=platform)


# Below this hard limit on open files the sandbox's larger imports fail (measured: 1024).
_NOFILE_WANTED = 8192

# Host checks that only predict trouble: once a real sandbox has run, what they found did not matter.
_PREDICTIONS = ("/proc", "CAP_SYS_PTRACE")


def _settled(check: Check) -> Check:
    if check.name not in _PREDICTIONS or not check.warning:
        return check
    return check.model_copy(
        update={"warning": False, "detail": f"{check.detail}; not needed here: the sandbox runs"}
    )


def main(argv: list[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in[:1] == ["doctor"]:  # `python -m runner doctor ...`
        args_in = args_in[1:]
    parser = argparse.ArgumentParser(
        prog="code-sessions-doctor", description="Check that gVisor sandboxes work."
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--runsc", default="runsc", help="path or name of runsc (default: runsc on PATH)")
    parser.add_argument("--platform", default=None, help="gVisor platform (default: auto)")
    parser.add_argument(
        "--storage-root",
        default=None,
        help="the chats' storage root, checked to be private "
        "(default: $CODE_SESSIONS_ROOT, else $DATA_DIR/code_sessions when DATA_DIR is set)",
    )
    args = parser.parse_args(args_in)
    root = args.storage_root or os.environ.get("CODE_SESSIONS_ROOT")
    if root is None and os.environ.get("DATA_DIR"):
        root = str(Path(os.environ["DATA_DIR"]) / "code_sessions")
    config = RunnerConfig(runsc_path=args.runsc, platform=args.platform)
    report = asyncio.run(doctor(config, Path(root) if root else None))
    print(report.model_dump_json(indent=2) if args.json else report.to_text())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
