"""The relay between workers of one host, under bad luck and abuse, with real processes and real runsc.

Each worker is its own Python process with its own KernelPool (as Open WebUI's workers are); they share
the registry, the socket folder and the chat's folder. What a user would see is checked: which kernel
ran the cell, the sentence, how long the wait was, and what stayed on disk.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from runner import KernelPool, KernelSettings, Limits, Runner
from tests.support.sandbox import live_processes, runsc_containers

pytestmark = pytest.mark.runsc

REPO = Path(__file__).resolve().parents[2]
LIMITS = Limits(timeout_s=10, memory_mb=256)

WORKER = textwrap.dedent(
    """
    import asyncio, json, sys
    from pathlib import Path
    from runner import KernelPool, KernelSettings, Limits, Runner

    async def main(registry, sockets, key, workdir, code, hold, state=""):
        pool = KernelPool(Runner(), Path(registry), socket_dir=Path(sockets))
        result = await pool.run(
            key, Path(workdir), code, "python", Limits(timeout_s=10, memory_mb=256),
            state_dir=Path(state) if state else None,
        )
        said = {"stdout": result.stdout, "notes": result.notes, "cid": result.container_id,
                "outcome": result.outcome.value}
        print(json.dumps(said), flush=True)
        if hold:
            await asyncio.sleep(3600)

    asyncio.run(main(*sys.argv[1:6], sys.argv[6] == "hold", *sys.argv[7:]))
    """
)

# A worker that starts several new chats at once under max_kernels, says what each printed, then
# reports, every 0.2 s, which of its kernels are alive (into <report>).
STARTER = textwrap.dedent(
    """
    import asyncio, json, os, sys
    from pathlib import Path
    from runner import KernelPool, KernelSettings, Limits, Runner

    async def main(registry, sockets, base, name, count, most, report):
        settings = KernelSettings(max_kernels=int(most))
        pool = KernelPool(Runner(), Path(registry), socket_dir=Path(sockets), settings=settings)
        limits = Limits(timeout_s=10, memory_mb=256)
        keys = [f"{name}-{i}" for i in range(int(count))]
        for key in keys:
            (Path(base) / key).mkdir()
        results = await asyncio.gather(
            *(pool.run(key, Path(base) / key, f"print({key!r})", "python", limits) for key in keys)
        )
        said = [{"stdout": r.stdout, "cid": r.container_id, "notes": r.notes} for r in results]
        print(json.dumps(said), flush=True)
        while True:
            alive = [k.cid for k in pool.kernels().values() if k.alive]
            with open(report + ".tmp", "w") as fh:
                json.dump(alive, fh)
            os.replace(report + ".tmp", report)
            await asyncio.sleep(0.2)

    asyncio.run(main(*sys.argv[1:]))
    """
)


class Workers:
    def __init__(self, tmp_path: Path) -> None:
        self.registry = tmp_path / "registry"
        # Short: a unix socket's path has at most 107 bytes, and pytest's tmp_path is long.
        self.sockets = Path(tempfile.mkdtemp(prefix="cs-relay-", dir="/tmp")) / "s"
        self.started: list[subprocess.Popen[str]] = []

    def start(
        self, key: str, workdir: Path, code: str, *, hold: bool, state: Path | None = None
    ) -> subprocess.Popen[str]:
        argv = [sys.executable, "-c", WORKER, str(self.registry), str(self.sockets), key, str(workdir), code]
        argv += ["hold" if hold else "exit", *([str(state)] if state is not None else [])]
        process = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, text=True)
        self.started.append(process)
        return process

    def starter(self, base: Path, name: str, count: int, most: int, report: Path) -> subprocess.Popen[str]:
        argv = [sys.executable, "-c", STARTER, str(self.registry), str(self.sockets), str(base), name]
        argv += [str(count), str(most), str(report)]
        process = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, text=True)
        self.started.append(process)
        return process

    def said(self, process: subprocess.Popen[str]) -> dict:
        assert process.stdout is not None
        return json.loads(process.stdout.readline())

    def pool(self) -> KernelPool:
        return KernelPool(Runner(), self.registry, socket_dir=self.sockets)

    def entry(self, key: str) -> dict:
        pool = self.pool()
        return json.loads(pool._registry.path(key).read_text())

    def stop_all(self) -> None:
        for process in self.started:
            with_signal(process, signal.SIGCONT)
            process.kill()
            process.wait()
        shutil.rmtree(self.sockets.parent, ignore_errors=True)


def with_signal(process: subprocess.Popen[str], sig: int) -> None:
    if process.poll() is None:
        os.kill(process.pid, sig)


@pytest.fixture
def workers(tmp_path: Path):
    found = Workers(tmp_path)
    yield found
    found.stop_all()


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    path = tmp_path / "chat"
    path.mkdir()
    return path


def test_an_old_kernels_teardown_leaves_the_newer_kernels_socket(workers: Workers, folder: Path) -> None:
    """Worker A loses its kernel's socket; worker B takes the chat over (and says the reset); A's
    teardown of its old kernel, a couple of seconds later, must not remove B's socket."""
    a = workers.start("k2", folder, "x = 'from a'", hold=True)
    old = workers.said(a)["cid"]
    os.unlink(workers.entry("k2")["socket"])
    b = workers.start("k2", folder, "y = 'from b'", hold=True)
    took_over = workers.said(b)
    assert took_over["notes"] and "reset" in took_over["notes"][0]
    # A's reaper (every 2 s) ends its old kernel: `runsc kill` (up to 10 s), 3 s for the sandbox to go,
    # `runsc delete --force` (up to 10 s). Under a loaded CI machine the delete alone took over 10 s once.
    deadline = time.monotonic() + 2 + 10 + 3 + 10 + 10
    while live_processes(old) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert live_processes(old) == [], "worker A never ended its old kernel"
    entry = workers.entry("k2")
    assert entry["cid"] == took_over["cid"] and os.path.exists(entry["socket"])
    c = workers.start("k2", folder, "print(y)", hold=False)
    reached = workers.said(c)
    assert reached["stdout"] == "from b\n" and reached["notes"] == [] and reached["cid"] == took_over["cid"]


async def test_a_stopped_worker_does_not_hang_the_others(workers: Workers, folder: Path) -> None:
    """The worker holding the chat's kernel is SIGSTOPped: another worker's run gets an answer within
    the time limit and a margin, in a new kernel, with the reason; the stopped worker's kernel is
    killed, so the chat never has two."""
    a = workers.start("k3", folder, "x = 1", hold=True)
    held = workers.said(a)
    with_signal(a, signal.SIGSTOP)
    pool = workers.pool()
    limits = LIMITS.model_copy(update={"timeout_s": 2})
    try:
        started = time.monotonic()
        result = await asyncio.wait_for(
            pool.run("k3", folder, "print(globals().get('x'))", "python", limits), 60
        )
        assert time.monotonic() - started < 2 + 15 + 10
        assert result.stdout == "None\n" and result.container_id != held["cid"]
        assert result.notes == (
            "The Python state was reset (the worker holding it did not answer within 17 s); "
            "files in /mnt/data are kept.",
        )
        assert held["cid"] not in runsc_containers(Runner().state_dir)
        assert live_processes(held["cid"]) == []  # (its runsc processes are zombies of the stopped worker)
    finally:
        await pool.close()


async def test_a_request_for_another_chat_or_from_another_user_is_refused(
    workers: Workers, folder: Path, tmp_path: Path
) -> None:
    a = workers.start("victim", folder, "secret = 'the victim'", hold=True)
    workers.said(a)
    victim = workers.entry("victim")
    # A registry entry for another chat that names the victim's socket (writing it needs our user).
    other = tmp_path / "other"
    other.mkdir()
    forged = {**victim, "key": "intruder", "workdir": str(other)}
    pool = workers.pool()
    pool._registry.path("intruder").write_text(json.dumps(forged))
    try:
        result = await pool.run("intruder", other, "print(globals().get('secret'))", "python", LIMITS)
        assert result.stdout == "None\n"  # its own kernel: the victim's refused the request
    finally:
        await pool.close()
    # Another uid that reaches the socket (its folders opened up) is refused by its credentials.
    os.chmod(workers.sockets.parent, 0o755)
    os.chmod(workers.sockets, 0o755)
    os.chmod(victim["socket"], 0o666)
    client = textwrap.dedent(
        """
        import json, socket, struct, sys
        s = socket.socket(socket.AF_UNIX)
        s.connect(sys.argv[1])
        body = json.dumps({"op": "run", "code": "print(secret)", "language": "python", "limits": {},
                           "key": "victim", "cid": sys.argv[2]}).encode()
        try:
            s.sendall(struct.pack(">I", len(body)) + body)
        except BrokenPipeError:
            pass  # the server may refuse before it reads the request
        size = struct.unpack(">I", s.recv(4))[0]
        print(s.recv(size).decode())
        """
    )
    done = subprocess.run(
        [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            sys.executable,
            "-c",
            client,
            victim["socket"],
            victim["cid"],
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"refused": "not our user"}


async def test_a_stopped_answer_stops_its_cell_in_the_serving_worker(workers: Workers, folder: Path) -> None:
    """The user stops the answer while worker A runs the chat's cell for this worker: the cell stops
    there too, before the cancelled run returns, so nothing is written after the caller's reconcile."""
    a = workers.start("k1", folder, "import time", hold=True)
    workers.said(a)
    pool = workers.pool()
    writer = "while True:\n    open('r.log', 'a').write('x' * 100)\n    time.sleep(0.02)"
    try:
        task = asyncio.create_task(pool.run("k1", folder, writer, "python", LIMITS))
        deadline = time.monotonic() + 30
        while not ((folder / "r.log").exists() and (folder / "r.log").stat().st_size > 0):
            assert time.monotonic() < deadline and not task.done(), "the cell did not write"
            await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        size = (folder / "r.log").stat().st_size
        await asyncio.sleep(2)
        assert (folder / "r.log").stat().st_size == size  # the cell stopped in worker A
        started = time.monotonic()
        after = await pool.run("k1", folder, "print(time.time() > 0)", "python", LIMITS)
        assert after.stdout == "True\n" and after.notes == ()  # the same kernel, at once
        assert time.monotonic() - started < 5
    finally:
        await pool.close()


async def test_max_kernels_holds_under_concurrent_starts(workers: Workers, tmp_path: Path) -> None:
    """Six new chats at once with max_kernels=2 (their starts interleave at every await): at most two
    kernels run afterwards, and each chat got its answer."""
    settings = KernelSettings(max_kernels=2)
    pool = KernelPool(Runner(), tmp_path / "registry", socket_dir=workers.sockets, settings=settings)
    folders = []
    for i in range(6):
        folders.append(tmp_path / f"chat{i}")
        folders[-1].mkdir()
    try:
        results = await asyncio.gather(
            *(pool.run(f"c{i}", folders[i], f"print({i})", "python", LIMITS) for i in range(6))
        )
        assert [r.stdout for r in results] == [f"{i}\n" for i in range(6)]
        running = [e for e in pool._registry.running_here()]
        assert len(running) <= 2, [e.key for e in running]
        assert len(pool.kernels()) <= 2
    finally:
        await pool.close()


async def test_a_relayed_run_with_other_limits_gets_a_kernel_with_those_limits(
    workers: Workers, folder: Path
) -> None:
    """The admin raised the memory limit: a run relayed to the worker holding the chat's kernel (started
    with the old limit) must not run there, as a local run would not: a new kernel, and the reason."""
    a = workers.start("k5", folder, "x = 1", hold=True)
    held = workers.said(a)
    pool = workers.pool()
    try:
        bigger = LIMITS.model_copy(update={"memory_mb": 384})
        result = await pool.run("k5", folder, "print(globals().get('x'))", "python", bigger)
        assert result.stdout == "None\n" and result.container_id != held["cid"]
        changed = "the admin changed the sandbox's limits"
        assert result.notes == (f"The Python state was reset ({changed}); files in /mnt/data are kept.",)
    finally:
        await pool.close()


def test_max_kernels_holds_under_concurrent_starts_from_several_workers(
    workers: Workers, tmp_path: Path
) -> None:
    """Three worker processes each start two new chats at once, with max_kernels=2 for the host: every
    chat gets its answer, and afterwards at most two kernels are alive, in the registry, in the
    workers, and as sandbox processes on the host (the others were stopped, not left running)."""
    base = tmp_path / "chats"
    base.mkdir()
    reports = {name: tmp_path / f"{name}.json" for name in ("w1", "w2", "w3")}
    started = {name: workers.starter(base, name, 2, 2, report) for name, report in reports.items()}
    said = {name: workers.said(process) for name, process in started.items()}
    for name, results in said.items():
        assert [r["stdout"] for r in results] == [f"{name}-0\n", f"{name}-1\n"], results
    cids = {r["cid"] for results in said.values() for r in results}
    assert len(cids) == 6
    # Stops still in flight end: the workers (reporting every 0.2 s), the registry and the host's
    # processes come to agree on at most two kernels.
    deadline = time.monotonic() + 15
    while True:
        reported = all(report.exists() for report in reports.values())
        alive = [cid for report in reports.values() if reported for cid in json.loads(report.read_text())]
        running = [e for e in workers.pool()._registry.running_here() if e.cid in cids]
        on_host = [cid for cid in cids if live_processes(cid)]
        settled = {e.cid for e in running} == set(alive) and sorted(on_host) == sorted(alive)
        if (reported and len(alive) <= 2 and settled) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert reported, "a worker never reported its kernels"
    assert len(alive) <= 2, alive
    assert len(running) <= 2 and {e.cid for e in running} == set(alive), (running, alive)
    assert sorted(on_host) == sorted(alive), on_host


async def test_a_busy_kernel_of_another_worker_is_not_the_lru_victim(
    workers: Workers, tmp_path: Path
) -> None:
    """Worker B's kernel runs a 6 s cell when this worker, at max_kernels=1, starts a new chat: B's
    cell is not killed for room (it finishes and prints); the new chat waits for B's kernel to be idle,
    then B saves it and stops it; B's chat resumes it afterwards with its variable and no sentence."""
    b_folder, state = tmp_path / "b", tmp_path / "state" / "b.kernel"
    b_folder.mkdir()
    cell = "x = 41\nimport time\nopen('started', 'w').close()\ntime.sleep(6)\nprint('finished')"
    b = workers.start("kb", b_folder, cell, hold=True, state=state)
    deadline = time.monotonic() + 60
    while not (b_folder / "started").exists():
        assert time.monotonic() < deadline and b.poll() is None, "B's cell did not start"
        time.sleep(0.1)
    pool = KernelPool(
        Runner(), workers.registry, socket_dir=workers.sockets, settings=KernelSettings(max_kernels=1)
    )
    a_folder = tmp_path / "a"
    a_folder.mkdir()
    try:
        began = time.monotonic()
        mine = await pool.run("ka", a_folder, "print('a')", "python", LIMITS)
        waited = time.monotonic() - began
        assert mine.stdout == "a\n" and mine.notes == ()
        held = workers.said(b)  # B's run returned: it was not stopped for room
        assert held == {"stdout": "finished\n", "notes": [], "cid": held["cid"], "outcome": "ok"}
        assert waited > 2, "the new chat did not wait for B's kernel to become idle"
        assert (state / "kernel" / "meta.json").is_file()  # B saved it when asked, once idle
        assert live_processes(held["cid"]) == []
        again = await pool.run("kb", b_folder, "print(x + 1)", "python", LIMITS, state_dir=state)
        assert again.stdout == "42\n" and again.notes == ()
    finally:
        await pool.close()
