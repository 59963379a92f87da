"""Nothing heavy on the event loop: a hostile input through the whole path, with the loop's lag measured.

Open WebUI serves every chat of a worker from one event loop: a stall there freezes them all. Each test
sends one hostile input through the installed bundle (dist/code_sessions.py, real storage, real runsc)
after a warm-up message, and measures the loop with tests/support/loop_lag.py's `LoopLag`: no stall
over 100 ms that this process caused (its own CPU time, or a GIL held by one of its threads), and no
unexplained stall over 100 ms above the floor a reference process measured at the same moment.

* `test_a_hostile_csv_freezes_no_chat`: a linked CSV whose cell is 60,000 digits and a letter; naive:
  the preview's float pattern backtracks (quadratic) on the loop, 16-29 s for 20,000 digits.
* `test_a_chart_nested_fifty_thousand_deep_ends_nothing[pipe|tool]`: the kernel saves a chart spec
  nested 50,000 deep; naive: RecursionError out of the answer, its files neither attached nor saved.
* `test_four_figures_of_4_mib_make_a_bounded_embed_off_the_loop`: naive: a 98 MiB embed (each `<`
  escaped to six characters), escaped on the loop for 1.1-1.9 s, sent and saved with the message.
* `test_a_long_hostile_answer_is_rewritten_and_read_back_without_a_stall`: 400 KB of the answer text
  the link rewriter finds hardest, streamed in 7-character pieces, then sent back as the history of the
  next turn (with a line of 100,000 preview captions); naive: a rewriter that rescans what it holds, or
  a pattern that backtracks over the history, on the loop.
"""

from __future__ import annotations

import json

import pytest

from tests.adversarial import bad_days_support as bd
from tests.support.loop_lag import LoopLag
from tests.support.pipe_harness import PipeHarness, code
from tests.support.tool_harness import ToolHarness

pytestmark = [pytest.mark.runsc, pytest.mark.timeout(300)]

KB, MB = 1024, 1024 * 1024


async def warm(harness: PipeHarness, user: str = "alice", chat: str = "chat-1") -> None:
    """A first message: the services, the store and the chat's sandbox are made before the measure."""
    answer = await bd.say(harness, user, chat, code("print('warm')", "ok"))
    assert "warm" in answer, answer


# ---- previews

HOSTILE_CSV = b"n,m\n" + b"1" * 60_000 + b"x,2\n" + b"3,4\n"  # within the 64 KiB a preview reads


async def test_a_hostile_csv_freezes_no_chat(harness: PipeHarness):
    await warm(harness)
    upload = harness.upload("alice", "hostile.csv", HOSTILE_CSV)
    async with LoopLag() as lag:
        answer = await bd.say(
            harness, "alice", "chat-1", code("print('linked')", "See /mnt/data/hostile.csv"), files=[upload]
        )
    print(lag.summary())
    lag.assert_quiet()
    assert "_Preview · 2 rows, 2 columns (n: text, m: int)_" in answer, answer
    assert "| n | m |" in answer, answer


# ---- charts

# The cell's own code writes the chart specs the kernel program saves: plotly's to_json replaced, the
# figures shown (their static pictures are still drawn from the real figure).
SHOW_SPECS = """
import plotly.graph_objects as go
SPECS = {specs}
made = iter(SPECS)
go.Figure.to_json = lambda self, *args, **kwargs: next(made)
for _ in SPECS:
    go.Figure(data=[go.Scatter(y=[1, 3, 2])]).show()
open('/mnt/data/kept.txt', 'w').write('kept')
print('shown', len(SPECS))
"""
DEEP = """['{"data": [' + '[' * 50_000 + ']' * 50_000 + ']}']"""
GOOD = repr(json.dumps({"data": [{"type": "bar", "y": [3, 5]}], "layout": {"title": "votes"}}))
# Four specs of 4 MiB (the per-chart limit) of `<`, and a small one.
BIG = """['{"data": [{"name": "' + '<' * (4 * 1024 * 1024 - 40) + '"}]}'] * 4 + [""" + GOOD + "]"
NESTED_NOTE = "/mnt/data/chart-1.plotly.json is not shown interactively: it is nested too deeply"


@pytest.mark.parametrize("adapter", ["pipe", "tool"])
async def test_a_chart_nested_fifty_thousand_deep_ends_nothing(tmp_path, adapter: str):
    cell = SHOW_SPECS.format(specs=DEEP + " + [" + GOOD + "]")
    if adapter == "pipe":
        harness = PipeHarness(tmp_path / "data", valves={"timeout_seconds": 30})
        try:
            await warm(harness)
            async with LoopLag() as lag:
                answer = await bd.say(
                    harness, "alice", "chat-1", code(cell, "See /mnt/data/kept.txt"), message_id="m2"
                )
            print(lag.summary())
            lag.assert_quiet()
            assert "shown 2" in answer and NESTED_NOTE in answer, answer
            [embed] = harness.embeds
            assert "votes" in embed and embed.count("class=&quot;chart&quot;") == 1
            # The answer ended: its files are attached to the message, the turn is over.
            attached = [item["name"] for item in harness.files.message_files[("chat-1", "m2")]]
            assert "kept.txt" in attached, attached
        finally:
            await harness.aclose()
        return
    tool = ToolHarness(tmp_path / "data", valves={"timeout_seconds": 30})
    try:
        turn = await tool.say("alice", "chat-1", code(cell, "See /mnt/data/kept.txt"))
        [result] = turn.tool_results
        assert "shown 2" in result and NESTED_NOTE in result, result
        assert "votes" in tool.embeds[-1]
    finally:
        await tool.aclose()


async def test_four_figures_of_4_mib_make_a_bounded_embed_off_the_loop(harness: PipeHarness):
    harness.set_valves(timeout_seconds=60, memory_mb=512)
    await warm(harness)
    async with LoopLag() as lag:
        answer = await bd.say(harness, "alice", "chat-1", code(SHOW_SPECS.format(specs=BIG), "ok"))
    print(lag.summary())
    lag.assert_quiet()
    assert "shown 5" in answer, answer
    [embed] = harness.embeds
    assert len(embed.encode()) <= 8 * 1024 * 1024 and "votes" in embed
    left_out = ", ".join(f"/mnt/data/chart-{i}.plotly.json" for i in range(1, 5))
    assert f"{left_out} are not shown interactively: with them, the message's charts would take " in answer


# ---- the answer's rewrite, and the history that brings it back

HOSTILE_LINES = [
    (unit * (100_000 // len(unit)))[:100_000] + " /mnt/data/x"
    for unit in ("](/mnt/data/x ", "`", "[", "<a", "[ /mnt/data/x", "\\")
]


async def test_a_long_hostile_answer_is_rewritten_and_read_back_without_a_stall(harness: PipeHarness):
    await warm(harness)
    made = "open('/mnt/data/x', 'w').write('x')"
    reply = "Here: " + " ".join(HOSTILE_LINES)  # one line: the scripted model answers a reply's line
    async with LoopLag() as lag:
        answer = await bd.say(harness, "alice", "chat-1", code(made, reply))
    print(lag.summary())
    lag.assert_quiet()
    assert len(answer) > 600_000 and "/mnt/data/x" not in answer.split("</details>")[-1], answer[-2000:]
    history = [
        {"role": "user", "content": code(made, reply)},
        {"role": "assistant", "content": answer + "\n\n" + "_Preview · " * 100_000 + "\n"},
    ]
    async with LoopLag() as lag:
        again = await bd.say(harness, "alice", "chat-1", code("print('read back')", "ok"), history=history)
    print(lag.summary())
    lag.assert_quiet()
    assert "read back" in again, again
