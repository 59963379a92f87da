"""Micro-measurement of reconcile, cleanup and the quota SUM (not a test: no timing assertions).

.venv/bin/python -m tests.storage.bench_reconcile [10000 100000]
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

from storage import Expiry, Store


def _make_files(folder: Path, count: int) -> None:
    per_dir = 1000
    for d in range((count + per_dir - 1) // per_dir):
        sub = folder / f"d{d:03}"
        sub.mkdir(parents=True, exist_ok=True)
        for i in range(min(per_dir, count - d * per_dir)):
            fd = os.open(sub / f"f{i:04}.txt", os.O_WRONLY | os.O_CREAT, 0o600)
            os.write(fd, b"x")
            os.close(fd)


def _bare_listing(folder: Path) -> int:
    """The floor: the same system calls as reconcile's listing, with none of its work."""
    n = 0
    stack = [str(folder)]
    while stack:
        with os.scandir(stack.pop()) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                else:
                    entry.stat(follow_symlinks=False)
                    n += 1
    return n


async def _best(fn, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1000


async def bench(count: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "root"
        async with Store(root) as store:
            s = await store.session("bench", f"chat-{count}")
            _make_files(s.path, count)
            start = time.perf_counter()
            first = await s.reconcile(enforce_quotas=False)
            initial = (time.perf_counter() - start) * 1000
            assert first.files == count

            target = s.path / "d000" / "f0000.txt"
            n = 0

            async def one_change() -> float:
                nonlocal n
                n += 1
                target.write_bytes(b"y" * (n + 1))  # not timed: only the reconcile is
                start = time.perf_counter()
                report = await s.reconcile()
                elapsed = time.perf_counter() - start
                assert report.changed == ["d000/f0000.txt"], report.summary()
                return elapsed

            async def no_change() -> None:
                report = await s.reconcile()
                assert not (report.added or report.changed or report.removed)

            changed_ms = min([await one_change() for _ in range(5)]) * 1000
            unchanged_ms = await _best(no_change)
            floor_ms = await _best(lambda: asyncio.to_thread(_bare_listing, s.path))
            print(
                f"{count:>7} files: first index {initial:7.0f} ms | one changed file {changed_ms:6.0f} ms"
                f" | nothing changed {unchanged_ms:6.0f} ms | bare scandir+lstat loop {floor_ms:6.0f} ms"
            )
            await store.close()
            start = time.perf_counter()
            await store.open()
            open_ms = (time.perf_counter() - start) * 1000
            print(f"{count:>7} files: Store.open() (quick_check of the index) {open_ms:5.0f} ms")

            # expiry of every file of the session
            conn = sqlite3.connect(root / "index.sqlite3", isolation_level=None)
            conn.execute("UPDATE files SET last_changed = 0")
            conn.close()
            store.expiry = Expiry(file_max_age_s=86400)
            start = time.perf_counter()
            report = await store.cleanup()
            assert report.files_removed == count, report.summary()
            cleanup_ms = (time.perf_counter() - start) * 1000
            print(f"{count:>7} files: cleanup of all files (expired) {cleanup_ms:7.0f} ms")


async def bench_quota_sum() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        async with Store(Path(tmp) / "root") as store:
            for chat in range(100):
                await store.session("user-0", f"chat-{chat}")
            conn = sqlite3.connect(Path(tmp) / "root" / "index.sqlite3", isolation_level=None)
            conn.execute("BEGIN")
            for user in range(1, 1000):
                for chat in range(100):
                    conn.execute(
                        "INSERT INTO sessions (user_id, chat_id, user_key, chat_key, created_at,"
                        " last_used_at, bytes, file_count) VALUES (?, ?, ?, ?, 0, 0, 10, 1)",
                        (f"user-{user}", f"chat-{chat}", f"uk{user}", f"ck{chat}"),
                    )
            conn.execute("COMMIT")
            conn.close()
            s = await store.session("user-0", "chat-0")

            async def check() -> None:
                await s.check_quota()

            print(f"check_quota, user with 100 sessions among 100k: {await _best(check, 50):.2f} ms")


async def main(counts: list[int]) -> None:
    print(f"python {sys.version.split()[0]}, sqlite {sqlite3.sqlite_version}, {os.cpu_count()} cpus")
    await bench_quota_sum()
    for count in counts:
        await bench(count)


if __name__ == "__main__":
    asyncio.run(main([int(a) for a in sys.argv[1:]] or [10_000, 100_000]))
