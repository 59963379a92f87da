"""Section: the states that let a conversation's branches get their files and Python state back.

(a) files: a chat folder of 10,000 files and 1 GB. The first state of the chat copies it whole (once
    per chat; on a file system with reflinks, no bytes); then one small file changes and the next
    state is saved: its time and the disk it adds, against a floor measured in the same run: the bare
    walk of the folder (one lstat per entry), which any state must do to know what changed.
(b) restore: the folder is put back to the earlier state (one file differs), against the same walk.
(c) Python state: a copy of a live kernel holding pandas (`runsc checkpoint --leave-running`),
    against writing and fsyncing the same bytes; and the rewind to it, up to the next run's answer.
(d) the bound across a user's chats: a user with 200 chats that keep states saves one small state
    with a storage limit (every chat's states measured against the room the files leave), against the
    same save with no limit (no other chat looked at).

Targets: a state when one small file changed <= 50 ms and <= 1% extra disk; restore <= 1 s; the bound
across 200 chats adds <= 10 ms.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

from runner import KernelPool, Limits

from ._common import Context, summary
from ._tables import ms

SECTION = "branches"
TARGETS = {"state_ms": 50.0, "extra_disk_pct": 1.0, "restore_s": 1.0, "bound_ms": 10.0}
BOUND_CHATS = 200
LIMITS = Limits(timeout_s=120, memory_mb=1024)


def _walk_floor(folder: Path) -> float:
    """Seconds for a bare walk of the folder: one lstat per entry, never a file's contents."""
    start = time.perf_counter()
    stack = [str(folder)]
    while stack:
        with os.scandir(stack.pop()) as listing:
            for entry in listing:
                st = entry.stat(follow_symlinks=False)
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                del st
    return time.perf_counter() - start


def _fill(folder: Path, files: int, size: int, owner: tuple[int, int]) -> None:
    block = os.urandom(size)
    per_dir = 500
    for i in range(files):
        sub = folder / f"d{i // per_dir:03d}"
        if i % per_dir == 0:
            sub.mkdir(exist_ok=True)
            os.chown(sub, *owner)
        path = sub / f"f{i:05d}.bin"
        path.write_bytes(block[i % 97 :] + block[: i % 97])
        os.chown(path, *owner)


def _write_floor(folder: Path, size: int) -> float:
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


async def run(ctx: Context) -> dict[str, Any]:
    files, size = (1_000, 10_000) if ctx.quick else (10_000, 100_000)
    repeats = 3 if ctx.quick else 7
    result: dict[str, Any] = {"targets": TARGETS, "files": files, "bytes": files * size}
    store = ctx.store("branches")
    runner = ctx.runner()
    await store.open()
    try:
        session = await store.session("bench", "branches")
        keep: dict[str, Any] = {"keep_states": 1000, "keep_kernels": 3, "room_bytes": None}
        async with session.lock():
            ctx.log(f"branches: filling a folder of {files:,} files, {files * size / 1e9:.2f} GB")
            _fill(session.path, files, size, (runner.sandbox_uid, runner.sandbox_gid))
            os.sync()
            t0 = time.perf_counter()
            first = await session.history.save("m0", **keep)
            first_s = time.perf_counter() - t0
            result["first_state"] = {"seconds": first_s, "copied_bytes": first.copied_bytes}
            small = session.path / "d000" / "notes.txt"
            states, extra, walks = [], [], []
            for i in range(repeats):
                small.write_text(f"change {i}\n")
                before = await session.history.bytes_on_disk()
                t0 = time.perf_counter()
                saved = await session.history.save(f"m{i + 1}", **keep)
                states.append(time.perf_counter() - t0)
                extra.append(await session.history.bytes_on_disk() - before)
                walks.append(_walk_floor(session.path))
                assert saved.copied_files == 1, saved
            result["state"] = {
                "state": summary(states),
                "walk_floor": summary(walks),
                "extra_bytes_median": sorted(extra)[len(extra) // 2],
                "extra_disk_pct": 100 * sorted(extra)[len(extra) // 2] / (files * size),
            }
            restores, walks = [], []
            for i in range(repeats):
                t0 = time.perf_counter()
                restored = await session.history.restore(f"m{i % 2}")
                restores.append(time.perf_counter() - t0)
                walks.append(_walk_floor(session.path))
                assert restored.copied_files <= 1, restored
            result["restore"] = {"restore": summary(restores), "walk_floor": summary(walks)}
            await session.reconcile(enforce_quotas=False)
        await _python_state(ctx, result, session.path, session.state_path)
        await _user_bound(store, result, repeats)
    finally:
        await store.close()
        if not ctx.quick:
            shutil.rmtree(ctx.scratch / "branches", ignore_errors=True)
    return result


async def _user_bound(store: Any, result: dict[str, Any], repeats: int) -> None:
    """(d): one small save of a user with BOUND_CHATS chats that keep states, with and without a limit."""
    keep = {"keep_states": 20, "keep_kernels": 3}
    for n in range(BOUND_CHATS):
        other = await store.session("bench-bound", f"chat-{n}")
        async with other.lock():
            (other.path / "f.txt").write_text("x" * 1000)
            await other.history.save("m", **keep, room_bytes=None)
    session = await store.session("bench-bound", "chat-0")
    free, bounded = [], []
    async with session.lock():
        for i in range(repeats):
            for room, times in ((None, free), (1 << 40, bounded)):
                (session.path / "f.txt").write_text(f"{i} {room}" * 100)
                t0 = time.perf_counter()
                await session.history.save(f"m{i}-{room}", **keep, room_bytes=room)
                times.append(time.perf_counter() - t0)
    result["user_bound"] = {"chats": BOUND_CHATS, "bounded": summary(bounded), "free": summary(free)}


async def _python_state(ctx: Context, result: dict[str, Any], folder: Path, state: Path) -> None:
    pool = KernelPool(ctx.runner(), ctx.scratch / "branches-registry")
    copies, writes, rewinds = [], [], []
    size = 0
    try:
        first = await pool.run("b/k", folder, "import pandas\nx = 1", "python", LIMITS, state_dir=state)
        if not first.ok:
            ctx.error(SECTION, f"kernel: {first.reason}")
            return
        for i in range(3 if ctx.quick else 5):
            into = ctx.scratch / "branches-kernels" / str(i)
            t0 = time.perf_counter()
            image, why = await pool.snapshot("b/k", into, state_dir=state)
            copies.append(time.perf_counter() - t0)
            if not image:
                ctx.error(SECTION, f"no copy of the kernel: {why}")
                return
            size = sum(p.stat().st_size for p in (into / "kernel").iterdir())
            writes.append(_write_floor(ctx.scratch, size))
            t0 = time.perf_counter()
            await pool.rewind("b/k", state, into, "")
            back = await pool.run("b/k", folder, "print(x)", "python", LIMITS, state_dir=state)
            rewinds.append(time.perf_counter() - t0)
            if back.stdout.strip() != "1":
                ctx.error(SECTION, f"rewound kernel answered {back.stdout!r} {back.reason}")
    finally:
        await pool.close()
        shutil.rmtree(ctx.scratch / "branches-kernels", ignore_errors=True)
    result["python_state"] = {
        "copy": summary(copies),
        "write_floor": summary(writes),
        "image_mib": round(size / 2**20, 1),
        "rewind_to_answer": summary(rewinds),
    }


def render(r: dict[str, Any]) -> str:

    parts = [f"a folder of {r['files']:,} files, {r['bytes'] / 1e9:.2f} GB"]
    first = r.get("first_state")
    if first:
        parts.append(
            f"the chat's first state: {first['seconds']:.2f} s, {first['copied_bytes'] / 1e6:.0f} MB copied"
        )
    s = r.get("state")
    if s:
        parts.append(
            f"a state after one small change: {ms(s['state'])} ms (walk floor {ms(s['walk_floor'])} ms), "
            f"{s['extra_bytes_median']} B more on disk ({s['extra_disk_pct']:.4f}% of the folder)"
        )
    rs = r.get("restore")
    if rs:
        floor = ms(rs["walk_floor"])
        parts.append(f"restore (one file differs): {ms(rs['restore'])} ms (walk floor {floor} ms)")
    b = r.get("user_bound")
    if b:
        parts.append(
            f"a small state of a user with {b['chats']} chats keeping states: {ms(b['bounded'])} ms with the "
            f"storage limit's bound across them (floor: {ms(b['free'])} ms without a limit)"
        )
    p = r.get("python_state")
    if p:
        parts.append(
            f"copy of a live kernel with pandas: {ms(p['copy'])} ms for {p['image_mib']} MiB (write floor "
            f"{ms(p['write_floor'])} ms); rewind to the next run's answer {ms(p['rewind_to_answer'])} ms"
        )
    return "\n".join(parts)


def targets(r: dict[str, Any], add: Any) -> None:
    full = r.get("files") == 10_000
    s, rs = r.get("state"), r.get("restore")
    state = s["state"]["median_ms"] if s and full else None
    add("a branch state, one small change in 10k files / 1 GB", state, TARGETS["state_ms"], "ms")
    extra = s["extra_disk_pct"] if s and full else None
    add("its extra disk, of the folder", extra, TARGETS["extra_disk_pct"], "%")
    restore = rs["restore"]["median_ms"] / 1000 if rs and full else None
    add("restore of a branch state (one file differs)", restore, TARGETS["restore_s"], "s")
    b = r.get("user_bound")
    bound = b["bounded"]["median_ms"] - b["free"]["median_ms"] if b else None
    add(f"the bound across a user's {BOUND_CHATS} chats, added to a save", bound, TARGETS["bound_ms"], "ms")
