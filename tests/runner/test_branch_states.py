"""Copies of a chat's Python state for the conversation's branches, in real gVisor: a copy taken while
the kernel goes on, and a chat rewound to it (the next run resumes that state, saying nothing)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from runner import KernelPool, KernelSettings, Limits, Runner, reset_sentence

pytestmark = pytest.mark.runsc

LIMITS = Limits(timeout_s=20, memory_mb=512, max_output_bytes=64 * 1024)


@pytest.fixture
def chat(tmp_path: Path) -> tuple[Path, Path]:
    folder, state = tmp_path / "sessions" / "chat", tmp_path / "state" / "chat.kernel"
    folder.mkdir(parents=True)
    return folder, state


def pool_of(runner: Runner, tmp_path: Path, **settings: object) -> KernelPool:
    return KernelPool(runner, tmp_path / "registry", settings=KernelSettings(**settings))


async def test_a_copy_taken_while_the_kernel_goes_on_is_what_a_rewind_resumes(
    runner: Runner, tmp_path: Path, chat: tuple[Path, Path]
) -> None:
    folder, state = chat
    pool = pool_of(runner, tmp_path)
    copy = tmp_path / "history" / "m1"
    try:
        setup = "x = 41\nrows = list(range(10))"
        first = await pool.run("u/c", folder, setup, "python", LIMITS, state_dir=state)
        assert first.ok, first
        image, why = await pool.snapshot("u/c", copy, state_dir=state)
        assert image and not why, why
        assert (copy / "kernel" / "meta.json").is_file()
        # The kernel went on: the same process, the state moving ahead of the copy.
        moved = "x += 1\nrows.pop()\nprint(x, len(rows))"
        later = await pool.run("u/c", folder, moved, "python", LIMITS, state_dir=state)
        assert later.stdout.strip() == "42 9" and later.container_id == first.container_id
        await pool.rewind("u/c", state, copy, "unused")
        back = await pool.run("u/c", folder, "print(x, len(rows))", "python", LIMITS, state_dir=state)
        assert back.stdout.strip() == "41 10", back
        assert back.notes == ()  # nothing lost: nothing said
        assert (copy / "kernel" / "meta.json").is_file()  # the copy stays for a later rewind
        # Twice: the same copy gives the same state again.
        await pool.run("u/c", folder, "x = 0", "python", LIMITS, state_dir=state)
        await pool.rewind("u/c", state, copy, "unused")
        again = await pool.run("u/c", folder, "print(x)", "python", LIMITS, state_dir=state)
        assert again.stdout.strip() == "41" and again.notes == ()
    finally:
        await pool.close()


async def test_a_rewind_without_a_copy_starts_anew_and_says_why(
    runner: Runner, tmp_path: Path, chat: tuple[Path, Path]
) -> None:
    folder, state = chat
    pool = pool_of(runner, tmp_path)
    try:
        await pool.run("u/c", folder, "x = 1", "python", LIMITS, state_dir=state)
        why = "the Python state of that message is no longer kept"
        await pool.rewind("u/c", state, None, why)
        after = await pool.run("u/c", folder, "print('x' in globals())", "python", LIMITS, state_dir=state)
        assert after.stdout.strip() == "False"
        assert after.notes == (reset_sentence(why),)
    finally:
        await pool.close()


async def test_a_sleeping_kernels_image_is_shared_not_written_again(
    runner: Runner, tmp_path: Path, chat: tuple[Path, Path]
) -> None:
    folder, state = chat
    pool = pool_of(runner, tmp_path)
    copy = tmp_path / "history" / "m1"
    try:
        await pool.run("u/c", folder, "x = 7", "python", LIMITS, state_dir=state)
        assert await pool.hibernate("u/c") is None
        image, why = await pool.snapshot("u/c", copy, state_dir=state)
        assert image and not why, why
        pages = [p for p in (copy / "kernel").iterdir() if p.name != "meta.json"]
        assert pages and all(p.stat().st_nlink == 2 for p in pages)  # the same inodes as the saved image
        resumed = await pool.run("u/c", folder, "x += 1\nprint(x)", "python", LIMITS, state_dir=state)
        assert resumed.stdout.strip() == "8" and resumed.notes == ()
        await pool.rewind("u/c", state, copy, "unused")
        back = await pool.run("u/c", folder, "print(x)", "python", LIMITS, state_dir=state)
        assert back.stdout.strip() == "7" and back.notes == ()
    finally:
        await pool.close()


async def test_a_copy_over_its_bound_is_not_kept_and_the_kernel_goes_on(
    runner: Runner, tmp_path: Path, chat: tuple[Path, Path]
) -> None:
    folder, state = chat
    pool = pool_of(runner, tmp_path)
    copy = tmp_path / "history" / "m1"
    try:
        await pool.run("u/c", folder, "x = 5", "python", LIMITS, state_dir=state)
        image, why = await pool.snapshot("u/c", copy, state_dir=state, max_bytes=1024)
        assert image == "" and "over the 1 KiB" in why, why
        assert not (copy / "kernel").exists()
        after = await pool.run("u/c", folder, "print(x)", "python", LIMITS, state_dir=state)
        assert after.stdout.strip() == "5" and after.notes == ()
    finally:
        await pool.close()


async def test_a_kernel_clearly_too_big_for_its_bound_is_not_even_written(
    runner: Runner, tmp_path: Path, chat: tuple[Path, Path]
) -> None:
    """Its cgroup says what it holds (gVisor's memory file, which no host process need map: summed
    RSS missed the 200 MiB here): more than compression could ever bring under the bound, so no
    checkpoint is taken only to be thrown away."""
    folder, state = chat
    pool = pool_of(runner, tmp_path)
    copy = tmp_path / "history" / "m1"
    try:
        code = "import os\nblob = os.urandom(200 << 20)"
        assert (await pool.run("u/c", folder, code, "python", LIMITS, state_dir=state)).ok
        image, why = await pool.snapshot("u/c", copy, state_dir=state, max_bytes=4 * 2**20)
        assert image == "" and why.startswith("its memory of ") and "more than 4 MiB can hold" in why, why
        assert not copy.exists() or not any(copy.iterdir())
    finally:
        await pool.close()


async def test_another_workers_kernel_is_copied_by_that_worker(
    runner: Runner, tmp_path: Path, chat: tuple[Path, Path]
) -> None:
    """Two pools of one process reach each other's kernels over the socket, as two workers do."""
    folder, state = chat
    holder, other = pool_of(runner, tmp_path), pool_of(runner, tmp_path)
    copy = tmp_path / "history" / "m1"
    try:
        await holder.run("u/c", folder, "x = 'held'", "python", LIMITS, state_dir=state)
        image, why = await other.snapshot("u/c", copy, state_dir=state)
        assert image and not why, why
        await holder.run("u/c", folder, "x = 'moved on'", "python", LIMITS, state_dir=state)
        await other.rewind("u/c", state, copy, "unused")
        deadline = time.monotonic() + 10
        while "u/c" in holder.kernels() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert "u/c" not in holder.kernels()  # the holder ended its kernel when asked
        back = await other.run("u/c", folder, "print(x)", "python", LIMITS, state_dir=state)
        assert back.stdout.strip() == "held" and back.notes == ()
        assert os.path.isdir(copy / "kernel")
    finally:
        await holder.close()
        await other.close()


async def test_a_stop_while_a_copy_is_being_taken_still_saves_the_kernel(
    runner: Runner, tmp_path: Path, chat: tuple[Path, Path]
) -> None:
    # A deploy's SIGTERM right after an answer lands while the answer's state is being copied: the
    # kernel is idle, not running a cell, and must be saved (it was stopped with its state).
    folder, state = chat
    pool = pool_of(runner, tmp_path)
    first = await pool.run("u/c", folder, "x = 41", "python", LIMITS, state_dir=state)
    assert first.ok, first
    into = tmp_path / "history" / "m1"
    copying = asyncio.ensure_future(pool.snapshot("u/c", into, state_dir=state))
    # The copy has begun once its staging folder is there (runsc checkpoint --leave-running writes
    # into it next): wait for that, not for a guessed time.
    deadline = time.monotonic() + 10
    while not (into.is_dir() and any(p.name.startswith(".kernel-") for p in into.iterdir())):
        assert not copying.done() and time.monotonic() < deadline, "the copy did not begin"
        await asyncio.sleep(0.002)
    assert not copying.done()
    await pool.close()
    image, why = await copying
    assert image and not why, why
    assert (state / "kernel" / "meta.json").is_file()
    again = pool_of(runner, tmp_path)
    try:
        back = await again.run("u/c", folder, "print(x)", "python", LIMITS, state_dir=state)
        assert back.stdout.strip() == "41" and back.notes == (), back
    finally:
        await again.close()
