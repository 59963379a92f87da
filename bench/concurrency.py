"""Section 3: eight chats at once on this machine, against the same eight steps one at a time.

Each step is the full path of a different chat (its own user and session): the code writes a small
file and prints, and the answer links that file, so every step also reconciles an added file and
publishes it. Rounds alternate sequential / concurrent; every step must end `ok`, print `1` and get a
working link, else it counts as an error.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from engine import Engine

from ._common import Context, percentile, summary

SECTION = "concurrency"
CHATS = 8
CODE = "open('out.txt', 'w').write('x' * 100)\nprint(1)"
ANSWER = "Saved /mnt/data/out.txt for you."


async def _step(service: Engine, index: int) -> tuple[float, str | None]:
    """(seconds, error or None) for one full step of chat `index`."""
    start = time.perf_counter()
    try:
        chat = await service.chat(f"conc-user-{index}", f"conc-chat-{index}")
        step = await chat.run(CODE, "python")
        text = await chat.rewrite(ANSWER)
    except Exception as exc:
        return time.perf_counter() - start, f"{type(exc).__name__}: {exc}"
    elapsed = time.perf_counter() - start
    if step.run is None:
        return elapsed, f"not run: {step.refused}"
    if step.run.outcome != "ok" or step.run.stdout != "1\n":
        return elapsed, f"ended {step.run.outcome}: {step.run.reason} {step.run.stderr[-200:]!r}"
    if "/cache/functions/" not in text:
        return elapsed, f"no link in the rewritten answer: {text!r}"
    return elapsed, None


async def run(ctx: Context) -> dict[str, Any]:
    rounds = 1 if ctx.quick else 4
    runner = ctx.runner()
    walls: dict[str, list[float]] = {"sequential": [], "concurrent": []}
    latencies: dict[str, list[float]] = {"sequential": [], "concurrent": []}
    errors: list[str] = []
    async with ctx.store("concurrency") as store:
        service = Engine(store, runner)
        for i in range(CHATS):  # warm-up, also creates the sessions
            _, error = await _step(service, i)
            if error:
                errors.append(f"warm-up chat {i}: {error}")
        for r in range(rounds):
            order = ["sequential", "concurrent"] if r % 2 == 0 else ["concurrent", "sequential"]
            for mode in order:
                ctx.log(f"{SECTION}: round {r + 1}/{rounds}, {mode}")
                start = time.perf_counter()
                if mode == "sequential":
                    outcomes = [await _step(service, i) for i in range(CHATS)]
                else:
                    outcomes = list(await asyncio.gather(*(_step(service, i) for i in range(CHATS))))
                walls[mode].append(time.perf_counter() - start)
                for i, (elapsed, error) in enumerate(outcomes):
                    latencies[mode].append(elapsed)
                    if error:
                        errors.append(f"round {r + 1} {mode} chat {i}: {error}")
    for error in errors:
        ctx.error(SECTION, error)
    seq = percentile(walls["sequential"], 0.5)
    conc = percentile(walls["concurrent"], 0.5)
    return {
        "chats": CHATS,
        "rounds": rounds,
        "code": CODE,
        "sequential_wall": summary(walls["sequential"]),
        "concurrent_wall": summary(walls["concurrent"]),
        "sequential_steps_per_s": round(CHATS / seq, 3),
        "concurrent_steps_per_s": round(CHATS / conc, 3),
        "throughput_ratio": round(seq / conc, 3),
        "step_latency_sequential": summary(latencies["sequential"]),
        "step_latency_concurrent": summary(latencies["concurrent"]),
        "errors": len(errors),
    }
