"""Section 1: what a chat step costs on top of gVisor itself.

(a) bare: `runsc run` of a bundle built by the runner's own code (`runner._bundle.make_spec`, same
    rootfs image, mounts, rlimits, memory/pids limits, same runsc flags from `Runner._runsc_argv`),
    the session folder at /mnt/data, and a fresh cgroup path that runsc creates and removes itself.
    Timed from spawn to exit with stdout/stderr drained; writing config.json and removing the bundle
    afterwards are not timed. No lock, quota, reconcile, rewrite, watchers or cgroup bookkeeping.
(b) full: `Engine.chat()` -> `ChatSession.run("print(1)", "python")` -> `ChatSession.rewrite()` of
    an answer with no path in it, timed end to end: session row, lock, quota check, bundle, cgroup,
    disk and OOM watchers, runsc, cleanup, reconcile, rewrite.

Pairs are interleaved (AB, BA, AB, ...) in one process so that drift of this shared machine hits both
sides alike; we report medians, p25/p75, the ratio of medians and the median of per-pair ratios.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from engine import Engine
from runner import HostSetup, Limits, Runner, RunResult
from runner import _bundle as runner_bundle
from storage import Store

from ._common import ANSWER_WITHOUT_PATHS, CGROUP_PARENT, Context, make_files, ratio_summary, summary

SECTION = "run_overhead"
CODE = "print(1)"
TARGETS = {"empty": 1.15, "10k files": 1.25}


async def bare_run(runner: Runner, setup: HostSetup, workdir: Path, limits: Limits) -> tuple[float, bytes]:
    """One `runsc run` of the runner's own bundle; returns (seconds, stdout)."""
    cid = "bench-" + secrets.token_hex(8)
    bundle = runner_bundle.write_bundle(runner.bundle_dir, cid, CODE, "python")
    try:
        spec = runner_bundle.make_spec(
            rootfs=setup.rootfs,
            bundle=bundle,
            workdir=workdir,
            language="python",
            interpreter=runner._interpreter("python"),
            limits=limits,
            uid=runner.sandbox_uid,
            gid=runner.sandbox_gid,
            # runsc creates this cgroup from the spec's resources, and deletes it when the sandbox exits
            cgroups_path=f"/{CGROUP_PARENT}/{cid}" if setup.cgroups is not None else None,
            rlimit_as=setup.cgroups is None,
            netns_path=None,
        )
        (bundle / "config.json").write_text(json.dumps(spec), encoding="utf-8")
        argv = [*runner._runsc_argv(setup, bundle), "run", "--bundle", str(bundle), cid]
        start = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        out, err = await proc.communicate()
        elapsed = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(f"bare runsc exited {proc.returncode}: {err.decode(errors='replace')[-300:]}")
        return elapsed, out
    finally:
        await asyncio.to_thread(shutil.rmtree, bundle, True)


class PhaseProbe:
    """Times the parts of one full step by wrapping the calls the engine makes on these instances."""

    def __init__(self) -> None:
        self.current: dict[str, float] = {}
        self.runs: list[RunResult] = []

    def wrap(self, name: str, fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return await fn(*args, **kwargs)
            finally:
                self.current[name] = self.current.get(name, 0.0) + time.perf_counter() - start

        return timed


async def full_step(
    service: Engine, user: str, chat_id: str, probe: PhaseProbe | None, *, code: str = CODE
) -> tuple[float, str, dict[str, float]]:
    """The engine's path for one step; returns (seconds, stdout, phases in seconds)."""
    start = time.perf_counter()
    chat = await service.chat(user, chat_id)
    t_chat = time.perf_counter()
    if probe is not None:
        probe.current = {}
        session = chat.session
        session.run_budget = probe.wrap("run_budget", session.run_budget)
        session.reconcile = probe.wrap("reconcile", session.reconcile)
    step = await chat.run(code, "python")
    t_run = time.perf_counter()
    await chat.rewrite(ANSWER_WITHOUT_PATHS)
    end = time.perf_counter()
    if step.run is None:
        raise RuntimeError(f"the step was not run: {step.refused}")
    if step.run.outcome != "ok":
        raise RuntimeError(f"the step ended {step.run.outcome}: {step.run.reason} {step.run.stderr[-300:]}")
    phases: dict[str, float] = {}
    if probe is not None:
        got = probe.current
        runner_total = got.get("runner.run", 0.0)
        runsc = step.run.duration_s
        phases = {
            "chat() (session row)": t_chat - start,
            "run_budget (quota)": got.get("run_budget", 0.0),
            "runsc process": runsc,
            "runner around runsc": runner_total - runsc,
            "reconcile": got.get("reconcile", 0.0),
            "lock and the rest": (t_run - t_chat)
            - got.get("run_budget", 0.0)
            - runner_total
            - got.get("reconcile", 0.0),
            "rewrite": end - t_run,
        }
    return end - start, step.run.stdout, phases


async def _scenario(
    ctx: Context, store: Store, service: Engine, probe: PhaseProbe, name: str, files: int, pairs: int
) -> dict[str, Any]:
    runner = service.runner
    setup = await runner.setup()
    user, chat_id = f"overhead-{files}", f"chat-{files}"
    session = await store.session(user, chat_id)
    if files:
        ctx.log(f"{SECTION}: creating {files} files in the session")
        await asyncio.to_thread(make_files, session.path, files)
        await session.reconcile(enforce_quotas=False)
    bare_times: list[float] = []
    full_times: list[float] = []
    phases: dict[str, list[float]] = defaultdict(list)

    async def a() -> float:
        elapsed, out = await bare_run(runner, setup, session.path, service.settings.limits)
        if out != b"1\n":
            raise RuntimeError(f"bare runsc printed {out[:100]!r}")
        return elapsed

    async def b() -> float:
        elapsed, out, got = await full_step(service, user, chat_id, probe)
        if out != "1\n":
            raise RuntimeError(f"full path printed {out[:100]!r}")
        for key, value in got.items():
            phases[key].append(value)
        return elapsed

    for _ in range(2):  # warm-up: page cache, image, first cgroup of each kind
        await a()
        await b()
    phases.clear()
    ctx.log(f"{SECTION}: {name}: {pairs} interleaved pairs")
    for i in range(pairs):
        if i % 2 == 0:
            bare_times.append(await a())
            full_times.append(await b())
        else:
            full_times.append(await b())
            bare_times.append(await a())
    pair_ratios = [f / b_ for f, b_ in zip(full_times, bare_times, strict=True)]
    bare_s, full_s = summary(bare_times), summary(full_times)
    ratio = full_s["median_ms"] / bare_s["median_ms"]
    return {
        "session_files": files,
        "pairs": pairs,
        "bare_runsc": bare_s,
        "full_path": full_s,
        "ratio_of_medians": round(ratio, 4),
        "pair_ratio": ratio_summary(pair_ratios),
        "overhead_ms": round(full_s["median_ms"] - bare_s["median_ms"], 2),
        "phases": {k: summary(v) for k, v in phases.items()},
        "target_ratio": TARGETS.get(name),
    }


async def run(ctx: Context) -> dict[str, Any]:
    pairs = 3 if ctx.quick else 30
    scenarios = [("empty", 0), ("100 files" if ctx.quick else "10k files", 100 if ctx.quick else 10_000)]
    result: dict[str, Any] = {"code": CODE, "limits": Limits().model_dump(), "scenarios": {}}
    runner = ctx.runner()
    probe = PhaseProbe()
    original_run = runner.run

    async def timed_run(*args: Any, **kwargs: Any) -> RunResult:
        return await probe.wrap("runner.run", original_run)(*args, **kwargs)

    runner.run = timed_run
    try:
        async with ctx.store("overhead") as store:
            service = Engine(store, runner)
            for name, files in scenarios:
                try:
                    result["scenarios"][name] = await _scenario(
                        ctx, store, service, probe, name, files, pairs
                    )
                except Exception as exc:  # a failed scenario is an error of the run, not a crash of it
                    ctx.error(SECTION, f"{name}: {type(exc).__name__}: {exc}")
    finally:
        del runner.run  # back to the class's method
    try:
        result["spawn"] = await _spawn(ctx)
    except Exception as exc:
        ctx.error(SECTION, f"spawn: {type(exc).__name__}: {exc}")
    return result


SPAWN_BALLAST_MIB = 1024  # an Open WebUI worker's size, roughly (1.2 GB RSS measured)


async def _spawn(ctx: Context) -> dict[str, Any]:
    """Starting a process that must die with us, as runsc is started: through setpriv (a vfork) and
    through the preexec_fn fallback (a fork), interleaved, from this process as it is and holding
    SPAWN_BALLAST_MIB of touched memory. The time is the event loop's: from the call to the child's
    existence."""
    from runner import _supervise

    if _supervise.setpriv_prefix() is None:
        raise RuntimeError("setpriv is missing: the preexec_fn fallback is all there is")
    reps = 5 if ctx.quick else 30

    async def spawn(fallback: bool) -> float:
        argv, preexec = (
            (["/bin/true"], _supervise.die_with(os.getpid()))
            if fallback
            else _supervise.dying_with_us(["/bin/true"])
        )
        start = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(*argv, preexec_fn=preexec, start_new_session=True)
        elapsed = time.perf_counter() - start
        if await proc.wait() != 0:
            raise RuntimeError(f"{argv} exited {proc.returncode}")
        return elapsed

    out: dict[str, Any] = {"ballast_mib": SPAWN_BALLAST_MIB}
    for label, mib in (("as is", 0), ("holding ballast", SPAWN_BALLAST_MIB)):
        ballast = bytearray(mib * 1024 * 1024)
        for i in range(0, len(ballast), 4096):  # touched: page tables a fork must copy
            ballast[i] = 1
        times: dict[str, list[float]] = {"setpriv": [], "preexec_fn": []}
        for i in range(reps):
            for fallback in (False, True) if i % 2 == 0 else (True, False):
                times["preexec_fn" if fallback else "setpriv"].append(await spawn(fallback))
        del ballast
        out[label] = {name: summary(t) for name, t in times.items()}
    return out
