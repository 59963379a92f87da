"""Persistent kernels in real gVisor: state that lives, limits that hold, losses that are said.

Each test drives a KernelPool the way the engine does (one key per chat, the chat's lock held by
the caller) against real runsc, and looks at what a user would see: outputs, outcomes, the sentence
that says the state was reset, and the host (no sandbox left once a kernel ends).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from runner import KernelPool, KernelSettings, Limits, Outcome, Runner, RunnerError
from tests.support.figure_cells import SURFACE
from tests.support.sandbox import leftovers

pytestmark = pytest.mark.runsc

LIMITS = Limits(timeout_s=10, memory_mb=256, max_output_bytes=64 * 1024)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
async def pool(tmp_path: Path):
    pool = KernelPool(Runner(), tmp_path / "registry")
    yield pool
    await pool.close()


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    folder = tmp_path / "chat"
    folder.mkdir()
    return folder


def gone(runner: Runner, cid: str) -> list[str]:
    return leftovers(cid, runner.state_dir, runner.bundle_dir, runner.config.cgroup_parent)


async def test_state_persists_and_bash_shares_the_sandbox(pool: KernelPool, workdir: Path) -> None:
    first = await pool.run(
        "u/c", workdir, "import math\ndata = [1, 2, 3]\ndef twice(x): return 2 * x", "python", LIMITS
    )
    assert first.ok and first.state_kept and first.notes == ()
    second = await pool.run("u/c", workdir, "print(twice(sum(data)), math.pi > 3)", "python", LIMITS)
    assert second.stdout == "12 True\n"
    assert (await pool.run("u/c", workdir, "data", "python", LIMITS)).stdout == "[1, 2, 3]\n"
    shell = await pool.run("u/c", workdir, "echo hi > from-bash.txt; pwd", "bash", LIMITS)
    assert shell.stdout == "/mnt/data\n" and shell.changed == ("from-bash.txt",)
    assert (workdir / "from-bash.txt").read_text() == "hi\n"
    assert first.container_id == second.container_id == shell.container_id  # one sandbox


async def test_another_chat_has_another_kernel(pool: KernelPool, tmp_path: Path, workdir: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    await pool.run("u/c", workdir, "secret = 'mine'", "python", LIMITS)
    theirs = await pool.run("u/other", other, "print(globals().get('secret'))", "python", LIMITS)
    assert theirs.stdout == "None\n"


async def test_an_interrupt_at_the_time_limit_keeps_the_state(pool: KernelPool, workdir: Path) -> None:
    await pool.run("u/c", workdir, "kept = 42", "python", LIMITS)
    started = time.monotonic()
    slow = await pool.run(
        "u/c", workdir, "import time\ntime.sleep(100)", "python", LIMITS.model_copy(update={"timeout_s": 1})
    )
    assert time.monotonic() - started < 5
    assert slow.outcome == Outcome.TIMEOUT and "state is kept" in (slow.reason or "") and slow.state_kept
    assert "KeyboardInterrupt" in slow.stderr
    after = await pool.run("u/c", workdir, "print(kept)", "python", LIMITS)
    assert after.stdout == "42\n" and after.notes == ()


async def test_a_cell_that_ignores_the_interrupt_is_killed_and_the_reset_is_said(
    pool: KernelPool, workdir: Path
) -> None:
    await pool.run("u/c", workdir, "kept = 42", "python", LIMITS)
    stubborn = "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    pass"
    killed = await pool.run("u/c", workdir, stubborn, "python", LIMITS.model_copy(update={"timeout_s": 1}))
    assert killed.outcome == Outcome.TIMEOUT and not killed.state_kept
    assert "did not stop" in (killed.reason or "")
    assert gone(pool.runner, killed.container_id) == []
    after = await pool.run("u/c", workdir, "print(globals().get('kept'))", "python", LIMITS)
    assert after.stdout == "None\n"
    [note] = after.notes
    assert (
        note.startswith("The Python state was reset (the cell did not stop")
        and "files in /mnt/data are kept" in note
    )


async def test_idle_kernels_stop_and_the_next_run_says_so(pool: KernelPool, workdir: Path) -> None:
    first = await pool.run("u/c", workdir, "x = 1", "python", LIMITS, settings=KernelSettings(idle_s=0.2))
    await asyncio.sleep(0.4)
    await pool.reap()
    assert gone(pool.runner, first.container_id) == []
    after = await pool.run("u/c", workdir, "print(globals().get('x'))", "python", LIMITS)
    assert after.stdout == "None\n" and "idle for more than" in after.notes[0]


async def test_beyond_max_kernels_the_least_recently_used_goes(pool: KernelPool, tmp_path: Path) -> None:
    two = KernelSettings(max_kernels=2)  # what each start brings
    folders = {}
    for name in ("a", "b", "c"):
        folders[name] = tmp_path / name
        folders[name].mkdir()
        await pool.run(f"u/{name}", folders[name], f"me = {name!r}", "python", LIMITS, settings=two)
        await asyncio.sleep(0.05)
    assert sorted(pool.kernels()) == ["u/b", "u/c"]
    again = await pool.run("u/a", folders["a"], "print(globals().get('me'))", "python", LIMITS, settings=two)
    assert again.stdout == "None\n" and "too many kernels" in again.notes[0]
    assert sorted(pool.kernels()) == ["u/a", "u/c"]  # b was the least recently used now


async def test_memory_limit_kills_the_kernel_with_a_clear_message(pool: KernelPool, workdir: Path) -> None:
    small = LIMITS.model_copy(update={"memory_mb": 128})
    await pool.run("u/c", workdir, "x = 1", "python", small)
    bomb = await pool.run(
        "u/c", workdir, "b = []\nwhile True:\n    b.append(bytearray(16 << 20))", "python", small
    )
    assert bomb.outcome == Outcome.OOM and "memory" in (bomb.reason or "") and not bomb.state_kept
    after = await pool.run("u/c", workdir, "print('back')", "python", small)
    assert after.stdout == "back\n" and "ran out of memory" in after.notes[0]


async def test_forged_frames_or_a_closed_channel_end_in_a_reset_and_nothing_worse(
    pool: KernelPool, workdir: Path
) -> None:
    forge = textwrap.dedent(
        """
        import json, os, struct
        done = {"t": "done", "id": 99, "status": "ok", "exit_code": 0, "figures": [], "more": 0, "ms": 1.0}
        body = json.dumps(done).encode()
        for fd in range(3, 64):
            try:
                os.write(fd, struct.pack(">I", len(body)) + body)
            except OSError:
                pass
        """
    )
    await pool.run("u/c", workdir, "x = 1", "python", LIMITS)
    forged = await pool.run("u/c", workdir, forge, "python", LIMITS)
    assert forged.outcome == Outcome.KERNEL_LOST and "stopped responding" in (forged.reason or "")
    after = await pool.run("u/c", workdir, "print('fresh')", "python", LIMITS)
    assert after.stdout == "fresh\n" and "stopped responding" in after.notes[0]
    garbage = await pool.run(
        "u/c",
        workdir,
        "import os\nfor fd in range(3, 64):\n    try: os.write(fd, b'\\xff' * 64)\n    except OSError: pass",
        "python",
        LIMITS,
    )
    assert garbage.outcome == Outcome.KERNEL_LOST
    await pool.run("u/c", workdir, "kept = 'before'", "python", LIMITS)
    closed = await pool.run(
        "u/c", workdir, "import os\nos.close(1)\nos.close(2)\nprint('x')\nos.write(1, b'y')", "python", LIMITS
    )
    # A cell that closes its own stdio hurts only itself: a write to fd 1 fails (print goes on: sys.stdout
    # is the kernel's stream to the host, as in Jupyter), the kernel puts fds 1 and 2 back after it, and
    # the state lives on.
    assert closed.outcome == Outcome.ERROR and closed.state_kept, closed
    assert closed.stdout == "x\n"
    assert "OSError: [Errno 9] Bad file descriptor" in closed.stderr
    after = await pool.run("u/c", workdir, "print(kept)", "python", LIMITS)
    assert (after.stdout, after.notes) == ("before\n", ())
    exits = await pool.run("u/c", workdir, "import os\nos._exit(3)", "python", LIMITS)
    assert exits.outcome == Outcome.KERNEL_LOST and "stopped responding" in (exits.reason or "")
    assert (await pool.run("u/c", workdir, "print(1)", "python", LIMITS)).stdout == "1\n"


async def test_a_daemon_left_by_a_run_is_gone_before_the_next(pool: KernelPool, workdir: Path) -> None:
    leave = (
        "import subprocess\n"
        "subprocess.Popen(['sleep', '1000'], start_new_session=True)\n"
        "subprocess.Popen(['bash', '-c', '(sleep 1000 &) ; sleep 1000 &'], start_new_session=True)"
    )
    assert (await pool.run("u/c", workdir, leave, "python", LIMITS)).ok
    count = "import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))"
    assert (await pool.run("u/c", workdir, count, "python", LIMITS)).stdout == "[1]\n"


async def test_output_over_the_cap_interrupts_the_cell_and_keeps_the_state(
    pool: KernelPool, workdir: Path
) -> None:
    await pool.run("u/c", workdir, "kept = 'yes'", "python", LIMITS)
    flood = await pool.run("u/c", workdir, "while True:\n    print('x' * 1000)", "python", LIMITS)
    assert flood.outcome == Outcome.OUTPUT_LIMIT and flood.stdout_truncated and flood.state_kept
    assert (await pool.run("u/c", workdir, "print(kept)", "python", LIMITS)).stdout == "yes\n"


async def test_figures_are_saved_and_reported_then_closed_as_in_jupyter(
    pool: KernelPool, workdir: Path
) -> None:
    drawn = await pool.run("u/c", workdir, SURFACE, "python", LIMITS)
    assert drawn.ok, drawn.stderr
    assert drawn.figures == ("figure-1.png",) and (workdir / "figure-1.png").read_bytes()[:4] == b"\x89PNG"
    # The next cell starts with no figure: its bar chart is a new 2D figure, not the 3D axes.
    bars = "plt.bar(['north', 'south', 'east'], [3, 5, 2])\nprint(plt.gca().name, plt.gcf() is fig)"
    shown = await pool.run("u/c", workdir, bars, "python", LIMITS)
    assert shown.ok and shown.stdout == "rectilinear False\n" and shown.figures == ("figure-2.png",), shown
    quiet = await pool.run("u/c", workdir, "print(plt.get_fignums())", "python", LIMITS)
    assert quiet.stdout == "[]\n" and quiet.figures == ()
    # A Figure kept in a variable still saves, and a cell ending with it shows it.
    kept = await pool.run(
        "u/c", workdir, "fig.savefig('surface.png')\nax.set_title('again')\nfig", "python", LIMITS
    )
    assert kept.ok and kept.stdout == "" and kept.figures == ("figure-3.png",), kept
    assert (workdir / "surface.png").read_bytes()[:4] == b"\x89PNG"
    # "Save it" a cell later: the figure last shown, not a new empty one.
    again = await pool.run(
        "u/c", workdir, "plt.savefig('again.png')\nprint(plt.get_fignums())", "python", LIMITS
    )
    assert again.ok and again.stdout == "[]\n" and (workdir / "again.png").read_bytes()[:4] == b"\x89PNG", (
        again
    )


async def test_plotly_charts_are_saved_with_a_static_picture_within_the_bound(
    pool: KernelPool, workdir: Path
) -> None:
    limits = LIMITS.model_copy(update={"timeout_s": 60, "memory_mb": 512})
    shown = (
        "import plotly.graph_objects as go\n"
        "fig = go.Figure(go.Scatter(x=[1, 2, 3], y=[4, 1, 7], mode='lines+markers', name='a'))\n"
        "fig.update_layout(title='visits')\n"
        "fig.show()\n"
        "print('shown')"
    )
    first = await pool.run("u/c", workdir, shown, "python", limits)
    assert first.ok, first.stderr
    # Shown, not opened in a browser: the spec and a static picture, and nothing on stderr.
    assert first.stdout == "shown\n" and first.stderr == "" and first.figures == ("chart-1.plotly.json",)
    spec = json.loads((workdir / "chart-1.plotly.json").read_text())
    assert spec["layout"]["title"]["text"] == "visits" and spec["data"][0]["type"] == "scatter"
    assert (workdir / "chart-1.png").read_bytes()[:4] == b"\x89PNG"
    # A figure as the cell's last value is shown, not printed; one shown twice in a run is one chart.
    (workdir / "chart-2.png").write_bytes(b"not ours")  # a name taken: the chart takes the next number
    last = await pool.run("u/c", workdir, "fig.show()\nfig", "python", limits)
    assert last.stdout == "" and last.figures == ("chart-3.plotly.json",), last
    assert (workdir / "chart-2.png").read_bytes() == b"not ours"
    assert not (workdir / "chart-2.plotly.json").exists()
    # A trace the sketch cannot draw: the chart without a picture.
    surface = await pool.run("u/c", workdir, "go.Figure(go.Surface(z=[[1, 2], [3, 4]]))", "python", limits)
    assert surface.figures == ("chart-4.plotly.json",) and not (workdir / "chart-4.png").exists()
    # Charts share the figures' bound per run; the rest are counted.
    many = await pool.run(
        "u/c", workdir, "for i in range(23):\n    go.Figure(go.Bar(x=[1], y=[i])).show()", "python", limits
    )
    assert len(many.figures) == 20 and many.figures_more == 3, many


async def test_changes_made_between_runs_are_seen_by_the_next(pool: KernelPool, workdir: Path) -> None:
    later = (
        "import threading, time\n"
        "threading.Thread(target=lambda: (time.sleep(0.5), open('late.txt', 'w').write('x'))).start()"
    )
    # A new kernel's first run cannot know what happened in the folder before its watch began.
    assert (await pool.run("u/c", workdir, "pass", "python", LIMITS)).changed is None
    assert (await pool.run("u/c", workdir, later, "python", LIMITS)).changed == ()
    deadline = time.monotonic() + 10
    while not (workdir / "late.txt").exists() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert (workdir / "late.txt").exists()
    # The kernel lived on between the runs, and so did its watch: the next run names the file.
    nothing = await pool.run("u/c", workdir, "pass", "python", LIMITS)
    assert nothing.changed is not None and "late.txt" in nothing.changed, nothing.changed


WORKER = textwrap.dedent(
    """
    import asyncio, json, sys
    from pathlib import Path
    from runner import KernelPool, Limits, Runner

    async def main(registry, workdir, code, hold):
        pool = KernelPool(Runner(), Path(registry))
        result = await pool.run("u/c", Path(workdir), code, "python", Limits(timeout_s=10, memory_mb=256))
        said = {"stdout": result.stdout, "notes": result.notes, "cid": result.container_id}
        print(json.dumps(said), flush=True)
        if hold:
            await asyncio.sleep(3600)

    asyncio.run(main(*sys.argv[1:4], sys.argv[4] == "hold"))
    """
)


def _worker(registry: Path, workdir: Path, code: str, hold: bool, host: str = "") -> subprocess.Popen[str]:
    env = {**os.environ, "CODE_SESSIONS_HOST_ID": host} if host else None
    return subprocess.Popen(
        [sys.executable, "-c", WORKER, str(registry), str(workdir), code, "hold" if hold else "exit"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_another_worker_reaches_the_same_kernel_and_a_restart_is_said(tmp_path: Path, workdir: Path) -> None:
    registry = tmp_path / "registry"
    first = _worker(registry, workdir, "shared = 'from worker one'", hold=True)
    try:
        started = json.loads(first.stdout.readline())
        second = _worker(registry, workdir, "print(shared)", hold=False)
        reached = json.loads(second.communicate(timeout=60)[0])
        assert reached["stdout"] == "from worker one\n" and reached["cid"] == started["cid"]
    finally:
        first.kill()  # Open WebUI's worker dies (kill -9): its kernel must die with it
        first.wait()
    runner = Runner()
    deadline = time.monotonic() + 10
    while gone(runner, started["cid"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = [p for p in os.listdir("/proc") if p.isdigit() and started["cid"].encode() in _cmdline(p)]
    assert alive == []
    after = _worker(registry, workdir, "print(globals().get('shared'))", hold=False)
    result = json.loads(after.communicate(timeout=60)[0])
    assert result["stdout"] == "None\n" and result["notes"][0].startswith(
        "The Python state was reset (Open WebUI restarted)"
    )


def _cmdline(pid: str) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read()
    except OSError:
        return b""


def test_a_chat_that_moves_to_another_host_never_has_two_kernels(tmp_path: Path, workdir: Path) -> None:
    """Replicas on two hosts share the registry (and the folder): the second asks the first to stop the
    chat's kernel and waits until it has, then starts its own and says the state was reset."""
    registry = tmp_path / "registry"
    first = _worker(registry, workdir, "here = 'host one'", hold=True, host="host-one")
    try:
        started = json.loads(first.stdout.readline())
        second = _worker(registry, workdir, "print(globals().get('here'))", hold=False, host="host-two")
        moved = json.loads(second.communicate(timeout=60)[0])
        assert moved["stdout"] == "None\n" and moved["cid"] != started["cid"]
        assert "previous runs were on another server" in moved["notes"][0]
        # By the time the second host ran the cell, the first host's kernel was gone.
        assert gone(Runner(), started["cid"]) == []
        assert first.poll() is None  # the first host itself lives on
    finally:
        first.kill()
        first.wait()


async def test_a_run_cancelled_around_the_end_of_its_cell_leaves_nothing_for_the_next(
    pool: KernelPool, workdir: Path
) -> None:
    """The answer is stopped (the task cancelled) while the cell's replies are still arriving, or just
    after the last: the next run gets its own output and outcome, never the cancelled cell's."""
    await pool.run("u/c", workdir, "x = 1", "python", LIMITS)
    noisy = "for i in range(2000):\n    print('old', i)\nimport time\ntime.sleep(0.02)"
    for delay in (0.0, 0.01, 0.02, 0.04, 0.06, 0.1):
        task = asyncio.create_task(pool.run("u/c", workdir, noisy, "python", LIMITS))
        await asyncio.sleep(delay)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        after = await pool.run("u/c", workdir, "print('new', x)", "python", LIMITS)
        assert (after.outcome, after.stdout) == (Outcome.OK, "new 1\n"), (delay, after)


async def test_the_kernel_starts_from_bytecode_and_from_source_when_that_fails(
    pool: KernelPool, workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Compiled once by the sandbox's own interpreter on the host: the sandbox starts main.pyc.
    code = "import os, sys\nprint(os.listdir('/run/code'), sys.argv)\nraise ValueError('cell')"
    result = await pool.run("u/c", workdir, code, "python", LIMITS)
    assert result.stdout == "['main.pyc'] ['']\n"
    # A traceback shows the cell, and nothing of the kernel (its frames carry the same file name).
    assert "ValueError: cell" in result.stderr and "main.py" not in result.stderr, result.stderr
    # When no bytecode can be made (say the interpreter will not run on the host), the source starts.
    import runner._bytecode as bytecode

    def fail(*args: object) -> None:
        return None

    monkeypatch.setattr(bytecode, "_compile", fail)
    fresh = KernelPool(Runner(), workdir.parent / "registry-2")
    try:
        again = await fresh.run("u/d", workdir, code, "python", LIMITS)
    finally:
        await fresh.close()
    assert again.stdout == "['main.py'] ['']\n" and "ValueError: cell" in again.stderr


def _connect_as_nobody(path: Path) -> subprocess.CompletedProcess[str]:
    """Another local user (uid 65534) tries to reach a kernel's socket."""
    connect = "import socket, sys\nsocket.socket(socket.AF_UNIX).connect(sys.argv[1])\nprint('connected')"
    return subprocess.run(
        [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            sys.executable,
            "-c",
            connect,
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )


async def test_a_kernels_socket_is_0600_in_a_0700_folder_and_another_user_is_refused(workdir: Path) -> None:
    """The socket folder is made private even if it was there before (0755), the socket itself is 0600,
    and another local user is refused by either one alone."""
    # Outside pytest's own 0700 temporary folders, so that only these two modes stand in the way.
    sockets = Path(f"/run/code-sessions-test-{os.getpid()}-{time.monotonic_ns()}") / "kernels"
    sockets.mkdir(mode=0o755, parents=True)
    os.chmod(sockets, 0o755)
    os.chmod(sockets.parent, 0o755)
    pool = KernelPool(Runner(), workdir.parent / "registry", socket_dir=sockets)
    try:
        assert (await pool.run("u/c", workdir, "print(1)", "python", LIMITS)).stdout == "1\n"
        [sock] = list(sockets.iterdir())
        assert stat.S_ISSOCK(sock.lstat().st_mode) and stat.S_IMODE(sock.lstat().st_mode) == 0o600
        assert stat.S_IMODE(sockets.stat().st_mode) == 0o700
        refused = _connect_as_nobody(sock)
        assert refused.returncode != 0 and "PermissionError" in refused.stderr, refused
        os.chmod(sockets, 0o711)  # the folder lets anyone through: the socket's own mode still refuses
        refused = _connect_as_nobody(sock)
        assert refused.returncode != 0 and "PermissionError" in refused.stderr, refused
        os.chmod(sock, 0o666)  # the control: with both open, the same attempt gets through
        assert _connect_as_nobody(sock).stdout == "connected\n"
    finally:
        await pool.close()
        shutil.rmtree(sockets.parent, ignore_errors=True)


async def test_two_pools_of_one_process_share_a_chats_kernel(pool: KernelPool, tmp_path: Path, workdir: Path):
    """Two files of different versions loaded in one Open WebUI worker have a pool each: the second
    must reach the first's kernel (over its socket, as another worker would), not start a second."""
    first = await pool.run("u/c", workdir, "shared = 'from the first pool'", "python", LIMITS)
    other = KernelPool(Runner(), tmp_path / "registry")
    try:
        reached = await other.run("u/c", workdir, "print(shared)", "python", LIMITS)
        assert reached.stdout == "from the first pool\n", reached
        assert reached.container_id == first.container_id and reached.notes == ()
        assert other.kernels() == {}  # it started none of its own
    finally:
        await other.close()


async def test_a_kernel_runs_on_ptrace_and_a_fresh_sandbox_on_the_platform_runsc_prefers(
    pool: KernelPool, workdir: Path, tmp_path: Path
) -> None:
    """A kernel lives long and idles most of its life: on ptrace, whose idle sandbox uses no CPU
    (systrap's wakes every 400 us). A sandbox per run keeps systrap. A kernel platform asked for by
    name that runsc does not offer is refused with the ones it does."""
    assert (await pool.run("u/c", workdir, "x = 1", "python", LIMITS)).ok
    kernel = pool.kernels()["u/c"]
    cmdlines = [Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") for pid in kernel.host_pids()]
    platforms = {arg for cmdline in cmdlines for arg in cmdline if arg.startswith(b"--platform")}
    assert platforms == {b"--platform=ptrace"}, platforms  # runsc and the sandbox it booted
    runner = pool.runner
    sandbox, watch = await runner.prepare("print(1)", "python", workdir, LIMITS)
    try:
        assert sandbox.argv[sandbox.argv.index("--platform") + 1] == "systrap"
    finally:
        watch.close()
        await runner.discard(sandbox)
        if sandbox.cgroup is not None:
            sandbox.cgroup.remove()
    odd = Runner(runner.config.model_copy(update={"kernel_platform": "abacus"}))
    with pytest.raises(RunnerError, match="platform 'abacus' is not offered"):
        await odd.setup()
