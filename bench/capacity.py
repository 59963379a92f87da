"""Section: what one host holds: 1,000 saved chats and 50 live kernels.

The fill, with the product's defaults (kernels on ptrace, warm starts from the template, saved images
compressed):

1. `SOURCES` chats saved the product's way (`KernelPool.run`, then saved as the idle reaper saves):
   most are data kernels (a CSV read with pandas, a matplotlib figure drawn), a fifth of those with two
   branch states (the Python state copied while the kernel runs, as the conversation's branches keep
   them: `KernelPool.snapshot`), the rest plain kernels (`x = 1`);
2. those copied, file by file (real copies, not links), into 1,000 chats of 50 users: each its own
   folder, state folder and registry entry, as the pool leaves a saved chat;
3. 50 live kernels beside them, idle: 10 data kernels and 40 plain ones (50 data kernels would take
   about 15 GiB of this shared machine; each kind's memory is measured, and the sizing uses it).

Then:

(a) disk: what the saved chats' state folders take, per chat and per kind; floor: the same images as
    runsc wrote them (their recorded sizes before compression);
(b) memory: the PSS of each live kernel's host processes, per kind (a saved chat runs nothing); floor:
    a bare python kept alive in one `runsc run` of the same sandbox (bench/_floors.py);
(c) idle CPU: the 50 live kernels' host processes and this process (their watchers, the reaper) over
    one window, per kernel; floor: the bare python, in the same window;
(d) resume: a sample of the saved chats, each image dropped from the page cache first (a chat that
    slept while others ran), resumed to its next answer (which must show its state), p50 and p95;
    floor: a cold kernel start and first print(1), interleaved with them;
(e) the warm step (`KernelPool.run` of print(1)) into a live kernel with the host full, against the
    same step before the fill.

From these, what a host of this size holds: live kernels by memory, saved chats by disk, and the idle
CPU of the live ones (docs/operations.md, "Sizing a host"). Quick mode (CI) fills 20 chats from 4,
with 3 live kernels; like every section it fails on errors (a resume that does not give back its state,
a sentence where none is due), never on timings.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import random
import resource
import shutil
import time
from pathlib import Path
from typing import Any

from runner import KernelPool, KernelSettings, Limits, _hibernate
from runner._kernel_watch import _cpu_seconds
from runner._procs import pids_by_marker

from . import _floors
from ._common import Context, evict_image, percentile, pss_kib, summary
from ._tables import ms, table

SECTION = "capacity"
LIMITS = Limits(timeout_s=60, memory_mb=1024)
DATA = (
    "import pandas as pd, matplotlib.pyplot as plt\n"
    "df = pd.read_csv('sales.csv')\n"
    "summary = df.groupby('region').sum()\n"
    "fig = plt.figure()\nplt.plot(df['units'])\n"
    "print(len(df))"
)
DATA_NEXT = "top = summary.sort_values('units').tail(3)\nprint(len(top))"
PLAIN = "x = 1\nprint(x)"
CHECK = {"data": ("print(len(df), len(summary))", "1000 4\n"), "plain": ("print(x)", "1\n")}
RESERVE_GIB = 4  # the host itself and Open WebUI (one worker holds about 1.2 GiB here)
TARGETS = {"resume_p95_s": 1.0, "fifty_idle_share_of_core": 0.05}


@dataclasses.dataclass
class _Chat:
    key: str
    folder: Path
    state: Path
    kind: str  # "data", "data+branches" or "plain"
    branches: Path | None = None


def _csv() -> str:
    rows = [f"{i},{('north', 'south', 'east', 'west')[i % 4]},{i % 17}" for i in range(1000)]
    return "day,region,units\n" + "\n".join(rows) + "\n"


def _du(paths: list[Path]) -> int:
    """Bytes allocated on disk under these folders (what `du` counts)."""
    total = 0
    for top in paths:
        for root, _dirs, files in os.walk(top):
            for name in files:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


def _raw_bytes(folders: list[Path]) -> int:
    """What the saved images under these folders would take as runsc wrote them."""
    total = 0
    for top in folders:
        for meta_path in top.rglob(_hibernate.META):
            meta = json.loads(meta_path.read_text())
            packed = {name + _hibernate.ZSTD_SUFFIX for name in meta.get("unpacked", {})}
            total += sum(meta.get("unpacked", {}).values())
            total += sum(size for name, (size, _) in meta["files"].items() if name not in packed)
    return total


def _charged_kib(kernel: Any) -> int | None:
    """The memory charged to a kernel's cgroup (what its memory limit counts: the sentry's memory
    file, gVisor's own, the page cache its files brought in), KiB; None without cgroups."""
    cgroup = kernel.sandbox.cgroup
    if cgroup is None:
        return None
    name = "memory.current" if cgroup.support.version == 2 else "memory.usage_in_bytes"
    try:
        return int(Path(cgroup.memory_dir, name).read_text()) // 1024
    except (OSError, ValueError):
        return None


def _own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class _Host:
    def __init__(self, ctx: Context, pool: KernelPool) -> None:
        self.base = ctx.scratch / SECTION
        self.pool = pool
        self.count = 0

    def chat(self, kind: str, prefix: str = "c") -> _Chat:
        self.count += 1
        user = f"u{self.count % 50}"
        name = f"{prefix}{self.count}"
        folder = self.base / "sessions" / user / name
        folder.mkdir(parents=True)
        (folder / "sales.csv").write_text(_csv())
        state = self.base / "state" / user / f"{name}.kernel"
        return _Chat(f"{user}/{name}", folder, state, kind)

    async def run(self, chat: _Chat, code: str, want: str | None = None) -> float:
        start = time.perf_counter()
        done = await self.pool.run(chat.key, chat.folder, code, "python", LIMITS, state_dir=chat.state)
        elapsed = time.perf_counter() - start
        if not done.ok or done.notes or (want is not None and done.stdout != want):
            raise RuntimeError(
                f"{chat.key} {code[:30]!r}: {done.outcome} {done.stdout[-200:]!r} {done.notes} "
                f"{done.reason} {done.stderr[-300:]}"
            )
        return elapsed

    async def save(self, chat: _Chat) -> None:
        why = await self.pool.hibernate(chat.key)
        if why is not None:
            raise RuntimeError(f"{chat.key} was not saved: {why}")

    async def source(self, kind: str) -> _Chat:
        """A chat saved the product's way."""
        chat = self.chat(kind, "s")
        if kind == "plain":
            await self.run(chat, PLAIN, "1\n")
        else:
            await self.run(chat, DATA, "1000\n")
            if kind == "data+branches":
                chat.branches = self.base / "branches" / chat.key
                for n, code in ((1, DATA_NEXT), (2, "later = 1")):
                    image, why = await self.pool.snapshot(chat.key, chat.branches / f"m{n}")
                    if not image:
                        raise RuntimeError(f"{chat.key}: no branch state: {why}")
                    await self.run(chat, code)
        await self.save(chat)
        return chat

    def copy(self, source: _Chat) -> _Chat:
        """A saved chat like `source`: its image and branch states copied byte for byte."""
        chat = self.chat(source.kind)
        chat.state.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(source.state, chat.state, copy_function=shutil.copyfile)
        if source.branches is not None:
            chat.branches = self.base / "branches" / chat.key
            shutil.copytree(source.branches, chat.branches, copy_function=shutil.copyfile)
        registry = self.pool._registry
        entry = registry.get(source.key)
        assert entry is not None and entry.image
        registry.save(dataclasses.replace(entry, key=chat.key, workdir=str(chat.folder)))
        return chat


async def run(ctx: Context) -> dict[str, Any]:
    saved_count = 20 if ctx.quick else 1000
    sources_count = 4 if ctx.quick else 40
    live_data, live_plain = (1, 2) if ctx.quick else (10, 40)
    sample = 4 if ctx.quick else 40
    window_s = 3.0 if ctx.quick else 30.0
    steps = 20 if ctx.quick else 200
    result: dict[str, Any] = {"targets": TARGETS, "quick": ctx.quick}
    runner = ctx.runner()
    settings = KernelSettings(idle_s=3600, max_kernels=live_data + live_plain + 8)
    pool = KernelPool(runner, ctx.scratch / SECTION / "registry", settings=settings, warm_start=True)
    host = _Host(ctx, pool)
    live: list[_Chat] = []
    try:
        async with contextlib.AsyncExitStack() as stack:
            # The template, and the warm step with one live kernel: (e)'s floor.
            first = host.chat("plain", "w")
            await host.run(first, "print(1)")
            await pool._warm.wait_built()
            before = [await host.run(first, "print(1)", "1\n") for _ in range(steps)]
            live.append(first)

            # 1. The chats saved the product's way: 4 in 5 data kernels, a fifth of those with branches.
            kinds = [
                "plain" if i % 5 == 4 else "data+branches" if i % 5 == 0 else "data"
                for i in range(sources_count)
            ]
            ctx.log(
                f"{SECTION}: {sources_count} chats saved the product's way ({kinds.count('plain')} plain)"
            )
            started = time.perf_counter()
            sources = [await host.source(kind) for kind in kinds]
            result["sources_s"] = round(time.perf_counter() - started, 1)

            # 2. The fill: copies, byte for byte, as long as the disk keeps 10 GiB free besides.
            per_chat = _du([s.state for s in sources] + [s.branches for s in sources if s.branches])
            need = per_chat / len(sources) * (saved_count - len(sources))
            free = shutil.disk_usage(ctx.scratch).free
            if free - need < 10 * 2**30:
                raise RuntimeError(
                    f"the fill needs {need / 2**30:.1f} GiB and {free / 2**30:.1f} GiB are free"
                )
            ctx.log(f"{SECTION}: filling {saved_count} saved chats ({need / 2**30:.1f} GiB)")
            started = time.perf_counter()
            saved = list(sources)
            for i in range(saved_count - len(sources)):
                saved.append(await asyncio.to_thread(host.copy, sources[i % len(sources)]))
            result["fill_s"] = round(time.perf_counter() - started, 1)

            # 3. The live kernels, idle beside them.
            ctx.log(f"{SECTION}: {live_data} live data kernels and {live_plain} plain ones")
            for kind, count in (("data", live_data), ("plain", live_plain - 1)):
                for _ in range(count):
                    chat = host.chat(kind, "l")
                    await host.run(chat, DATA if kind == "data" else PLAIN)
                    live.append(chat)
            floor_dir = ctx.scratch / SECTION / "floor"
            floor_dir.mkdir()
            bare = await stack.enter_async_context(
                _floors.bare_python(runner, await runner.setup(), floor_dir, LIMITS)
            )

            # (a) disk.
            states = [c.state for c in saved] + [c.branches for c in saved if c.branches]
            # The template's pages the data kernels are stored against: one copy for them all.
            bases = _du([ctx.scratch / SECTION / "registry" / "bases"])
            on_disk = _du(states) + bases
            raw = _raw_bytes(states)
            by_kind: dict[str, list[int]] = {}
            for source in sources:
                folders = [source.state] + ([source.branches] if source.branches else [])
                by_kind.setdefault(source.kind, []).append(_du(folders))
            result["disk"] = {
                "saved_chats": len(saved),
                "gib": round(on_disk / 2**30, 2),
                "template_pages_mib": round(bases / 2**20, 1),
                "per_chat_mib": round(on_disk / len(saved) / 2**20, 2),
                "uncompressed_per_chat_mib": round(raw / len(saved) / 2**20, 2),
                "per_kind_mib": {k: round(sum(v) / len(v) / 2**20, 2) for k, v in by_kind.items()},
                "kinds": {k: sum(1 for c in saved if c.kind == k) for k in by_kind},
            }

            # (b) memory and (c) idle CPU, one window.
            await asyncio.sleep(3.0)  # the watchers settle into their idle pace
            kernels = pool.kernels()
            pids = {c.key: kernels[c.key].host_pids() for c in live}
            bare_pids = pids_by_marker(str(bare.bundle))
            memory = {c.key: pss_kib(p) for c, p in zip(live, pids.values(), strict=True)}
            charged = {c.key: _charged_kib(kernels[c.key]) for c in live}
            cpu_before = {k: _cpu_seconds(p) for k, p in pids.items()}
            bare_before, own_before, t0 = _cpu_seconds(bare_pids), _own_cpu(), time.monotonic()
            ctx.log(f"{SECTION}: {len(live)} live kernels idle for {window_s:g} s")
            await asyncio.sleep(window_s)
            elapsed = time.monotonic() - t0
            sandboxes = sum(_cpu_seconds(p) - cpu_before[k] for k, p in pids.items()) / elapsed
            ours = (_own_cpu() - own_before) / elapsed
            bare_cpu = (_cpu_seconds(bare_pids) - bare_before) / elapsed
            pss = {kind: [memory[c.key] for c in live if c.kind == kind] for kind in ("data", "plain")}
            cgroup = {kind: [charged[c.key] or 0 for c in live if c.kind == kind] for kind in pss}
            result["memory"] = {
                "live": len(live),
                "pss_mib": {k: round(sum(v) / len(v) / 1024, 1) for k, v in pss.items() if v},
                "cgroup_mib": {k: round(sum(v) / len(v) / 1024, 1) for k, v in cgroup.items() if any(v)},
                "floor_bare_python_mib": round(pss_kib(bare_pids) / 1024, 1),
                "live_total_gib": round(sum(memory.values()) / 2**20, 2),
            }
            result["idle_cpu"] = {
                "live": len(live),
                "window_s": window_s,
                "sandboxes_share_of_core": round(sandboxes, 5),
                "ours_share_of_core": round(ours, 5),
                "per_kernel_share_of_core": round((sandboxes + ours) / len(live), 6),
                "floor_bare_python_share_of_core": round(bare_cpu, 6),
                "fifty_idle_share_of_core": round(50 * (sandboxes + ours) / len(live), 4),
            }

            # (d) resume a sample of the saved chats (each from the disk), a cold start between two.
            ctx.log(f"{SECTION}: {sample} saved chats resumed, cold starts between")
            picked = random.Random(34).sample(saved, sample)
            resumes: list[float] = []
            colds: list[float] = []
            for n, chat in enumerate(picked):
                await asyncio.to_thread(evict_image, chat.state)
                code, want = CHECK["plain" if chat.kind == "plain" else "data"]
                resumes.append(await host.run(chat, code, want))
                await pool.stop(chat.key, "done", forget=True)
                if n % 2 == 1:
                    cold = host.chat("plain", "f")
                    pool.warm_start = False
                    colds.append(await host.run(cold, "print(1)", "1\n"))
                    pool.warm_start = True
                    await pool.stop(cold.key, "done", forget=True)
            result["resume"] = {
                "sampled": sample,
                "p50_s": round(percentile(resumes, 0.5), 3),
                "p95_s": round(percentile(resumes, 0.95), 3),
                "cold_start": summary(colds),
                "registry_entries": len(list((ctx.scratch / SECTION / "registry").glob("*.json"))),
            }

            # (e) the warm step with the host full, against before the fill.
            after = [await host.run(first, "print(1)", "1\n") for _ in range(steps)]
            result["warm_step"] = {
                "before_fill": summary(before),
                "host_full": summary(after),
                "ratio": round(percentile(after, 0.5) / percentile(before, 0.5), 3),
            }
            result["host"] = _holds(result)
    finally:
        for chat in live:  # not saved: nothing of this section is kept
            with contextlib.suppress(Exception):
                await pool.stop(chat.key, "done", forget=True)
        await pool.close()
        await asyncio.to_thread(shutil.rmtree, ctx.scratch / SECTION, True)
    return result


def _holds(r: dict[str, Any]) -> dict[str, Any]:
    """What a host of this size holds, from what was measured."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    room = ram - RESERVE_GIB * 2**30
    # Per kind, the larger of what its processes map (PSS) and what its cgroup is charged.
    charged = r["memory"].get("cgroup_mib", {})
    pss = {k: max(v, charged.get(k, 0.0)) for k, v in r["memory"]["pss_mib"].items()}
    per_saved = r["disk"]["per_chat_mib"] * 2**20
    return {
        "ram_gib": round(ram / 2**30, 1),
        "cores": os.cpu_count(),
        "reserve_gib": RESERVE_GIB,
        "live_data_kernels": int(room / (pss["data"] * 2**20)) if "data" in pss else None,
        "live_plain_kernels": int(room / (pss["plain"] * 2**20)) if "plain" in pss else None,
        "saved_chats_per_100_gib": int(100 * 2**30 / per_saved),
        "idle_cpu_of_fifty_live": r["idle_cpu"]["fifty_idle_share_of_core"],
    }


def render(r: dict[str, Any]) -> str:

    if "disk" not in r:
        return "(no data)"
    d, m, c, res, w = r["disk"], r["memory"], r["idle_cpu"], r["resume"], r["warm_step"]
    kinds = ", ".join(f"{n} {k}" for k, n in d["kinds"].items())
    rows = [
        ["saved chats", f"{d['saved_chats']:,} ({kinds})", ""],
        [
            "disk, all saved chats",
            f"{d['gib']} GiB",
            f"of which the template's pages {d['template_pages_mib']} MiB",
        ],
        [
            "disk per saved chat",
            f"{d['per_chat_mib']} MiB",
            f"{d['uncompressed_per_chat_mib']} MiB uncompressed",
        ],
        *[[f"  {k}", f"{v} MiB", ""] for k, v in d["per_kind_mib"].items()],
        ["live kernels, idle", str(m["live"]), ""],
        *[
            [
                f"  memory per live {k} kernel: PSS / its cgroup",
                f"{v} / {m.get('cgroup_mib', {}).get(k, '-')} MiB",
                f"{m['floor_bare_python_mib']} MiB a bare python (PSS)",
            ]
            for k, v in m["pss_mib"].items()
        ],
        ["  memory of all live kernels", f"{m['live_total_gib']} GiB", ""],
        [
            "idle CPU per live kernel (sandbox + ours)",
            f"{100 * c['per_kernel_share_of_core']:.4f}% of a core",
            f"{100 * c['floor_bare_python_share_of_core']:.4f}% a bare python",
        ],
        ["  50 idle live kernels", f"{100 * c['fifty_idle_share_of_core']:.2f}% of a core", ""],
        [
            "resume from the disk, p50 / p95",
            f"{res['p50_s']:.3f} / {res['p95_s']:.3f} s",
            f"cold start {ms(res['cold_start'])} ms",
        ],
        ["warm step, host full", f"{ms(w['host_full'])} ms", f"before the fill {ms(w['before_fill'])} ms"],
        ["saved a chat the product's way / filled", f"{r['sources_s']} s / {r['fill_s']} s", ""],
    ]
    parts = [table(["", "measured", "floor"], rows, right=())]
    h = r.get("host")
    if h:
        size = f"a host of {h['ram_gib']} GiB and {h['cores']} cores"
        live = f"{h['live_data_kernels']} live data kernels (or {h['live_plain_kernels']} plain ones)"
        parts.append(
            f"{size}, {h['reserve_gib']} GiB kept for itself and Open WebUI, holds {live} and "
            f"{h['saved_chats_per_100_gib']:,} saved chats per 100 GiB of disk; 50 idle live kernels use "
            f"{100 * h['idle_cpu_of_fifty_live']:.2f}% of a core"
        )
    return "\n".join(parts)


def targets(r: dict[str, Any], add: Any) -> None:
    res = r.get("resume")
    value = None if not res or r.get("quick") else res["p95_s"]
    add("resume of a saved chat from the disk, p95, host full", value, TARGETS["resume_p95_s"], "s")
    cpu = r.get("idle_cpu")
    value = None if not cpu or r.get("quick") else 100 * cpu["fifty_idle_share_of_core"]
    add("50 idle live kernels with the host full, share of one core", value, 5.0, "%")
