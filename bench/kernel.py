"""Section: the live kernel. What a warm step costs, what a chat's first step costs, what a kernel weighs.

(a) warm step: `Engine.chat()` -> `ChatSession.run("print(1)")` -> `rewrite()` of an answer with no
    path, through the whole path with a live kernel (lock, budget, mark, kernel round trip, change
    harvest, sync), against (b) the same step with `kernel=fresh` (a cold sandbox per run), interleaved
    (a, b, a, b...). Then, apart (a cold sandbox's teardown runs on in the background), interleaved:
    (a) again, (c) the bare warm round trip into the same kernel (`Kernel.run`: one frame out, frames
    back, no storage), and the floors of bench/_floors.py: an echo and a print(1) of a bare python
    kept alive in one `runsc run` of the same sandbox. Then (a) against the peer, a Jupyter kernel's
    execute (no sandbox), interleaved apart.
(d) first step of a chat: a chat without a kernel (a new key), so the step starts one, against a bare
    `runsc run` of print(1) in the same sandbox setup (run_overhead.bare_run), interleaved.
(e) kernel start: time from `KernelPool` starting a sandbox to the kernel's ready frame, and what the
    kernel says it can import.
(g) the CPU watcher (a thread left spinning between runs is stopped): what its looks at those idle
    kernels cost our process each second, against the CPU the idle kernels use themselves.
(f) memory: the RSS of a kernel's host processes (runsc, the sentry, the gofer, ptrace stubs: every
    process of its cgroup) when idle, for one kernel and for 20 at once, plus the growth of our own
    process's RSS for those 20.

Targets: warm step <= 0.1x the cold full path and <= 2 ms, (c) <= 1 ms; first step <= 1.15x bare runsc.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from engine import Engine, Settings
from runner import KernelPool, KernelSettings, Limits
from runner._kernel_watch import CPU_POLL_S, _cpu_seconds

from . import _floors
from ._common import ANSWER_WITHOUT_PATHS, Context, ratio_summary, rss_kib, status_kib, summary
from .run_overhead import bare_run

SECTION = "kernel"
CODE = "print(1)"
TARGETS = {"warm_vs_cold": 0.1, "warm_ms": 2.0, "kernel_ms": 1.0, "first_vs_bare": 1.15}


async def _step(service: Engine, user: str, chat_id: str) -> tuple[float, str]:
    """One step through the whole path; returns (seconds, the chat's kernel key)."""
    start = time.perf_counter()
    chat = await service.chat(user, chat_id)
    step = await chat.run(CODE, "python")
    await chat.rewrite(ANSWER_WITHOUT_PATHS)
    elapsed = time.perf_counter() - start
    if step.run is None or step.run.stdout != "1\n":
        raise RuntimeError(f"the step printed {step.run.stdout[:80] if step.run else step.refused!r}")
    return elapsed, chat.kernel_key


async def _cpu_watch(kernels: list[Any], window_s: float) -> dict[str, Any]:
    """(g) What the CPU watcher (one look per kernel every CPU_POLL_S: its host processes' CPU time)
    costs our process, against its floor: the CPU those idle kernels use themselves meanwhile."""
    used_before = sum(_cpu_seconds(k.host_pids()) for k in kernels)
    started = time.monotonic()
    await asyncio.sleep(window_s)
    idle_cpu_per_s = (sum(_cpu_seconds(k.host_pids()) for k in kernels) - used_before) / (
        time.monotonic() - started
    )
    rounds = 20
    cpu_before = time.process_time()
    for _ in range(rounds):
        for kernel in kernels:
            _cpu_seconds(kernel.host_pids())
    look_cpu_s = (time.process_time() - cpu_before) / rounds  # one look at every kernel
    watch_cpu_per_s = look_cpu_s / CPU_POLL_S
    return {
        "kernels": len(kernels),
        "look_at_all_ms": round(look_cpu_s * 1000, 3),
        "watcher_cpu_share_of_core": round(watch_cpu_per_s, 5),
        "idle_kernels_cpu_share_of_core": round(idle_cpu_per_s, 4),
        "watcher_vs_idle_kernels": round(watch_cpu_per_s / idle_cpu_per_s, 4) if idle_cpu_per_s else None,
    }


def _spread(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "min": round(ordered[0], 1),
        "median": round(ordered[len(ordered) // 2], 1),
        "max": round(ordered[-1], 1),
    }


async def run(ctx: Context) -> dict[str, Any]:
    pairs = 5 if ctx.quick else 40
    many = 3 if ctx.quick else 20
    result: dict[str, Any] = {"code": CODE, "targets": TARGETS}
    runner = ctx.runner()
    limits = Limits()
    async with ctx.store("kernel") as store:
        settings = KernelSettings(max_kernels=max(many + 2, 20))
        pool = KernelPool(runner, ctx.scratch / "kernel" / "registry", settings=settings)
        warm = Engine(store, runner, Settings(limits=limits), kernels=pool)
        cold = Engine(store, runner, Settings(limits=limits))
        setup = await runner.setup()
        try:
            # (a) (b) (c): one chat, its kernel warmed up; the cold path in another chat; and the floors.
            for _ in range(2):
                await _step(warm, "bench", "warm")
                await _step(cold, "bench", "cold")
            [kernel] = pool.kernels().values()
            floor_dir = (await store.session("bench", "floor")).path

            async def warm_step() -> float:
                return (await _step(warm, "bench", "warm"))[0]

            async def cold_step() -> float:
                return (await _step(cold, "bench", "cold"))[0]

            async def kernel_round_trip() -> float:
                start = time.perf_counter()
                got = await kernel.run(CODE, "python", limits)
                elapsed = time.perf_counter() - start
                if got.stdout != "1\n":
                    raise RuntimeError(f"the bare kernel round trip printed {got.stdout[:80]!r}")
                return elapsed

            # The cold steps first, interleaved with warm ones, for their ratio: a cold sandbox's teardown
            # goes on in the background and would weigh on the sub-millisecond figures measured next.
            ctx.log(f"{SECTION}: {pairs} interleaved rounds of warm and cold steps")
            t_cold = await _floors.interleave(pairs, {"warm": warm_step, "cold": cold_step})
            await asyncio.sleep(1.0)
            ctx.log(
                f"{SECTION}: {pairs} interleaved rounds of warm steps, kernel round trips and their floors"
            )
            async with _floors.bare_python(runner, setup, floor_dir, limits) as floor:
                steps = {
                    "warm": warm_step,
                    "kernel": kernel_round_trip,
                    "echo": floor.echo,
                    "bare_print": floor.cell,
                }
                for _ in range(3):  # warm-up of the floors
                    await floor.echo()
                    await floor.cell()
                t = await _floors.interleave(pairs * 2, steps)
            # The peer apart too: a Jupyter kernel goes on working for a while after its reply (status
            # messages, its heartbeat), which would weigh on whatever is measured next.
            ctx.log(f"{SECTION}: {pairs} interleaved rounds of warm steps and a Jupyter kernel's executes")
            async with _floors.jupyter() as jup:
                if jup is None:
                    ctx.error(SECTION, "jupyter_client and ipykernel are not installed (the dev extra)")
                else:
                    for _ in range(3):
                        await jup.cell()
                    t_peer = await _floors.interleave(pairs, {"warm": warm_step, "jupyter": jup.cell})
                    t["jupyter"] = t_peer["jupyter"]
            t["cold"] = t_cold["cold"]
            warm_s, cold_s, bare_s = summary(t["warm"]), summary(t["cold"]), summary(t["kernel"])
            result["warm_step"] = {
                "warm_full_path": warm_s,
                "cold_full_path": cold_s,
                "bare_kernel_round_trip": bare_s,
                "floor_echo_in_runsc": summary(t["echo"]),
                "floor_print_in_runsc": summary(t["bare_print"]),
                "jupyter_execute": summary(t["jupyter"]) if "jupyter" in t else None,
                "warm_vs_cold": round(warm_s["median_ms"] / cold_s["median_ms"], 4),
                "warm_vs_bare_kernel": round(warm_s["median_ms"] / bare_s["median_ms"], 3),
                "warm_beside_cold": summary(t_cold["warm"]),
                "pair_ratio_warm_vs_cold": ratio_summary(
                    [w / c for w, c in zip(t_cold["warm"], t_cold["cold"], strict=True)]
                ),
                "pair_ratio_kernel_vs_bare_print": ratio_summary(
                    [k / b for k, b in zip(t["kernel"], t["bare_print"], strict=True)]
                ),
            }
            if "jupyter" in t:
                result["warm_step"]["warm_beside_jupyter"] = summary(t_peer["warm"])
                result["warm_step"]["pair_ratio_warm_vs_jupyter"] = ratio_summary(
                    [w / j for w, j in zip(t_peer["warm"], t_peer["jupyter"], strict=True)]
                )

            # (d) a chat's first step (it starts the kernel), against bare runsc.
            session = await store.session("bench", "bare")
            first_t: list[float] = []
            bare_runsc_t: list[float] = []
            rounds = 3 if ctx.quick else 24
            ctx.log(f"{SECTION}: {rounds} interleaved first steps and bare runsc runs")
            for i in range(rounds):
                chat_id = f"first-{i}"

                async def first(chat_id: str = chat_id) -> None:
                    elapsed, key = await _step(warm, "bench", chat_id)
                    first_t.append(elapsed)
                    await pool.stop(key, "the benchmark is done with it", forget=True)

                async def bare() -> None:
                    elapsed, out = await bare_run(runner, setup, session.path, limits)
                    if out != b"1\n":
                        raise RuntimeError(f"bare runsc printed {out[:80]!r}")
                    bare_runsc_t.append(elapsed)

                for do in (first, bare) if i % 2 == 0 else (bare, first):
                    await do()
            first_s, bare_runsc_s = summary(first_t), summary(bare_runsc_t)
            result["first_step"] = {
                "first_step_full_path": first_s,
                "bare_runsc_run": bare_runsc_s,
                "first_vs_bare": round(first_s["median_ms"] / bare_runsc_s["median_ms"], 4),
                "pair_ratio": ratio_summary([f / b for f, b in zip(first_t, bare_runsc_t, strict=True)]),
            }

            # (e) kernel start, and (f) memory, idle, one and many.
            ours_before = status_kib("VmRSS") or 0
            starts: list[float] = []
            keys = []
            for i in range(many):
                chat = await warm.chat("bench", f"idle-{i}")
                begin = time.perf_counter()
                await chat.run("pass", "python")
                starts.append(time.perf_counter() - begin)
                keys.append(chat.kernel_key)
            await asyncio.sleep(2.0 if not ctx.quick else 0.5)  # let them settle into idle
            kernels = [k for key, k in pool.kernels().items() if key in keys]
            per_kernel = [rss_kib(k.host_pids()) / 1024 for k in kernels]
            ready = kernels[0].ready
            result["kernel_start"] = {
                "start_and_first_run": summary(starts),
                "python": ready.python if ready else None,
                "packages": ready.packages if ready else None,
            }
            result["memory"] = {
                "idle_kernel_mib": _spread(per_kernel),
                "idle_kernels": len(per_kernel),
                "idle_kernels_total_mib": round(sum(per_kernel), 1),
                "our_process_growth_mib": round(((status_kib("VmRSS") or 0) - ours_before) / 1024, 1),
            }
            result["cpu_watch"] = await _cpu_watch(kernels, 0.5 if ctx.quick else 3.0)
        finally:
            await pool.close()
    return result
