"""The conversation loop with a scripted model and a stand-in chat (no sandbox: see test_service.py)."""

import json

from engine import StreamingRewriter, Target, find_paths, rewrite
from engine.loop import RUN_CODE_TOOL, LoopOptions, converse
from engine.service import StepResult
from engine.sse import ModelError, TextDelta, ToolCall
from runner import Outcome, RunResult

LINK = Target(url="/cache/functions/cs/TOKEN/out.csv", name="out.csv")


class StandInChat:
    """Records the code it is asked to run; every run 'saves' out.csv."""

    def __init__(self) -> None:
        self.ran: list[tuple[str, str]] = []

    async def run(self, code: str, language: str, *, waiting: object = None) -> StepResult:
        self.ran.append((language, code))
        result = RunResult(
            outcome=Outcome.OK,
            exit_code=0,
            stdout="hello\n",
            stderr="",
            stdout_truncated=False,
            stderr_truncated=False,
            duration_s=0.2,
            reason=None,
        )
        return StepResult(language, code, run=result)

    async def resolve(self, path: str):
        return LINK if path == "out.csv" else None

    async def rewrite(self, text: str, *, inline_images: bool = True) -> str:
        targets = {p: await self.resolve(p) for p in find_paths(text)}
        return rewrite(text, targets, inline_images=inline_images)

    def unlinked_notes(self) -> list[str]:
        return []

    shown: tuple[str, ...] = ()  # no table among the files the answer names: no preview

    async def hand_over(self, paths, *, attachments: bool) -> str:
        return ""

    def streaming_rewriter(self) -> StreamingRewriter:
        return StreamingRewriter(self.resolve)


def scripted(*turns):
    """A ModelCall answering each call with the next list of events; records what it was sent."""
    calls = []

    async def call(messages, tools):
        calls.append((json.loads(json.dumps(messages)), tools))
        for event in turns[len(calls) - 1]:
            yield event

    return call, calls


async def collect(gen) -> str:
    return "".join([piece async for piece in gen])


async def no_status(text, done, *, hidden=False):
    pass


async def test_tool_call_runs_code_and_feeds_the_result_back():
    chat = StandInChat()
    model, calls = scripted(
        [
            TextDelta("Let me compute."),
            ToolCall("c1", "run_code", '{"language": "python", "code": "print(1)"}'),
        ],
        [TextDelta("Done: /mnt/"), TextDelta("data/out.csv")],
    )
    messages = [{"role": "user", "content": "go"}]
    answer = await collect(converse(chat, messages, model, LoopOptions(), no_status))
    assert chat.ran == [("python", "print(1)")]
    assert calls[0][1] == [RUN_CODE_TOOL]
    second_request = calls[1][0]
    assert second_request[-2]["tool_calls"][0]["function"]["name"] == "run_code"
    assert second_request[-1] == {
        "role": "tool",
        "tool_call_id": "c1",
        "content": second_request[-1]["content"],
    }
    assert "hello" in second_request[-1]["content"]
    assert answer.startswith("Let me compute.")
    assert "<details>" in answer and "print(1)" in answer
    assert answer.endswith(f"Done: [out.csv]({LINK.url})")


async def test_step_limit_stops_running_and_asks_for_an_answer():
    chat = StandInChat()
    call = ToolCall("c", "run_code", '{"code": "x"}')
    model, calls = scripted([call], [call], [TextDelta("final")])
    answer = await collect(converse(chat, [], model, LoopOptions(max_steps=1), no_status))
    assert len(chat.ran) == 1
    assert "step limit" in calls[2][0][-1]["content"]
    assert calls[2][1] is None  # no tools offered once the budget is spent
    assert answer.endswith("final")


async def test_bad_arguments_are_reported_to_the_model_not_run():
    chat = StandInChat()
    model, calls = scripted([ToolCall("c", "run_code", "{not json")], [TextDelta("sorry")])
    await collect(converse(chat, [], model, LoopOptions(), no_status))
    assert chat.ran == []
    assert "not valid JSON" in calls[1][0][-1]["content"]


async def test_fenced_mode_runs_tagged_blocks_and_continues():
    chat = StandInChat()
    model, calls = scripted(
        [TextDelta("```python\nprint(2)\n```\n```text\nnot code\n```")],
        [TextDelta("All done.")],
    )
    answer = await collect(converse(chat, [], model, LoopOptions(tool_mode=False), no_status))
    assert chat.ran == [("python", "print(2)\n")]
    assert calls[0][1] is None
    assert calls[1][0][-1]["role"] == "user" and "hello" in calls[1][0][-1]["content"]
    assert answer.endswith("All done.")


async def test_model_error_is_shown_and_ends_the_answer():
    chat = StandInChat()
    model, _ = scripted([TextDelta("partial"), ModelError("rate limited")])
    answer = await collect(converse(chat, [], model, LoopOptions(), no_status))
    assert "partial" in answer and "rate limited" in answer


async def test_an_answer_that_comes_in_one_large_piece_is_scanned_off_the_event_loop(monkeypatch):
    # A base model that does not stream sends its whole answer as one piece: scanning it (and looking
    # for code blocks in it) grows with its length, so it must not run on Open WebUI's event loop.
    import threading

    import engine.loop as loop_module

    where: dict[str, list[bool]] = {"push": [], "blocks": []}
    loop_thread = threading.get_ident()
    real_push, real_blocks = StreamingRewriter.push, loop_module.runnable_blocks

    def push(self, piece):
        where["push"].append(threading.get_ident() == loop_thread)
        return real_push(self, piece)

    def blocks(text):
        where["blocks"].append(threading.get_ident() == loop_thread)
        return real_blocks(text)

    monkeypatch.setattr(StreamingRewriter, "push", push)
    monkeypatch.setattr(loop_module, "runnable_blocks", blocks)
    big = "x " * 200_000 + "see /mnt/data/out.csv"
    model, _ = scripted([TextDelta("small piece, "), TextDelta(big)])
    chat = StandInChat()
    answer = await collect(converse(chat, [], model, LoopOptions(tool_mode=False), no_status))
    assert answer.endswith(f"see [out.csv]({LINK.url})") and chat.ran == []
    assert where == {"push": [True, False], "blocks": [False]}
