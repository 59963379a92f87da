"""The sandbox's view: what it can use, and what it must never see. Real runsc, no mocks."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import time
from pathlib import Path

import pytest

from runner import Outcome, Runner, UnsupportedLanguage, WorkdirError

from .conftest import assert_nothing_left


async def test_python_and_bash_share_the_persistent_mount(runner: Runner, workdir: Path) -> None:
    first = await runner.run(
        "open('/mnt/data/x.txt', 'w').write('from python')\nprint('wrote')", "python", workdir
    )
    assert first.outcome is Outcome.OK, first
    assert first.stdout == "wrote\n"
    assert (workdir / "x.txt").read_text() == "from python"  # really on the host
    second = await runner.run('cat /mnt/data/x.txt; echo; pwd; id -u; echo "$HOME"', "bash", workdir)
    assert second.outcome is Outcome.OK, second
    assert second.stdout.splitlines() == [
        "from python",
        "/mnt/data",
        str(runner.sandbox_uid),
        "/home/sandbox",
    ]
    assert (workdir / "x.txt").stat().st_uid == runner.sandbox_uid
    assert_nothing_left(runner, second)


async def test_exit_status_and_stderr(runner: Runner, workdir: Path) -> None:
    res = await runner.run("import sys\nprint('to err', file=sys.stderr)\nsys.exit(3)", "python", workdir)
    assert (res.outcome, res.exit_code, res.stderr) == (Outcome.ERROR, 3, "to err\n")
    assert res.reason == "exit code 3"


async def test_code_is_never_interpreted_by_a_host_shell(runner: Runner, workdir: Path) -> None:
    tricky = "print('$(touch /mnt/data/pwned) `id` \\'; rm -rf / \" ünïcødé')"
    res = await runner.run(tricky, "python", workdir)
    assert res.outcome is Outcome.OK, res
    assert res.stdout == "$(touch /mnt/data/pwned) `id` '; rm -rf / \" ünïcødé\n"
    assert not (workdir / "pwned").exists()


async def test_host_secrets_environment_and_network_are_out_of_reach(
    runner: Runner, workdir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "s3cr3t-" + secrets.token_hex(8)
    monkeypatch.setenv("CODE_SESSIONS_TEST_SECRET", secret)  # in the host process that starts runsc
    data_dir = tmp_path / "open-webui-data"
    data_dir.mkdir()
    (data_dir / "webui.db").write_text(secret)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    probe = f"""
import glob, json, os, socket
out = {{"env": dict(os.environ), "environ": {{}}, "errors": {{}}}}
for p in glob.glob("/proc/*/environ"):
    try:
        out["environ"][p] = open(p, "rb").read().decode("utf-8", "replace")
    except OSError as e:
        out["environ"][p] = "ERR " + str(e)
def attempt(name, fn):
    try:
        fn()
        out["errors"][name] = None
    except Exception as e:
        out["errors"][name] = type(e).__name__
attempt("host_data", lambda: open({str(data_dir / "webui.db")!r}).read())
attempt("shadow", lambda: open("/etc/shadow").read())
attempt("root", lambda: os.listdir("/root"))
attempt("host_home", lambda: os.listdir("/home/sandbox/..") and open("/home/root/x"))
attempt("app", lambda: os.listdir("/app"))
attempt("tcp", lambda: socket.create_connection(("127.0.0.1", {port}), timeout=2))
attempt("write_usr", lambda: open("/usr/x", "w"))
attempt("write_etc", lambda: open("/etc/x", "w"))
attempt("write_root", lambda: open("/x", "w"))
print(json.dumps(out))
"""
    try:
        res = await runner.run(probe, "python", workdir)
    finally:
        listener.close()
    assert res.outcome is Outcome.OK, res
    assert secret not in res.stdout + res.stderr
    seen = json.loads(res.stdout)
    assert set(seen["env"]) <= {
        "PATH",
        "HOME",
        "USER",
        "LANG",
        "TMPDIR",
        "PYTHONUNBUFFERED",
        "PYTHONDONTWRITEBYTECODE",
        "MPLBACKEND",
        "LC_CTYPE",  # set by Python itself under C.UTF-8
    }
    assert seen["env"]["PATH"] == "/usr/local/bin:/usr/bin:/bin"
    assert "/proc/1/environ" in seen["environ"]
    errors = seen["errors"]
    assert errors["host_data"] == "FileNotFoundError"
    assert errors["shadow"] == "FileNotFoundError"
    assert errors["root"] == "FileNotFoundError"
    assert errors["host_home"] is not None
    assert errors["app"] == "FileNotFoundError"
    assert errors["tcp"] in ("ConnectionRefusedError", "TimeoutError", "OSError")
    assert errors["write_usr"] in ("OSError", "PermissionError")  # EROFS / EACCES
    assert errors["write_etc"] in ("OSError", "PermissionError")
    assert errors["write_root"] in ("OSError", "PermissionError")


async def test_bash_sees_a_readonly_system_and_no_host_env(
    runner: Runner, workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CODE_SESSIONS_TEST_SECRET", "bash-secret-123")
    script = "env; cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'; touch /usr/x && echo WROTE-USR; id -u"
    res = await runner.run(script, "bash", workdir)
    assert "bash-secret-123" not in res.stdout + res.stderr
    assert "WROTE-USR" not in res.stdout
    assert "Read-only file system" in res.stderr or "Permission denied" in res.stderr
    assert res.stdout.splitlines()[-1] == str(runner.sandbox_uid)


async def test_runs_in_different_workdirs_proceed_in_parallel(runner: Runner, tmp_path: Path) -> None:
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    await runner.run("pass", "python", dirs[0])  # warm-up: runsc detection and image are built once
    t0 = time.monotonic()
    results = await asyncio.gather(*(runner.run("import time; time.sleep(1)", "python", d) for d in dirs))
    elapsed = time.monotonic() - t0
    assert all(r.outcome is Outcome.OK for r in results), results
    assert elapsed < 1.9, f"two 1 s sleeps took {elapsed:.2f} s: runs were serialised"


async def test_only_the_top_of_the_workdir_is_chowned(runner: Runner, workdir: Path) -> None:
    (workdir / "sub").mkdir()
    (workdir / "sub" / "kept.txt").write_text("root's")
    res = await runner.run("import os; print(os.access('/mnt/data', os.W_OK))", "python", workdir)
    assert res.stdout == "True\n"
    assert workdir.stat().st_uid == runner.sandbox_uid
    assert (workdir / "sub" / "kept.txt").stat().st_uid == os.geteuid()


async def test_host_misconfiguration_raises(runner: Runner, tmp_path: Path) -> None:
    with pytest.raises(WorkdirError):
        await runner.run("print(1)", "python", tmp_path / "missing")
    with pytest.raises(UnsupportedLanguage):
        await runner.run("print(1)", "ruby", tmp_path)
