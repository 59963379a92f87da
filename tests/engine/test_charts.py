"""The message's chart embed with hostile specs: a spec that is not a figure, or nested too deeply to be
read, is left out with a sentence (never an exception that ends the answer); the embed is bounded in
bytes, and says which charts it left out; none of the work runs on the event loop."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from engine.charts import MAX_CHART_BYTES, MAX_EMBED_BYTES, ChartEmbed, chart_embed
from tests.support.loop_lag import LoopLag

GOOD = json.dumps({"data": [{"type": "bar", "x": ["a", "b"], "y": [3, 5]}], "layout": {"title": "votes"}})
DEEP = '{"data": [' + "[" * 50_000 + "]" * 50_000 + "]}"


def _big(fill: str) -> str:
    """A figure of MAX_CHART_BYTES whose one trace name is `fill` repeated."""
    frame = '{"data": [{"type": "scatter", "name": "%s"}]}'
    return frame % (fill * (MAX_CHART_BYTES - len(frame) + 2))


@pytest.fixture
def environment(tmp_path: Path) -> Path:
    """A sandbox environment's root holding a plotly.js (a stand-in of 2 MB: it is only found, never
    run, here)."""
    package = tmp_path / "usr/local/lib/python3.13/dist-packages/plotly/package_data"
    package.mkdir(parents=True)
    (package / "plotly.min.js").write_bytes(bytes(range(256)) * 8192)
    return tmp_path


URL = "/code-sessions/plotly/" + "0" * 64 + ".js"


async def _html(embed: ChartEmbed | None) -> str | None:
    """The embed as the host makes it (in a thread), with plotly.js at URL."""
    return None if embed is None else await asyncio.to_thread(embed.html, URL)


def _reader(files: dict[str, str]):
    async def read_head(path: str, limit: int) -> tuple[bytes, int]:
        data = files[path].encode()
        return data[:limit], len(data)

    return read_head


async def test_a_spec_nested_fifty_thousand_deep_is_left_out_with_a_sentence(environment: Path) -> None:
    files = {"chart-1.plotly.json": DEEP, "chart-2.plotly.json": GOOD, "chart-3.plotly.json": "[1, 2]"}
    made, notes = await chart_embed(list(files), _reader(files), environment)
    embed = await _html(made)
    assert embed is not None and "votes" in embed and embed.count("class=&quot;chart&quot;") == 1
    assert notes == [
        "/mnt/data/chart-1.plotly.json is not shown interactively: it is nested too deeply to be a "
        "plotly figure",
        "/mnt/data/chart-3.plotly.json is not shown interactively: it is not a plotly figure",
    ]


async def test_a_failing_read_is_that_chart_left_out(environment: Path) -> None:
    async def read_head(path: str, limit: int) -> tuple[bytes, int]:
        if path == "chart-1.plotly.json":
            raise MemoryError("no room")
        return GOOD.encode(), len(GOOD)

    made, notes = await chart_embed(["chart-1.plotly.json", "chart-2.plotly.json"], read_head, environment)
    embed = await _html(made)
    assert embed is not None and "votes" in embed
    assert notes == [
        "/mnt/data/chart-1.plotly.json is not shown interactively: it could not be read "
        "(MemoryError: no room)"
    ]


async def test_the_embed_is_bounded_says_what_it_left_out_and_keeps_the_loop_free(environment: Path) -> None:
    # Four figures of 4 MiB of `<` (each escaped to six characters, twice over): 98 MiB of embed, built
    # on the event loop, before the bound.
    files = {f"chart-{i}.plotly.json": _big("<") for i in range(1, 5)}
    files["chart-5.plotly.json"] = GOOD
    files["chart-6.plotly.json"] = _big("x")  # 4 MiB that escapes to itself: it fits
    async with LoopLag() as lag:
        made, notes = await chart_embed(list(files), _reader(files), environment)
        embed = await _html(made)
    lag.assert_quiet()
    assert embed is not None and len(embed.encode()) <= MAX_EMBED_BYTES
    assert "votes" in embed and "x" * 1000 in embed and "&lt;" * 10 not in embed
    assert embed.count("class=&quot;chart&quot;") == 2
    left_out = ", ".join(f"/mnt/data/chart-{i}.plotly.json" for i in range(1, 5))
    assert notes == [
        f"{left_out} are not shown interactively: with them, the message's charts would take more than "
        "8 MiB (they stay files of the chat)"
    ]


async def test_the_embed_names_plotly_js_and_carries_only_the_specs(environment: Path) -> None:
    files = {"chart-1.plotly.json": GOOD, "out/chart-2.plotly.json": GOOD}
    made, notes = await chart_embed(list(files), _reader(files), environment)
    assert made is not None and notes == []
    assert made.script == next(environment.rglob("plotly.min.js"))  # the host serves this file
    embed = await _html(made)
    assert embed is not None and len(embed.encode()) < 8_000 and URL in embed
    # The PNG download is named after the chart's file.
    assert "const names = [&quot;chart-1&quot;, &quot;chart-2&quot;];" in embed
    for url in ("https://cdn.example/plotly.js", "//cdn.example/p.js", "/a b.js", "/x" * 200):
        with pytest.raises(ValueError):
            made.html(url)
