"""Plain paths in a row are taken as one PathRun (engine/scan.py, Scan.path_run), in C: it must find and
rewrite exactly what the main loop finds one token at a time, whole and streamed, whatever surrounds
the paths (a character that joins a path to a word, trailing punctuation, a `/` at the end, tokens of
every other kind, paths that are prefixes of others, files that exist and files that do not)."""

from __future__ import annotations

import asyncio
import random

import pytest

from engine import References, StreamingRewriter, Target
from engine.grammar import MAX_PATH, PathRun
from engine.scan import Scan, find_references

GAPS = [" ", "](", " and ", ") (", "\n", "\n\n", "x", "-", ".", "_", "é", "! ", ", ", "|", "* ", "a/b ", "="]
NAMES = ["x", "xy", "x.csv", "d/x", "x.", "x,", "x/", "x!", "%20x", "dir/", "y", "xy/z", "É"]
OTHER = ["`code`", "[link](/mnt/data/x)", "<b>", "http://h/mnt/data/x", "sandbox:/mnt/data/x", "\\[", "~~~"]
TARGETS = {
    name.rstrip(".,!/"): Target(url=f"/cache/functions/cs/T/{name}", name=name)
    for name in ("x", "x.csv", "d/x", "xy/z", " x")
}


def _text(rng: random.Random, units: int) -> str:
    parts = []
    for _ in range(units):
        parts.append(rng.choice(GAPS))
        roll = rng.random()
        if roll < 0.75:
            parts.append("/mnt/data/" + rng.choice(NAMES))
        elif roll < 0.85:
            parts.append(rng.choice(OTHER))
        elif roll < 0.9:
            parts.append("/mnt/data/" + "n" * rng.choice((MAX_PATH - 1, MAX_PATH, MAX_PATH + 3)))
    return "".join(parts)


def _without_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Scan, "path_run", lambda self, pos: pos)


def _flat(refs: list[tuple[int, int, object]], text: str) -> list[str]:
    """The paths named, in order, a PathRun's as many times as its text names them."""
    out: list[str] = []
    for _start, _end, what in refs:
        if isinstance(what, PathRun):
            out.append(f"run {sorted(what.paths)}")
        else:
            out.append(repr(what))
    return out


async def _streamed(text: str, rng: random.Random) -> str:
    async def resolve(path: str) -> Target | None:
        return TARGETS.get(path)

    rewriter = StreamingRewriter(resolve)
    out, at = [], 0
    while at < len(text):
        step = rng.choice((1, 3, 4, 17, 200, 5000))
        out.append(await rewriter.feed(text[at : at + step]))
        at += step
    out.append(await rewriter.flush())
    return "".join(out)


@pytest.mark.parametrize("seed", range(60))
def test_a_path_run_rewrites_what_the_main_loop_rewrites(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(seed)
    text = _text(rng, rng.choice((3, 20, 300)))
    refs = References(text)
    fast = (refs.rewrite(TARGETS), refs.paths, asyncio.run(_streamed(text, random.Random(seed))))
    _without_runs(monkeypatch)
    slow_refs = References(text)
    slow = (slow_refs.rewrite(TARGETS), slow_refs.paths, asyncio.run(_streamed(text, random.Random(seed))))
    assert fast[0] == slow[0]
    assert fast[1] == slow[1]
    assert fast[2] == slow[2] == slow[0]


def test_a_line_of_paths_is_one_run_and_a_doubtful_path_ends_it() -> None:
    text = "see /mnt/data/x" + " /mnt/data/x" * 1000 + " /mnt/data/y" * 3 + " a/mnt/data/z /mnt/data/x"
    refs = find_references(text)
    assert [type(r[2]).__name__ for r in refs] == ["str", "PathRun", "str"]
    run = refs[1][2]
    assert isinstance(run, PathRun) and run.paths == ["/mnt/data/x", "/mnt/data/y"]
    assert text[refs[1][1] :].startswith(" a/mnt/data/z")  # `a` joins that one to a word: the main loop's
    rewritten = References(text).rewrite({"x": Target("/u/x", "x"), "y": None})
    assert rewritten.count("[x](/u/x)") == 1002 and rewritten.count("/mnt/data/y") == 3


def test_many_distinct_paths_in_a_run() -> None:
    names = [f"f{i}" for i in range(50)]
    text = " ".join(f"/mnt/data/{name}" for name in names * 3)
    refs = References(text)
    assert refs.paths == names
    targets = {name: Target(f"/u/{name}", name) for name in names[::2]}
    out = refs.rewrite({**targets, **dict.fromkeys(names[1::2])})
    assert out == " ".join(f"[{n}](/u/{n})" if n in targets else f"/mnt/data/{n}" for n in names * 3)
