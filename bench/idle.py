"""Section: idle kernels on systrap and on ptrace, and the warm step on each.

Two kernel pools in this process, one with its kernels on systrap and one on ptrace (the default:
`RunnerConfig.kernel_platform`), each holding N idle kernels (`x = 1`), and beside them the floor of
each platform: a bare python kept alive in one `runsc run` of the same sandbox, blocked on a read
(bench/_floors.py). Then, at once for all of them (one window, the same moment of the machine):

(a) idle CPU: the CPU time of each kernel's host processes (runsc, the sentry, the gofer, ptrace
    stubs) over the window, per kernel and platform, against the bare python's on the same platform;
    and this process's own CPU over the window (the kernels' watchers, the reaper), per kernel;
(b) warm step: `KernelPool.run` of print(1) into a kernel of each platform, interleaved, against a
    print(1) cell of each bare python.

Targets: 50 idle kernels on the chosen platform cost under 5% of one core together (their sandboxes'
CPU and ours, per kernel, times 50), and the warm step into a kernel on it <= 2 ms on a quiet machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import time
from typing import Any

from runner import KernelPool, KernelSettings, Limits, Runner
from runner._kernel_watch import _cpu_seconds
from runner._procs import pids_by_marker

from . import _floors
from ._common import Context, summary
from ._tables import ms, table

SECTION = "idle_kernels"
PLATFORMS = ("systrap", "ptrace")
CHOSEN = "ptrace"
TARGETS = {"fifty_idle_share_of_core": 0.05, "warm_ms": 2.0}
LIMITS = Limits(timeout_s=30, memory_mb=512)


def _own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def run(ctx: Context) -> dict[str, Any]:
    count = 2 if ctx.quick else 10
    window_s = 3.0 if ctx.quick else 30.0
    rounds = 20 if ctx.quick else 200
    base = ctx.scratch / SECTION
    result: dict[str, Any] = {"targets": TARGETS, "kernels_per_platform": count, "window_s": window_s}
    pools: dict[str, KernelPool] = {}
    async with contextlib.AsyncExitStack() as stack:
        bare: dict[str, _floors.BarePython] = {}
        for platform in PLATFORMS:
            config = ctx.runner_config().model_copy(
                update={
                    "kernel_platform": platform,
                    "state_dir": ctx.runner_base / f"idle-{platform}" / "state",
                    "bundle_dir": ctx.runner_base / f"idle-{platform}" / "bundles",
                }
            )
            runner = Runner(config)
            pool = pools[platform] = KernelPool(
                runner, base / platform / "registry", settings=KernelSettings(idle_s=3600, max_kernels=100)
            )
            stack.push_async_callback(pool.close)
            ctx.log(f"{SECTION}: {count} idle kernels on {platform}, and a bare python beside them")
            for i in range(count):
                folder = base / platform / "chats" / str(i)
                folder.mkdir(parents=True)
                done = await pool.run(f"idle/{i}", folder, "x = 1", "python", LIMITS)
                if not done.ok:
                    raise RuntimeError(f"a kernel on {platform} did not start: {done.reason}")
            floor_dir = base / platform / "floor"
            floor_dir.mkdir()
            setup = await runner.setup()
            bare[platform] = await stack.enter_async_context(
                _floors.bare_python(runner, setup, floor_dir, LIMITS, platform=platform)
            )

        # (b) first, the window after: a warm step wakes nothing that lasts.
        async def step(platform: str) -> float:
            folder = base / platform / "chats" / "0"
            start = time.perf_counter()
            done = await pools[platform].run("idle/0", folder, "print(1)", "python", LIMITS)
            elapsed = time.perf_counter() - start
            if done.stdout != "1\n" or done.notes:
                raise RuntimeError(f"the warm step on {platform} printed {done.stdout!r} {done.notes}")
            return elapsed

        steps = {f"kernel {p}": (lambda p=p: step(p)) for p in PLATFORMS}
        steps |= {f"bare {p}": bare[p].cell for p in PLATFORMS}
        ctx.log(f"{SECTION}: {rounds} warm steps on each platform, interleaved")
        times = await _floors.interleave(rounds, steps)
        result["warm_step"] = {name: summary(values) for name, values in times.items()}

        # (a) the idle window, every sandbox and this process at once.
        ctx.log(f"{SECTION}: {window_s:g} s of idle")
        await asyncio.sleep(3.0)  # the watchers settle into their idle pace
        kernel_pids = {p: [k.host_pids() for k in pools[p].kernels().values()] for p in PLATFORMS}
        bare_pids = {p: pids_by_marker(str(bare[p].bundle)) for p in PLATFORMS}
        before = {p: [_cpu_seconds(pids) for pids in kernel_pids[p]] for p in PLATFORMS}
        bare_before = {p: _cpu_seconds(bare_pids[p]) for p in PLATFORMS}
        own_before, started = _own_cpu(), time.monotonic()
        await asyncio.sleep(window_s)
        elapsed = time.monotonic() - started
        own = (_own_cpu() - own_before) / elapsed
        idle: dict[str, Any] = {}
        for p in PLATFORMS:
            shares = [
                (_cpu_seconds(pids) - was) / elapsed
                for pids, was in zip(kernel_pids[p], before[p], strict=True)
            ]
            idle[p] = {
                "kernel_share_of_core": round(sum(shares) / len(shares), 5),
                "bare_share_of_core": round((_cpu_seconds(bare_pids[p]) - bare_before[p]) / elapsed, 5),
            }
        per_kernel_ours = own / (count * len(PLATFORMS))
        chosen = idle[CHOSEN]["kernel_share_of_core"] + per_kernel_ours
        result["idle"] = {
            **idle,
            "ours_per_kernel_share_of_core": round(per_kernel_ours, 5),
            "fifty_idle_share_of_core": round(50 * chosen, 4),
            "fifty_idle_on_systrap_share_of_core": round(
                50 * (idle["systrap"]["kernel_share_of_core"] + per_kernel_ours), 4
            ),
        }
    return result


def render(r: dict[str, Any]) -> str:

    parts = []
    idle = r.get("idle")
    if idle:
        rows = [
            [
                p,
                f"{100 * idle[p]['kernel_share_of_core']:.3f}",
                f"{100 * idle[p]['bare_share_of_core']:.3f}",
            ]
            for p in PLATFORMS
        ]
        head = f"{r['kernels_per_platform']} idle kernels per platform, a {r['window_s']:g} s window"
        parts.append(f"{head}; % of one core")
        parts.append(table(["platform", "per idle kernel", "floor: a bare python"], rows, right=(1, 2)))
        ours = 100 * idle["ours_per_kernel_share_of_core"]
        fifty = 100 * idle["fifty_idle_share_of_core"]
        systrap = 100 * idle["fifty_idle_on_systrap_share_of_core"]
        parts.append(
            f"this process (the kernels' watchers, the reaper): {ours:.3f}% of a core per kernel; "
            f"50 idle kernels on {CHOSEN}: {fifty:.2f}% of a core in all (on systrap: {systrap:.1f}%)"
        )
    warm = r.get("warm_step")
    if warm:
        rows = [[name, ms(s)] for name, s in warm.items()]
        parts.append(table(["print(1), interleaved", "ms"], rows, right=(1,)))
    return "\n".join(parts) or "(no data)"


def targets(r: dict[str, Any], add: Any) -> None:
    idle = r.get("idle")
    add(
        f"50 idle kernels ({CHOSEN}), share of one core",
        idle and 100 * idle["fifty_idle_share_of_core"],
        100 * TARGETS["fifty_idle_share_of_core"],
        "%",
    )
    warm = r.get("warm_step")
    add(
        f"warm step into a kernel ({CHOSEN}), KernelPool.run",
        warm and warm[f"kernel {CHOSEN}"]["median_ms"],
        2.0,
        "ms",
    )
