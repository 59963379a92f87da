"""Section 10: a table preview of a 100 MB CSV, which must not read the whole file; and of a 1 MiB one,
which is read whole so that its rows are counted, not estimated.

The CSV lies in a real session folder; the preview is what an answer linking it adds (engine/previews.py:
its first 64 KiB read through the store for the rows shown and the types, and two samples of 32 KiB,
from its middle and its end, for the row count, which is then an estimate). Measured in the same run,
alternately, against two floors that read the whole file: a bare read of its bytes (the least any
preview that reads it all could cost) and counting its rows with the same csv module (what an exact
row count costs). The estimate must be within 2% of the true count (the file's ids grow longer
further down, as real ones do), and say it is an estimate.
"""

from __future__ import annotations

import asyncio
import csv
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

from engine.previews import COUNTED_BYTES, HEAD_BYTES, SAMPLE_BYTES, previews

from ._common import Context, summary
from ._tables import ms, table

SECTION = "previews"
TARGET_RATIO = 0.1  # of a bare read of the whole file
TARGET_MS = 50.0
TARGET_COUNTED_MS = 50.0  # a CSV of COUNTED_BYTES, read whole and its rows counted


def _make_csv(path: Path, size: int) -> int:
    """A CSV of about `size` bytes with varied rows; returns its number of data rows."""
    rng = random.Random(7)
    cities = ["Oslo", "Lima", "Pune", "Quito, Ecuador", 'the "big" apple', "Zürich"]
    rows = 0
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["id", "city", "when", "amount", "note"])
        while handle.tell() < size:
            chunk = [
                [
                    rows + i,
                    rng.choice(cities),
                    f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
                    f"{rng.uniform(0, 10_000):.2f}",
                    "x" * rng.randint(0, 60),
                ]
                for i in range(1000)
            ]
            writer.writerows(chunk)
            rows += len(chunk)
    return rows


def _bare_read(path: Path) -> int:
    total = 0
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            total += len(chunk)
    return total


def _count_rows(path: Path) -> int:
    with path.open(newline="", encoding="utf-8") as handle:
        return sum(1 for _ in csv.reader(handle)) - 1


async def run(ctx: Context) -> dict[str, Any]:
    size = (4 if ctx.quick else 100) * 1024 * 1024
    reps = 3 if ctx.quick else 10
    try:
        async with ctx.store("previews") as store:
            session = await store.session("bench-user", "bench-previews")
            session.path.mkdir(parents=True, exist_ok=True)  # the sandbox would write it here
            result = await _measure(ctx, session, size, reps)
    finally:
        shutil.rmtree(ctx.scratch / "previews", ignore_errors=True)  # 100 MB: never left behind
    ctx.log(
        f"previews: {result['preview']['median_ms']:.1f} ms for a {result['file_bytes'] / 2**20:.0f} MiB "
        f"CSV, bare read {result['bare_read']['median_ms']:.1f} ms, x{result['ratio_of_medians']:.3f}"
    )
    return result


async def _measure(ctx: Context, session: Any, size: int, reps: int) -> dict[str, Any]:
    path = session.path / "big.csv"
    rows = await asyncio.to_thread(_make_csv, path, size)
    size = path.stat().st_size
    asked: list[int] = []

    async def read_head(name: str, limit: int) -> tuple[bytes, int]:
        data, total = await session.files.read_head(name, limit)
        asked.append(len(data))
        return data, total

    async def read_at(name: str, offset: int, limit: int) -> bytes:
        data = await session.files.read_at(name, offset, limit)
        asked.append(len(data))
        return data

    async def no_sandbox(code: str) -> Any:
        raise AssertionError("a CSV preview needs no sandbox")

    preview_t, read_t, count_t = [], [], []
    shown = ""
    for i in range(reps):
        t0 = time.perf_counter()
        shown = await previews(["big.csv"], read_head, no_sandbox, read_at)
        t1 = time.perf_counter()
        await asyncio.to_thread(_bare_read, path)
        t2 = time.perf_counter()
        preview_t.append(t1 - t0)
        read_t.append(t2 - t1)
        if i < (1 if ctx.quick else 3):  # seconds each: a few are enough for its median
            t3 = time.perf_counter()
            counted = await asyncio.to_thread(_count_rows, path)
            count_t.append(time.perf_counter() - t3)
            if counted != rows:
                ctx.error(SECTION, f"the csv module counted {counted} rows, not {rows}")
    found = re.search(r"about ([0-9,]+) rows, estimated", shown)
    estimate = int(found.group(1).replace(",", "")) if found else None
    if estimate is None:
        ctx.error(SECTION, f"the preview gave no estimated row count: {shown[:300]!r}")
    elif abs(estimate - rows) > 0.02 * rows:
        ctx.error(SECTION, f"the estimate {estimate:,} is more than 2% from {rows:,} rows")
    read = sum(asked) // reps
    if read > HEAD_BYTES + 2 * SAMPLE_BYTES:
        ctx.error(SECTION, f"the preview read {read:,} bytes, more than {HEAD_BYTES + 2 * SAMPLE_BYTES:,}")
    path.unlink()

    # The largest CSV whose rows are counted: read whole, parsed in a thread.
    small = session.path / "counted.csv"
    counted_rows = await asyncio.to_thread(_make_csv, small, COUNTED_BYTES - 64 * 1024)
    counted_t = []
    for _ in range(reps):
        t0 = time.perf_counter()
        counted_shown = await previews(["counted.csv"], read_head, no_sandbox, read_at)
        counted_t.append(time.perf_counter() - t0)
    if f"· {counted_rows:,} rows, " not in counted_shown:
        ctx.error(SECTION, f"a {COUNTED_BYTES:,}-byte CSV was not counted exactly: {counted_shown[:200]!r}")
    small.unlink()
    return {
        "counted_file_bytes": COUNTED_BYTES - 64 * 1024,
        "counted": summary(counted_t),
        "target_counted_ms": TARGET_COUNTED_MS,
        "file_bytes": size,
        "rows": rows,
        "estimate": estimate,
        "bytes_read": read,
        "preview": summary(preview_t),
        "bare_read": summary(read_t),
        "count_rows": summary(count_t),
        "ratio_of_medians": summary(preview_t)["median_ms"] / summary(read_t)["median_ms"],
        "target_ratio": TARGET_RATIO,
        "target_ms": TARGET_MS,
    }


def targets(r: dict[str, Any], add: Any) -> None:
    full = r.get("file_bytes", 0) >= 100 * 1024 * 1024
    add(
        "table preview of a 100 MB CSV / a bare read of it",
        (full and r["ratio_of_medians"]) or None,
        r.get("target_ratio", TARGET_RATIO),
        "x",
    )
    add(
        "table preview of a 100 MB CSV",
        (full and r["preview"]["median_ms"]) or None,
        r.get("target_ms", TARGET_MS),
        "ms",
    )
    add(
        "table preview of a 1 MiB CSV, its rows counted",
        ("counted" in r and r["counted"]["median_ms"]) or None,
        r.get("target_counted_ms", TARGET_COUNTED_MS),
        "ms",
    )


def render(r: dict[str, Any]) -> str:

    if "preview" not in r:
        return "(no data)"
    rows = [
        [f"floor: a bare read of the whole file ({r['file_bytes'] / 2**20:.0f} MiB)", ms(r["bare_read"]), ""],
        [f"counting its {r['rows']:,} rows with the csv module (an exact count)", ms(r["count_rows"]), ""],
        [
            f"the preview (reads {r['bytes_read'] / 1024:.0f} KiB)",
            ms(r["preview"]),
            f"<= {r['target_ms']:g} ms",
        ],
        [
            "preview / bare read, ratio of medians",
            f"x{r['ratio_of_medians']:.3f}",
            f"<= {r['target_ratio']:g}",
        ],
        ["its estimate of the rows", f"{r['estimate']:,}" if r["estimate"] else "-", "within 2%"],
    ]
    if "counted" in r:
        rows.append(
            [
                f"a {r['counted_file_bytes'] / 2**10:.0f} KiB CSV, read whole and its rows counted",
                ms(r["counted"]),
                f"<= {r['target_counted_ms']:g} ms",
            ]
        )
    return table(["", "ms", "target"], rows, right=(1,))
