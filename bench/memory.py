"""Section 5: peak RSS of the host side (our Python process), each scenario in a fresh process.

* a run whose code prints 50 MB (the runner keeps 64 KiB and stops the sandbox), after a warm-up step;
* the first reconcile of a 100k-file session (indexes everything), then, in another fresh process,
  a reconcile that finds one changed file among the 100k.

The child measures VmRSS just before the operation, resets the high-water mark (/proc/self/clear_refs)
and reads VmHWM afterwards, so imports, setup and file creation do not count. gVisor's own processes
are not ours and not counted (their memory is bounded by the run's cgroup).

Child mode: python -m bench.memory {run|reconcile-first|reconcile-change} ARGS (prints one JSON line).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ._common import BENCH_QUOTAS, CGROUP_PARENT, Context, make_files, reset_peak_rss, status_kib

SECTION = "memory"
REPO = Path(__file__).resolve().parent.parent


def _print_code(mb: int) -> str:
    return (
        f"import sys\nline = 'x' * 1023 + '\\n'\nfor _ in range({mb} * 1024):\n    sys.stdout.write(line)\n"
    )


def _measure_start() -> dict[str, Any]:
    rss = status_kib("VmRSS")
    reset = reset_peak_rss()
    return {"rss_before_kib": rss, "hwm_reset": reset}


def _measure_end(start: dict[str, Any], seconds: float) -> dict[str, Any]:
    peak = status_kib("VmHWM") if start["hwm_reset"] else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    before = start["rss_before_kib"] or 0
    return {
        "rss_before_mib": round(before / 1024, 1),
        "peak_mib": round((peak or 0) / 1024, 1),
        "growth_mib": round(((peak or 0) - before) / 1024, 1),
        "seconds": round(seconds, 3),
        "peak_is": "VmHWM after reset" if start["hwm_reset"] else "ru_maxrss of the whole process",
    }


async def _child_run(args: argparse.Namespace) -> dict[str, Any]:
    from engine import Engine
    from runner import Runner, RunnerConfig
    from storage import DirectoryPublisher, Store

    base = Path(args.runner_base)
    runner = Runner(
        RunnerConfig(state_dir=base / "state", bundle_dir=base / "bundles", cgroup_parent=CGROUP_PARENT)
    )
    root = Path(args.dir)
    store = Store(
        root / "sessions-root",
        quotas=BENCH_QUOTAS,
        publisher=DirectoryPublisher(root / "cache", "/cache/functions/bench-memory/"),
        owner=(runner.sandbox_uid, runner.sandbox_gid),
    )
    async with store:
        service = Engine(store, runner)
        chat = await service.chat("memory-user", "memory-chat")
        warm = await chat.run("print(1)", "python")  # setup, image, imports: not part of the peak
        if warm.run is None or warm.run.outcome != "ok":
            raise RuntimeError(f"warm-up step failed: {warm.refused or warm.run}")
        start = _measure_start()
        t = time.perf_counter()
        step = await chat.run(_print_code(args.mb), "python")
        await chat.rewrite("done")
        out = _measure_end(start, time.perf_counter() - t)
    if step.run is None:
        raise RuntimeError(f"not run: {step.refused}")
    out.update(
        printed_mb=args.mb,
        outcome=str(step.run.outcome),
        reason=step.run.reason,
        stdout_kept_kib=round(len(step.run.stdout.encode()) / 1024, 1),
    )
    if step.run.outcome not in ("ok", "output_limit") or not step.run.stdout.startswith("x" * 1023):
        raise RuntimeError(f"unexpected run: {step.run.outcome} {step.run.reason} {step.run.stderr[-200:]!r}")
    return out


async def _child_reconcile(args: argparse.Namespace, first: bool) -> dict[str, Any]:
    from storage import Store

    async with Store(Path(args.dir) / "sessions-root", quotas=BENCH_QUOTAS) as store:
        session = await store.session("memory-user", "reconcile-chat")
        if first:
            await asyncio.to_thread(make_files, session.path, args.files)
        else:
            (session.path / "d000" / "f0000.txt").write_bytes(b"changed")
        start = _measure_start()
        t = time.perf_counter()
        report = await session.reconcile(enforce_quotas=not first)
        out = _measure_end(start, time.perf_counter() - t)
    expected = (report.files == args.files) and (first or report.changed == ["d000/f0000.txt"])
    if not expected:
        raise RuntimeError(f"reconcile: {report.summary()}")
    out["files"] = args.files
    return out


def _child(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.memory")
    parser.add_argument("mode", choices=["run", "reconcile-first", "reconcile-change"])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--runner-base", default="")
    parser.add_argument("--mb", type=int, default=50)
    parser.add_argument("--files", type=int, default=100_000)
    args = parser.parse_args(argv)
    if args.mode == "run":
        out = asyncio.run(_child_run(args))
    else:
        out = asyncio.run(_child_reconcile(args, first=args.mode == "reconcile-first"))
    print(json.dumps(out))


def _spawn(args: list[str]) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "bench.memory", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        raise RuntimeError(f"child {args[0]} exited {done.returncode}: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


async def run(ctx: Context) -> dict[str, Any]:
    mb = 5 if ctx.quick else 50
    files = 1_000 if ctx.quick else 100_000
    base = ctx.scratch / "memory"
    result: dict[str, Any] = {}
    jobs = [
        (
            "run_printing",
            ["run", "--dir", str(base / "run"), "--runner-base", str(ctx.runner_base), "--mb", str(mb)],
        ),
        ("reconcile_first", ["reconcile-first", "--dir", str(base / "rec"), "--files", str(files)]),
        ("reconcile_one_change", ["reconcile-change", "--dir", str(base / "rec"), "--files", str(files)]),
    ]
    for name, args in jobs:
        ctx.log(f"{SECTION}: {name} in a fresh process")
        try:
            result[name] = await asyncio.to_thread(_spawn, args)
        except Exception as exc:
            ctx.error(SECTION, f"{name}: {type(exc).__name__}: {exc}")
    return result


if __name__ == "__main__":
    _child(sys.argv[1:])
