"""Each flag of the README's recipe, dropped one at a time, and a few less privileged variants: what the
doctor says and what the runner can still do (tests/container/probe.py) in such a container.

The results go to $CODE_SESSIONS_CONTAINER_OUT/flags.md (the table in docs/runner.md, "Container flags,
measured", comes from it) and flags.json. Each variant's assertions pin what was measured, so a change in
the image, the runner or the recipe that changes the table fails here.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from .recipe import (
    IMAGE,
    LABEL,
    OUT,
    PODMAN_EXTRA,
    flag_groups,
    podman,
    readme_recipe,
    remove_container,
    unique,
    without,
)

pytestmark = [pytest.mark.container]

PROBE = Path(__file__).with_name("probe.py")
# PID 1 of these containers neither reaps nor exits, like Open WebUI's own PID 1 (uvicorn).
IDLE = ["python3", "-c", "import time; time.sleep(10**6)"]
LIMITS = "write,memory,timeout,unlinked_flood,fork_bomb"
WORKING = {
    "write": "ok",
    "stack_default_python": "ok",
    "stack_usr_bin_python3": "ok",
    "matplotlib": "ok",
    "shell": "ok",
    "memory": "out_of_memory",
    "timeout": "timeout",
    "unlinked_flood": "disk_limit",
    "fork_bomb": "timeout",
}


@dataclass
class Result:
    started: bool
    start_error: str = ""
    doctor: str = ""
    doctor_ok: bool = False
    probe: dict = field(default_factory=dict)
    cap_eff: str = ""

    def lines(self, mark: str) -> list[str]:
        return [line for line in self.doctor.splitlines() if line.startswith(f"[{mark}]")]

    def outcomes(self) -> dict[str, str]:
        return {k: v["outcome"] for k, v in self.probe.items() if isinstance(v, dict) and "outcome" in v}


@dataclass
class Variant:
    name: str
    flags: list[str]
    expect: Callable[[Result], None]
    extra: list[str] = field(default_factory=lambda: list(PODMAN_EXTRA))
    checks: str = LIMITS
    runsc_flags: tuple[str, ...] = ()
    note: str = ""


def measure(variant: Variant) -> Result:
    name = unique("cs-flags")
    started = podman(
        "run", "-d", "--name", name, "--label", LABEL, *variant.extra, *variant.flags, IMAGE, *IDLE,
        check=False,
    )  # fmt: skip
    if started.returncode != 0:
        remove_container(name)
        return Result(False, start_error=(started.stderr.strip().splitlines() or [""])[-1])
    try:
        podman("cp", str(PROBE), f"{name}:/tmp/probe.py")
        doctor = podman("exec", name, "code-sessions-doctor", check=False, timeout=300)
        probe_args = [f"--checks={variant.checks}", *(f"--runsc-flag={f}" for f in variant.runsc_flags)]
        probe = podman(
            "exec", "-e", "PYTHONPATH=/opt/code-sessions", name, "python3", "/tmp/probe.py", *probe_args,
            check=False, timeout=600,
        )  # fmt: skip
        status = podman("exec", name, "cat", "/proc/self/status").stdout
        cap_eff = re.search(r"^CapEff:\s*(\S+)", status, re.M)
        try:
            report = json.loads(probe.stdout)
        except json.JSONDecodeError:
            report = {"error": (probe.stderr or probe.stdout)[-2000:]}
        return Result(
            True,
            doctor=doctor.stdout.strip(),
            doctor_ok=doctor.returncode == 0,
            probe=report,
            cap_eff=cap_eff.group(1) if cap_eff else "",
        )
    finally:
        remove_container(name)


def works(result: Result) -> None:
    assert result.started, result.start_error
    assert result.doctor_ok, result.doctor
    assert result.outcomes() == {k: WORKING[k] for k in result.outcomes()}, result.probe
    assert not result.probe.get("zombies"), result.probe


def recipe_works(result: Result) -> None:
    works(result)
    # The data environment deploy/Dockerfile installs, in the interpreter the sandbox runs by default.
    assert result.probe["stack_default_python"]["stdout"].strip() == "/usr/bin/python3 missing: none"
    assert result.probe["matplotlib"]["stdout"].strip() == "saved"


def warns(*words: str) -> Callable[[Result], None]:
    def check(result: Result) -> None:
        works(result)
        warnings = " ".join(result.lines("WARN"))
        for word in words:
            assert word in warnings, result.doctor

    return check


def sandbox_fails(words: str) -> Callable[[Result], None]:
    def check(result: Result) -> None:
        assert result.started, result.start_error
        assert not result.doctor_ok
        assert any(words in line for line in result.lines("FAIL")), result.doctor
        assert result.outcomes()["write"] == "sandbox_failure", result.probe

    return check


def does_not_start(words: str) -> Callable[[Result], None]:
    def check(result: Result) -> None:
        assert not result.started
        assert words in result.start_error, result.start_error

    return check


def seccomp_profile(tmp: Path, allow_pivot_root: bool) -> Path | None:
    """Podman's default seccomp profile made to refuse pivot_root, as Docker's default profile does
    (moby/profiles' default.json has no pivot_root at all; podman's allows it)."""
    source = Path("/usr/share/containers/seccomp.json")
    if not source.exists():
        return None
    profile = json.loads(source.read_text())
    for rule in profile["syscalls"]:
        rule["names"] = [n for n in rule["names"] if n != "pivot_root" or allow_pivot_root]
    if not allow_pivot_root:
        profile["syscalls"].append({"names": ["pivot_root"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1})
    path = tmp / f"seccomp-pivot_root-{'allowed' if allow_pivot_root else 'refused'}.json"
    path.write_text(json.dumps(profile))
    return path


def variants(tmp: Path) -> list[Variant]:
    recipe = readme_recipe().flags
    groups = flag_groups(recipe)
    assert ["--cap-add", "SYS_ADMIN"] in groups, recipe
    found: list[Variant] = [Variant("the README's recipe", recipe, recipe_works, checks="")]

    expected_without: dict[str, Callable[[Result], None]] = {
        "--init": assert_zombies,
        # cgroup v1 here: podman's (and Docker's) default on v1 is already the host's cgroup namespace.
        "--cgroupns=host": works,
        "-v /sys/fs/cgroup:/sys/fs/cgroup:rw": warns("RLIMIT_AS per process", "not writable"),
        # podman's default seccomp profile allows pivot_root (Docker's does not: see the variant below).
        "--security-opt seccomp=unconfined": warns("seccomp mode 2"),
        # No AppArmor in this kernel: nothing to measure.
        "--security-opt apparmor=unconfined": works,
        # runsc 20240729 says it itself: "can't run sandbox process in minimal chroot since we don't have
        # CAP_SYS_ADMIN"; the doctor names the flag.
        "--cap-add SYS_ADMIN": sandbox_fails("CAP_SYS_ADMIN"),
    }
    for group in groups:
        key = " ".join(group)
        assert key in expected_without, f"no measured expectation for dropping {key}: add one"
        found.append(Variant(f"without {key}", without(recipe, group), expected_without[key]))

    unconfined = ["--security-opt", "seccomp=unconfined"]
    refused = seccomp_profile(tmp, allow_pivot_root=False)
    if refused and unconfined[1] in recipe:
        swapped = [t if t != "seccomp=unconfined" else f"seccomp={refused}" for t in recipe]
        found.append(
            Variant(
                "seccomp: podman's default profile refusing pivot_root, as Docker's default does",
                swapped,
                sandbox_fails("pivot_root"),
            )
        )

    no_admin = [*without(recipe, ["--cap-add", "SYS_ADMIN"]), "--security-opt", "systempaths=unconfined"]
    found += [
        Variant(
            "no SYS_ADMIN, runsc --rootless, systempaths=unconfined",
            no_admin,
            rootless_runs_but_cannot_write,
            runsc_flags=("--rootless",),
        ),
        Variant(
            "no SYS_ADMIN, runsc --rootless, /proc masked",
            without(recipe, ["--cap-add", "SYS_ADMIN"]),
            rootless_cannot_write,
            runsc_flags=("--rootless",),
            checks="write",
        ),
        Variant(
            "user namespace (--uidmap 0:200000:65536)",
            ["--uidmap", "0:200000:65536", "--gidmap", "0:200000:65536", *recipe],
            warns("RLIMIT_AS per process", "Permission denied"),
        ),
        Variant("--privileged instead of the recipe", ["--init", "--privileged"], works),
        Variant(
            "podman: its default rlimits",
            recipe,
            does_not_start("setting rlimit"),
            extra=["--runtime", "runc"],
        ),
        Variant(
            "nofile hard limit 1024",
            recipe,
            emfile,
            extra=["--runtime", "runc", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=4096:4096"],
            checks="stack_default_python",
        ),
        Variant(
            "--cap-add SYS_RESOURCE on top",
            [*recipe, "--cap-add", "SYS_RESOURCE"],
            sys_resource_not_granted,
            checks="write",
        ),
    ]
    if shutil.which("crun"):
        found.append(
            Variant(
                "podman: crun, its default runtime",
                recipe,
                does_not_start("cgroups in hybrid mode"),
                extra=[e for e in PODMAN_EXTRA if e not in ("--runtime", "runc")],
            )
        )
    return found


def assert_zombies(result: Result) -> None:
    assert result.started and result.doctor_ok, result.doctor
    outcomes = result.outcomes()
    assert outcomes == {k: WORKING[k] for k in outcomes}, result.probe
    # runsc's helper processes, orphaned when a run ends, are never reaped without an init.
    assert len(result.probe["zombies"]) >= 5, result.probe


def assert_probe_fails(result: Result, outcome: str) -> None:
    assert result.started, result.start_error
    assert result.outcomes()["write"] == outcome, result.probe


def rootless_runs_but_cannot_write(result: Result) -> None:
    # The doctor runs runsc as the runner does, without --rootless: it fails. With
    # extra_runsc_flags=("--rootless",) code runs and the limits hold, but /mnt/data, which the runner
    # hands to uid 65534, is not writable: rootless runsc maps only the caller's own uid.
    assert result.started, result.start_error
    assert not result.doctor_ok
    outcomes = result.outcomes()
    assert outcomes["memory"] == "out_of_memory" and outcomes["timeout"] == "timeout", result.probe
    assert outcomes["write"] == "error", result.probe
    assert "PermissionError" in result.probe["write"]["stderr"], result.probe


def rootless_cannot_write(result: Result) -> None:
    # runsc 20240729 runs --rootless with /proc masked too; /mnt/data is still not writable.
    assert result.started, result.start_error
    assert not result.doctor_ok
    assert result.outcomes()["write"] == "error", result.probe
    assert "PermissionError" in result.probe["write"]["stderr"], result.probe


def emfile(result: Result) -> None:
    assert result.started, result.start_error
    assert "Too many open files" in result.doctor or "OSError" in str(result.probe), result.probe


def sys_resource_not_granted(result: Result) -> None:
    assert result.started, result.start_error
    assert not int(result.cap_eff, 16) & (1 << 24), result.cap_eff  # CAP_SYS_RESOURCE is bit 24
    assert result.outcomes()["write"] == "ok", result.probe


def summary(result: Result) -> str:
    if not result.started:
        return f"container does not start: `{result.start_error}`"
    parts = []
    for mark in ("FAIL", "WARN"):
        for line in result.lines(mark):
            if "coreutils" not in line:
                parts.append(line)
    verdict = "doctor: works" if result.doctor_ok else "doctor: does NOT work"
    outcomes = ", ".join(f"{k} → {v}" for k, v in result.outcomes().items())
    for name in ("write", "stack_default_python"):
        entry = result.probe.get(name) or {}
        broken = name.startswith("stack") and "missing: none" not in entry.get("stdout", "")
        if entry and (entry.get("outcome") == "error" or broken):
            detail = (entry.get("stderr") or entry.get("stdout") or "").strip().splitlines()[-1:]
            outcomes += f" ({name}: `{' '.join(detail)}`)"
    zombies = len(result.probe.get("zombies") or [])
    text = "; ".join([verdict, *parts])
    return f"{text}<br>runner: {outcomes or result.probe.get('error', '')[:300]}; zombies left: {zombies}"


def test_each_flag_measured(tmp_path: Path) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    rows, records, failures = [], [], []
    for variant in variants(tmp_path):
        result = measure(variant)
        records.append({"variant": variant.name, "flags": variant.flags, **result.__dict__})
        rows.append(f"| {variant.name} | {summary(result)} |")
        try:
            variant.expect(result)
        except AssertionError as exc:
            failures.append(f"{variant.name}: {exc}")
    (OUT / "flags.json").write_text(json.dumps(records, indent=2))
    table = "| variant | measured |\n|---|---|\n" + "\n".join(rows) + "\n"
    (OUT / "flags.md").write_text(table)
    print(table)
    assert not failures, "\n\n".join(failures)
