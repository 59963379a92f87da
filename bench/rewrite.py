"""Section 4: link rewriting of a 100 KB answer that names 1,000 session files, and of 1 MB lines.

* text: one `References` scan of the answer, its `paths`, and `rewrite` with the targets already
  resolved: the scan and substitution, what the <= 20 ms target is about;
* streaming: the same answer through `StreamingRewriter` in 40-character chunks (how Open WebUI's
  stream arrives), resolver a dict lookup;
* full: `ChatSession.rewrite`, which also publishes each file (a copy and an index row per file) on
  the first call and finds the existing links on later calls;
* pathological: a 1 MB answer on one line (no path at all, base64-like text, and `](/mnt/data/x `
  repeated: 71,429 paths), rewritten (a) whole and (b) streamed in 4-character pieces through the sync
  path (`push`, `resolve_pending` when something is pending, `flush`), each against <= 50 ms. Streaming
  250,000 pieces costs at least 250,000 Python calls: `push_floor` is a loop calling a method that does
  nothing with each piece, measured in the same run, the least any streaming rewriter could cost. For
  the whole text, `substitution_floor` is one `re.sub` with a fixed replacement of the same length as
  the rewriter's link (C from start to end, no judgement of any reference): the least a rewriter that
  writes that output could cost. Latency: `first_out_after_chars` is how many characters of the line
  had been pushed when the first text came out, and `most_held_chars` the most pushed but not out yet
  ('no path': the batching's hold-back, which grows to an eighth of the line so far, at most 4 KB).
"""

from __future__ import annotations

import random
import re
import time
from typing import Any

from engine import Engine, References, StreamingRewriter, Target, find_paths

from ._common import Context, summary

SECTION = "rewrite"
TARGET_MS = 20.0
PATHOLOGICAL_BYTES = 1_000_000
PATHOLOGICAL_TARGET_MS = 50.0
PIECE_CHARS = 4
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


def pathological_answers(size: int = PATHOLOGICAL_BYTES) -> dict[str, str]:
    """One-line answers of `size` characters that made the old rewriter quadratic (or are just large)."""
    rng = random.Random(9)
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    return {
        "no path": (FILLER + " ") * (size // (len(FILLER) + 1)) + "x" * (size % (len(FILLER) + 1)),
        "base64-like": "".join(rng.choices(alphabet, k=size)),
        "](/mnt/data/x ": ("](/mnt/data/x " * (size // 14 + 1))[:size],
    }


class _Floor:
    """The least a streaming rewriter can cost per piece: a method call that does nothing."""

    pending = ()

    def push(self, chunk: str) -> str:
        return ""


async def _stream_sync_path(pieces: list[str], known: dict[str, Target | None]) -> str:
    async def resolve(path: str) -> Target | None:
        return known.get(path)

    rewriter = StreamingRewriter(resolve)
    out: list[str] = []
    for piece in pieces:
        out.append(rewriter.push(piece))
        if rewriter.pending:
            out.append(await rewriter.resolve_pending())
    out.append(await rewriter.flush())
    return "".join(out)


async def _latency(pieces: list[str]) -> dict[str, int]:
    """Characters pushed when the first text came out, and the most pushed but not out yet (in the
    answer's characters: no path names a file here, so the output is the text as written)."""
    rewriter = StreamingRewriter(_no_file)
    pushed = out = most = 0
    first = -1
    for piece in pieces:
        pushed += len(piece)
        out += len(rewriter.push(piece))
        if rewriter.pending:
            out += len(await rewriter.resolve_pending())
        if out and first < 0:
            first = pushed
        most = max(most, pushed - out)
    return {"first_out_after_chars": first, "most_held_chars": most}


async def _no_file(path: str) -> Target | None:
    return None


_SUBSTITUTED = re.compile(r"/mnt/data/[^\s<>()\[\]{}`\"'|*]+")


def _push_floor(pieces: list[str]) -> str:
    rewriter = _Floor()
    out: list[str] = []
    for piece in pieces:
        out.append(rewriter.push(piece))
        if rewriter.pending:
            out.append("")
    return "".join(out)


async def _pathological(ctx: Context) -> dict[str, Any]:
    size = 100_000 if ctx.quick else PATHOLOGICAL_BYTES
    reps = 2 if ctx.quick else 5
    known: dict[str, Target | None] = {"x": Target("/cache/functions/code_sessions/" + "0" * 32 + "/x", "x")}
    cases: dict[str, Any] = {}
    floor_t: list[float] = []
    link = "[x](" + known["x"].url + ")"
    for name, text in pathological_answers(size).items():
        pieces = [text[i : i + PIECE_CHARS] for i in range(0, len(text), PIECE_CHARS)]
        plain_t, stream_t, sub_t = [], [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            references = References(text)
            references.paths  # noqa: B018 (what the engine publishes)
            whole = references.rewrite(known)
            t1 = time.perf_counter()
            streamed = await _stream_sync_path(pieces, known)
            t2 = time.perf_counter()
            _push_floor(pieces)
            t3 = time.perf_counter()
            substituted = _SUBSTITUTED.sub(link, text)
            t4 = time.perf_counter()
            plain_t.append(t1 - t0)
            stream_t.append(t2 - t1)
            floor_t.append(t3 - t2)
            sub_t.append(t4 - t3)
        if streamed != whole:
            raise RuntimeError(f"{name}: the streamed rewrite differs from the whole-text rewrite")
        if len(substituted) != len(whole):
            raise RuntimeError(f"{name}: the floor writes {len(substituted)} characters, not {len(whole)}")
        case = cases[name] = {
            "plain": summary(plain_t),
            f"streamed_{PIECE_CHARS}_char_pieces": summary(stream_t),
            "substitution_floor": summary(sub_t),
            **await _latency(pieces),
        }
        whole_ms = case["plain"]["median_ms"]
        streamed_ms = case[f"streamed_{PIECE_CHARS}_char_pieces"]["median_ms"]
        floor_ms = case["substitution_floor"]["median_ms"]
        ctx.log(
            f"rewrite, {size // 1000} KB line, {name}: whole {whole_ms:.1f} ms, "
            f"streamed {streamed_ms:.1f} ms (target <= {PATHOLOGICAL_TARGET_MS:g} ms each); "
            f"one re.sub {floor_ms:.1f} ms; first text out after {case['first_out_after_chars']} "
            f"characters, at most {case['most_held_chars']} held"
        )
    floor = summary(floor_t)
    ctx.log(
        f"rewrite, {len(pieces):,} pieces to a no-op push (streaming's floor): {floor['median_ms']:.1f} ms"
    )
    return {
        "bytes": size,
        "pieces": len(pieces),
        "piece_chars": PIECE_CHARS,
        "cases": cases,
        "push_floor": floor,
        "target_ms": PATHOLOGICAL_TARGET_MS,
    }


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
        service = Engine(store, ctx.runner())
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
        "pathological": await _pathological(ctx),
    }
