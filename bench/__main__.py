"""python -m bench [--quick] [--json PATH] [--only SECTIONS] [--dir DIR] [--no-tmpfs] [--keep]

Runs the benchmarks of issue #6, prints a table to stdout (progress goes to stderr) and writes the
results as JSON (default bench/results/<timestamp>.json). Exits 1 if anything went wrong (a failed run,
a wrong output, an exception), never because of a timing. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import shutil
import sqlite3
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from . import (
    branches,
    capacity,
    concurrency,
    deleted_chats,
    environment,
    exports,
    filter_stream,
    hibernate,
    idle,
    index_backends,
    index_scale,
    kernel,
    memory,
    previews,
    report,
    rewrite,
    run_overhead,
    uploads,
)
from ._common import CGROUP_PARENT, Context, filesystem_of

REPO = Path(__file__).resolve().parent.parent
SECTIONS: dict[str, Callable[[Context], Awaitable[dict[str, Any]]]] = {
    "run_overhead": run_overhead.run,
    "index_scale": index_scale.run,
    "concurrency": concurrency.run,
    "rewrite": rewrite.run,
    "memory": memory.run,
    "kernel": kernel.run,
    "deleted_chats": deleted_chats.run,
    "filter_stream": filter_stream.run,
    "previews": previews.run,
    "hibernate": hibernate.run,
    "idle_kernels": idle.run,
    "index_backends": index_backends.run,
    "environment": environment.run,
    "branches": branches.run,
    "uploads": uploads.run,
    "capacity": capacity.run,
    "exports": exports.run,
}
# Sections that render their own table and targets (bench/report.py renders the others).


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[1])
    parser.add_argument("--quick", action="store_true", help="CI mode: tiny sizes, few repetitions (< 60 s)")
    parser.add_argument(
        "--json", type=Path, help="where to write the results (default bench/results/<time>.json)"
    )
    parser.add_argument("--only", help=f"comma-separated sections: {', '.join(SECTIONS)}")
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp"), help="scratch on the real disk")
    parser.add_argument("--no-tmpfs", action="store_true", help="skip the index measurements on /dev/shm")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folders")
    args = parser.parse_args(argv)
    if args.only:
        unknown = set(args.only.split(",")) - set(SECTIONS)
        if unknown:
            parser.error(f"unknown sections: {', '.join(sorted(unknown))}")
    return args


def _machine() -> str:
    model = "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as fh:
        for line in fh:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3
    return f"{os.cpu_count()} cpus ({model}), {mem:.1f} GiB RAM, Linux {platform.release()}"


async def _software(ctx: Context) -> str:
    text = f"Python {platform.python_version()}, SQLite {sqlite3.sqlite_version}"
    try:
        setup = await ctx.runner().setup()
    except Exception as exc:
        return f"{text}, runsc unavailable ({exc})"
    cg = f"cgroup v{setup.cgroups.version}" if setup.cgroups else "no cgroups"
    platforms = f"{setup.platform}, kernels on {setup.kernel_platform}"
    return f"{text}, runsc {setup.runsc.version} ({platforms}, {cg})"


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _remove_cgroup_parent() -> None:
    """rmdir the bench's cgroup parent in every hierarchy (runsc and the runner leave it behind)."""
    from runner._cgroups import _cgroup_mounts

    with contextlib.suppress(OSError):
        for mount, _fs, _opts in _cgroup_mounts():
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(mount, CGROUP_PARENT))


async def _main(args: argparse.Namespace) -> int:
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    scratch = args.dir / f"code-sessions-bench-{stamp}-{os.getpid()}"
    runner_base = Path("/run") / f"code-sessions-bench-{os.getpid()}"
    tmpfs = None if args.no_tmpfs or args.quick else Path("/dev/shm") / scratch.name
    for folder in (scratch, runner_base, tmpfs):
        if folder is not None:
            folder.mkdir(parents=True, mode=0o700)
    ctx = Context(quick=args.quick, scratch=scratch, runner_base=runner_base, tmpfs_scratch=tmpfs)
    started = time.perf_counter()
    results: dict[str, Any] = {
        "meta": {
            "mode": "quick" if args.quick else "full",
            "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": _machine(),
            "software": await _software(ctx),
            "scratch": f"{scratch} ({filesystem_of(scratch)})",
            "tmpfs_scratch": str(tmpfs) if tmpfs else None,
            "runner_base": f"{runner_base} ({filesystem_of(runner_base)})",
            "load_before": _load(),
        },
        "sections": {},
    }
    wanted = args.only.split(",") if args.only else list(SECTIONS)
    try:
        for name in wanted:
            ctx.log(f"section {name}")
            t = time.perf_counter()
            try:
                results["sections"][name] = await SECTIONS[name](ctx)
            except Exception as exc:
                ctx.error(name, f"{type(exc).__name__}: {exc}")
                results["sections"][name] = {}
            results["sections"][name]["seconds"] = round(time.perf_counter() - t, 1)
    finally:
        if not args.keep:
            for folder in (scratch, runner_base, tmpfs):
                if folder is not None:
                    await asyncio.to_thread(shutil.rmtree, folder, True)
        _remove_cgroup_parent()
    results["meta"]["load_after"] = _load()
    results["meta"]["seconds"] = round(time.perf_counter() - started, 1)
    results["targets"] = report.targets(results)
    results["errors"] = ctx.errors

    path = args.json or REPO / "bench" / "results" / f"{stamp}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(report.render(results))
    print(f"\nresults: {path} ({results['meta']['seconds']:.0f} s)")
    return 1 if ctx.errors else 0


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if os.geteuid() != 0:
        print("python -m bench needs root (gVisor's runsc does)", file=sys.stderr)
        return 2
    return asyncio.run(_main(args))


if __name__ == "__main__":
    sys.exit(main())
