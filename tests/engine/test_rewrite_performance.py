"""Rewriting is linear in the answer's length, whole or streamed: it runs on Open WebUI's event loop.

The old rewriter scanned back to the start of the line from every path and every `](`, and rescanned its
whole held text on every streamed piece: 200 KB of `](/mnt/data/x ` took about 10 s, a 2 MB line streamed
in 4-character pieces about 27 s. The bounds here are CPU time (what this process spent, not what other
processes on the machine took), at least 10x below that and generous for a slow machine.
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import time

import pytest

from engine import References, StreamingRewriter, Target
from engine.scan import Scan

SIZE = 200_000
TARGETS = {"x": Target(url="/cache/functions/cs/T/x", name="x")}


def _json(size: int) -> str:
    rng = random.Random(3)
    items = []
    while sum(map(len, items)) < size:
        item = {"id": rng.randint(0, 10**6), "tags": ["a", "b"], "v": [rng.random(), [1, 2]], "p": "a/b"}
        items.append(json.dumps(item, separators=(",", ":")))
    return "[" + ",".join(items) + "]"


def _line(unit: str, size: int = SIZE) -> str:
    # One line of `unit`, ending with a path so that no shortcut for answers without paths applies.
    return (unit * (size // len(unit) + 1))[:size] + " /mnt/data/x"


PATHOLOGICAL = {
    "no path": ("The analysis grouped the rows by region and quarter. " * (SIZE // 50))[:SIZE],
    "base64": base64.b64encode(random.Random(1).randbytes(SIZE * 3 // 4)).decode() + " /mnt/data/x",
    "links to a path": _line("](/mnt/data/x "),
    "openers": _line("["),
    "closers": _line("]("),
    "backticks": _line("`"),
    "lone backticks": _line("` a"),
    "angle brackets": _line("<"),
    "tag starts": _line("<a"),
    "comment starts": _line("<!--"),
    "empty links": _line("[]("),
    "paths in a link text": _line("[ /mnt/data/x"),
    "paths in code spans": _line("`` /mnt/data/x `"),
    "backslashes": _line("\\"),
    "minified json": _json(SIZE) + " /mnt/data/x",
    "short lines": _line("a\n"),
}


def _cpu(function) -> float:
    start = time.process_time()
    function()
    return time.process_time() - start


def _rewrite_whole(text: str) -> str:
    references = References(text)
    references.paths  # noqa: B018 (what the caller publishes)
    return references.rewrite(TARGETS)


async def _resolve(path: str) -> Target | None:
    return TARGETS.get(path)


def _stream(text: str, size: int = 4) -> str:
    """`text` through the rewriter as the conversation loop drives it: push, resolve what it waits for."""

    async def run() -> str:
        rewriter = StreamingRewriter(_resolve)
        pieces: list[str] = []
        for i in range(0, len(text), size):
            pieces.append(rewriter.push(text[i : i + size]))
            if rewriter.pending:
                pieces.append(await rewriter.resolve_pending())
        pieces.append(await rewriter.flush())
        return "".join(pieces)

    return asyncio.run(run())


@pytest.mark.parametrize("name", PATHOLOGICAL)
def test_a_pathological_line_is_rewritten_in_linear_time(name):
    text = PATHOLOGICAL[name]
    assert _cpu(lambda: _rewrite_whole(text)) < 1.0


@pytest.mark.parametrize("name", PATHOLOGICAL)
def test_a_pathological_line_streams_in_linear_time(name):
    text = PATHOLOGICAL[name]
    assert _cpu(lambda: _stream(text)) < 1.0


@pytest.mark.parametrize(
    "unit",
    ["A line of plain words that goes on and on without a single path in it. ", "`", "[", "\\"],
    ids=["prose", "backticks", "openers", "backslashes"],
)
def test_a_long_line_streams_in_small_pieces_in_linear_time(unit):
    # 2 MB on one line, 4 characters at a time. Also runs that form one growing token (backticks): the
    # rewriter must not copy what it holds on every piece.
    text = (unit * (2_000_000 // len(unit) + 1))[:2_000_000]
    out: list[str] = []
    assert _cpu(lambda: out.append(_stream(text))) < 2.0
    assert out == [text]


def test_held_text_is_not_scanned_again_for_every_piece(monkeypatch):
    # Inside constructs that stay open (a code span, a link text), the rewriter holds text back; it must
    # rescan it only when enough new text has arrived, not on every 4-character piece.
    scanned = 0
    run = Scan.run

    def counting(self, pos):
        nonlocal scanned
        scanned += self.end - pos
        return run(self, pos)

    monkeypatch.setattr(Scan, "run", counting)
    for opening in ("Intro `", "Intro [", "Intro [a `b", "Intro <a title='"):
        text = opening + "word /mnt/data/x " * (SIZE // 17)
        scanned = 0
        _stream(text, 1)
        assert scanned < 4 * len(text), (opening, scanned / len(text))


def test_one_push_does_little_work():
    # Every call runs on the event loop: none may take long for ordinary pieces of a realistic answer.
    line = "Saved `out.csv` to /mnt/data/x and [a chart](sandbox:/mnt/data/x), see <b>this</b>.\n"
    text = line * (100_000 // len(line))

    async def run() -> float:
        rewriter = StreamingRewriter(_resolve)
        longest = 0.0
        for i in range(0, len(text), 40):
            start = time.process_time()
            rewriter.push(text[i : i + 40])
            longest = max(longest, time.process_time() - start)
            if rewriter.pending:
                await rewriter.resolve_pending()
        return longest

    assert asyncio.run(run()) < 0.02
