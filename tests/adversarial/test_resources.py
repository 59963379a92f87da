"""Resource abuse: code that tries to take the host's CPU, memory, processes, disk or the answer itself."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import pytest

from runner import RunResult
from tests.adversarial.attack import assert_index_matches_disk, links, published_files, session_dirs
from tests.support.pipe_harness import PipeHarness, code
from tests.support.sandbox import assert_nothing_left

pytestmark = pytest.mark.runsc

MB = 1024 * 1024


def spy_on_runs(harness: PipeHarness) -> list[RunResult]:
    """Record what each run returned (the answer only shows the user's view of it), in a fresh
    sandbox or in the chat's kernel."""
    results: list[RunResult] = []
    services = harness.pipe._services
    target = services.kernels if services.kernels is not None else services.runner
    original = target.run

    async def run(*args, **kwargs):
        result = await original(*args, **kwargs)
        results.append(result)
        return result

    target.run = run
    return results


async def nothing_left_of(harness: PipeHarness, result: RunResult) -> None:
    """No runsc container, host process, cgroup or bundle of the run survives it (a kernel's: once the
    kernel is stopped, as at the end of its idle time)."""
    services = harness.pipe._services
    if services.kernels is not None:
        await services.kernels.close()
    assert_nothing_left(services.runner, result)


async def warm(harness: PipeHarness) -> list[RunResult]:
    await harness.say("mallory", "chat-1", code("print('warm')"))
    return spy_on_runs(harness)


async def test_fork_bomb_is_contained_and_cleaned_up(harness: PipeHarness):
    """Naive: a fork bomb takes the host's process table, outlives the answer or blocks it forever."""
    harness.set_valves(timeout_seconds=3)
    runs = await warm(harness)
    started = time.monotonic()
    bomb = "bomb() { bomb | bomb & }; bomb; sleep 60"
    answer = await harness.say("mallory", "chat-1", code(bomb, "bombed", "bash"))
    assert time.monotonic() - started < 20
    assert "stopped: time limit reached" in answer
    await nothing_left_of(harness, runs[-1])
    assert "still here" in await harness.say("mallory", "chat-1", code("print('still here')"))


async def test_infinite_loop_ends_at_the_time_limit(harness: PipeHarness):
    """Naive: `while True: pass` holds the chat (and its lock) forever."""
    harness.set_valves(timeout_seconds=2)
    runs = await warm(harness)
    started = time.monotonic()
    answer = await harness.say("mallory", "chat-1", code("while True:\n    pass"))
    assert time.monotonic() - started < 12
    assert "was stopped: time limit reached" in answer
    await nothing_left_of(harness, runs[-1])


async def test_memory_bomb_is_stopped_as_out_of_memory(harness: PipeHarness):
    """Naive: allocating without end grows until the host's OOM killer picks a victim (maybe Open WebUI)."""
    harness.set_valves(memory_mb=128)
    runs = await warm(harness)
    bomb = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 * 1024 * 1024))"
    answer = await harness.say("mallory", "chat-1", code(bomb))
    assert "was stopped: out of memory" in answer
    await nothing_left_of(harness, runs[-1])


async def test_tmp_is_memory_not_host_disk(harness: PipeHarness, tmp_path: Path):
    """Naive: /tmp is a host folder, so filling it fills the host disk without any quota."""
    harness.set_valves(memory_mb=128)
    before = shutil.disk_usage(tmp_path).used
    fill = (  # many files: each stays under the per-file limit (RLIMIT_FSIZE applies in /tmp too)
        "for i in range(1000):\n    with open(f'/tmp/fill{i}', 'wb') as f:\n"
        "        for _ in range(16):\n            f.write(b'x' * (1 << 20))"
    )
    answer = await harness.say("mallory", "chat-1", code(fill))
    assert "was stopped: out of memory" in answer
    assert shutil.disk_usage(tmp_path).used - before < 64 * MB


async def test_disk_fill_in_mnt_data_is_stopped_and_rolled_back(harness: PipeHarness):
    """Naive: writing without end into /mnt/data fills the host disk; the file stays past the user's quota."""
    harness.set_valves(max_mb_per_user=32, timeout_seconds=10)
    fill = (  # each file stays under the per-file limit (RLIMIT_FSIZE), together they do not
        "for i in range(1000):\n    with open(f'/mnt/data/fill{i:03}', 'wb') as f:\n"
        "        for _ in range(8):\n            f.write(b'x' * (1 << 20))"
    )
    answer = await harness.say("mallory", "chat-1", code(fill))
    assert "was stopped: it wrote more than the disk limit" in answer
    assert ": over the 32 MiB storage limit across all your chats" in answer
    [folder] = session_dirs(harness)
    assert sum(p.stat().st_size for p in folder.iterdir()) <= 32 * MB
    await assert_index_matches_disk(harness)


async def test_a_hundred_megabytes_of_stdout_is_cut(harness: PipeHarness):
    """Naive: the whole output goes into the answer (and the model's context), 100 MB of it."""
    flood = "import sys\nfor _ in range(100):\n    sys.stdout.write('y' * (1 << 20))"
    answer = await harness.say("mallory", "chat-1", code(flood))
    assert "was stopped: too much output" in answer
    assert "[... output truncated at 64 KiB ...]" in answer
    assert len(answer) < 100_000
    tool_result = harness.requests[-1]["messages"][-1]["content"]
    assert len(tool_result) < 10_000


async def test_many_tiny_files_past_the_quota_are_removed_and_the_next_run_has_nothing_to_spend(
    harness: PipeHarness,
):
    """Naive: thousands of 1-byte files slip under a bytes-only quota and are all kept."""
    harness.set_valves(max_files_per_user=100, max_new_files_per_run=300)
    make = "for i in range(300):\n    open(f't{i:03}', 'w').write('x')"
    answer = await harness.say("mallory", "chat-1", code(make))
    assert "over the limit of 100 files across all your chats" in answer
    [folder] = session_dirs(harness)
    assert len(list(folder.iterdir())) == 100
    full = await harness.say("mallory", "chat-2", code("open('/mnt/data/one-more', 'w').write('x')"))
    assert "You are at your storage limit of 100 files" in full and "can read, delete or shrink" in full
    assert "Removed /mnt/data/one-more: over the limit of 100 files" in full
    assert len(list(folder.iterdir())) == 100
    await assert_index_matches_disk(harness)


async def test_sparse_terabyte_file_is_refused(harness: PipeHarness):
    """Naive: a 1 TB sparse file costs nothing on disk, so it passes a quota that only counts blocks."""
    sparse = "with open('/mnt/data/huge', 'wb') as f:\n    f.truncate(1 << 40)\nprint('made', 'it')"
    answer = await harness.say("mallory", "chat-1", code(sparse, "See /mnt/data/huge"))
    assert "File too large" in answer and "made it" not in answer  # RLIMIT_FSIZE: 100 MiB per file
    [folder] = session_dirs(harness)
    assert (folder / "huge").stat().st_size == 0
    await assert_index_matches_disk(harness)


async def test_a_huge_sparse_file_without_quotas_is_not_linked_and_the_answer_says_why(harness: PipeHarness):
    """Naive: with quotas off, linking a 2 GiB sparse file makes Open WebUI read and store 2 GiB (its
    storage provider holds a file in memory whole): the worker's memory, and a dense copy on disk."""
    harness.set_valves(max_file_mb=0, max_mb_per_user=0)
    sparse = "with open('/mnt/data/huge', 'wb') as f:\n    f.truncate(2 << 30)\n    f.write(b'end')"
    answer = await harness.say("mallory", "chat-1", code(sparse, "See /mnt/data/huge"))
    assert links(answer) == []
    [said] = [line for line in answer.splitlines() if line.startswith("- Not linked: /mnt/data/huge:")]
    assert "too large to link (2 GiB" in said and "links stop at 1 GiB" in said, said
    assert published_files(harness) == []  # nothing was stored
    await assert_index_matches_disk(harness)


async def test_writes_to_deleted_but_open_files_count(harness: PipeHarness):
    """Naive: a disk watcher that walks the folder cannot see files that are unlinked but still written."""
    harness.set_valves(max_mb_per_user=32, timeout_seconds=15)
    hide = (
        "import os\nkept = []\nfor i in range(64):\n    f = open(f'h{i}', 'wb')\n    os.unlink(f'h{i}')\n"
        "    for _ in range(30):\n        f.write(b'x' * (1 << 20))\n    f.flush()\n    kept.append(f)\n"
        "print('hid', 'it', 'all')"
    )
    answer = await harness.say("mallory", "chat-1", code(hide))
    assert "hid it all" not in answer
    assert "was stopped: it wrote more than the disk limit" in answer


@pytest.mark.parametrize("levels, name", [(20, "n" * 200), (3000, "d")])
async def test_writes_hidden_in_deep_or_long_paths_count(harness: PipeHarness, levels: int, name: str):
    """Naive: a watcher walking by path skips folders past PATH_MAX (4096 bytes) or too deep to recurse."""
    harness.set_valves(max_mb_per_user=32, timeout_seconds=15)
    hide = (
        f"import os\nfor _ in range({levels}):\n    os.mkdir({name!r})\n    os.chdir({name!r})\n"
        "for i in range(64):\n    with open(f'h{i}', 'wb') as f:\n"
        "        for _ in range(30):\n            f.write(b'x' * (1 << 20))\nprint('hid', 'it', 'all')"
    )
    answer = await harness.say("mallory", "chat-1", code(hide))
    assert "hid it all" not in answer
    assert "was stopped: it wrote more than the disk limit" in answer
    await assert_index_matches_disk(harness)


async def test_empty_folders_do_not_pile_up_outside_the_quota(harness: PipeHarness):
    """Naive: folders are not files, so every run may add thousands of them and none is ever counted."""
    harness.set_valves(timeout_seconds=20)
    make = "import os\nfor i in range(1500):\n    os.mkdir(f'{RUN}-{i}')"
    for run in ("a", "b"):
        answer = await harness.say("mallory", "chat-1", code(make.replace("{RUN}", run)))
        assert "too many empty folders; only the first 1000 are kept" in answer
    [folder] = session_dirs(harness)
    # At most 1000 kept per run (at each full listing of the chat's folder, 1000 in all).
    assert sum(1 for p in folder.rglob("*") if p.is_dir()) <= 2000
    await assert_index_matches_disk(harness)


async def test_published_copies_are_bounded_by_the_quota(harness: PipeHarness):
    """Naive: rewriting files and linking them again makes a new copy each time, outside every quota."""
    harness.set_valves(max_mb_per_user=8, timeout_seconds=15)
    rewrite = (
        "import os\nfor i in range(3):\n    open(f'part{i}.bin', 'wb').write(os.urandom(2 * 1024 * 1024))"
    )
    reply = "Parts: /mnt/data/part0.bin /mnt/data/part1.bin /mnt/data/part2.bin"
    for _ in range(4):
        answer = await harness.say("mallory", "chat-1", code(rewrite, reply))
    total = sum(path.stat().st_size for path in published_files(harness))
    files = sum(
        p.stat().st_size for folder in session_dirs(harness) for p in folder.rglob("*") if p.is_file()
    )
    assert files + total <= 8 * MB  # copies count toward the quota with the files
    assert "was not linked: a copy for download would take 2 MiB" in answer
    await assert_index_matches_disk(harness)


async def test_two_runs_at_once_in_different_chats_both_finish(harness: PipeHarness):
    """Naive: one user's long run blocks every other chat (a global lock) or they share a sandbox."""
    slow = code("import time\ntime.sleep(2)\nopen('/mnt/data/who', 'w').write('slow')\nprint('slow done')")
    fast = code("open('/mnt/data/who', 'w').write('fast')\nprint('fast done')")
    started = time.monotonic()
    one, two = await asyncio.gather(harness.say("a", "chat-a", slow), harness.say("b", "chat-b", fast))
    assert "slow done" in one and "fast done" in two
    assert time.monotonic() - started < 10


async def test_growth_through_a_hard_link_alias_is_not_hidden_from_the_index(harness: PipeHarness):
    """Naive: an index updated only from the paths a run touched misses b/y when it grows through a/x
    (a hard link to it) and a/x is then deleted: the quota never sees the bytes."""
    await harness.say(
        "mallory",
        "chat-1",
        code("import os\nos.makedirs('a')\nos.makedirs('b')\nopen('b/y', 'w').write('1')"),
    )
    grow = (
        "import os\nos.link('b/y', 'a/x')\nwith open('a/x', 'ab') as f:\n"
        "    f.write(b'x' * (12 * 1024 * 1024))\nos.unlink('a/x')"
    )
    await harness.say("mallory", "chat-1", code(grow))
    usage = {u.user_id: u for u in await harness.pipe._services.store.users_usage()}["mallory"]
    assert usage.bytes >= 12 * MB
    await assert_index_matches_disk(harness)
