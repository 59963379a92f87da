"""How often one message crosses between the packages, measured: a warm tool-call step (the model runs
one cell, then answers) through the installed Pipe, in-process with real storage and real gVisor (the
harness of tests/function), with a profiler that notes every call from a function of one package into a
function of another.

    python tools/crossings.py

Prints, for each (from package, to package), the distinct calling edges (caller function -> callee
function: what a reader follows) and the calls made. Needs runsc, as the function tests do.
"""

from __future__ import annotations

import asyncio
import inspect
import sys
import tempfile
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.pipe_harness import PipeHarness, code

PACKAGES = ("functions", "webui", "engine", "runner", "storage")
_RESUMABLE = inspect.CO_COROUTINE | inspect.CO_GENERATOR | inspect.CO_ASYNC_GENERATOR


def _package(frame: FrameType) -> str | None:
    """Our package a frame's code belongs to: the bundle serves them as `<bundle>.<package>.<module>`,
    and the Pipe itself is the module Open WebUI execs."""
    name = str(frame.f_globals.get("__name__", ""))
    if name.startswith("function_"):
        return "functions"
    parts = name.split(".")
    for part in parts[:2]:
        if part in PACKAGES:
            return part
    return None


def _function(frame: FrameType) -> str:
    return f"{frame.f_globals.get('__name__', '?')}.{frame.f_code.co_qualname}"


class Crossings:
    def __init__(self) -> None:
        self.edges: set[tuple[str, str, str, str]] = set()
        self.calls: Counter[tuple[str, str]] = Counter()
        # A coroutine's frame fires "call" at each resumption: only its first is a call. Held, so that
        # no new frame reuses an id while measuring.
        self._started: dict[int, FrameType] = {}

    def profile(self, frame: FrameType, event: str, _arg: Any) -> None:
        if event != "call":
            return
        if frame.f_code.co_flags & _RESUMABLE:
            if id(frame) in self._started:
                return
            self._started[id(frame)] = frame
        callee = _package(frame)
        caller_frame = frame.f_back
        while caller_frame is not None and _package(caller_frame) is None:
            caller_frame = caller_frame.f_back  # through the standard library (asyncio, to_thread)
        if callee is None or caller_frame is None:
            return
        caller = _package(caller_frame)
        if caller is None or caller == callee:
            return
        self.calls[(caller, callee)] += 1
        self.edges.add((caller, callee, _function(caller_frame), _function(frame)))


async def _measure() -> Crossings:
    with tempfile.TemporaryDirectory(prefix="cs-crossings-") as scratch:
        harness = PipeHarness(Path(scratch) / "data", valves={"timeout_seconds": 30})
        try:
            await harness.say("u1", "chat-1", code("x = 1"))  # the cold start is not the step measured
            crossings = Crossings()
            sys.setprofile(crossings.profile)
            try:
                await harness.say("u1", "chat-1", code("open('/mnt/data/a.txt', 'w').write(str(x))"))
            finally:
                sys.setprofile(None)
        finally:
            await harness.aclose()
    return crossings


def main() -> None:
    crossings = asyncio.run(_measure())
    edges = Counter((caller, callee) for caller, callee, _, _ in crossings.edges)
    print(f"{'from':<10} {'to':<10} {'edges':>6} {'calls':>7}")
    for pair in sorted(crossings.calls):
        print(f"{pair[0]:<10} {pair[1]:<10} {edges[pair]:>6} {crossings.calls[pair]:>7}")
    print(f"{'total':<21} {sum(edges.values()):>6} {sum(crossings.calls.values()):>7}")


if __name__ == "__main__":
    main()
