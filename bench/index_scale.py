"""Section 2: the index at scale.

* reconcile after a run that changed one file, in sessions of 1k, 10k and 100k files (also: the first
  reconcile that indexes everything, and a reconcile that finds nothing), interleaved with the bare
  `scandir` + `lstat` walk of the same folder, the floor any listing-based reconcile pays;
* the quota check of a user with 100 sessions, among 100k session rows;
* cleanup of expired files (1k, 10k, 100k): what the caller waits for (the files renamed into the
  trash, one rename per folder, and the index written), and the trash's emptying in the background
  after it, next to a bare `rename` of as many folders and a bare `unlink` loop over as many files;
* the CLI's `usage` on the 100k-file index (a fresh process, as an admin runs it).
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from storage import Expiry, Policy, Store

from ._common import (
    BENCH_QUOTAS,
    Context,
    bare_rename,
    bare_unlink,
    bare_walk,
    filesystem_of,
    make_files,
    ratio_summary,
    summary,
)

SECTION = "index_scale"
TARGET_ONE_CHANGE_MS = {10_000: 50.0, 100_000: 500.0}
TARGET_QUOTA_MS = 5.0
TARGET_CLEANUP_100K_S = 1.5  # what the caller waits for; the unlinks run in the background
REPO = Path(__file__).resolve().parent.parent


def _reps(size: int, quick: bool) -> int:
    if quick:
        return 3
    return {1_000: 41, 10_000: 21}.get(size, 7)


async def _reconcile_size(ctx: Context, store: Store, size: int) -> dict[str, Any]:
    session = await store.session("index-user", f"chat-{size}")
    start = time.perf_counter()
    await asyncio.to_thread(make_files, session.path, size)
    created = time.perf_counter() - start

    start = time.perf_counter()
    first = await session.reconcile(enforce_quotas=False)
    first_s = time.perf_counter() - start
    if first.files != size:
        raise RuntimeError(f"first reconcile indexed {first.files} files, expected {size}")

    target = session.path / "d000" / "f0000.txt"
    one_change: list[float] = []
    one_hint: list[float] = []
    no_change: list[float] = []
    walk: list[float] = []
    n = 0

    async def changed() -> None:
        nonlocal n
        n += 1
        target.write_bytes(b"y" * (n + 1))  # the run's change; not timed
        t = time.perf_counter()
        report = await session.reconcile()
        one_change.append(time.perf_counter() - t)
        if report.changed != ["d000/f0000.txt"] or report.added or report.removed:
            raise RuntimeError(f"reconcile after one change: {report.summary()}")

    async def unchanged() -> None:
        t = time.perf_counter()
        report = await session.reconcile()
        no_change.append(time.perf_counter() - t)
        if report.changed or report.added or report.removed:
            raise RuntimeError(f"reconcile with nothing changed: {report.summary()}")

    async def bare() -> None:
        t = time.perf_counter()
        found = await asyncio.to_thread(bare_walk, session.path)
        walk.append(time.perf_counter() - t)
        if found != size:
            raise RuntimeError(f"bare walk found {found} files, expected {size}")

    async def hinted() -> None:
        # What a chat step does: the runner's watch names the changed path, only it is looked at.
        nonlocal n
        n += 1
        target.write_bytes(b"y" * (n + 1))
        t = time.perf_counter()
        report = await session.reconcile(changed=["d000/f0000.txt"])
        one_hint.append(time.perf_counter() - t)
        if report.full or report.changed != ["d000/f0000.txt"] or report.added or report.removed:
            raise RuntimeError(f"reconcile with a one-path hint: full={report.full} {report.summary()}")

    steps = [changed, bare, unchanged, hinted]
    for i in range(_reps(size, ctx.quick)):
        rotation = i % len(steps)  # rotate the order so no step always follows the same one
        for step in steps[rotation:] + steps[:rotation]:
            await step()
    ratios = [r / w for r, w in zip(one_change, walk, strict=True)]
    ctx.log(
        f"{SECTION}: {size} files: reconcile with a one-path hint {summary(one_hint)['median_ms']:.2f} ms,"
        f" full listing {summary(one_change)['median_ms']:.1f} ms (medians)"
    )
    result = {
        "files": size,
        "create_files_s": round(created, 3),
        "first_reconcile": summary([first_s]),
        "one_change": summary(one_change),
        "one_change_hint": summary(one_hint),
        "no_change": summary(no_change),
        "bare_walk": summary(walk),
        "one_change_over_walk": ratio_summary(ratios),
        "target_ms": TARGET_ONE_CHANGE_MS.get(size),
    }
    return result


async def _cleanup_size(ctx: Context, store: Store, root: Path, size: int, base: Path) -> dict[str, Any]:
    """Expire every file of the size's session, time cleanup; then a bare unlink of as many files."""
    conn = sqlite3.connect(root / "index.sqlite3", isolation_level=None)
    try:
        conn.execute(
            "UPDATE files SET last_changed = 0 WHERE session_id ="
            " (SELECT id FROM sessions WHERE chat_id = ?)",
            (f"chat-{size}",),
        )
    finally:
        conn.close()
    expiry = Policy(expiry=Expiry(file_max_age_s=86_400, session_idle_s=0, temporary_idle_s=0))
    session = await store.session("index-user", f"chat-{size}")
    start = time.perf_counter()
    report = await store.cleanup(policy=expiry)
    cleanup_s = time.perf_counter() - start
    if report.files_removed != size:
        raise RuntimeError(f"cleanup removed {report.files_removed} files, expected {size}")
    visible = await asyncio.to_thread(bare_walk, session.path)
    if visible:
        raise RuntimeError(f"{visible} expired files still in the session after cleanup")
    await store.trash_emptied()
    background_s = time.perf_counter() - start - cleanup_s
    left = await asyncio.to_thread(lambda: os.listdir(root / "trash"))
    if left:
        raise RuntimeError(f"{len(left)} entries left in the trash after its emptying")

    floor = base / f"unlink-{size}"
    aside = base / f"aside-{size}"
    aside.mkdir(exist_ok=True)
    folders = await asyncio.to_thread(make_files, floor, size)
    await asyncio.to_thread(os.sync)  # both start from a clean journal: cleanup ran after a sync too
    start = time.perf_counter()
    moved = await asyncio.to_thread(bare_rename, folders, aside)
    rename_s = time.perf_counter() - start
    start = time.perf_counter()
    removed = await asyncio.to_thread(bare_unlink, moved)
    unlink_s = time.perf_counter() - start
    if removed != size:
        raise RuntimeError(f"bare unlink removed {removed} files, expected {size}")
    return {
        "files": size,
        "folders": len(folders),
        "cleanup": summary([cleanup_s]),
        "background_unlink": summary([background_s]),
        "bare_rename": summary([rename_s]),
        "bare_unlink": summary([unlink_s]),
        "cleanup_over_unlink": round(cleanup_s / unlink_s, 3) if unlink_s else None,
        "background_over_unlink": round(background_s / unlink_s, 3) if unlink_s else None,
        "target_s": TARGET_CLEANUP_100K_S if size == 100_000 else None,
    }


def _usage_cli(root: Path, reps: int) -> dict[str, Any]:
    """`python -m storage usage` in a fresh process, against `python -c 'import storage.cli'`."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cli = [sys.executable, "-m", "storage", "--root", str(root), "usage"]
    startup = [sys.executable, "-c", "import storage.cli"]
    cli_t: list[float] = []
    startup_t: list[float] = []
    for _ in range(reps):
        for argv, times in ((cli, cli_t), (startup, startup_t)):
            t = time.perf_counter()
            done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
            times.append(time.perf_counter() - t)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(argv[1:])} exited {done.returncode}: {done.stderr[-300:]}")
    return {"cli_usage": summary(cli_t), "python_import_only": summary(startup_t)}


async def _quota_check(ctx: Context, base: Path) -> dict[str, Any]:
    users = 10 if ctx.quick else 1000
    root = base / "quota-root"
    async with Store(root) as store:
        for chat in range(100):
            await store.session("user-0", f"chat-{chat}")
        conn = sqlite3.connect(root / "index.sqlite3", isolation_level=None)
        try:
            conn.execute("BEGIN")
            conn.executemany(
                "INSERT INTO sessions (user_id, chat_id, user_key, chat_key, created_at,"
                " last_used_at, bytes, file_count) VALUES (?, ?, ?, ?, 0, 0, 10, 1)",
                ((f"user-{u}", f"chat-{c}", f"uk{u}", f"ck{c}") for u in range(1, users) for c in range(100)),
            )
            conn.execute("COMMIT")
        finally:
            conn.close()
        session = await store.session("user-0", "chat-0")
        await session.run_budget()
        times = []
        for _ in range(20 if ctx.quick else 300):
            t = time.perf_counter()
            await session.run_budget()
            times.append(time.perf_counter() - t)
    return {"user_sessions": 100, "session_rows": users * 100, **summary(times), "target_ms": TARGET_QUOTA_MS}


async def _on(ctx: Context, base: Path) -> dict[str, Any]:
    sizes = [100, 1_000] if ctx.quick else [1_000, 10_000, 100_000]
    root = base / "index-root"
    out: dict[str, Any] = {"filesystem": filesystem_of(base), "reconcile": {}, "cleanup": {}}
    async with Store(root, quotas=BENCH_QUOTAS) as store:
        for size in sizes:
            ctx.log(f"{SECTION} [{out['filesystem']}]: reconcile, {size} files")
            try:
                out["reconcile"][str(size)] = await _reconcile_size(ctx, store, size)
                if size == sizes[-1]:
                    ctx.log(f"{SECTION} [{out['filesystem']}]: CLI usage on a {size}-file index")
                    out["usage"] = {
                        "files": size,
                        **await asyncio.to_thread(_usage_cli, root, 3 if ctx.quick else 7),
                    }
                ctx.log(f"{SECTION} [{out['filesystem']}]: cleanup of {size} expired files")
                await asyncio.to_thread(os.sync)
                out["cleanup"][str(size)] = await _cleanup_size(ctx, store, root, size, base)
            except Exception as exc:
                ctx.error(SECTION, f"{size} files on {out['filesystem']}: {type(exc).__name__}: {exc}")
    return out


async def run(ctx: Context) -> dict[str, Any]:
    result: dict[str, Any] = {"filesystems": {}}
    try:
        ctx.log(f"{SECTION}: quota check")
        result["quota_check"] = await _quota_check(ctx, ctx.scratch)
    except Exception as exc:
        ctx.error(SECTION, f"quota check: {type(exc).__name__}: {exc}")
    bases = [("disk", ctx.scratch / "index")]
    if ctx.tmpfs_scratch is not None:
        bases.append(("tmpfs", ctx.tmpfs_scratch / "index"))
    for label, base in bases:
        base.mkdir(parents=True, exist_ok=True)
        result["filesystems"][label] = await _on(ctx, base)
    return result
