"""Section: the index on SQLite (embedded) and on PostgreSQL (several replicas), side by side.

A real PostgreSQL server is started from Debian's packages for the run, the way the tests start one
(tests/support/postgres.py), but with its durable defaults (fsync on); our connections run with
`synchronous_commit = off`, the promise SQLite's `synchronous = NORMAL` makes. Both stores keep their
session folders on the same disk. Measured, interleaved (SP, PS, SP, ...) so that drift of this shared
machine hits both alike:

(a) the quota check of a user with 100 sessions (among 100k session rows; 1k in --quick):
    `session.run_budget()`;
(b) the storage side of one chat step, in a session of 1,000 files (100 in --quick): `session.lock()`,
    `run_budget()` and `begin_run()` at once (as engine/service.py does), then (the run's change, not
    timed) one file rewritten, then a
    change-driven `reconcile(changed=[that file])` and `publish(that file)` into a DirectoryPublisher,
    and the lock's release.

(c) the batch paths, once each per backend (SQLite first, then PostgreSQL), on a store of their own
    holding 10 sessions of 10,000 files (200 in --quick): a rebuild of the index from the folders
    (`store.reconcile(Reconcile.REBUILD)` after every session row was deleted), and the cleanup of all
    those files, expired (what the caller waits for; the trash is emptied in the background, not
    timed). Their floors, in the same run: the bare walk of the same folders (scandir + lstat) for
    the rebuild, a bare rename of each folder into another for the cleanup.

Reported: medians (p25-p75) in ms, the ratio of medians PostgreSQL/SQLite, the median of per-pair
ratios, and where a step's time goes. The target is a step within 1.2x of SQLite's. Also measured, as
the floor of a network database: one bare round trip (`SELECT 1` on an asyncio psycopg connection), of
which a step makes ROUND_TRIPS_PER_STEP.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from storage import DirectoryPublisher, Expiry, Policy, Reconcile, Session, Store

from ._common import (
    BENCH_QUOTAS,
    Context,
    bare_rename,
    bare_walk,
    make_files,
    percentile,
    ratio_summary,
    summary,
)
from ._tables import ms, table

SECTION = "index_backends"
TARGET_STEP_RATIO = 1.2
BACKENDS = ("sqlite", "postgresql")
PHASES = ("lock", "budget_and_mark", "reconcile", "publish", "unlock")
CHANGED = "out/result.csv"
# Counted from the statements one step sends (storage/_postgres.py pipelines a transaction's
# statements, a read of one statement goes alone, a write's answers come with its COMMIT): the chat
# lock 1; run_budget 1; the reconcile's read 1 and write 1 (2 when the quota is decided); publish's
# read 1 and write 1; the lock's release 1.
ROUND_TRIPS_PER_STEP = 7


def _sizes(quick: bool) -> dict[str, int]:
    if quick:
        return {"users": 10, "files": 100, "quota_reps": 20, "step_reps": 10, "warmup": 3, "batch": 200}
    return {"users": 1000, "files": 1000, "quota_reps": 300, "step_reps": 200, "warmup": 10, "batch": 10_000}


BATCH_SESSIONS = 10


async def _batch_paths(
    ctx: Context, base: Path, name: str, url: str | None, per_session: int
) -> dict[str, Any]:
    """(c) for one backend: rebuild the index of 10 sessions from their folders, then expire them all."""
    root = base / f"batch-{name}"
    store = Store(root, quotas=BENCH_QUOTAS, database_url=url)
    await store.open()
    try:
        sessions = [await store.session("batch-user", f"chat-{i}") for i in range(BATCH_SESSIONS)]
        for session in sessions:
            await asyncio.to_thread(make_files, session.path, per_session)
            await session.reconcile(enforce_quotas=False)
        await store.backend.write(lambda tx: tx.run("DELETE FROM sessions", ()))
        await asyncio.to_thread(os.sync)
        start = time.perf_counter()
        await asyncio.to_thread(lambda: [bare_walk(s.path) for s in sessions])
        walk_s = time.perf_counter() - start
        start = time.perf_counter()
        report = await store.reconcile(Reconcile.REBUILD)
        rebuild_s = time.perf_counter() - start
        if report.files != BATCH_SESSIONS * per_session:
            raise RuntimeError(f"{name}: the rebuild indexed {report.files} files")
        await store.backend.write(lambda tx: tx.run("UPDATE files SET last_changed = 0", ()))
        expiry = Policy(expiry=Expiry(file_max_age_s=86_400, session_idle_s=0, temporary_idle_s=0))
        await asyncio.to_thread(os.sync)
        start = time.perf_counter()
        cleaned = await store.cleanup(policy=expiry)
        cleanup_s = time.perf_counter() - start
        if cleaned.files_removed != BATCH_SESSIONS * per_session:
            raise RuntimeError(f"{name}: the cleanup removed {cleaned.files_removed} files")
        await store.trash_emptied()
        floor = base / f"rename-{name}"
        folders = await asyncio.to_thread(make_files, floor / "from", BATCH_SESSIONS * per_session)
        (floor / "to").mkdir()
        await asyncio.to_thread(os.sync)
        start = time.perf_counter()
        await asyncio.to_thread(bare_rename, folders, floor / "to")
        rename_s = time.perf_counter() - start
        ctx.log(f"{SECTION}: {name}: rebuild {rebuild_s:.2f} s, cleanup {cleanup_s:.2f} s")
        return {
            "rebuild": summary([rebuild_s]),
            "bare_walk": summary([walk_s]),
            "cleanup": summary([cleanup_s]),
            "bare_rename": summary([rename_s]),
        }
    finally:
        await store.close()
        await asyncio.to_thread(shutil.rmtree, root, True)
        await asyncio.to_thread(shutil.rmtree, base / f"rename-{name}", True)


async def _add_session_rows(store: Store, users: int) -> None:
    """Session rows of `users - 1` other users with 100 chats each, straight into the index (no folders)."""
    rows = [
        (f"user-{u}", f"chat-{c}", f"uk{u}", f"ck{c}", 0, 0.0, 0.0, 10, 1)
        for u in range(1, users)
        for c in range(100)
    ]
    sql = (
        "INSERT INTO sessions (user_id, chat_id, user_key, chat_key, temporary, created_at, last_used_at,"
        " bytes, file_count) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
    )
    for i in range(0, len(rows), 10_000):
        chunk = rows[i : i + 10_000]
        await store.backend.write(lambda tx, chunk=chunk: tx.many(sql, chunk))


async def _prepare(store: Store, size: dict[str, int]) -> tuple[Session, Session]:
    for chat in range(100):
        await store.session("user-0", f"chat-{chat}")
    await _add_session_rows(store, size["users"])
    quota_session = await store.session("user-0", "chat-0")
    step = await store.session("step-user", "step-chat")
    await asyncio.to_thread(make_files, step.path, size["files"])
    (step.path / "out").mkdir(exist_ok=True)
    (step.path / CHANGED).write_bytes(b"a,b\n")
    report = await step.reconcile(enforce_quotas=False)
    if report.files != size["files"] + 1:
        raise RuntimeError(f"indexed {report.files} files, expected {size['files'] + 1}")
    return quota_session, step


async def _quota_check(session: Session) -> float:
    t = time.perf_counter()
    budget = await session.run_budget()
    elapsed = time.perf_counter() - t
    if budget.note is not None:
        raise RuntimeError(f"the quota check refused: {budget.note}")
    return elapsed


async def _forget_links(store: Store, session: Session) -> None:
    """The earlier steps' links of the file go (not timed), so that every step publishes the same way:
    a new version of a file linked before, not the n-th of a pile of links growing with the run."""
    await store.backend.write(
        lambda tx: tx.run(
            "DELETE FROM links WHERE session_id ="
            " (SELECT id FROM sessions WHERE user_key = ? AND chat_key = ?)",
            (session.user_key, session.chat_key),
        )
    )


async def _step(session: Session, n: int, phases: dict[str, list[float]]) -> float:
    """One chat step's storage side; returns its time without the run itself."""
    marks: dict[str, float] = {}
    t0 = time.perf_counter()
    lock = session.lock()
    await lock.__aenter__()
    try:
        marks["lock"] = time.perf_counter()
        # As a step does it (engine/service.py): the quota read and the run's mark at once.
        await asyncio.gather(session.run_budget(), session.begin_run())
        marks["budget_and_mark"] = time.perf_counter()
        # The run: it rewrites one file (not timed).
        await asyncio.to_thread((session.path / CHANGED).write_bytes, b"a,b\n" + b"%d,%d\n" % (n, n) * 20)
        resumed = time.perf_counter()
        report = await session.reconcile(changed=[CHANGED])
        marks["reconcile"] = time.perf_counter()
        if report.full or report.changed != [CHANGED] or report.added or report.removed:
            raise RuntimeError(f"reconcile after one change: full={report.full} {report.summary()}")
        link = await session.publish(CHANGED)
        marks["publish"] = time.perf_counter()
        if not link.url:
            raise RuntimeError("publish gave no URL")
    finally:
        await lock.__aexit__(None, None, None)
    marks["unlock"] = time.perf_counter()
    before = t0
    for phase in PHASES:
        start = resumed if phase == "reconcile" else before
        phases[phase].append(marks[phase] - start)
        before = marks[phase]
    return (marks["budget_and_mark"] - t0) + (marks["unlock"] - resumed)


async def _round_trip(conn: Any) -> float:
    t = time.perf_counter()
    cursor = await conn.execute("SELECT 1")
    await cursor.fetchone()
    return time.perf_counter() - t


async def _interleaved(
    reps: int, warmup: int, measure: dict[str, Callable[[int], Awaitable[float]]]
) -> tuple[dict[str, list[float]], list[float]]:
    times: dict[str, list[float]] = {name: [] for name in measure}
    order = list(measure)
    for i in range(warmup + reps):
        pair = {}
        for name in order if i % 2 == 0 else order[::-1]:
            pair[name] = await measure[name](i)
        if i >= warmup:
            for name, value in pair.items():
                times[name].append(value)
    ratios = [p / s for s, p in zip(times["sqlite"], times["postgresql"], strict=True)]
    return times, ratios


def _compare(times: dict[str, list[float]], ratios: list[float]) -> dict[str, Any]:
    out: dict[str, Any] = {name: summary(values) for name, values in times.items()}
    sqlite, postgres = (percentile(times[n], 0.5) for n in BACKENDS)
    out["ratio_of_medians"] = round(postgres / sqlite, 3) if sqlite else None
    out["pair_ratio"] = ratio_summary(ratios)
    return out


async def run(ctx: Context) -> dict[str, Any]:
    # The tests' server helper: initdb into a temporary folder, a free port on 127.0.0.1.
    from tests.support.postgres import start_server

    size = _sizes(ctx.quick)
    base = ctx.scratch / SECTION
    ctx.log(f"{SECTION}: starting PostgreSQL")
    server = await asyncio.to_thread(start_server, durable=True)
    stores: dict[str, Store] = {}
    try:
        url = await asyncio.to_thread(server.create_database)
        for name in BACKENDS:
            stores[name] = Store(
                base / name / "root",
                quotas=BENCH_QUOTAS,
                publisher=DirectoryPublisher(base / name / "cache", f"/cache/functions/bench-{name}/"),
                database_url=url if name == "postgresql" else None,
            )
            await stores[name].open()
        ctx.log(f"{SECTION}: {size['users'] * 100:,} session rows and a {size['files']}-file session each")
        prepared = {name: await _prepare(store, size) for name, store in stores.items()}

        ctx.log(f"{SECTION}: quota check, {size['quota_reps']} interleaved pairs")

        def quota(name: str) -> Callable[[int], Awaitable[float]]:
            return lambda _: _quota_check(prepared[name][0])

        q_times, q_ratios = await _interleaved(
            size["quota_reps"], size["warmup"], {name: quota(name) for name in BACKENDS}
        )

        ctx.log(f"{SECTION}: chat step, {size['step_reps']} interleaved pairs")
        phases: dict[str, dict[str, list[float]]] = {name: defaultdict(list) for name in BACKENDS}

        def step(name: str) -> Callable[[int], Awaitable[float]]:
            async def one(n: int) -> float:
                await _forget_links(stores[name], prepared[name][1])
                return await _step(prepared[name][1], n, phases[name])

            return one

        s_times, s_ratios = await _interleaved(
            size["step_reps"], size["warmup"], {name: step(name) for name in BACKENDS}
        )
        ctx.log(f"{SECTION}: rebuild and cleanup of {BATCH_SESSIONS * size['batch']:,} files on each")
        batch = {
            name: await _batch_paths(ctx, base, name, url if name == "postgresql" else None, size["batch"])
            for name in BACKENDS
        }
        ctx.log(f"{SECTION}: bare round trips")
        import psycopg

        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            trips = [await _round_trip(conn) for _ in range(size["quota_reps"] + size["warmup"])]
        cut = size["warmup"]
        result = {
            "postgresql_version": await stores["postgresql"].backend.read(
                lambda tx: tx.one("SELECT current_setting('server_version')")
            ),
            "session_rows": size["users"] * 100,
            "round_trip": summary(trips[cut:]),
            "round_trips_per_step": ROUND_TRIPS_PER_STEP,
            "step_session_files": size["files"] + 1,
            "batch_files": BATCH_SESSIONS * size["batch"],
            "batch": batch,
            "quota_check": _compare(q_times, q_ratios),
            "step": {
                **_compare(s_times, s_ratios),
                "target_ratio": TARGET_STEP_RATIO,
                "phases": {name: {p: summary(phases[name][p][cut:]) for p in PHASES} for name in BACKENDS},
            },
        }
        result["postgresql_version"] = result["postgresql_version"][0]
        ctx.log(
            f"{SECTION}: step {result['step']['sqlite']['median_ms']:.2f} ms on SQLite, "
            f"{result['step']['postgresql']['median_ms']:.2f} ms on PostgreSQL "
            f"(x{result['step']['ratio_of_medians']:.2f})"
        )
        return result
    finally:
        for store in stores.values():
            await store.close()
        await asyncio.to_thread(server.stop)
        await asyncio.to_thread(shutil.rmtree, server.base, True)
        await asyncio.to_thread(shutil.rmtree, base, True)


# ---------------------------------------------------------------------------- report


def render(r: dict[str, Any]) -> str:
    """The section's table (bench/report.py knows the other sections)."""

    if "step" not in r:
        return "(no data)"
    rows = []
    for label, key in (("quota check (run_budget), 100 sessions", "quota_check"), ("chat step", "step")):
        c = r[key]
        target = f"<= {c['target_ratio']:g}" if c.get("target_ratio") else "-"
        rows.append(
            [
                label,
                ms(c["sqlite"]),
                ms(c["postgresql"]),
                f"{c['ratio_of_medians']:.2f}",
                f"{c['pair_ratio']['median']:.2f}",
                target,
            ]
        )
    phases = r["step"]["phases"]
    trip = r["round_trip"]
    waiting = trip["median_ms"] * r["round_trips_per_step"]
    gap = r["step"]["postgresql"]["median_ms"] - r["step"]["sqlite"]["median_ms"]
    lines = [
        f"PostgreSQL {r['postgresql_version']} on 127.0.0.1; {r['session_rows']:,} session rows; "
        f"the step's session holds {r['step_session_files']:,} files; ms: median (p25-p75)",
        table(["", "SQLite", "PostgreSQL", "P/S", "per-pair P/S", "target"], rows, right=(3, 4)),
        f"one bare round trip to PostgreSQL: {ms(trip)} ms; a step makes {r['round_trips_per_step']}: "
        f"{waiting:.2f} ms of it is waiting for the server",
        f"PostgreSQL step - SQLite step: {gap:.2f} ms, {gap / waiting:.2f}x those round trips (the floor of "
        "any network database)"
        if waiting
        else "",
        *_batch_lines(r),
        "",
        "where the step's time goes (median ms):",
        table(
            ["phase", *BACKENDS],
            [[p, *(ms(phases[b][p], spread=False) for b in BACKENDS)] for p in PHASES],
            right=(1, 2),
        ),
    ]
    return "\n".join(lines)


def _batch_lines(r: dict[str, Any]) -> list[str]:
    batch = r.get("batch")
    if not batch:
        return []

    rows = []
    for label, key, floor in (
        ("rebuild from the folders", "rebuild", "bare_walk"),
        ("cleanup, all expired", "cleanup", "bare_rename"),
    ):
        s, p = batch["sqlite"], batch["postgresql"]
        rows.append(
            [
                label,
                f"{s[key]['median_ms'] / 1000:.2f}",
                f"{p[key]['median_ms'] / 1000:.2f}",
                f"{p[key]['median_ms'] / s[key]['median_ms']:.2f}",
                f"{s[floor]['median_ms'] / 1000:.2f} / {p[floor]['median_ms'] / 1000:.2f}",
            ]
        )
    return [
        "",
        f"batch paths, {r['batch_files']:,} files in {BATCH_SESSIONS} sessions, once each (s):",
        table(["", "SQLite", "PostgreSQL", "P/S", "floor S / P"], rows, right=(1, 2, 3)),
        "floors: the bare walk of the same folders (rebuild), a bare rename of each folder (cleanup)",
    ]
