"""Section 4: link rewriting of a 100 KB answer that names 1,000 session files.

* text: one `References` scan of the answer, its `paths`, and `rewrite` with the targets already
  resolved: the scan and substitution, what the <= 20 ms target is about;
* streaming: the same answer through `StreamingRewriter` in 40-character chunks (how Open WebUI's
  stream arrives), resolver a dict lookup;
* full: `ChatSession.rewrite`, which also publishes each file (a copy and an index row per file) on
  the first call and finds the existing links on later calls.
"""

from __future__ import annotations

import random
import time
from typing import Any

from engine import CodeSessions
from engine.rewrite import References, StreamingRewriter, Target, find_paths
from runner import Limits

from ._common import Context, summary

SECTION = "rewrite"
TARGET_MS = 20.0
PATHS = 1000
ANSWER_BYTES = 100_000
FILLER = (
    "The analysis grouped the rows by region and quarter, then compared each total with the previous "
    "period to find the largest changes."
)


def _path(i: int) -> str:
    kind = i % 10
    if kind < 2:
        return f"charts/plot_{i:04}.png"
    if kind < 4:
        return f"reports/q{i % 4 + 1}/summary_{i:04}.csv"
    return f"out/result_{i:04}.txt"


def make_answer(paths: int = PATHS, size: int = ANSWER_BYTES, seed: int = 6) -> tuple[str, list[str]]:
    """A markdown answer of about `size` bytes naming each of `paths` files once, in every form a
    model writes (bare, sandbox:, markdown links, images), with code blocks that must stay as they are."""
    rng = random.Random(seed)
    names = [_path(i) for i in range(paths)]
    filler = FILLER.split(" ")
    lines: list[str] = ["# Results", ""]
    for i, name in enumerate(names):
        form = i % 5
        if form == 0:
            ref = f"/mnt/data/{name}"
        elif form == 1:
            ref = f"sandbox:/mnt/data/{name}"
        elif form == 2:
            ref = f"[{name.rsplit('/', 1)[-1]}](sandbox:/mnt/data/{name})"
        elif form == 3:
            ref = f"![chart {i}](/mnt/data/{name})" if name.endswith(".png") else f"[file](/mnt/data/{name})"
        else:
            ref = f"`{name}` is at /mnt/data/{name}."
        words = " ".join(rng.choice(filler) for _ in range(rng.randint(4, 10)))
        lines.append(f"{i + 1}. {words} {ref}")
        if i % 100 == 99:
            lines += ["", "```python", f"open('/mnt/data/{name}').read()  # code: never rewritten", "```", ""]
    text = "\n".join(lines) + "\n"
    pad = size - len(text.encode())
    if pad > 0:
        sentence = " ".join(filler) + " "
        text += "\n" + (sentence * (pad // len(sentence) + 1))[:pad] + "\n"
    return text, names


def _targets(names: list[str]) -> dict[str, Target | None]:
    return {
        n: Target(f"/cache/functions/code_sessions/{i:032}/{n.rsplit('/', 1)[-1]}", n, n.endswith(".png"))
        for i, n in enumerate(names)
    }


def _check(out: str, names: list[str]) -> None:
    left = find_paths(out)  # every reference in prose must have become a link
    links = out.count("/cache/functions/")
    if left or links < len(names):
        raise RuntimeError(f"{len(left)} paths left as written (e.g. {left[:3]}), {links} links made")


async def _streaming(text: str, known: dict[str, Target | None]) -> str:
    async def resolve(path: str) -> Target | None:
        return known.get(path)

    rewriter = StreamingRewriter(resolve)
    parts = [await rewriter.feed(text[i : i + 40]) for i in range(0, len(text), 40)]
    parts.append(await rewriter.flush())
    return "".join(parts)


async def run(ctx: Context) -> dict[str, Any]:
    paths = 100 if ctx.quick else PATHS
    size = 10_000 if ctx.quick else ANSWER_BYTES
    reps = 5 if ctx.quick else 50
    text, names = make_answer(paths, size)
    found = find_paths(text)
    if sorted(found) != sorted(names):
        raise RuntimeError(f"find_paths found {len(found)} paths, expected {len(names)}")
    targets = _targets(names)

    scan_t, sub_t, total_t, stream_t = [], [], [], []
    for i in range(reps):
        # As the engine does it: one scan of the answer, then its paths (to publish), then the
        # substitution with the resolved targets.
        answer = f"{text}\n(answer {i})\n"
        t0 = time.perf_counter()
        references = References(answer)
        found = references.paths
        t1 = time.perf_counter()
        out = references.rewrite(targets)
        t2 = time.perf_counter()
        scan_t.append(t1 - t0)
        sub_t.append(t2 - t1)
        total_t.append(t2 - t0)
        t3 = time.perf_counter()
        streamed = await _streaming(answer, targets)
        stream_t.append(time.perf_counter() - t3)
    _check(out, names)
    _check(streamed, names)

    full: dict[str, Any] = {}
    async with ctx.store("rewrite") as store:
        service = CodeSessions(store, ctx.runner(), Limits())
        chat = await service.chat("rewrite-user", "rewrite-chat")
        for name in names:
            await chat.session.files.write(name, b"a,b\n1,2\n" if name.endswith(".csv") else b"x" * 64)
        t = time.perf_counter()
        out = await chat.rewrite(text)
        full["first_call_publishes"] = summary([time.perf_counter() - t])
        _check(out, names)
        again = []
        for i in range(2 if ctx.quick else 5):
            t = time.perf_counter()
            out = await chat.rewrite(f"{text}\n(again {i})\n")
            again.append(time.perf_counter() - t)
        _check(out, names)
        full["later_calls_reuse_links"] = summary(again)
    return {
        "answer_bytes": len(text.encode()),
        "paths": len(names),
        "text": summary(total_t),
        "text_find_paths": summary(scan_t),
        "text_substitute": summary(sub_t),
        "streaming_40_char_chunks": summary(stream_t),
        "chat_session_rewrite": full,
        "target_ms": TARGET_MS,
    }
