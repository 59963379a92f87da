"""The doctor: real sandbox on a working host; plain fixes for broken ones (missing runsc, or a stub
runsc that fails the way gVisor does in a locked-down container)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from runner import Outcome, Runner, RunnerConfig, doctor

from .conftest import RUNSC

STUB = r"""#!/usr/bin/python3
import json, sys
MESSAGE = {message!r}
args = sys.argv[1:]
if args == ["--version"]:
    print("runsc version release-20240513.0\nspec: 1.1.0-rc.1")
elif args == ["flags"]:
    for flag in ("platform string", "overlay2 value", "log string", "log-format string", "directfs"):
        print("  -" + flag)
elif args == ["help", "platforms"]:
    print("ptrace\nsystrap")
elif "run" in args:
    if {to_log!r} and "--log" in args:
        with open(args[args.index("--log") + 1], "w") as fh:
            fh.write(json.dumps({{"msg": MESSAGE, "level": "error"}}) + "\n")
    print(MESSAGE, file=sys.stderr)
    sys.exit(128)
"""


def make_stub(tmp_path: Path, message: str, to_log: bool = True) -> str:
    path = tmp_path / "runsc"
    path.write_text(STUB.format(message=message, to_log=to_log))
    path.chmod(0o755)
    return str(path)


def doctor_json(runsc: str, *args: str, timeout: float = 60, **run) -> subprocess.CompletedProcess[str]:
    """`python -m runner doctor --json --runsc <runsc> <args>`, as an admin runs it (`run`: more of
    subprocess.run's arguments, an `env` or a `preexec_fn`)."""
    command = [sys.executable, "-m", "runner", "doctor", "--json", "--runsc", runsc, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, **run)


def checks_of(done: subprocess.CompletedProcess[str]) -> dict[str, dict]:
    """The doctor's checks, by name, from its JSON report."""
    return {c["name"]: c for c in json.loads(done.stdout)["checks"]}


def config_for(tmp_path: Path, runsc: str) -> RunnerConfig:
    return RunnerConfig(runsc_path=runsc, state_dir=tmp_path / "state", bundle_dir=tmp_path / "bundles")


async def test_doctor_passes_on_this_host(tmp_path: Path) -> None:
    report = await doctor(config_for(tmp_path, RUNSC))
    assert report.ok, report.to_text()
    sandbox = report.check("sandbox")
    assert sandbox is not None and sandbox.ok
    assert report.runsc_version and report.platform
    # scripts/setup builds the sandbox environment: the doctor names it and what the sandbox imports
    env = report.check("environment")
    assert env is not None and env.ok and not env.warning, env
    assert "Debian GNU/Linux 13" in env.detail and "Python 3.13" in env.detail
    packages = report.check("packages")
    assert packages is not None and not packages.warning, packages
    expected = ("numpy 2.", "pandas 2.", "matplotlib", "scipy", "PIL (pillow)", "docx (python-docx)")
    for name in expected:
        assert name in packages.detail
    # Every package asked for, not only those the system prompt names (toolz is not named there).
    assert "packages asked for (" in packages.detail and "toolz " in packages.detail
    coreutils = report.check("coreutils")
    assert coreutils is not None and coreutils.ok and "work" in coreutils.detail
    compression = report.check("compression")  # scripts/setup installs Debian's zstd
    assert compression is not None and compression.ok and not compression.warning, compression
    assert "zstd" in compression.detail and "saved kernels are compressed" in compression.detail
    # A kernel was really saved and resumed with its state (runsc checkpoint and restore work here).
    checkpoint = report.check("checkpoint")
    assert checkpoint is not None and checkpoint.ok and not checkpoint.warning, checkpoint
    assert "saved in" in checkpoint.detail and "resumed" in checkpoint.detail


# Debian 12's runsc (20221219), unpacked here by scripts/setup (scripts/fetch-old-runsc) on any host.
OLD_RUNSC = Path("/var/cache/code-sessions/apt-trixie/old/runsc")


async def test_doctor_fails_with_the_fix_on_a_runsc_whose_ls_breaks(tmp_path: Path) -> None:
    assert OLD_RUNSC.exists(), "Debian 12's runsc is missing: run scripts/setup (scripts/fetch-old-runsc)"
    report = await doctor(config_for(tmp_path, str(OLD_RUNSC)))
    assert not report.ok, report.to_text()
    sandbox, coreutils = report.check("sandbox"), report.check("coreutils")
    assert sandbox is not None and sandbox.ok  # python runs; the shell's ls does not
    assert coreutils is not None and not coreutils.ok
    assert "Invalid argument" in coreutils.detail and "20240729" in (coreutils.fix or "")


async def test_doctor_fails_on_a_damaged_environment(tmp_path: Path) -> None:
    build = tmp_path / "envs" / "env-0"
    (build / "rootfs" / "usr" / "bin").mkdir(parents=True)
    (build / "manifest.json").write_text("{not json", encoding="utf-8")
    (tmp_path / "envs" / "current").symlink_to("env-0")
    config = config_for(tmp_path, RUNSC).model_copy(update={"environment": tmp_path / "envs"})
    report = await doctor(config)
    assert not report.ok
    check = report.check("environment")
    assert check is not None and not check.ok and "damaged" in check.detail
    assert "sandbox/build" in (check.fix or "")


async def test_doctor_says_how_to_install_a_missing_runsc(tmp_path: Path) -> None:
    report = await doctor(config_for(tmp_path, str(tmp_path / "no-such-runsc")))
    assert not report.ok
    check = report.check("runsc")
    assert check is not None and not check.ok
    assert "apt-get install runsc" in (check.fix or "")
    assert "FAIL" in report.to_text()


@pytest.mark.parametrize(
    ("message", "to_log", "expected_fix"),
    [
        (
            "running container: creating container: cannot create gofer process: "
            "gofer: fork/exec /proc/self/exe: operation not permitted",
            True,
            "seccomp=unconfined",
        ),
        (
            "running container: creating container: cannot set up cgroup for root: "
            "configuring cgroup: mkdir /sys/fs/cgroup/memory/x: read-only file system",
            False,  # only on stderr: runsc died before writing its log
            "/sys/fs/cgroup:rw",
        ),
        (
            "running container: starting container: mounting /proc: operation not permitted",
            True,
            "systempaths=unconfined",
        ),
        (
            "running container: creating container: cannot create sandbox: ptrace: PTRACE_ATTACH: "
            "operation not permitted",
            True,
            "SYS_PTRACE",
        ),
    ],
)
async def test_doctor_turns_gvisor_errors_into_fixes(
    tmp_path: Path, message: str, to_log: bool, expected_fix: str
) -> None:
    config = config_for(tmp_path, make_stub(tmp_path, message, to_log))
    report = await doctor(config)
    assert not report.ok
    assert report.platform is None or report.platform == "systrap"
    check = report.check("sandbox")
    assert check is not None and not check.ok, report.to_text()
    assert expected_fix in (check.fix or ""), report.to_text()
    # The same words reach a plain run() as the reason of a SANDBOX_FAILURE.
    workdir = tmp_path / "w"
    workdir.mkdir()
    res = await Runner(config).run("print(1)", "python", workdir)
    assert res.outcome is Outcome.SANDBOX_FAILURE
    assert expected_fix in (res.reason or "")


def test_cli_json_and_exit_status(tmp_path: Path) -> None:
    bad = doctor_json(str(tmp_path / "missing"))
    assert bad.returncode == 1
    report = json.loads(bad.stdout)
    assert report["ok"] is False
    assert report["checks"][0]["name"] == "runsc"
    good = subprocess.run(
        [sys.executable, "-m", "runner", "doctor", "--runsc", RUNSC],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert good.returncode == 0, good.stdout + good.stderr
    assert "gVisor sandbox works." in good.stdout


def test_a_low_open_files_limit_is_a_warning_with_the_flag_that_fixes_it(tmp_path: Path) -> None:
    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))

    # A missing runsc: the host checks still run, and the report comes back quickly.
    checks = checks_of(doctor_json(str(tmp_path / "missing"), preexec_fn=low_limit))
    assert checks["open files"]["warning"] is True, checks["open files"]
    assert "--ulimit nofile=" in checks["open files"]["fix"]
    assert "1024" in checks["open files"]["detail"]


def test_a_missing_zstd_is_a_warning_with_its_fix(tmp_path: Path) -> None:
    """Without zstd, kernels are still saved (uncompressed): a warning that says the cost and the fix."""
    checks = checks_of(doctor_json(str(tmp_path / "missing"), env={**os.environ, "PATH": str(tmp_path)}))
    compression = checks["compression"]
    assert compression["ok"] and compression["warning"], compression
    assert compression["detail"].startswith("zstd is not installed")
    assert "apt-get install zstd" in compression["fix"]


def test_a_storage_root_open_to_other_users_is_a_warning_with_its_fix(tmp_path: Path) -> None:
    """A root made beforehand with 0755 (a pre-made volume): the doctor says so, and how to fix it; the
    default root is found from DATA_DIR as the function finds it."""
    root = tmp_path / "data" / "code_sessions"
    root.mkdir(parents=True)
    os.chmod(root, 0o755)

    def run(*args: str, **env: str) -> dict:
        without_root = {k: v for k, v in os.environ.items() if k != "CODE_SESSIONS_ROOT"}
        done = doctor_json(RUNSC, *args, timeout=120, env={**without_root, **env})
        assert done.returncode == 0, done.stdout + done.stderr  # a warning, not a failure
        return checks_of(done)

    found = run(DATA_DIR=str(tmp_path / "data"))["storage root"]
    assert found["warning"] and "mode 0755" in found["detail"] and "other local users" in found["detail"]
    assert found["fix"] == f"chmod 700 {root}"
    os.chmod(root, 0o700)
    private = run("--storage-root", str(root))["storage root"]
    assert not private["warning"] and "0700" in private["detail"]
