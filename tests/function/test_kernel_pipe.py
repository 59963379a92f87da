"""The live kernel through the installed function (in-process, real storage, real gVisor).

What a user of a chat sees: a variable set in one message is there in the next ones of that chat and
nowhere else; a figure appears inline; a lost state is said, in the answer and in a status; an admin's
purge and the `fresh` valve end the state.
"""

from __future__ import annotations

import asyncio
import re

import pytest

from tests.support.files_api import URL_PATTERN as FILE_URL
from tests.support.pipe_harness import PLOTLY_URL, PipeHarness, code
from tests.support.sandbox import kill_a_worker_holding_a_kernel, leftovers

pytestmark = pytest.mark.runsc

IMAGE = re.compile(r"!\[[^\]]*\]\((" + FILE_URL + r")\)")


@pytest.fixture
async def harness(tmp_path) -> PipeHarness:
    harness = PipeHarness(tmp_path / "data", valves={"timeout_seconds": 15})
    yield harness
    await harness.aclose()


async def test_a_variable_lives_through_the_turns_of_one_chat_only(harness: PipeHarness):
    await harness.say("alice", "chat-1", code("loaded = sum(range(1000))\nprint('loaded')"))
    for _ in range(2):
        answer = await harness.say("alice", "chat-1", code("print('still', loaded)"))
        assert "still 499500" in answer
    assert "NameError" in await harness.say("alice", "chat-2", code("print(loaded)"))
    assert "NameError" in await harness.say("bob", "chat-1", code("print(loaded)"))
    system = harness.requests[-1]["messages"][0]["content"]
    assert "live kernel" in system and "numpy" in system


async def test_a_figure_left_open_is_shown_inline_and_named_to_the_model(harness: PipeHarness):
    draw = "import matplotlib.pyplot as plt\nplt.plot([1, 4, 9])\nplt.title('squares')"
    answer = await harness.say("alice", "chat-1", code(draw))
    [url] = IMAGE.findall(answer)
    served = harness.files.fetch(url, "alice")
    assert served is not None and served.body[:4] == b"\x89PNG" and served.content_type == "image/png"
    assert harness.files.fetch(url, "bob") is None  # nobody else opens it
    tool_result = harness.requests[-1]["messages"][-1]["content"]
    assert "Figures: /mnt/data/figure-1.png" in tool_result


async def test_a_plotly_chart_is_the_messages_embed_with_its_picture_in_the_block(harness: PipeHarness):
    draw = "import plotly.express as px\npx.bar(x=['a', 'b'], y=[3, 5], title='votes')"
    answer = await harness.say("alice", "chat-1", code(draw), message_id="m1")
    [embed] = harness.embeds
    assert 'sandbox="allow-scripts allow-downloads"' in embed and "votes" in embed
    # plotly.js is not in it: the host serves it, and the embed names the host's URL.
    assert len(embed) < 30_000 and PLOTLY_URL in embed  # its spec: plotly.py writes its template in
    # The static picture is inside the run's block (before its end), not under it.
    block = answer[: answer.index("</details>")]
    assert "_Static picture of the interactive chart:_" in block
    [url] = IMAGE.findall(block)
    assert harness.files.fetch(url, "alice").body[:4] == b"\x89PNG"
    tool_result = harness.requests[-1]["messages"][-1]["content"]
    assert "Interactive charts: /mnt/data/chart-1.plotly.json (already shown to the user" in tool_result
    assert "static pictures, for readers who cannot see them: /mnt/data/chart-1.png" in tool_result


async def test_a_linked_table_is_previewed_unless_the_user_turns_it_off(harness: PipeHarness):
    make = "open('/mnt/data/t.csv', 'w').write('a,b\\n1,x\\n2,y\\n')"
    answer = await harness.say("alice", "chat-1", code(make, "Here: /mnt/data/t.csv"))
    assert answer.rstrip().endswith("| a | b |\n|---|---|\n| 1 | x |\n| 2 | y |"), answer
    assert "_Preview · 2 rows, 2 columns (a: int, b: text)_" in answer
    # The model does not read it back in the next turn's history.
    await harness.say(
        "alice",
        "chat-1",
        code("print(1)"),
        history=[{"role": "user", "content": "t"}, {"role": "assistant", "content": answer}],
    )
    sent = harness.requests[-2]["messages"]
    assert not any("_Preview" in str(m.get("content")) for m in sent), sent
    harness.user_valves = {"table_previews": False}
    answer = await harness.say("alice", "chat-1", code(make, "Again: /mnt/data/t.csv"))
    assert "Preview" not in answer and "t.csv" in answer


async def test_a_lost_state_is_said_to_the_user_and_the_model(harness: PipeHarness):
    harness.set_valves(timeout_seconds=2)
    await harness.say("alice", "chat-1", code("kept = 1"))
    stubborn = "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    pass"
    await harness.say("alice", "chat-1", code(stubborn))
    answer = await harness.say("alice", "chat-1", code("print(globals().get('kept'))"))
    assert "The Python state was reset (the cell did not stop" in answer
    assert "None" in answer
    statuses = [e["data"]["description"] for e in harness.events if e["type"] == "status"]
    assert any(s.startswith("The Python state was reset") for s in statuses)
    assert "The Python state was reset" in harness.requests[-1]["messages"][-1]["content"]


async def test_a_purge_stops_the_chats_kernel_and_its_next_run_says_so(harness: PipeHarness):
    await harness.say("alice", "chat-1", code("kept = 1"))
    [kernel] = harness.pipe._services.kernels.kernels().values()
    assert kernel.sandbox.argv[kernel.sandbox.argv.index("--platform") + 1] == "ptrace"  # the valve's default
    harness.set_valves(purge="chat:chat-1")
    answer = await harness.say("alice", "chat-1", code("print(globals().get('kept'))"))
    runner = harness.pipe._services.runner
    assert leftovers(kernel.cid, runner.state_dir, runner.bundle_dir, runner.config.cgroup_parent) == []
    assert "None" in answer and "an admin deleted this chat's files" in answer


async def test_fresh_mode_keeps_files_but_not_variables(harness: PipeHarness):
    harness.set_valves(kernel="fresh")
    await harness.say("alice", "chat-1", code("x = 1\nopen('/mnt/data/f.txt', 'w').write('kept')"))
    answer = await harness.say(
        "alice", "chat-1", code("print(open('/mnt/data/f.txt').read(), globals().get('x'))")
    )
    assert "kept None" in answer
    assert harness.pipe._services.kernels is None


async def test_figures_past_the_bound_are_counted_in_their_answer_and_never_carried_to_the_next(
    harness: PipeHarness,
):
    many = "import matplotlib.pyplot as plt\nfor i in range(30):\n    plt.figure()\n    plt.plot([0, i])"
    answer = await harness.say("alice", "chat-1", code(many))
    shown = re.findall(r"!\[figure-\d+\.png\]\(", answer)
    assert len(shown) == 20, answer
    assert "and 10 more not saved (too many figures in one run)" in answer
    assert "and 10 more not saved" in harness.requests[-1]["messages"][-1]["content"]  # the model hears it
    following = await harness.say("alice", "chat-1", code("print('unrelated')"))
    assert "unrelated" in following
    assert "![figure" not in following and "Figures:" not in following, following
    saved = sorted(p.name for p in harness.data_dir.rglob("figure-*.png") if "cache" not in p.parts)
    assert len(saved) == 20, saved


async def test_the_background_tick_sweeps_what_a_dead_workers_kernel_left(harness: PipeHarness, tmp_path):
    """Another worker of this host is SIGKILLed while it holds a kernel: its sandbox dies with it, and
    the next background tick of this worker removes its container state, bundle and cgroup."""
    await harness.say("alice", "chat-1", code("print('set up')"))  # this worker's runner is set up
    services = harness.pipe._services
    runner = services.runner
    cid = await asyncio.to_thread(kill_a_worker_holding_a_kernel, runner.config, tmp_path)
    where = (cid, runner.state_dir, runner.bundle_dir, runner.config.cgroup_parent)
    assert "bundle" in leftovers(*where)
    await harness.pipe._tick()
    assert leftovers(*where) == []


async def test_the_background_tick_applies_valves_saved_without_a_message(harness: PipeHarness):
    """An admin saves a shorter kernel idle time: the kernels of this file's chats follow at the next
    tick, not only once a message reaches this worker (the reaper stops this one within seconds)."""
    await harness.say("alice", "chat-1", code("print('set up')"))
    pool = harness.pipe._services.kernels
    [key] = pool.kernels()
    await harness.pipe._tick()  # its expiry is done: the next tick's is not due for half an hour
    harness.stored_valves = {**harness.stored_valves, "kernel_idle_minutes": 0.02}
    await harness.pipe._tick()
    deadline = asyncio.get_running_loop().time() + 30
    while key in pool.kernels():  # the reaper's doing, every quarter of the idle time
        assert asyncio.get_running_loop().time() < deadline, "the kernel kept the old idle time"
        await asyncio.sleep(0.1)
