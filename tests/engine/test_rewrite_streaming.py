"""StreamingRewriter: the whole-text output however the answer is cut, with a bounded hold-back."""

from __future__ import annotations

import inspect
import random

import pytest

from engine import StreamingRewriter, Target, rewrite
from engine.grammar import MAX_CODE_SPAN

CSV = Target(url="/cache/functions/cs/TOKEN1/report.csv", name="report.csv")
PNG = Target(url="/cache/functions/cs/TOKEN2/plot.png", name="plot.png", is_image=True)
SPACED = Target(url="/cache/functions/cs/TOKEN3/my_file.csv", name="my file.csv")
NESTED = Target(url="/cache/functions/cs/TOKEN4/a.csv", name="a.csv")
TARGETS = {
    "report.csv": CSV,
    "plot.png": PNG,
    "my file.csv": SPACED,
    "out/a.csv": NESTED,
    "missing.txt": None,
}

# Answers as models write them, with everything that must stay as written next to what must not.
CORPUS = [
    "Saved to /mnt/data/report.csv. Also sandbox:/mnt/data/report.csv!\n",
    "Here is the chart:\n\n![A plot](sandbox:/mnt/data/plot.png)\n\nand [the data](/mnt/data/report.csv).",
    "```python\nimport pandas as pd\ndf = pd.read_csv('/mnt/data/report.csv')\n```\n"
    "The file is /mnt/data/report.csv",
    "~~~\n/mnt/data/plot.png\n~~~\n````md\n```\n/mnt/data/plot.png\n```\n````\nDone: /mnt/data/plot.png\n",
    "Use `open('/mnt/data/report.csv')` or ``a ` b /mnt/data/report.csv`` then /mnt/data/out/a.csv.",
    "A span `across\n/mnt/data/report.csv lines` and /mnt/data/report.csv; a ` lone tick /mnt/data/plot.png",
    '<img src="/mnt/data/plot.png" width="50%"> <!-- /mnt/data/report.csv --> <br/> /mnt/data/plot.png',
    '[x](https://example.com "/mnt/data/report.csv") [see /mnt/data/plot.png](https://e.com/) '
    "[r](</mnt/data/my file.csv>)",
    "| file | link |\n|---|---|\n| `report.csv` | /mnt/data/report.csv |\n"
    "| plot | ![p](/mnt/data/plot.png) |\n",
    "# Results for /mnt/data/report.csv\n\n1. /mnt/data/missing.txt\n2. [gone](/mnt/data/missing.txt)\n"
    "3. [f](/mnt/data/my%20file.csv)\n",
    "<https://x.com/mnt/data/report.csv> https://x.com/a?f=/mnt/data/report.csv "
    "<sandbox:/mnt/data/report.csv>",
    "Nested [a [b](/mnt/data/report.csv) c](https://y.com) and [![i](/mnt/data/plot.png)](https://y.com) "
    "\\[z](/mnt/data/plot.png)",
    "Windows lines\r\n```\r\n/mnt/data/report.csv\r\n```\r\n/mnt/data/report.csv\r\n",
    "Unfinished at the end: [label](/mnt/data/report.csv",
    "Unfinished fence\n```\n/mnt/data/report.csv",
    "![](/mnt/data/plot.png)![x](/mnt/data/report.csv)[](/mnt/data/plot.png)/mnt/data/plot.png/mnt/data/x",
    "A long paragraph "
    + "with words and `code` and [links](https://e.com) " * 60
    + "ends at /mnt/data/report.csv.\n",
]


async def _streamed(text: str, cuts: list[int]) -> tuple[str, list[str]]:
    calls: list[str] = []

    async def resolve(path: str) -> Target | None:
        calls.append(path)
        return TARGETS.get(path)

    rewriter = StreamingRewriter(resolve)
    out: list[str] = []
    previous = 0
    for cut in [*cuts, len(text)]:
        out.append(rewriter.push(text[previous:cut]))
        previous = cut
        if rewriter.pending:
            out.append(await rewriter.resolve_pending())
    out.append(await rewriter.flush())
    return "".join(out), calls


@pytest.mark.parametrize("size", range(1, 8))
async def test_same_output_as_the_whole_text_at_every_chunk_size(size):
    for text in CORPUS:
        out, calls = await _streamed(text, list(range(size, len(text), size)))
        assert out == rewrite(text, TARGETS), text
        assert len(calls) == len(set(calls)), calls  # each path resolved once


async def test_same_output_as_the_whole_text_for_random_cuts():
    rng = random.Random(7)
    for text in CORPUS:
        for _ in range(20):
            cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(40, len(text) - 1))))
            out, _ = await _streamed(text, cuts)
            assert out == rewrite(text, TARGETS), (text, cuts)


async def test_feed_and_flush_give_the_same_text():
    async def resolve(path: str) -> Target | None:
        return TARGETS.get(path)

    for text in CORPUS:
        rewriter = StreamingRewriter(resolve)
        out = [await rewriter.feed(text[i : i + 3]) for i in range(0, len(text), 3)]
        assert "".join(out) + await rewriter.flush() == rewrite(text, TARGETS)


async def test_push_never_awaits_and_says_what_it_waits_for():
    calls: list[str] = []

    async def resolve(path: str) -> Target | None:
        calls.append(path)
        return TARGETS.get(path)

    rewriter = StreamingRewriter(resolve)
    assert not inspect.iscoroutinefunction(rewriter.push)
    shown = rewriter.push("First see /mnt/data/report.csv and then " + "more words " * 20)
    assert shown == "First see "  # the rest waits for the path to be published
    assert rewriter.pending == ("report.csv",)
    assert calls == []
    shown += await rewriter.resolve_pending()
    assert shown.startswith(f"First see [report.csv]({CSV.url}) and then more words")
    assert calls == ["report.csv"] and rewriter.pending == ()
    rewriter.push("again /mnt/data/report.csv")
    await rewriter.flush()
    assert calls == ["report.csv"]  # resolved once per rewriter


async def test_fence_state_carries_across_chunks():
    async def resolve(path: str) -> Target | None:
        return TARGETS.get(path)

    rewriter = StreamingRewriter(resolve)
    pieces = [
        "Code:\n``",
        "`py",
        "thon\nopen('/mnt/da",
        "ta/report.csv')\n",
        "``",
        "`\nSee /mnt/data/",
        "report.csv\n",
    ]
    out = "".join([await rewriter.feed(piece) for piece in pieces]) + await rewriter.flush()
    assert out == f"Code:\n```python\nopen('/mnt/data/report.csv')\n```\nSee [report.csv]({CSV.url})\n"


async def test_a_flushed_rewriter_takes_a_new_answer():
    calls: list[str] = []

    async def resolve(path: str) -> Target | None:
        calls.append(path)
        return TARGETS.get(path)

    rewriter = StreamingRewriter(resolve)
    first = "```\nopen code block /mnt/data/report.csv"
    assert await rewriter.feed(first) + await rewriter.flush() == first  # (code: released as it comes)
    second = await rewriter.feed("/mnt/data/report.csv\n") + await rewriter.flush()
    assert second == f"[report.csv]({CSV.url})\n"  # no fence left over from the first answer
    assert calls == ["report.csv"]


async def _hold_back(text: str, size: int = 4, trace: list[tuple[int, int]] | None = None) -> tuple[int, str]:
    """The most text the rewriter held back at any point, and its whole output; `trace` gets (characters
    pushed, characters held back) after each piece."""

    async def resolve(path: str) -> Target | None:
        return TARGETS.get(path)

    rewriter = StreamingRewriter(resolve)
    out: list[str] = []
    covered = held = 0
    link = f"[report.csv]({CSV.url})"
    for i in range(0, len(text), size):
        out.append(await rewriter.feed(text[i : i + size]))
        # In the answer's characters: a released piece holds whole links, the only rewriting here.
        covered += len(out[-1].replace(link, "/mnt/data/report.csv"))
        pushed = min(i + size, len(text))
        held = max(held, pushed - covered)
        if trace is not None:
            trace.append((pushed, pushed - covered))
    out.append(await rewriter.flush())
    return held, "".join(out)


@pytest.mark.parametrize(
    "opening",
    ["Intro `", "Intro ``", "Intro [", "Intro <a title='", "Intro <!--", "Intro ![alt"],
    ids=["code span", "double code span", "link text", "tag", "comment", "image text"],
)
async def test_hold_back_is_bounded_inside_a_construct_that_never_closes(opening):
    # 100 KB in one paragraph after something that opens and never closes: the rewriter must not keep
    # all of it until the end, and must still give the whole-text output.
    text = opening + "word /mnt/data/report.csv " * 4000
    held, out = await _hold_back(text)
    assert held <= 8 * 1024 + 4, held
    assert out == rewrite(text, TARGETS)


async def test_hold_back_is_small_without_constructs():
    # One 105 KB line. Pieces are batched before each scan, with a bounded latency: the first 2 KB of
    # the line show within 320 characters of arriving, later text within an eighth of the line so far
    # (plus that), and never more than 4 KB (plus that) behind.
    text = "plain words and /mnt/data/report.csv here " * 2500
    trace: list[tuple[int, int]] = []
    held, out = await _hold_back(text, 4, trace)
    assert out == rewrite(text, TARGETS)
    assert max(h for pushed, h in trace if pushed <= 2048) <= 320
    assert all(h <= 320 + min(pushed // 8, 4096) for pushed, h in trace), held
    assert held > 1024  # (batches did grow: the trace measures what it should)


async def test_hold_back_starts_again_small_on_each_line():
    # The batch is an eighth of the line so far: after a long line, the next line's first characters
    # show as soon as they did on the first line.
    long_line = "word " * 20_000 + "\n"
    text = long_line + "next line " * 40
    trace: list[tuple[int, int]] = []
    _, out = await _hold_back(text, 4, trace)
    assert out == text
    assert max(h for pushed, h in trace if pushed > len(long_line) + 300) <= 320


async def test_a_code_span_longer_than_the_bound_streams_as_written():
    # The hold-back bound and the whole-text rule agree: past MAX_CODE_SPAN, the span's paragraph is
    # left as written, streamed or not.
    text = "Intro `" + "x /mnt/data/report.csv " * (MAX_CODE_SPAN // 10) + "` and then /mnt/data/report.csv"
    held, out = await _hold_back(text)
    assert (
        out
        == rewrite(text, TARGETS)
        == text.replace("then /mnt/data/report.csv", f"then [report.csv]({CSV.url})")
    )
    assert held <= 8 * 1024 + 4
