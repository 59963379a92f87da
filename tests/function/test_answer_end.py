"""An answer's end always happens, in both forms (the Pipe; the Tool with the Filter), driven in-process
with real storage and real gVisor: when the answer fails (an exception, in a chart's making or the
outlet), is stopped (Open WebUI closes the Pipe's stream, or cancels the task mid-run, when the user
presses stop) or is a command answered without the model, its status settles, the files its runs saved
are attached to its message, and its state is saved for the conversation's branches (engine/turn.py
`Turn.end`, from a `finally`)."""

from __future__ import annotations

import asyncio
import importlib
import time
from collections.abc import Callable

import pytest

from tests.support.pipe_harness import PipeHarness, code, settle
from tests.support.tool_harness import ToolHarness

pytestmark = pytest.mark.runsc

WRITE = "open('/mnt/data/out.txt', 'w').write('kept')"
WRITE_THEN_WAIT = WRITE + "\nimport time\ntime.sleep(60)"
TREE = {"id": "u1", "parentId": None}
SECOND = {"id": "u2", "parentId": "a1"}


@pytest.fixture
async def pipe(tmp_path) -> PipeHarness:
    harness = PipeHarness(tmp_path / "data", valves={"timeout_seconds": 90})
    yield harness
    await harness.aclose()


@pytest.fixture
async def tool(tmp_path) -> ToolHarness:
    harness = ToolHarness(tmp_path / "data", valves={"timeout_seconds": 90})
    yield harness
    await harness.aclose()


def attached(harness: PipeHarness | ToolHarness, chat_id: str, message_id: str) -> list[str]:
    return [item["name"] for item in harness.files.message_files.get((chat_id, message_id), [])]


async def state_saved(adapter, user_id: str, chat_id: str, message_id: str) -> bool:
    """Whether the answer's state was saved for a later branch (what its end leaves to the background)."""
    await settle(adapter)
    session = await adapter._services.store.session(user_id, chat_id)
    async with session.lock():
        return await session.history.has(message_id)


async def assert_ended(harness: PipeHarness | ToolHarness, adapter, events: list[dict]) -> None:
    """Answer a1 of alice's chat-1 ended: the file its run wrote is attached to it, its last status is
    done, and its state is saved."""
    assert attached(harness, "chat-1", "a1") == ["out.txt"]
    assert settled(events), events
    assert await state_saved(adapter, "alice", "chat-1", "a1")


def settled(events: list[dict]) -> bool:
    statuses = [e["data"] for e in events if e.get("type") == "status"]
    return bool(statuses) and statuses[-1]["done"] is True


async def until(condition: Callable[[], bool], what: str, timeout: float = 60) -> None:
    """Wait for something a sandboxed run does (it reports nothing while it runs)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout:.0f} s"
        await asyncio.sleep(0.05)


def written(harness: PipeHarness | ToolHarness, name: str) -> Callable[[], bool]:
    return lambda: any((harness.sessions_root / "sessions").glob(f"*/*/{name}"))


def failing(module, dotted: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make one function of the loaded bundle raise (another engineer's defect made charts raise; any
    exception in the middle of an answer must end it the same way)."""
    where, _, name = dotted.rpartition(".")
    # A package's module of the bundle, or ("") the file's own body (a Filter's, a Tool's).
    target = importlib.import_module(f"{module._CS_PACKAGE}.{where}") if where else module

    def broken(*args, **kwargs):
        raise RuntimeError("broken on purpose")

    monkeypatch.setattr(target, name, broken)


# ---- the Pipe ------------------------------------------------------------------------------------------


async def test_the_pipe_ends_an_answer_that_raises(pipe: PipeHarness, monkeypatch: pytest.MonkeyPatch):
    failing(pipe.module, "engine.service.charts_of", monkeypatch)  # after the run, in the middle of the step
    with pytest.raises(RuntimeError, match="broken on purpose"):
        await pipe.say("alice", "chat-1", code(WRITE), message_id="a1", user_message=TREE)
    await assert_ended(pipe, pipe.pipe, pipe.events)


async def test_the_pipe_ends_an_answer_whose_stream_is_closed(pipe: PipeHarness):
    """Open WebUI closes the stream of an answer the user stopped: the generator gets GeneratorExit."""
    stream = await pipe.start("alice", "chat-1", code(WRITE, "Done."), message_id="a1", user_message=TREE)
    async for piece in stream:
        if "<details>" in piece:  # the run's block: the run is over, the model's words are next
            break
    await stream.aclose()
    await assert_ended(pipe, pipe.pipe, pipe.events)


async def test_the_pipe_ends_an_answer_cancelled_mid_run(pipe: PipeHarness):
    """Open WebUI cancels the task of a streamed answer the user stopped: CancelledError mid-run."""
    stream = await pipe.start("alice", "chat-1", code(WRITE_THEN_WAIT), message_id="a1", user_message=TREE)
    reading = asyncio.ensure_future(_read(stream))
    await until(written(pipe, "out.txt"), "the run's file")
    reading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading
    await assert_ended(pipe, pipe.pipe, pipe.events)


async def _read(stream) -> str:
    return "".join([piece async for piece in stream])


async def test_the_pipe_ends_a_command_whose_answer_waited_for_the_chat(pipe: PipeHarness):
    """!save-to-knowledge is answered without the model; it waited for the chat's previous step, and
    that wait's status must not stay in progress."""
    await pipe.say("alice", "chat-1", code(WRITE, "ok"), message_id="a1", user_message=TREE)
    session = await pipe.pipe._services.store.session("alice", "chat-1")
    async with session.lock():  # another step of the chat holds it as the command arrives
        command = asyncio.ensure_future(
            pipe.say("alice", "chat-1", "!save-to-knowledge", message_id="a2", user_message=SECOND)
        )
        await until(lambda: any("Waiting" in str(e.get("data")) for e in pipe.events), "the wait")
    said = await command
    assert "!save-to-knowledge" in said
    assert settled(pipe.events), pipe.events


# ---- the Tool and the Filter -------------------------------------------------------------------------


async def test_the_tool_and_filter_end_an_answer_whose_outlet_raises(
    tool: ToolHarness, monkeypatch: pytest.MonkeyPatch
):
    failing(tool.filter_module, "engine.turn.answer_previews", monkeypatch)
    with pytest.raises(RuntimeError, match="broken on purpose"):
        await tool.say("alice", "chat-1", code(WRITE, "Done."), message_id="a1", user_message=TREE)
    assert attached(tool, "chat-1", "a1") == ["out.txt"]
    assert await state_saved(tool.filter._adapter, "alice", "chat-1", "a1")


async def test_the_tool_and_filter_end_an_answer_whose_run_raises(
    tool: ToolHarness, monkeypatch: pytest.MonkeyPatch
):
    """A run that raises after the code ran (the charts, here): Open WebUI gives the model the error,
    the answer goes on, and its end still attaches what the run saved and saves its state."""
    failing(tool.tool_module, "engine.service.charts_of", monkeypatch)
    turn = await tool.say("alice", "chat-1", code(WRITE, "Done."), message_id="a1", user_message=TREE)
    assert "broken on purpose" in turn.tool_results[0]
    await assert_ended(tool, tool.filter._adapter, turn.events)


async def test_the_tool_and_filter_end_an_answer_cancelled_mid_run(tool: ToolHarness):
    """The user stops a streamed answer while the Tool runs: Open WebUI cancels the task and calls no
    outlet, so the Tool ends the answer."""
    answer = asyncio.ensure_future(
        tool.say("alice", "chat-1", code(WRITE_THEN_WAIT), message_id="a1", user_message=TREE)
    )
    await until(written(tool, "out.txt"), "the run's file")
    answer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await answer
    await assert_ended(tool, tool.tools._adapter, tool.events)


async def test_the_filter_settles_a_command_that_waited_for_the_chat(tool: ToolHarness):
    await tool.say("alice", "chat-1", code(WRITE, "ok"), message_id="a1", user_message=TREE)
    session = await tool.filter._adapter._services.store.session("alice", "chat-1")
    async with session.lock():
        command = asyncio.ensure_future(
            tool.say("alice", "chat-1", "!save-to-knowledge", message_id="a2", user_message=SECOND)
        )
        await until(lambda: any("Waiting" in str(e.get("data")) for e in tool.events), "the wait")
    turn = await command
    assert settled(turn.events), turn.events
