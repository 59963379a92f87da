"""Faults: a lost or corrupt index, a full disk while publishing, a broken sandbox, races in one chat."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.adversarial.attack import (
    SMALL,
    assert_index_matches_disk,
    links,
    published,
    published_files,
    session_dirs,
)
from tests.adversarial.bad_days_support import start_running
from tests.support.pipe_harness import PipeHarness, code

pytestmark = pytest.mark.runsc


async def close(harness: PipeHarness) -> None:
    """What an Open WebUI shutdown leaves: the store closed, the background loop gone."""
    if harness.pipe._background is not None:
        harness.pipe._background.cancel()
    await harness.pipe._services.close()


async def some_history(harness: PipeHarness) -> str:
    await harness.say("alice", "chat-1", code("open('/mnt/data/a.csv', 'w').write('1,2')"))
    answer = await harness.say(
        "alice", "chat-2", code("open('/mnt/data/b.txt', 'w').write('b')", "/mnt/data/b.txt")
    )
    [url] = links(answer.splitlines()[-1])
    return url


@pytest.mark.parametrize("damage", ["deleted", "corrupted"])
async def test_lost_or_corrupt_index_is_rebuilt_from_disk(tmp_path: Path, caplog, damage: str):
    """Naive: a missing or garbage index starts empty, so every file is forgotten (and off the quota)."""
    first = PipeHarness(tmp_path / "data", valves=dict(SMALL))
    url = await some_history(first)
    await close(first)
    index = first.sessions_root / "index.sqlite3"
    for suffix in ("", "-wal", "-shm"):
        Path(f"{index}{suffix}").unlink(missing_ok=True)
    if damage == "corrupted":
        index.write_bytes(b"this is not a database " * 1000)

    caplog.set_level(logging.WARNING, logger="code_sessions.storage")
    restarted = PipeHarness(tmp_path / "data", valves=dict(SMALL))  # Open WebUI started again
    answer = await restarted.say("alice", "chat-1", code("print(open('/mnt/data/a.csv').read())"))
    assert "1,2" in answer
    words = "is corrupt" if damage == "corrupted" else "is new but session folders exist: rebuilding it"
    assert any(words in record.getMessage() for record in caplog.records), caplog.text
    assert any("index rebuilt" in record.getMessage() for record in caplog.records), caplog.text
    # The model is told the chat's files again, and the other chat and its old link are intact.
    assert "/mnt/data/a.csv" in restarted.requests[-1]["messages"][0]["content"]
    assert published(restarted, url) == b"b"
    usage = {u.user_id: u for u in await restarted.pipe._services.store.users_usage()}["alice"]
    assert usage.files == 2
    await assert_index_matches_disk(restarted)


@contextlib.contextmanager
def tiny_disk(path: Path, size: str = "1m") -> Iterator[None]:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


async def test_full_disk_while_publishing_leaves_no_partial_copy(harness: PipeHarness):
    """Naive: ENOSPC half-way leaves a truncated copy behind a working link, or kills the whole answer."""
    await harness.say("alice", "chat-1", code("print('warm')"))
    make = (
        "import os\nopen('/mnt/data/big.bin', 'wb').write(os.urandom(3 * 1024 * 1024))\n"
        "open('/mnt/data/small.txt', 'w').write('small')"
    )
    uploads = harness.files.uploads  # where Open WebUI's storage provider keeps the copies
    uploads.mkdir(parents=True, exist_ok=True)
    with tiny_disk(uploads):
        answer = await harness.say(
            "alice", "chat-1", code(make, "Big: /mnt/data/big.bin small: /mnt/data/small.txt")
        )
        [reply] = [line for line in answer.splitlines() if line.startswith("Big:")]
        assert "Big: /mnt/data/big.bin" in reply  # not a link: there was no room for its copy
        [url] = links(reply)
        assert published(harness, url) == b"small"
        assert "not enough disk space" in answer.lower()  # the user is told why
        # Only the small file's copy is stored: nothing half-written of the big one.
        assert [p.read_bytes() for p in published_files(harness)] == [b"small"]
    # The small file's copy was on the tiny disk, gone with it; the next cleanup drops its link.
    await harness.pipe._services.store.cleanup()
    again = await harness.say("alice", "chat-1", code("print('room again')", "Big: /mnt/data/big.bin"))
    [url] = links(again.splitlines()[-1])
    assert len(published(harness, url)) == 3 * 1024 * 1024
    await assert_index_matches_disk(harness)


FAILING_RUNSC = r"""#!/usr/bin/python3
import sys, time
args = sys.argv[1:]
if args == ["--version"]:
    print("runsc version 0.0~20221219.0\nspec: 1.0.2")
elif args == ["flags"]:
    for flag in ("platform string", "log string", "log-format string", "panic-log string"):
        print("  -" + flag)
elif args == ["help", "platforms"]:
    print("ptrace")
elif "run" in args:
    bundle = args[args.index("--bundle") + 1]
    if open(bundle + "/config.json").read().count("main.sh"):
        sys.exit(0)  # the startup probe of the sandbox's quirks (a bash run): nothing to report
    if MODE == "hang":
        time.sleep(3600)
    print("creating container: cannot create sandbox: cannot read client sync file: EOF", file=sys.stderr)
    sys.exit(128)
"""


@pytest.mark.parametrize("mode", ["fail", "hang"])
async def test_broken_runsc_gives_a_clear_answer_and_the_chat_recovers(harness: PipeHarness, tmp_path, mode):
    """Naive: a runsc that fails or hangs raises out of the pipe (an error page) or hangs the chat forever."""
    stub = tmp_path / "runsc"
    stub.write_text(FAILING_RUNSC.replace("MODE", repr(mode)))
    stub.chmod(0o755)
    harness.set_valves(runsc_path=str(stub), timeout_seconds=2)
    answer = await asyncio.wait_for(harness.say("alice", "chat-1", code("print('hello')")), 60)
    if mode == "fail":
        assert "could not run: the sandbox failed" in answer and "cannot create sandbox" in answer
    elif harness.pipe._services.kernels is not None:  # a kernel that never says it is ready
        assert "could not run: the sandbox failed" in answer and "did not start within" in answer
    else:
        assert "was stopped: time limit reached" in answer
    harness.set_valves(runsc_path="runsc")
    assert "back" in await harness.say("alice", "chat-1", code("print('back')"))
    await assert_index_matches_disk(harness)


async def test_cleanup_racing_a_run_never_deletes_under_it(harness: PipeHarness):
    """Naive: expiry (or a purge) deletes a chat's folder while its sandbox is still writing into it."""
    await harness.say("alice", "chat-x", code("open('/mnt/data/old.txt', 'w').write('old')"))
    # Everything is long expired by this policy: idle sessions and old files go at the next cleanup.
    harness.set_valves(session_idle_days=1e-7, file_max_age_days=1e-7, timeout_seconds=10)
    slow = code(
        "import time\ntime.sleep(6)\nopen('/mnt/data/new.txt', 'w').write('new')\n"
        "print('OLD=' + open('/mnt/data/old.txt').read())",
        "New: /mnt/data/new.txt",
    )
    running, _ = await start_running(harness, "alice", "chat-x", slow)
    # Mid-run: the background loop's expiry tick, and an admin's purge of this very chat (run at the
    # next message of anyone).
    pipe = harness.pipe
    await pipe._tick()
    harness.set_valves(purge="chat:chat-x")
    other = await harness.say("bob", "chat-y", code("print('other chat')"))
    assert "other chat" in other and not running.done()
    answer = await running
    assert "OLD=old" in answer  # the old file was still there while the run needed it
    [url] = links(answer.splitlines()[-1])
    assert published(harness, url) == b"new"
    [folder] = [f for f in session_dirs(harness) if f.name.startswith("chat-x")]
    assert sorted(p.name for p in folder.iterdir()) == ["new.txt", "old.txt"]
    await assert_index_matches_disk(harness)
