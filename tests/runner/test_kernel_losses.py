"""Why a live kernel's state was lost, in real gVisor: every reset names its real cause.

A kernel can end between runs (a thread a cell left behind writes too much, grows its memory, or
spins), or during one in ways the generic words would hide (the reaper noticing first, a cell that
breaks the wire's framing, a bash cell that cannot start). Each test looks at the sentence the user
and the model get.
"""

from __future__ import annotations

import asyncio
import textwrap
import time
from pathlib import Path

import pytest

from runner import KernelPool, Limits, Outcome, Runner
from runner.models import MIB

pytestmark = pytest.mark.runsc

LIMITS = Limits(timeout_s=10, memory_mb=256, max_output_bytes=64 * 1024)


@pytest.fixture
async def pool(tmp_path: Path):
    pool = KernelPool(Runner(), tmp_path / "registry")
    yield pool
    await pool.close()


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    folder = tmp_path / "chat"
    folder.mkdir()
    return folder


async def _until_gone(pool: KernelPool, key: str, within_s: float) -> None:
    """Wait until the pool no longer holds the key's kernel (its reaper ended it)."""
    deadline = time.monotonic() + within_s
    while key in pool.kernels() and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert key not in pool.kernels(), f"the kernel of {key} still runs after {within_s} s"


@pytest.mark.parametrize("after_s", [0.5, 4.0])
async def test_a_thread_that_breaks_the_write_limit_between_runs_is_named(
    pool: KernelPool, workdir: Path, after_s: float
) -> None:
    """Stopped, not only named: at 0.5 s the kernel's watch still looks closely; at 4 s it has long
    handed the looking to the one thread that watches every idle kernel's filesystem."""
    limits = LIMITS.model_copy(update={"max_write_bytes": 4 * MIB})
    writer = textwrap.dedent(
        f"""
        import threading, time
        def fill():
            time.sleep({after_s})
            with open('big.bin', 'wb') as f:
                for _ in range(256):
                    f.write(b'x' * (1 << 20))
                    f.flush()
                    time.sleep(0.01)
        threading.Thread(target=fill, daemon=True).start()
        """
    )
    assert (await pool.run("u/c", workdir, writer, "python", limits)).ok
    await _until_gone(pool, "u/c", 10 + after_s)  # the reaper noticed the dead kernel first
    assert (workdir / "big.bin").stat().st_size < 128 * MIB  # stopped before it was half done
    after = await pool.run("u/c", workdir, "print('back')", "python", limits)
    assert after.stdout == "back\n"
    [note] = after.notes
    assert "wrote more than 4 MiB to /mnt/data" in note, note


async def test_a_thread_that_runs_out_of_memory_between_runs_is_named(
    pool: KernelPool, workdir: Path
) -> None:
    small = LIMITS.model_copy(update={"memory_mb": 128})
    grower = textwrap.dedent(
        """
        import threading, time
        def grow():
            time.sleep(0.5)
            hoard = []
            while True:
                hoard.append(bytearray(8 << 20))
        threading.Thread(target=grow, daemon=True).start()
        """
    )
    assert (await pool.run("u/c", workdir, grower, "python", small)).ok
    await _until_gone(pool, "u/c", 15)
    after = await pool.run("u/c", workdir, "print('back')", "python", small)
    assert after.stdout == "back\n"
    [note] = after.notes
    assert "ran out of memory" in note, note


async def test_the_reaper_racing_an_out_of_memory_run_keeps_the_real_cause(
    pool: KernelPool, workdir: Path
) -> None:
    """The reaper looks at every kernel while a cell is out of memory: whoever notices first, the
    run and the next one both say out of memory."""
    small = LIMITS.model_copy(update={"memory_mb": 128})
    await pool.run("u/c", workdir, "x = 1", "python", small)
    bomb = asyncio.create_task(
        pool.run("u/c", workdir, "b = []\nwhile True:\n    b.append(bytearray(16 << 20))", "python", small)
    )
    while not bomb.done():  # the reaper, as often as it can run
        await pool.reap()
        await asyncio.sleep(0.005)
    result = await bomb
    assert result.outcome == Outcome.OOM and "memory" in (result.reason or ""), result
    after = await pool.run("u/c", workdir, "print('back')", "python", small)
    [note] = after.notes
    assert "ran out of memory" in note, note


async def test_a_length_prefix_without_its_body_is_a_broken_protocol_said_at_once(
    pool: KernelPool, workdir: Path
) -> None:
    prefix_only = textwrap.dedent(
        """
        import gc, os, struct
        [channel] = [o for o in gc.get_objects() if type(o).__name__ == "_Channel"]
        os.write(channel.fd, struct.pack(">I", 100_000))  # a frame's length, and never its body
        """
    )
    await pool.run("u/c", workdir, "x = 1", "python", LIMITS)
    started = time.monotonic()
    broken = await pool.run(
        "u/c", workdir, prefix_only, "python", LIMITS.model_copy(update={"timeout_s": 30})
    )
    took = time.monotonic() - started
    assert broken.outcome == Outcome.KERNEL_LOST and not broken.state_kept, broken
    assert "broke the protocol" in (broken.reason or "") and "did not stop" not in (broken.reason or "")
    assert took < 15, f"took {took:.1f} s: the cell had returned at once"
    after = await pool.run("u/c", workdir, "print('fresh')", "python", LIMITS)
    assert after.stdout == "fresh\n" and "broke the protocol" in after.notes[0]


async def test_a_bash_cell_that_cannot_start_says_why(pool: KernelPool, workdir: Path) -> None:
    # An environment variable longer than the kernel allows one exec string: bash cannot be started.
    await pool.run("u/c", workdir, "import os\nos.environ['HUGE'] = 'x' * (1 << 20)", "python", LIMITS)
    shell = await pool.run("u/c", workdir, "echo hi", "bash", LIMITS)
    assert shell.outcome == Outcome.ERROR and shell.state_kept, shell
    reason = shell.reason or ""
    assert "None" not in reason and "bash" in reason and "could not start" in reason, reason
    again = await pool.run("u/c", workdir, "import os\ndel os.environ['HUGE']", "python", LIMITS)
    assert again.ok
    assert (await pool.run("u/c", workdir, "echo hi", "bash", LIMITS)).stdout == "hi\n"


async def test_a_thread_spinning_after_its_cell_is_stopped_and_said(pool: KernelPool, workdir: Path) -> None:
    """Between runs a kernel may use the CPU in bursts (up to a run's time limit of CPU time, refilled
    slowly), not for good: a spinning thread gets the kernel stopped, and the next run says why."""
    limits = LIMITS.model_copy(update={"timeout_s": 2})
    spin = "import threading\ndef spin():\n    while True:\n        pass\n"
    spin += "threading.Thread(target=spin, daemon=True).start()"
    assert (await pool.run("u/c", workdir, "kept = 1", "python", limits)).ok
    assert (await pool.run("u/spin", workdir, spin, "python", limits)).ok
    await _until_gone(pool, "u/spin", 30)
    after = await pool.run("u/spin", workdir, "print('back')", "python", limits)
    assert after.stdout == "back\n"
    [note] = after.notes
    assert "kept the CPU busy between runs" in note and "2 s of CPU time" in note, note
    # The kernel left idle meanwhile (gVisor's idle sentry uses a little CPU) was not touched.
    idle = await pool.run("u/c", workdir, "print(kept)", "python", limits)
    assert idle.stdout == "1\n" and idle.notes == ()


async def test_a_kernel_whose_last_words_name_memory_is_not_taken_for_out_of_memory(
    pool: KernelPool, workdir: Path
) -> None:
    """The outcome comes from what the watchers and the cgroup saw, not from the words: a cell that
    breaks the protocol with a frame whose type reads "out of memory" is a lost kernel."""
    lying = textwrap.dedent(
        """
        import gc, json, os, struct
        [channel] = [o for o in gc.get_objects() if type(o).__name__ == "_Channel"]
        body = json.dumps({"t": "out of memory"}).encode()
        os.write(channel.fd, struct.pack(">I", len(body)) + body)
        """
    )
    await pool.run("u/c", workdir, "x = 1", "python", LIMITS)
    result = await pool.run("u/c", workdir, lying, "python", LIMITS)
    assert "memory" in (result.reason or ""), result  # the words name it...
    assert result.outcome == Outcome.KERNEL_LOST, result  # ...and the outcome is not taken from them
