"""Each limit fires with its own Outcome, and a killed sandbox leaves nothing behind. Real runsc."""

from __future__ import annotations

import resource
import time
from pathlib import Path

from runner import Limits, Outcome, Runner
from tests.support.sandbox import disk_usage

from .conftest import assert_nothing_left

MIB = 1 << 20


async def test_infinite_loop_is_killed_at_the_deadline(runner: Runner, workdir: Path) -> None:
    t0 = time.monotonic()
    res = await runner.run("while True:\n    pass", "python", workdir, Limits(timeout_s=2))
    elapsed = time.monotonic() - t0
    assert res.outcome is Outcome.TIMEOUT, res
    assert res.exit_code is None
    assert res.reason == "killed after 2 s"
    assert elapsed < 2 + 3, f"teardown took {elapsed - 2:.1f} s"
    assert_nothing_left(runner, res)


async def test_fork_bomb_is_contained_and_fully_reaped(runner: Runner, workdir: Path) -> None:
    t0 = time.monotonic()
    res = await runner.run(":(){ :|:& };:\nsleep 60", "bash", workdir, Limits(timeout_s=3, max_processes=64))
    elapsed = time.monotonic() - t0
    # RLIMIT_NPROC stops it at 64 tasks inside gVisor; the deadline ends it.
    assert res.outcome is Outcome.TIMEOUT, res
    assert "Resource temporarily unavailable" in res.stderr
    assert elapsed < 3 + 5
    assert_nothing_left(runner, res)


async def test_process_limit_fails_fork_inside_the_sandbox(runner: Runner, workdir: Path) -> None:
    code = """
import threading, time
started = 0
try:
    for _ in range(50):
        threading.Thread(target=time.sleep, args=(1,), daemon=True).start()
        started += 1
except RuntimeError as e:
    print("refused after", started, e)
"""
    res = await runner.run(code, "python", workdir, Limits(max_processes=8))
    assert res.outcome is Outcome.OK, res
    assert res.stdout.startswith("refused after 7")  # the main thread is the 8th task


async def test_memory_limit_reports_out_of_memory(runner: Runner, workdir: Path) -> None:
    code = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))"
    res = await runner.run(code, "python", workdir, Limits(memory_mb=128, timeout_s=10))
    assert res.outcome is Outcome.OOM, res
    assert "128 MB" in (res.reason or "")
    assert_nothing_left(runner, res)


async def test_huge_stdout_is_truncated_and_never_buffered_on_the_host(runner: Runner, workdir: Path) -> None:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    code = "import sys\nline = 'x' * 1023 + '\\n'\nfor _ in range(50 * 1024):\n    sys.stdout.write(line)"
    res = await runner.run(code, "python", workdir, Limits(timeout_s=10))
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert res.outcome is Outcome.OUTPUT_LIMIT, res
    assert res.stdout_truncated and not res.stderr_truncated
    assert res.stdout.endswith("\n[... output truncated at 64 KiB ...]\n")
    assert len(res.stdout.encode()) < 64 * 1024 + 100
    assert res.reason == "stdout passed 64 KiB"
    assert grown_kib < 20 * 1024, f"host peak RSS grew by {grown_kib} KiB"
    assert_nothing_left(runner, res)


async def test_stderr_has_its_own_cap(runner: Runner, workdir: Path) -> None:
    res = await runner.run("yes error >&2", "bash", workdir, Limits(max_output_bytes=1000, timeout_s=10))
    assert res.outcome is Outcome.OUTPUT_LIMIT, res
    assert res.stderr_truncated and res.stderr.startswith("error\nerror\n")
    assert "[... output truncated at 1000 bytes ...]" in res.stderr


async def test_runaway_writes_are_stopped_with_a_bounded_overshoot(runner: Runner, workdir: Path) -> None:
    limit = 32 * MIB
    code = "f = open('/mnt/data/flood', 'wb')\nwhile True:\n    f.write(b'x' * (1 << 20))"
    res = await runner.run(code, "python", workdir, Limits(max_write_bytes=limit, max_file_bytes=None))
    assert res.outcome is Outcome.DISK_LIMIT, res
    assert "32 MiB" in (res.reason or "")
    overshoot = disk_usage(str(workdir)) - limit
    print(f"disk overshoot: {overshoot / MIB:.0f} MiB past a {limit // MIB} MiB limit")
    # Measured 10-40 MiB on this machine (gVisor writes ~500 MB/s here); generous bound.
    assert overshoot < 256 * MIB
    assert_nothing_left(runner, res)


async def test_writes_in_a_session_of_10k_files_are_still_caught(runner: Runner, workdir: Path) -> None:
    for i in range(100):
        sub = workdir / f"d{i}"
        sub.mkdir()
        for j in range(100):
            (sub / f"f{j}").write_bytes(b"x")
    limit = 32 * MIB
    code = "f = open('/mnt/data/flood', 'wb')\nwhile True:\n    f.write(b'x' * (1 << 20))"
    res = await runner.run(code, "python", workdir, Limits(max_write_bytes=limit, max_file_bytes=None))
    assert res.outcome is Outcome.DISK_LIMIT, res
    assert (workdir / "flood").stat().st_size < limit + 256 * MIB


async def test_file_size_limit(runner: Runner, workdir: Path) -> None:
    code = "open('/mnt/data/big', 'wb').write(b'x' * (2 << 20))"
    res = await runner.run(code, "python", workdir, Limits(max_file_bytes=1 << 20))
    assert res.outcome is Outcome.ERROR, res
    assert "File too large" in res.stderr
    assert (workdir / "big").stat().st_size <= 1 << 20
