"""Section: kernels saved to disk and resumed, and warm starts from a template.

(a) save: `runsc checkpoint` of a kernel plus sealing its image (sizes and digests), idle (nothing
    imported) and holding 100 MB of DataFrames; the image's size. Floor: writing and fsyncing the same
    number of bytes to the same disk (what any save of that much memory costs at least).
(b) resume: a saved chat's next step (`runsc restore` to the first answer) against a cold kernel
    start and first answer of print(1) in the same setup, for the idle and the 100 MB kernel.
(c) first data step: a new chat's first `import pandas, numpy, matplotlib` + a small read_csv, with
    the template built, against a new chat's first print(1) (both start a kernel the product's way).
(d) memory: the RSS of every kernel host process with 5 live kernels, then with 100 more chats saved
    to disk (started, used, saved, stopped) besides them; and the disk those 100 take.

Targets: first data step <= 1.5x the first print(1); resume of the 100 MB kernel <= 1 s; the 100
saved chats add no resident memory (<= 1 MiB over the 5 live ones).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from runner import KernelPool, KernelSettings, Limits, _hibernate

from ._common import Context, rss_kib, summary

SECTION = "hibernate"
TARGETS = {"first_data_vs_print": 1.5, "resume_100mb_s": 1.0, "saved_chats_rss_mib": 1.0}
DATA_STEP = "import pandas, numpy, matplotlib\ndf = pandas.read_csv('small.csv')\nprint(len(df))"
FRAMES_100MB = (
    "import numpy, pandas\n"
    "frames = [pandas.DataFrame(numpy.random.default_rng(i).random((125_000, 10))) for i in range(10)]\n"
    "print(sum(f.memory_usage().sum() for f in frames) // 2**20)"
)
LIMITS = Limits(timeout_s=120, memory_mb=1024)




def _kernel_rss_kib(pool: KernelPool) -> int:
    return sum(rss_kib(kernel.host_pids()) for kernel in pool.kernels().values())


def _write_floor(folder: Path, size: int) -> float:
    """Seconds to write and fsync `size` bytes into `folder`."""
    path = folder / "floor.bin"
    block = os.urandom(1 << 20)
    start = time.perf_counter()
    with open(path, "wb") as fh:
        left = size
        while left > 0:
            fh.write(block[: min(left, len(block))])
            left -= len(block)
        fh.flush()
        os.fsync(fh.fileno())
    elapsed = time.perf_counter() - start
    path.unlink()
    return elapsed


class _Chats:
    def __init__(self, ctx: Context, pool: KernelPool, name: str) -> None:
        self.base = ctx.scratch / SECTION / name
        self.pool = pool
        self.count = 0

    def new(self) -> tuple[str, Path, Path]:
        self.count += 1
        key = f"bench/{self.count}"
        folder, state = self.base / "sessions" / str(self.count), self.base / "state" / f"{self.count}.kernel"
        folder.mkdir(parents=True)
        (folder / "small.csv").write_text("a,b\n" + "".join(f"{i},{i * 2}\n" for i in range(100)))
        return key, folder, state

    async def step(self, key: str, folder: Path, state: Path, code: str) -> tuple[float, str]:
        start = time.perf_counter()
        result = await self.pool.run(key, folder, code, "python", LIMITS, state_dir=state)
        elapsed = time.perf_counter() - start
        if not result.ok or result.notes:
            raise RuntimeError(
                f"{code[:30]!r}: {result.outcome} {result.reason} {result.notes} {result.stderr[-300:]}"
            )
        return elapsed, result.stdout

    async def save(self, key: str) -> float:
        """Save and stop the key's kernel as the idle reaper does; returns the seconds it took."""
        kernel = self.pool.kernels()[key]
        start = time.perf_counter()
        await self.pool._end(key, kernel, "the benchmark saves it", save=True)
        elapsed = time.perf_counter() - start
        entry = self.pool._registry.get(key)
        if entry is None or not entry.image:
            raise RuntimeError(f"{key} was not saved: {entry and entry.reason}")
        return elapsed


async def run(ctx: Context) -> dict[str, Any]:
    rounds = 2 if ctx.quick else 6
    hibernated = 5 if ctx.quick else 100
    runner = ctx.runner()
    result: dict[str, Any] = {"targets": TARGETS}
    registry = ctx.scratch / SECTION / "registry"
    # No bound on the saved states: the 100 chats' images all sit in one owner's folder here, and
    # together pass the per-user default (what is measured is the saving, not the refusal).
    settings = KernelSettings(
        max_kernels=1000, idle_s=24 * 3600, max_image_bytes=None, max_saved_bytes_together=None
    )
    pool = KernelPool(runner, registry, settings=settings, warm_start=True)
    chats = _Chats(ctx, pool, "chats")
    try:
        # The template first (built in the background on the first start), then every kernel of the
        # section starts the product's way.
        key, folder, state = chats.new()
        await chats.step(key, folder, state, "print(1)")
        await pool._warm.wait_built()
        await pool.stop(key, "done", forget=True)

        # (a) and (b): save and resume, idle and with 100 MB of frames; cold start of print(1) between.
        cases: dict[str, dict[str, list[float]]] = {}
        for case, setup in (("idle", "x = 1"), ("100 MB of DataFrames", FRAMES_100MB)):
            got: dict[str, list[float]] = {"save": [], "size": [], "floor": [], "resume": [], "cold": []}
            ctx.log(f"{SECTION}: {rounds} saves and resumes of a kernel, {case}")
            for _ in range(rounds):
                key, folder, state = chats.new()
                await chats.step(key, folder, state, setup)
                got["save"].append(await chats.save(key))
                size = _hibernate.size_of(state)
                got["size"].append(size)
                got["floor"].append(_write_floor(state, size))
                elapsed, out = await chats.step(key, folder, state, "print(2)")
                if out != "2\n":
                    raise RuntimeError(f"the resumed kernel printed {out!r}")
                got["resume"].append(elapsed)
                await pool.stop(key, "done", forget=True)
                # The floor of a resume: a cold kernel's start and first answer (no template).
                cold_key, cold_folder, cold_state = chats.new()
                pool.warm_start = False
                elapsed, _ = await chats.step(cold_key, cold_folder, cold_state, "print(1)")
                pool.warm_start = True
                got["cold"].append(elapsed)
                await pool.stop(cold_key, "done", forget=True)
            cases[case] = got
        result["save_resume"] = {
            case: {
                "save": summary(got["save"]),
                "write_floor": summary(got["floor"]),
                "image_mib": round(sorted(got["size"])[len(got["size"]) // 2] / 2**20, 1),
                "resume": summary(got["resume"]),
                "cold_start": summary(got["cold"]),
                "save_vs_floor": round(
                    summary(got["save"])["median_ms"] / summary(got["floor"])["median_ms"], 2
                ),
                "resume_vs_cold": round(
                    summary(got["resume"])["median_ms"] / summary(got["cold"])["median_ms"], 3
                ),
            }
            for case, got in cases.items()
        }

        # (c) a new chat's first data step (warm, from the template) vs a new chat's first print(1).
        data_t: list[float] = []
        print_t: list[float] = []
        ctx.log(f"{SECTION}: {rounds} first data steps and first print(1), interleaved")
        for i in range(rounds):
            for which in ("data", "print") if i % 2 == 0 else ("print", "data"):
                key, folder, state = chats.new()
                elapsed, out = await chats.step(
                    key, folder, state, DATA_STEP if which == "data" else "print(1)"
                )
                (data_t if which == "data" else print_t).append(elapsed)
                await pool.stop(key, "done", forget=True)
        data_s, print_s = summary(data_t), summary(print_t)
        result["first_data_step"] = {
            "data_step": data_s,
            "first_print": print_s,
            "data_vs_print": round(data_s["median_ms"] / print_s["median_ms"], 3),
        }

        # (d) memory with 5 live kernels, then 100 saved chats besides them.
        live = []
        for _ in range(5):
            key, folder, state = chats.new()
            await chats.step(key, folder, state, "import pandas\nx = 1")
            live.append(key)
        await asyncio.sleep(1)
        before = _kernel_rss_kib(pool)
        ctx.log(f"{SECTION}: {hibernated} chats started, used and saved to disk")
        saved_bytes = 0
        for _ in range(hibernated):
            key, folder, state = chats.new()
            await chats.step(key, folder, state, "import pandas\nx = 1")
            await chats.save(key)
            saved_bytes += _hibernate.size_of(state)
        await asyncio.sleep(1)
        after = _kernel_rss_kib(pool)
        result["memory"] = {
            "live": len(live),
            "hibernated": hibernated,
            "live_rss_mib": round(before / 1024, 1),
            "live_and_hibernated_rss_mib": round(after / 1024, 1),
            "hibernated_added_mib": round((after - before) / 1024, 1),
            "hibernated_disk_mib": round(saved_bytes / 2**20, 1),
        }
    finally:
        await pool.close()
    return result


def render(r: dict[str, Any]) -> str:
    from .report import ms, table  # report imports this module

    parts = []
    sr = r.get("save_resume") or {}
    rows = []
    for case, s in sr.items():
        rows.append(
            [
                case,
                ms(s["save"]),
                ms(s["write_floor"]),
                f"{s['save_vs_floor']:.3g}x",
                s["image_mib"],
                ms(s["resume"]),
                ms(s["cold_start"]),
                f"{s['resume_vs_cold']:.3g}x",
            ]
        )
    if rows:
        headers = [
            "kernel",
            "save ms",
            "write floor ms",
            "ratio",
            "image MiB",
            "resume ms",
            "cold start ms",
            "ratio",
        ]
        parts.append(table(headers, rows, right=(1, 2, 3, 4, 5, 6, 7)))
    f = r.get("first_data_step")
    if f:
        parts.append(
            f"a new chat's first data step {ms(f['data_step'])} ms vs its first print(1) "
            f"{ms(f['first_print'])} ms: {f['data_vs_print']:.3g}x"
        )
    m = r.get("memory")
    if m:
        parts.append(
            f"RSS of kernel host processes: {m['live']} live {m['live_rss_mib']} MiB; with "
            f"{m['hibernated']} saved chats besides them {m['live_and_hibernated_rss_mib']} MiB "
            f"(+{m['hibernated_added_mib']} MiB); the saved chats take {m['hibernated_disk_mib']} MiB of disk"
        )
    return "\n".join(parts) or "(no data)"


def targets(r: dict[str, Any], add: Any) -> None:
    first = r.get("first_data_step")
    add("first data step / first print(1) (template)", first and first["data_vs_print"], 1.5, "x")
    big = (r.get("save_resume") or {}).get("100 MB of DataFrames")
    add("resume of a kernel holding 100 MB", big and big["resume"]["median_ms"] / 1000, 1.0, "s")
    mem = r.get("memory")
    value = mem["hibernated_added_mib"] if mem and mem["hibernated"] == 100 else None
    add("RSS added by 100 saved chats", value, 1.0, "MiB")
