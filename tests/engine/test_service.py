"""A chat step through real storage and real gVisor: serialisation across processes, quotas, links."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from engine import Engine, Settings
from runner import Limits, Outcome, Runner
from storage import DirectoryPublisher, Quotas, Store

pytestmark = pytest.mark.runsc

LIMITS = Limits(timeout_s=15, memory_mb=256)

# One OS process = one Open WebUI worker: its own Store, Runner and event loop.
WORKER = textwrap.dedent(
    """
    import asyncio, json, sys
    from pathlib import Path
    from engine import Engine, Settings
    from runner import Limits, Runner
    from storage import Store

    async def main(root, chat, label):
        runner = Runner()
        async with Store(Path(root), owner=(runner.sandbox_uid, runner.sandbox_gid)) as store:
            service = Engine(store, runner, Settings(limits=Limits(timeout_s=15, memory_mb=256)))
            chat_session = await service.chat("u", chat)
            step = await chat_session.run(
                "import time\\nt0 = time.time()\\ntime.sleep(1.0)\\n"
                f"open('/mnt/data/{label}.txt', 'w').write(f'{{t0}} {{time.time()}}')", "python")
            print(json.dumps({"ok": step.ok, "why": step.headline()}))

    asyncio.run(main(*sys.argv[1:]))
    """
)


def run_workers(root: Path, chats: list[str]) -> list[dict]:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(root), chat, f"w{i}"], stdout=subprocess.PIPE, text=True
        )
        for i, chat in enumerate(chats)
    ]
    results = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert all(r["ok"] for r in results), results
    return results


def sandbox_intervals(root: Path, chat_dirs: list[Path]) -> list[tuple[float, float]]:
    intervals = []
    for directory in chat_dirs:
        for path in directory.glob("w*.txt"):
            start, end = map(float, path.read_text().split())
            intervals.append((start, end))
    return sorted(intervals)


def test_runs_of_one_chat_are_serialised_across_processes_other_chats_run_in_parallel(tmp_path: Path):
    same = tmp_path / "same"
    run_workers(same, ["chat-a", "chat-a"])
    [session_dir] = [p for p in (same / "sessions").glob("*/*") if p.is_dir()]
    (_, first_end), (second_start, _) = sandbox_intervals(same, [session_dir])
    assert second_start >= first_end, "two runs of one chat overlapped"

    apart = tmp_path / "apart"
    run_workers(apart, ["chat-b", "chat-c"])
    dirs = [p for p in (apart / "sessions").glob("*/*") if p.is_dir()]
    (_, a_end), (b_start, _) = sandbox_intervals(apart, dirs)
    assert b_start < a_end, "runs of different chats did not overlap"


@pytest.fixture
async def service(tmp_path: Path):
    runner = Runner()
    store = Store(
        tmp_path / "root",
        quotas=Quotas(max_files_per_user=3, max_bytes_per_user=1 << 20, max_file_bytes=1 << 16),
        publisher=DirectoryPublisher(tmp_path / "cache" / "functions" / "cs", "/cache/functions/cs/"),
        owner=(runner.sandbox_uid, runner.sandbox_gid),
    )
    async with store:
        yield Engine(store, runner, Settings(limits=LIMITS))


async def test_quota_removes_new_files_and_says_why_then_runs_with_nothing_to_spend(service: Engine):
    chat = await service.chat("u", "c")
    first = await chat.run("open('/mnt/data/old.txt', 'w').write('keep me')", "python")
    assert first.ok and first.files.added == ["old.txt"]
    too_big = await chat.run("open('/mnt/data/big.bin', 'wb').write(b'0' * 70000)", "python")
    assert too_big.run.outcome == Outcome.ERROR and "File too large" in too_big.run.stderr
    step = await chat.run("for i in range(5):\n    open(f'/mnt/data/new{i}.txt', 'w').write('x')", "python")
    removed = {removal.path for removal in step.files.quota_removed}
    notes = "\n".join(step.file_notes())
    # old.txt and the partial big.bin were there before the run: only new files go, newest first.
    assert len(removed) == 4 and removed <= {f"new{i}.txt" for i in range(5)} and "limit of 3 files" in notes
    assert (chat.session.path / "old.txt").read_text() == "keep me"
    assert len(list(chat.session.path.iterdir())) == 3
    # At the limit the next run still starts, says so, and what it adds goes...
    full = await chat.run("print('more')\nopen('/mnt/data/one-more.txt', 'w').write('x')", "python")
    assert full.ok and "more" in full.run.stdout
    assert [r.path for r in full.files.quota_removed] == ["one-more.txt"]
    assert "You are at your storage limit of 3 files" in full.for_model()
    # ... but it may delete files, which frees room for the next one.
    freed = await chat.run("import os\nos.remove('/mnt/data/old.txt')", "python")
    assert freed.ok and freed.files.removed == ["old.txt"]
    after = await chat.run("open('/mnt/data/fits.txt', 'w').write('y')", "python")
    assert after.files.added == ["fits.txt"] and after.files.quota_removed == []


async def test_links_only_for_real_files_of_this_session(service: Engine, tmp_path: Path):
    chat = await service.chat("u", "c")
    other = await service.chat("u", "other")
    await other.run("open('/mnt/data/theirs.txt', 'w').write('no')", "python")
    step = await chat.run("open('/mnt/data/mine.txt', 'w').write('yes')", "python")
    assert step.ok
    text = await chat.rewrite("mine: /mnt/data/mine.txt, theirs: /mnt/data/theirs.txt, ../: /mnt/data/../x")
    assert "[mine.txt](/cache/functions/cs/" in text
    assert "theirs: /mnt/data/theirs.txt" in text and "/mnt/data/../x" in text
    [published] = list((tmp_path / "cache").rglob("mine.txt"))
    assert published.read_text() == "yes" and not published.is_symlink()


async def test_a_timeout_is_reported_and_files_written_before_it_are_kept(service: Engine):
    settings = Settings(limits=LIMITS.model_copy(update={"timeout_s": 2}), policy=service.store.policy)
    chat = await service.chat("u", "c", settings)
    step = await chat.run("open('/mnt/data/partial.txt', 'w').write('x')\nwhile True: pass", "python")
    assert step.run.outcome == Outcome.TIMEOUT
    assert "time limit" in step.headline()
    assert step.files.added == ["partial.txt"]
    started = time.monotonic()
    assert (await chat.run("print(1)", "python")).ok  # the chat is not left locked
    assert time.monotonic() - started < 10
