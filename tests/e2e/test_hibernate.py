"""A chat's Python state outlives its kernel process, through a real Open WebUI 0.12.4, the bundled
function, a scripted model and real gVisor: a variable and a DataFrame of more than 50 MB set in turn 1
are read in turn 2 after the kernel idled past kernel_idle_minutes=0.25, with max_kernels=1 and two chats
taking turns, and after an Open WebUI restart. A worker SIGKILLed mid-run loses the state, says so, and
loses no file."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import uuid
from pathlib import Path

import pytest

from demo import launcher
from tests.support.open_webui import OpenWebUI, Reply, running_open_webui

pytestmark = [pytest.mark.e2e, pytest.mark.runsc, pytest.mark.timeout(900)]

TURN_ONE = (
    "```python\n"
    "import numpy as np, pandas as pd\n"
    "word = 'kept-' + str(len('{tag}'))\n"
    "df = pd.DataFrame({{'n': np.arange(7_000_000, dtype='int64')}})\n"
    "print('MiB', df.memory_usage().sum() // 2**20)\n"
    "```\n"
    "reply: loaded"
)
TURN_TWO = "```python\nprint('again', word, len(df), int(df['n'].sum()))\n```\nreply: read"
EXPECTED = f"again kept-{{n}} 7000000 {sum(range(7_000_000))}"
LOST = "The Python state"


def turn_one(server: OpenWebUI, tag: str) -> Reply:
    reply = server.admin.say(TURN_ONE.format(tag=tag))
    assert "MiB 53" in reply.content, reply.content
    return reply


def turn_two(server: OpenWebUI, previous: Reply, tag: str) -> Reply:
    reply = server.admin.say(TURN_TWO, previous=previous)
    assert EXPECTED.format(n=len(tag)) in reply.content, reply.content
    assert LOST not in reply.content, reply.content
    return reply


def saved_images(server: OpenWebUI) -> list[Path]:
    return sorted((server.sessions_root / "state").glob("*/*.kernel/kernel/meta.json"))


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(1)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_server: str):
    with running_open_webui(tmp_path_factory.mktemp("hibernate"), model_server, []) as started:
        started.set_valves(kernel_idle_minutes=0.25, max_kernels=1, timeout_seconds=60)
        yield started


def test_the_state_survives_an_idle_kernel(server: OpenWebUI) -> None:
    first = turn_one(server, "idle")
    wait_for(lambda: len(saved_images(server)) == 1, 150, "the idle kernel to be saved")
    turn_two(server, first, "idle")
    assert saved_images(server) == []  # resumed: its image went


def test_two_chats_take_turns_with_one_kernel(server: OpenWebUI) -> None:
    a = turn_one(server, "chat-a")
    b = turn_one(server, "chat-bb")  # a is saved to make room
    a2 = turn_two(server, a, "chat-a")  # b saved, a resumed
    turn_two(server, b, "chat-bb")
    turn_two(server, a2, "chat-a")


def test_the_state_survives_an_open_webui_restart(tmp_path: Path, model_server: str) -> None:
    home = tmp_path / "restart"
    with running_open_webui(home, model_server, []) as first:
        first.set_valves(timeout_seconds=60)
        reply = turn_one(first, "restart")
        assert saved_images(first) == []  # the kernel is live: nothing on disk yet
        environment = _environment_of(first)
        launcher.stop(first.process)  # SIGTERM, as a deploy does: idle kernels are saved at exit
        assert len(saved_images(first)) == 1
        _start_again(first, environment)
        turn_two(first, reply, "restart")


def _environment_of(server: OpenWebUI) -> dict[str, str]:
    """What the running Open WebUI was started with (its secret key signs our tokens)."""
    with open(f"/proc/{server.process.pid}/environ", "rb") as fh:
        pairs = [item.split(b"=", 1) for item in fh.read().split(b"\0") if b"=" in item]
    wanted = ("WEBUI_SECRET_KEY", "ENABLE_OLLAMA_API", "OPENAI_API_BASE_URL", "OPENAI_API_KEY")
    found = {k.decode(): v.decode() for k, v in pairs}
    return {name: found[name] for name in wanted}


def _start_again(server: OpenWebUI, environment: dict[str, str]) -> None:
    """The same Open WebUI (data dir, secret) started again; the accounts' tokens stay valid."""
    port = launcher.free_port()
    server.process = launcher.start_open_webui(server.data_dir, port, server.log, environment)
    server.url = f"http://127.0.0.1:{port}"  # running_open_webui stops this process at the end


def test_a_worker_killed_mid_run_says_the_state_was_lost_and_keeps_the_files(
    tmp_path: Path, model_server: str
) -> None:
    home = tmp_path / "killed"
    with running_open_webui(home, model_server, []) as first:
        first.set_valves(timeout_seconds=60)
        write = "```python\nopen('/mnt/data/kept.txt', 'w').write('still here')\nx = 1\n```\nreply: written"
        reply = first.admin.say(write)
        tag = uuid.uuid4().hex[:8]
        slow = (
            f"```python\nimport time\nopen('started-{tag}', 'w').close()\ntime.sleep(120)\n```\nreply: slept"
        )
        threading.Thread(target=lambda: _quietly(first, slow, reply), daemon=True).start()
        started = lambda: list(first.sessions_root.glob(f"sessions/*/*/started-{tag}"))  # noqa: E731
        wait_for(lambda: bool(started()), 90, "the slow cell to run")
        environment = _environment_of(first)
        os.killpg(first.process.pid, signal.SIGKILL)  # a crash: no exit handler runs
        first.process.wait()
        _start_again(first, environment)
        # The answer the crash cut short stays in the chat: the next message continues from it.
        after = first.admin.say(
            "```python\nprint(open('/mnt/data/kept.txt').read(), globals().get('x'))\n```\nreply: read",
            previous=first.admin.newest(reply),
        )
        assert "still here None" in after.content, after.content
        assert "The Python state was reset (Open WebUI restarted)" in after.content, after.content
        assert saved_images(first) == []


def _quietly(server: OpenWebUI, text: str, previous: Reply) -> None:
    with contextlib.suppress(Exception):  # the server is killed under this request
        server.admin.say(text, previous=previous)
