"""Pure-Python parts: capture, detection parsing, diagnosis, classification, the disk walk, the spec,
and the bundler's source rules. (Sandbox behaviour is tested against the real runsc elsewhere.)"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

import runner
from runner import Limits, Outcome, RunnerConfig
from runner._bundle import make_spec
from runner._diagnose import explain, read_runsc_errors, tidy
from runner._disk import folder_sizes, growth
from runner._outcome import classify
from runner._supervise import Capture, Facts
from runner._warm import wants_template
from runner.capabilities import RunscInfo, detect_runsc, parse_flags, parse_platforms
from tests.support.sandbox import disk_usage

RUNNER_SRC = Path(runner.__path__[0])


def test_capture_keeps_the_cap_marks_truncation_and_never_splits_a_character() -> None:
    cap = Capture(10)
    assert not cap.feed(b"123456789")
    assert cap.feed("é€".encode())  # 9 + 5 bytes: the euro sign is cut in half at byte 10
    assert cap.total == 14 and len(cap.data) == 10
    assert cap.text() == "123456789\n[... output truncated at 10 bytes ...]\n"  # half "é" dropped
    small = Capture(64 * 1024)
    small.feed(b"ok\n")
    assert small.text() == "ok\n" and not small.truncated


def test_flag_and_platform_parsing_prefers_systrap() -> None:
    flags = parse_flags("  -directfs\n    \tuse directfs\n  -overlay2 value\n  -platform string\n")
    assert {"directfs", "overlay2", "platform"} <= flags
    new = RunscInfo("/x", "release-20240513.0", flags, parse_platforms("kvm\nptrace\nsystrap\n"))
    old = RunscInfo("/x", "0.0~20221219.0", frozenset(), parse_platforms("kvm\nptrace\n"))
    assert new.auto_platform() == "systrap" and new.supports("--directfs")
    assert old.auto_platform() == "ptrace" and not old.supports("overlay2")


async def test_detect_real_runsc() -> None:
    info = await detect_runsc(os.environ.get("RUNSC", "runsc"))
    assert info.version and "ptrace" in info.platforms
    assert info.supports("network") and info.supports("root")


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("cannot create sandbox: mkdir /sys/fs/cgroup/pids/x: permission denied (cgroup)", "cgroup"),
        ("fork/exec /proc/self/exe: operation not permitted", "seccomp=unconfined"),
        ("error mounting /proc: operation not permitted", "systempaths=unconfined"),
        ("ptrace attach: operation not permitted", "SYS_PTRACE"),
        ("open /dev/kvm: no such file or directory", "platform='ptrace'"),
        ("panic: error initializing first thread: resource temporarily unavailable", "pids"),
    ],
)
def test_explain_maps_gvisor_errors_to_fixes(text: str, needle: str) -> None:
    diag = explain(text)
    assert diag is not None and needle in diag.fix


def test_tidy_and_log_parsing(tmp_path: Path) -> None:
    assert tidy("running container: starting container: starting root container: boom") == "boom"
    log = tmp_path / "runsc.log"
    log.write_text('{"msg":"fine","level":"warning"}\n{"msg":"it broke","level":"error"}\nnot json\n')
    panic = tmp_path / "panic.log"
    panic.write_text("fatal error: newosproc\n\nstack...\n")
    errors = read_runsc_errors(log, panic)
    assert errors[0] == "it broke" and errors[1].startswith("gVisor crashed: fatal error: newosproc")
    assert read_runsc_errors(tmp_path / "missing.log") == []


def test_classification_precedence() -> None:
    lim = Limits()
    assert classify(Facts(returncode=0), lim, [], "", False)[0] is Outcome.OK
    assert classify(Facts(returncode=137, oom_kills=1), lim, [], "", False)[0] is Outcome.OOM
    stopped = Facts(returncode=137, stopped_for="disk", stop_detail="x", oom_kills=1)
    assert classify(stopped, lim, [], "", False)[:2] == (Outcome.DISK_LIMIT, None)
    assert classify(Facts(returncode=128), lim, ["boom"], "", False)[0] is Outcome.SANDBOX_FAILURE
    # exit 128 from the code itself is an ordinary error, unless runsc's error shape is on stderr
    assert classify(Facts(returncode=128), lim, [], "bye\n", False)[0] is Outcome.ERROR
    by_rlimit = classify(Facts(returncode=1), lim, [], "Traceback...\nMemoryError\n", True)
    assert by_rlimit[0] is Outcome.OOM
    assert classify(Facts(returncode=137), lim, [], "", False)[2] == "exit code 137 (killed by SIGKILL)"


def test_disk_usage_never_follows_symlinks_and_counts_hardlinks_once(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "big").write_bytes(b"x" * 1_000_000)
    work = tmp_path / "work"
    work.mkdir()
    (work / "to-outside").symlink_to(outside)
    (work / "to-file").symlink_to(outside / "big")
    (work / "a").write_bytes(b"y" * 100_000)
    os.link(work / "a", work / "b")
    used = disk_usage(str(work))
    assert 100_000 <= used < 200_000


def test_growth_counts_what_each_folder_gained_and_stops_once_the_limit_is_proven(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path / "work"
    for name in ("keep", "shrink", "moved"):
        (work / name).mkdir(parents=True)
    (work / "shrink" / "old").write_bytes(b"x" * 300_000)
    (work / "moved" / "data").write_bytes(b"x" * 50_000)
    before = folder_sizes(str(work))
    assert growth(str(work), before) == 0
    (work / "shrink" / "old").unlink()  # a folder that shrank gives nothing to the others
    (work / "keep" / "new").write_bytes(b"y" * 200_000)
    os.rename(work / "moved", work / "keep" / "moved")  # a renamed folder is the same folder
    (work / "fresh").mkdir()
    (work / "fresh" / "f").write_bytes(b"z" * 100_000)
    gained = growth(str(work), before)
    assert 300_000 <= gained < 320_000
    import runner._disk as disk

    visited: list[int] = []
    real_key = disk._key
    monkeypatch.setattr(disk, "_key", lambda fd: visited.append(fd) or real_key(fd))
    assert growth(str(work), before, stop_above=1000) > 1000
    assert len(visited) < 5  # of the 5 folders: stopped at the first that proved the limit broken
    (work / "top-level.bin").write_bytes(b"w" * 50_000)
    open_before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):  # stopping at the top folder itself must close it too
        assert growth(str(work), before, stop_above=1000) > 1000
    assert len(os.listdir("/proc/self/fd")) == open_before


def test_spec_is_minimal_and_readonly(tmp_path: Path) -> None:
    arguments: dict[str, Any] = dict(
        rootfs=tmp_path / "rootfs",
        bundle=tmp_path / "b",
        workdir=tmp_path / "w",
        language="python",
        interpreter="/usr/bin/python3",
        limits=Limits(max_processes=10, max_file_bytes=1234),
        uid=65534,
        gid=65534,
        cgroups_path="/code-sessions/cs-1",
        rlimit_as=False,
        netns_path=None,
    )
    spec = make_spec(**arguments)
    assert spec["root"]["readonly"] is True
    proc = spec["process"]
    assert proc["args"] == ["/usr/bin/python3", "/run/code/main.py"]
    assert proc["user"]["uid"] == 65534 and proc["noNewPrivileges"] is True
    assert all(not caps for caps in proc["capabilities"].values())
    assert not any(e.startswith("CODE_SESSIONS") for e in proc["env"])
    rl = {r["type"]: r["hard"] for r in proc["rlimits"]}
    assert rl["RLIMIT_NPROC"] == 10 and rl["RLIMIT_FSIZE"] == 1234 and "RLIMIT_AS" not in rl
    unlimited = make_spec(**{**arguments, "limits": Limits(max_file_bytes=None)})  # None: no limit
    assert "RLIMIT_FSIZE" not in {r["type"] for r in unlimited["process"]["rlimits"]}
    mounts = {m["destination"]: m for m in spec["mounts"]}
    assert "ro" in mounts["/usr"]["options"] and "rw" in mounts["/mnt/data"]["options"]
    assert "ro" in mounts["/run/code"]["options"]
    assert {"type": "network"} in spec["linux"]["namespaces"]
    assert spec["linux"]["cgroupsPath"] == "/code-sessions/cs-1"


def test_config_is_typed_and_validated() -> None:
    with pytest.raises(ValueError):
        Limits(timeout_s=0)
    with pytest.raises(ValueError):
        RunnerConfig(cgroup_parent="../escape")
    assert Outcome("out_of_memory") is Outcome.OOM


def test_sources_obey_the_bundler_rules() -> None:
    banned = ["from " + w for w in ("utils", "apps", "main", "config")] + ["'" * 3, "__file__"]
    for path in RUNNER_SRC.glob("*.py"):
        text = path.read_text()
        for word in banned:
            assert word not in text, f"{path.name} contains {word!r}"
        assert "from runner" not in text, f"{path.name}: intra-package imports must be relative"


@pytest.mark.parametrize(
    ("code", "wanted"),
    [
        ("print(1)", False),
        ("import os\nprint(os.listdir('.'))", False),
        ("from __future__ import annotations\nimport json, os.path as p", False),
        ("from . import x", False),
        ("s = 'no import here'", False),
        ("import pandas as pd", True),
        ("import os, numpy as np", True),
        ("x = 1; import seaborn", True),
        ("try:\n    import polars\nexcept ImportError:\n    pass", True),
        ("from sklearn.linear_model import LinearRegression", True),
        ("  import matplotlib.pyplot as plt", True),
        ("import\tdocx", True),
        ("x = 1\n" * 20_000 + "import pandas", False),  # past the part read: a cold start, nothing lost
    ],
)
def test_which_first_cells_start_from_the_template(code: str, wanted: bool) -> None:
    assert wants_template(code, "python") is wanted


def test_a_first_bash_cell_starts_from_the_template() -> None:
    assert wants_template("ls -la /mnt/data", "bash")


def test_the_registry_counts_running_kernels_without_parsing_every_saved_chat(tmp_path: Path) -> None:
    """Every kernel start reads the host's running entries; a saved chat's entry (the many) is told
    apart by its bytes, and a reason quoting `"running": true` does not fool it."""
    from runner._registry import HOST, Entry, Registry

    registry = Registry(tmp_path)
    started = Path(f"/proc/{os.getpid()}/stat").read_bytes().rsplit(b")", 1)[1].split()[19].decode()
    mine = f"{os.getpid()} {started} pool"
    for i in range(50):
        registry.save(
            Entry(f"u/{i}", f"cs-k-{i}", HOST, mine, "", "/x", 1.0, 2.0, False, reason='"running": true')
        )
    registry.save(Entry("u/live", "cs-k-live", HOST, mine, "", "/x", 1.0, 2.0, True))
    registry.save(Entry("u/gone", "cs-k-gone", HOST, "1 0 pool", "", "/x", 1.0, 2.0, True))  # owner dead
    assert [e.key for e in registry.running_here()] == ["u/live"]
