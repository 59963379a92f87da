"""Section: what the buttons under an answer and the clones add.

(a) a run's record, kept at the end of every run of an answer (on every step's path): a run of 2 KB of
    code, 4 KB of output and a 40 KB figure, the 1st to 8th run of one answer, against writing the
    same record's bytes once (write and rename), the floor of any record on disk.
(b) a clone's start: a source state of 1,000 files of 10 KB copied into the clone's history, against
    copying the same files with shutil.copyfile, the floor of a copy that shares nothing.
(c) a notebook of a branch of 20 answers of 3 runs each, built and encoded (engine/notebook.py).
(d) the zip of a folder of 1,000 files (10 MB), against zipfile over the same files.

Targets: a run's record <= 1 ms with a figure, <= 0.2 ms for print(1); a clone's start <= 1.5x its copy
floor; a notebook <= 50 ms; a zip <= 1.3x its floor.
"""

from __future__ import annotations

import base64
import os
import shutil
import tempfile
import time
import zipfile
from typing import Any

from engine.notebook import BranchMessage, build_notebook, notebook_bytes
from storage import AnswerRuns, Figure, Room, RunRecord
from storage._exports import zip_folder
from storage._history import digest, write_bytes
from storage._history_runs import RunRecords

from ._common import Context, summary
from ._tables import ms

SECTION = "exports"
TARGETS = {
    "record_ms": 1.0,
    "plain_record_ms": 0.2,
    "clone_ratio": 1.5,
    "notebook_ms": 50.0,
    "zip_ratio": 1.3,
}
KEEP = {"keep_states": 20, "keep_kernels": 3, "room_bytes": None}


async def run(ctx: Context) -> dict[str, Any]:
    files = 100 if ctx.quick else 1_000
    repeats = 3 if ctx.quick else 7
    result: dict[str, Any] = {"targets": TARGETS, "files": files}
    store = ctx.store("exports")
    runner = ctx.runner()
    owner = (runner.sandbox_uid, runner.sandbox_gid)
    await store.open()
    try:
        session = await store.session("bench", "source")
        async with session.lock():
            figure = session.path / "figure-1.png"
            figure.write_bytes(b"\x89PNG\r\n\x1a\n" + os.urandom(40_000))
            records, floors = [], []
            for answer in range(repeats):
                for _ in range(8):
                    t0 = time.perf_counter()
                    await session.history.add_run(
                        f"a{answer}",
                        language="python",
                        code="x = 1\n" * 340,
                        outcome="ok",
                        stdout="y" * 4096,
                        stderr="",
                        figures=["figure-1.png"],
                    )
                    records.append(time.perf_counter() - t0)
                written = RunRecords(session.history.folder).folder / f"{digest(f'a{answer}')}.jsonl"
                data, floor = written.read_bytes(), written.with_name("floor.json")
                t0 = time.perf_counter()
                write_bytes(floor, data)  # the answer's whole record, written once
                floors.append(time.perf_counter() - t0)
                floor.unlink()
            plain = []
            for _ in range(repeats * 4):  # print(1): a run with no figure and a line of output
                t0 = time.perf_counter()
                await session.history.add_run(
                    "plain",
                    language="python",
                    code="print(1)",
                    outcome="ok",
                    stdout="1\n",
                    stderr="",
                    figures=[],
                )
                plain.append(time.perf_counter() - t0)
            result["record"] = {
                "record": summary(records),
                "write_floor": summary(floors),
                "plain": summary(plain),
            }
            for i in range(files):
                path = session.path / f"f{i:04d}.bin"
                path.write_bytes(os.urandom(10_000))
                os.chown(path, *owner)
            await session.history.save("m1", **KEEP)
            await session.reconcile(enforce_quotas=False)
        clones, copies = [], []
        for i in range(repeats):
            clone = await store.session("bench", f"clone-{i}")
            async with clone.lock():
                t0 = time.perf_counter()
                imported = await clone.history.import_from(
                    session.history, ["m1"], Room(), python=False, records=False
                )
                clones.append(time.perf_counter() - t0)
            if imported.files != files + 1:  # and the figure
                ctx.error(SECTION, f"a clone copied {imported.files} of {files + 1} files")
            target = ctx.scratch / f"exports-floor-{i}"
            target.mkdir()
            t0 = time.perf_counter()
            for path in session.path.iterdir():
                shutil.copyfile(path, target / path.name)
            copies.append(time.perf_counter() - t0)
            shutil.rmtree(target)
        result["clone"] = {"clone": summary(clones), "copy_floor": summary(copies)}
        result["notebook"] = {"build": summary([_notebook() for _ in range(repeats)])}
        zips, floors, whole = [], [], []
        async with session.lock():
            for _ in range(repeats):
                with tempfile.TemporaryFile(dir=ctx.scratch) as out:
                    t0 = time.perf_counter()
                    zip_folder(session.path, out, max_bytes=None)
                    zips.append(time.perf_counter() - t0)
                with tempfile.TemporaryFile(dir=ctx.scratch) as out:
                    t0 = time.perf_counter()
                    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as archive:
                        for path in sorted(session.path.iterdir()):
                            archive.write(path, path.name)
                    floors.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                await session.export_zip("all.zip", max_bytes=None)  # built, hashed and published
                whole.append(time.perf_counter() - t0)
        result["zip"] = {"zip": summary(zips), "zipfile_floor": summary(floors), "published": summary(whole)}
    finally:
        await store.close()
        shutil.rmtree(ctx.scratch / "exports", ignore_errors=True)
    return result


def _notebook() -> float:
    """Seconds to build and encode the notebook of 20 answers of 3 runs each."""
    figure = Figure("figure-1.png", "image/png", base64.b64encode(os.urandom(30_000)).decode())
    branch, records = [], {}
    for n in range(20):
        answer = "Text.\n" + "\n".join(
            "<details>\n<summary>Python finished in 1 ms</summary>\n\n```python\nx\n```\n</details>\n"
            for _ in range(3)
        )
        branch += [BranchMessage(f"u{n}", "user", "do it"), BranchMessage(f"a{n}", "assistant", answer)]
        run = RunRecord("python", "x = 1\n" * 40, "ok", stdout="y" * 1000, figures=(figure,))
        records[f"a{n}"] = AnswerRuns(f"a{n}", (run, run, run))
    t0 = time.perf_counter()
    notebook_bytes(build_notebook(branch, records, {}, title="t", environment="e", python="3.13"))
    return time.perf_counter() - t0


def render(r: dict[str, Any]) -> str:
    parts = []
    rec = r.get("record")
    if rec:
        parts.append(
            f"a run's record (2 KB of code, 4 KB of output, a 40 KB figure; 1st to 8th run of an answer): "
            f"{ms(rec['record'])} ms (writing such a record's bytes once: {ms(rec['write_floor'])} ms); "
            f"a print(1) run's record: {ms(rec['plain'])} ms"
        )
    c = r.get("clone")
    if c:
        parts.append(
            f"a clone's start, {r['files']:,} files of 10 KB: {ms(c['clone'])} ms (shutil.copyfile of the "
            f"same files: {ms(c['copy_floor'])} ms)"
        )
    n = r.get("notebook")
    if n:
        parts.append(f"the notebook of 20 answers of 3 runs each: {ms(n['build'])} ms")
    z = r.get("zip")
    if z:
        parts.append(
            f"the zip of {r['files']:,} files: {ms(z['zip'])} ms (zipfile over them: "
            f"{ms(z['zipfile_floor'])} ms); built, hashed and published: {ms(z['published'])} ms"
        )
    return "\n".join(parts)


def targets(r: dict[str, Any], add: Any) -> None:
    rec, c, n, z = r.get("record"), r.get("clone"), r.get("notebook"), r.get("zip")
    record, plain = (rec["record"]["median_ms"], rec["plain"]["median_ms"]) if rec else (None, None)
    add("a run's record, with a 40 KB figure", record, TARGETS["record_ms"], "ms")
    add("a print(1) run's record", plain, TARGETS["plain_record_ms"], "ms")
    ratio = c["clone"]["median_ms"] / c["copy_floor"]["median_ms"] if c else None
    add("a clone's start / copying its files", ratio, TARGETS["clone_ratio"], "x")
    add(
        "a notebook of 20 answers of 3 runs",
        n["build"]["median_ms"] if n else None,
        TARGETS["notebook_ms"],
        "ms",
    )
    ratio = z["zip"]["median_ms"] / z["zipfile_floor"]["median_ms"] if z else None
    add("the zip of a folder / zipfile over it", ratio, TARGETS["zip_ratio"], "x")
