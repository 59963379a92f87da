"""The Filter's `stream` hook on its own (the installed bundle, no sandbox): odd chunks pass through
untouched, a path split across chunks becomes one link, and the finish releases what was held."""

from __future__ import annotations

import copy
import importlib
import types
from pathlib import Path

from tests.support.pipe_harness import load_like_open_webui

FILTER_BUNDLE = Path(__file__).resolve().parents[2] / "dist" / "code_sessions_filter.py"


def _filter_with_answer(message_id: str):
    module = load_like_open_webui(FILTER_BUNDLE.read_text())
    engine = importlib.import_module(module._CS_PACKAGE + ".engine")
    hook = module.Filter()

    async def resolve(path: str):
        if path == "report.csv":
            return engine.Target(url="/api/v1/files/x/content", name="report.csv", is_image=False)
        return None

    turns = engine.Turns(
        None
    )  # what an inlet leaves: the answer's turn, of which the stream uses the rewriter
    turns._held[message_id] = types.SimpleNamespace(rewriter=engine.StreamingRewriter(resolve))
    hook._adapter._turns = turns
    return hook


def _chunk(content: object = None, finish: str | None = None) -> dict:
    delta = {} if content is None else {"content": content}
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


async def test_a_path_split_across_chunks_becomes_one_link_and_the_finish_releases_the_rest():
    hook = _filter_with_answer("m1")
    metadata = {"message_id": "m1"}
    out = []
    for piece in ("See /mnt/da", "ta/report", ".csv and /mnt/data/missing.txt", " now."):
        event = await hook.stream(_chunk(piece), __metadata__=metadata)
        out.append(event["choices"][0]["delta"]["content"])
    last = await hook.stream(_chunk(finish="stop"), __metadata__=metadata)
    out.append(last["choices"][0]["delta"].get("content", ""))
    assert "".join(out) == "See [report.csv](/api/v1/files/x/content) and /mnt/data/missing.txt now."


async def test_odd_chunks_and_other_answers_pass_through_untouched():
    hook = _filter_with_answer("m1")
    odd = [
        {"choices": None},
        {"choices": ["not a dict"]},
        {"choices": [{"delta": "a string"}]},
        {"choices": [{"delta": {"content": 42}}]},
        {"choices": [{"delta": {"content": None}, "finish_reason": None}]},
        {"type": "response.output_text.delta", "delta": "/mnt/data/report.csv"},
        "not even a dict",
    ]
    for event in odd:
        before = copy.deepcopy(event)
        assert await hook.stream(event, __metadata__={"message_id": "m1"}) == before
    unchanged = _chunk("/mnt/data/report.csv", finish="stop")
    for metadata in ({"message_id": "m2"}, None):  # an answer the inlet did not take, or no metadata
        other = copy.deepcopy(unchanged)
        assert await hook.stream(other, __metadata__=metadata) == unchanged
