"""Section 9: the Filter's `stream` hook, what Open WebUI calls for every chunk of an answer with the Tool.

A 100 KB answer naming 1,000 session files (section 4's), as Open WebUI hands it to the hook: one
chat.completion.chunk dict per 7-character piece (the scripted model's pieces; real models send a few
characters each), then the chunk with the finish_reason. Measured against a floor in the same run: the
least a hook using the engine's `StreamingRewriter` could do with each chunk, one coroutine that reads
the delta's text, feeds it and writes back what it releases, with no lookup and no checks. The ratio is
what the hook adds on top (finding the answer by its message id, checking what a hostile or odd
upstream sends); both outputs must be the same rewritten answer.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from engine import StreamingRewriter, Target, Turns
from functions.code_sessions_filter import Filter

from ._common import Context, summary
from ._tables import ms, table
from .rewrite import _check, _targets, make_answer

SECTION = "filter_stream"
PIECE_CHARS = 7
TARGET_RATIO = 1.5  # the hook may add half of the rewriter's own cost, no more


def _events(text: str) -> list[dict]:
    chunks = [
        {"choices": [{"index": 0, "delta": {"content": text[i : i + PIECE_CHARS]}, "finish_reason": None}]}
        for i in range(0, len(text), PIECE_CHARS)
    ]
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    return chunks


async def _minimal(rewriter: StreamingRewriter, event: dict) -> dict:
    # The least a hook using the engine's rewriter can do with a chunk: no lookup, no checks.
    choice = event["choices"][0]
    delta = choice["delta"]
    if "content" in delta:
        text = rewriter.push(delta["content"])
        if rewriter.pending:
            text += await rewriter.resolve_pending()
        delta["content"] = text
    if choice["finish_reason"]:
        delta["content"] = delta.get("content", "") + await rewriter.flush()
    return event


async def _floor(events: list[dict], resolve: Any) -> str:
    rewriter = StreamingRewriter(resolve)
    out = []
    for event in events:
        event = await _minimal(rewriter, event)
        out.append(event["choices"][0]["delta"].get("content") or "")
    return "".join(out)


def _held(message_id: str, rewriter: StreamingRewriter) -> Turns:
    """The turns of a process whose Filter inlet began the answer `message_id` (its rewriter alone)."""
    turns = Turns(None)  # type: ignore[arg-type]  # the stream needs no services
    turns._held[message_id] = SimpleNamespace(rewriter=rewriter)  # type: ignore[assignment]
    return turns


async def _hook(hook: Filter, events: list[dict], resolve: Any) -> str:
    hook._adapter._turns = _held("m", StreamingRewriter(resolve))  # what the inlet leaves
    metadata = {"message_id": "m"}
    out = []
    for event in events:
        event = await hook.stream(event, __metadata__=metadata)
        out.append(event["choices"][0]["delta"].get("content") or "")
    return "".join(out)


async def run(ctx: Context) -> dict[str, Any]:
    paths = 100 if ctx.quick else 1000
    size = 10_000 if ctx.quick else 100_000
    reps = 5 if ctx.quick else 30
    text, names = make_answer(paths, size)
    known = _targets(names)

    async def resolve(path: str) -> Target | None:
        return known.get(path)

    hook = Filter()
    floor_t, hook_t, ratios = [], [], []
    for _ in range(reps):
        events, again = _events(text), _events(text)  # parsed by Open WebUI before the hook: not timed
        t0 = time.perf_counter()
        bare = await _floor(again, resolve)
        t1 = time.perf_counter()
        hooked = await _hook(hook, events, resolve)
        t2 = time.perf_counter()
        floor_t.append(t1 - t0)
        hook_t.append(t2 - t1)
        ratios.append((t2 - t1) / (t1 - t0))
    if hooked != bare:
        raise RuntimeError("the stream hook's answer differs from the rewriter's")
    _check(hooked, names)
    result = {
        "answer_bytes": len(text.encode()),
        "paths": len(names),
        "chunks": len(events),
        "piece_chars": PIECE_CHARS,
        "floor": summary(floor_t),
        "hook": summary(hook_t),
        "ratio_of_medians": summary(hook_t)["median_ms"] / summary(floor_t)["median_ms"],
        "target_ratio": TARGET_RATIO,
    }
    ctx.log(
        f"filter stream: {result['hook']['median_ms']:.1f} ms for {result['chunks']:,} chunks, "
        f"floor {result['floor']['median_ms']:.1f} ms, x{result['ratio_of_medians']:.2f}"
    )
    return result


def render(r: dict[str, Any]) -> str:

    if "hook" not in r:
        return "(no data)"
    rows = [
        [f"floor: a minimal rewriting hook, {r['chunks']:,} chunks", ms(r["floor"]), ""],
        ["Filter.stream over the same chunks", ms(r["hook"]), ""],
        ["ratio of medians", f"x{r['ratio_of_medians']:.2f}", f"<= {r['target_ratio']:g}"],
    ]
    head = (
        f"an answer of {r['answer_bytes'] / 1000:.0f} KB naming {r['paths']} files, "
        f"{r['piece_chars']}-character chunks"
    )
    return head + "\n" + table(["", "ms", "target"], rows, right=(1,))
