"""Section: the sandbox environment (sandbox/build): what it costs on disk, in a cold import, in a
kernel's memory, and systrap against ptrace.

(a) a fresh sandbox's data step (`import numpy, pandas, matplotlib.pyplot` and a small `read_csv`)
    against a fresh sandbox's `print(1)`, interleaved, on the platform the runner picks;
(b) `print(1)` and the data step on systrap against ptrace (two Runners, interleaved), where runsc
    offers both;
(c) the RSS of a new chat's kernel host processes (runsc, sentry, gofer) after its first print(1)
    and after the data step, for a kernel started cold and one resumed from the warm-start template;
(d) the environment's size on disk and its number of files;
(e) the warm-start template: how long building it takes (a kernel started, the data stack imported,
    the kernel checkpointed) and the size of its saved image.

Target: systrap's data step <= 1.0x ptrace's (the platform the runner picks is the faster one).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from runner import KernelPool, KernelSettings, Limits, Runner

from ._common import Context, rss_kib, summary
from ._tables import table

SECTION = "environment"
PRINT = "print(1)"
DATA_STEP = (
    "import io, numpy, pandas, matplotlib.pyplot\n"
    "df = pandas.read_csv(io.StringIO('a,b\\n1,2\\n3,4\\n'))\n"
    "print(int(df.b.sum()))"
)
TARGET_SYSTRAP_VS_PTRACE = 1.0


async def _timed(runner: Runner, code: str, workdir: Path, expected: str) -> float:
    start = time.perf_counter()
    res = await runner.run(code, "python", workdir, Limits(timeout_s=120))
    elapsed = time.perf_counter() - start
    if res.stdout != expected:
        raise RuntimeError(f"{code[:20]!r} printed {res.stdout[:80]!r} ({res.reason}; {res.stderr[-300:]})")
    return elapsed


async def _kernel_memory(ctx: Context, runner: Runner, work: Path, *, warm: bool) -> dict[str, float]:
    """The RSS of a new chat's kernel host processes after its first cell (print(1); for the warm one,
    `import numpy` first, as a cell must import a package to resume the template), then after the
    data step."""
    name = "warm" if warm else "cold"
    settings = KernelSettings(max_kernels=2)
    pool = KernelPool(runner, ctx.scratch / f"environment-{name}-kernels", settings=settings, warm_start=warm)
    said, logger = _Said(), logging.getLogger("code_sessions.runner")
    level = logger.level
    logger.addHandler(said)
    logger.setLevel(logging.INFO)
    template: dict[str, float] = {}
    try:
        if warm:  # the first start builds the template, in the background
            first = work / "template-chat"
            first.mkdir(exist_ok=True)
            await pool.run("bench/first", first, PRINT, "python", Limits(timeout_s=120))
            started = time.perf_counter()
            await pool._warm.wait_built()
            template["build_s"] = round(time.perf_counter() - started, 2)
            template["image_mib"] = round(_disk(pool._warm.folder)["bytes"] / 2**20, 1)
            await pool.stop("bench/first", "done", forget=True)
        chat = work / f"{name}-kernel-chat"
        chat.mkdir(exist_ok=True)
        # A first cell that imports a package is what resumes the template (a plain one starts cold).
        first_cell = "import numpy\nprint(1)" if warm else PRINT
        await pool.run(f"bench/{name}", chat, first_cell, "python", Limits(timeout_s=120))
        [kernel] = pool.kernels().values()
        time.sleep(0.5)
        idle = round(rss_kib(kernel.host_pids()) / 1024, 1)
        got = await pool.run(f"bench/{name}", chat, DATA_STEP, "python", Limits(timeout_s=120))
        if got.stdout != "6\n" or got.notes:
            raise RuntimeError(f"the {name} kernel's data step printed {got.stdout[:80]!r} {got.notes}")
        time.sleep(0.5)
        loaded = round(rss_kib(kernel.host_pids()) / 1024, 1)
        if pool.kernels().get(f"bench/{name}") is not kernel:
            raise RuntimeError(f"the {name} kernel was replaced between its two runs")
        if warm != any(f"started warm for bench/{name}" in line for line in said.lines):
            raise RuntimeError(f"the {name} kernel did not start as measured: {said.lines[-3:]}")
        return {"idle": idle, "data_stack_imported": loaded, **template}
    finally:
        logger.removeHandler(said)
        logger.setLevel(level)
        await pool.close()


class _Said(logging.Handler):
    """The runner's log lines (how each kernel started)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _disk(root: Path) -> dict[str, Any]:
    size = files = 0
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            try:
                size += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                continue
            files += 1
    return {"bytes": size, "files": files}


async def run(ctx: Context) -> dict[str, Any]:
    rounds = 3 if ctx.quick else 12
    runner = ctx.runner()
    setup = await runner.setup()
    env = setup.environment
    result: dict[str, Any] = {"environment": env.describe(), "platform": setup.platform, "quick": ctx.quick}
    work = ctx.scratch / "environment"
    work.mkdir(parents=True, exist_ok=True)

    # (a) the data step against print(1), fresh sandboxes, on the chosen platform.
    await _timed(runner, DATA_STEP, work, "6\n")  # the first one reads the environment from disk
    data_t: list[float] = []
    print_t: list[float] = []
    ctx.log(f"{SECTION}: {rounds} interleaved fresh data steps and print(1) runs")
    for i in range(rounds):
        pair = ((DATA_STEP, "6\n", data_t), (PRINT, "1\n", print_t))
        for code, expected, into in pair if i % 2 == 0 else pair[::-1]:
            into.append(await _timed(runner, code, work, expected))
    data_s, print_s = summary(data_t), summary(print_t)
    result["cold_data_step"] = {
        "data_step": data_s,
        "print": print_s,
        "data_vs_print": round(data_s["median_ms"] / print_s["median_ms"], 3),
    }

    # (b) systrap against ptrace, where both are offered.
    if {"systrap", "ptrace"} <= set(setup.runsc.platforms):
        runners = {
            name: Runner(ctx.runner_config().model_copy(update={"platform": name}))
            for name in ("systrap", "ptrace")
        }
        timings: dict[str, dict[str, list[float]]] = {name: {"print": [], "data": []} for name in runners}
        for r in runners.values():
            await _timed(r, PRINT, work, "1\n")
        ctx.log(f"{SECTION}: {rounds} interleaved rounds on systrap and ptrace")
        for i in range(rounds):
            order = ("systrap", "ptrace") if i % 2 == 0 else ("ptrace", "systrap")
            for name in order:
                timings[name]["print"].append(await _timed(runners[name], PRINT, work, "1\n"))
                timings[name]["data"].append(await _timed(runners[name], DATA_STEP, work, "6\n"))
        platforms = {
            name: {kind: summary(values) for kind, values in t.items()} for name, t in timings.items()
        }
        result["platforms"] = platforms
        result["systrap_vs_ptrace"] = {
            kind: round(platforms["systrap"][kind]["median_ms"] / platforms["ptrace"][kind]["median_ms"], 3)
            for kind in ("print", "data")
        }

    # (c) a kernel's host memory, idle and with the data stack imported: started cold, and resumed
    # from the warm-start template (the data stack imported in the image, no name bound).
    result["kernel_memory_mib"] = await _kernel_memory(ctx, runner, work, warm=False)
    result["warm_kernel_memory_mib"] = await _kernel_memory(ctx, runner, work, warm=True)

    # (d) size on disk.
    if env.built:
        result["disk"] = _disk(env.root)
    return result


def targets(r: dict[str, Any]) -> list[tuple[str, float | None, float, str]]:
    ratio = None if r.get("quick") else r.get("systrap_vs_ptrace", {}).get("data")
    return [("data step, systrap / ptrace (fresh sandbox)", ratio, TARGET_SYSTRAP_VS_PTRACE, "x")]


def render(r: dict[str, Any]) -> str:
    """The section's table (bench/report.py knows the other sections)."""

    if "environment" not in r:
        return "(no data)"
    parts = [f"{r['environment']}; platform {r['platform']}"]
    c = r.get("cold_data_step")
    if c:
        rows = [
            ["fresh sandbox: import numpy, pandas, matplotlib + read_csv", c["data_step"]["median_ms"]],
            ["fresh sandbox: print(1)", c["print"]["median_ms"]],
        ]
        parts.append(table(["", "median ms"], rows, right=(1,)))
        parts.append(f"data step / print(1) = {c['data_vs_print']:.3g}x")
    p = r.get("platforms")
    if p:
        rows = [[name, t["print"]["median_ms"], t["data"]["median_ms"]] for name, t in p.items()]
        parts.append(table(["platform", "print(1) ms", "data step ms"], rows, right=(1, 2)))
        ratio = r["systrap_vs_ptrace"]
        parts.append(f"systrap / ptrace: print(1) {ratio['print']:.3g}x, data step {ratio['data']:.3g}x")
    for key, how in (
        ("kernel_memory_mib", "started cold"),
        ("warm_kernel_memory_mib", "warm from the template"),
    ):
        m = r.get(key)
        if m:
            parts.append(
                f"a new chat's kernel, {how}: host RSS after its first cell {m['idle']} MiB, "
                f"after the data step {m['data_stack_imported']} MiB"
            )
            if "build_s" in m:
                parts.append(
                    f"the warm-start template: built (data stack imported, checkpointed) in "
                    f"{m['build_s']} s after the first chat's run; saved image {m['image_mib']} MiB"
                )
    d = r.get("disk")
    if d:
        parts.append(f"on disk: {d['bytes'] / 1024**3:.2f} GiB in {d['files']:,} files")
    return "\n".join(parts)
