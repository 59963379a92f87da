"""Section 10: an upload link's receiving path, against a plain copy of the same bytes.

One file (200 MiB; 16 MiB in quick mode) arrives as the multipart body an upload link takes, in the
64 KiB pieces a web server hands on, and goes the whole way the route sends it (webui/uploads.py
`receive_body`): the multipart reader, the storage's staged file with the per-file limit and the quota
checked as it grows (storage `Incoming`), then `finish` under the chat's lock (fsync, linked into
place, indexed with the quota checked again). The floor, measured in the same run on the same disk:
the same bytes written to a new file a MiB at a time and fsynced, with no parsing, no checks and no
event loop: the least any upload must do once the bytes are in memory. The HTTP server in front
(Open WebUI's uvicorn) is not in either; tests/e2e/test_inbound.py prints what the whole way takes.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from storage import MiB, Policy, Quotas
from webui.multipart import MultipartFile
from webui.uploads import receive_body

from ._common import Context, summary
from ._tables import ms, table

SECTION = "uploads"
PIECE = 64 * 1024
TARGET_RATIO = 2.0  # receiving may take up to twice a plain copy of the bytes
BOUNDARY = b"bench-upload-boundary"


def _pieces(size: int) -> tuple[bytes, bytes, bytes, int]:
    head = (
        b"--" + BOUNDARY + b'\r\nContent-Disposition: form-data; name="file"; filename="export.bin"\r\n'
        b"Content-Type: application/octet-stream\r\n\r\n"
    )
    block = os.urandom(PIECE)
    return head, block, b"\r\n--" + BOUNDARY + b"--\r\n", size // PIECE


async def _body(head: bytes, block: bytes, tail: bytes, count: int) -> AsyncIterator[bytes]:
    yield head
    for _ in range(count):
        yield block
    yield tail


def _plain_copy(path: str, block: bytes, count: int) -> None:
    batch = block * (MiB // len(block))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        written = 0
        while written < count * len(block):
            os.write(fd, batch)
            written += len(batch)
        os.fsync(fd)
    finally:
        os.close(fd)


async def run(ctx: Context) -> dict[str, Any]:
    size = (16 if ctx.quick else 200) * MiB
    reps = 2 if ctx.quick else 5
    head, block, tail, count = _pieces(size)
    store = ctx.store(SECTION)
    await store.open()
    unlimited = Policy(Quotas(max_file_bytes=None, max_bytes_per_user=None))
    floor_dir = ctx.scratch / SECTION / "plain"
    floor_dir.mkdir(parents=True, exist_ok=True)
    floor_t, ours_t, ratios = [], [], []
    try:
        session = await store.session("bench-user", "bench-chat", policy=unlimited)
        for i in range(reps):
            target = floor_dir / f"copy-{i}.bin"
            t0 = time.perf_counter()
            await asyncio.to_thread(_plain_copy, str(target), block, count)
            t1 = time.perf_counter()
            incoming = await session.files.incoming(f"upload-{i}.bin")
            await receive_body(MultipartFile(BOUNDARY), incoming, _body(head, block, tail, count))
            async with session.lock():
                await incoming.finish()
            t2 = time.perf_counter()
            if (session.path / f"upload-{i}.bin").stat().st_size != count * PIECE:
                raise RuntimeError("the received file does not have the bytes sent")
            target.unlink()
            await session.files.remove(f"upload-{i}.bin")
            floor_t.append(t1 - t0)
            ours_t.append(t2 - t1)
            ratios.append((t2 - t1) / (t1 - t0))
    finally:
        await store.close()
    floor, ours = summary(floor_t), summary(ours_t)
    result = {
        "bytes": count * PIECE,
        "floor": floor,
        "upload": ours,
        "floor_mb_s": count * PIECE / MiB / (floor["median_ms"] / 1000),
        "upload_mb_s": count * PIECE / MiB / (ours["median_ms"] / 1000),
        "ratio_of_medians": ours["median_ms"] / floor["median_ms"],
        "target_ratio": TARGET_RATIO,
    }
    ctx.log(
        f"uploads: {result['upload_mb_s']:.0f} MiB/s received, plain copy {result['floor_mb_s']:.0f} MiB/s, "
        f"x{result['ratio_of_medians']:.2f}"
    )
    return result


def targets(r: dict[str, Any], add: Any) -> None:
    value = r.get("ratio_of_medians") if r.get("bytes") == 200 * MiB else None
    add("upload link, 200 MiB: receiving / a plain copy", value, r.get("target_ratio", TARGET_RATIO), "x")


def render(r: dict[str, Any]) -> str:

    if "upload" not in r:
        return "(no data)"
    rows = [
        ["floor: the bytes written to a new file and fsynced", ms(r["floor"]), f"{r['floor_mb_s']:.0f}", ""],
        ["an upload link's body received", ms(r["upload"]), f"{r['upload_mb_s']:.0f}", ""],
        ["ratio of medians", f"x{r['ratio_of_medians']:.2f}", "", f"<= {r['target_ratio']:g}"],
    ]
    head = f"one file of {r['bytes'] / MiB:.0f} MiB in {PIECE // 1024} KiB pieces"
    return head + "\n" + table(["", "ms", "MiB/s", "target"], rows, right=(1, 2))
