"""Helpers of tests/adversarial/test_bad_days.py: what the host holds for a user, a small real disk, the
status events of one message, a damaged index, runs that end together, and an Open WebUI that crashes.

Everything here looks at the host from the outside (the folders, the published copies, the index file)
or stands in for Open WebUI (its file store); nothing replaces a part of the function under test.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from tests.adversarial.attack import LINK
from tests.support.pipe_harness import REPO, PipeHarness

MB = 1024 * 1024
KB = 1024
DISK_FULL = "The disk that holds the chats' files is full"
AT_LIMIT = "can read, delete or shrink files, but anything it adds is removed when it ends"
WAITING = "Waiting for this chat's previous step to finish"


# ---------------------------------------------------------------- what the host holds


def user_folders(root: Path, user: str) -> list[Path]:
    """The session folders of a user (`sessions/<slug>-<hash>/<chat>`), found on disk, not in the index."""
    pattern = re.compile(re.escape(user) + r"-[0-9a-f]{24}")
    base = root / "sessions"
    if not base.is_dir():
        return []
    return [
        chat
        for folder in base.iterdir()
        if pattern.fullmatch(folder.name) and folder.is_dir()
        for chat in folder.iterdir()
        if chat.is_dir()
    ]


def chat_folder(root: Path, user: str, chat: str) -> Path:
    pattern = re.compile(re.escape(chat) + r"-[0-9a-f]{24}")
    [found] = [f for f in user_folders(root, user) if pattern.fullmatch(f.name)]
    return found


def files_in(folder: Path) -> dict[str, int]:
    """Relative path -> size of every regular file under a folder (symlinks are not files)."""
    return {
        str(p.relative_to(folder)): p.lstat().st_size
        for p in folder.rglob("*")
        if p.is_file() and not p.is_symlink()
    }


def user_files(root: Path, user: str) -> tuple[int, int]:
    """(files, bytes) of a user's folders on disk."""
    sizes = [size for folder in user_folders(root, user) for size in files_in(folder).values()]
    return len(sizes), sum(sizes)


def copies(harness: PipeHarness, urls: Iterable[str] | None = None) -> int:
    """Bytes of the published copies on disk: all of them, or those behind these link URLs."""
    on_disk = {
        f"/api/v1/files/{row.id}/content": row.path.stat().st_size
        for row in harness.files.rows.values()
        if row.path.is_file()
    }
    if urls is None:
        return sum(on_disk.values())
    return sum(on_disk.get(url, 0) for url in set(urls))


def answer_links(answers: Iterable[str]) -> list[str]:
    return [url for answer in answers for url in LINK.findall(answer)]


def host_total(
    harness: PipeHarness, user: str, root: Path | None = None, answers: Iterable[str] | None = None
):
    """What a user holds on the host: file bytes in all their folders plus their published copies (all
    copies on disk when `answers` is None: a test with one user; else the copies linked in their
    answers)."""
    _, size = user_files(root or harness.sessions_root, user)
    return size + copies(harness, None if answers is None else answer_links(answers))


async def indexed_usage(harness: PipeHarness, user: str) -> tuple[int, int]:
    """(files, bytes) the index counts for a user (`python -m storage usage`)."""
    for usage in await harness.pipe._services.store.users_usage():
        if usage.user_id == user:
            return usage.files, usage.bytes
    return 0, 0


def count(answer: str, needle: str) -> int:
    return answer.count(needle)


# ---------------------------------------------------------------- a small real disk


@contextlib.contextmanager
def small_disk(path: Path, size: str = "16m") -> Iterator[Path]:
    """A real tmpfs of `size` at `path` (ENOSPC for real), unmounted afterwards whatever happened."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


# Writes /mnt/data/<name> until the disk refuses (each file under the per-file limit), then says so.
FILL = (
    "n = 0\ntry:\n    with open('/mnt/data/{name}', 'wb') as f:\n        while True:\n"
    "            f.write(b'f' * 65536)\n            f.flush()\n            n += 65536\n"
    "except OSError as error:\n    print('disk refused after', n, 'bytes:', error.strerror)"
)


def fill(name: str = "fill.bin") -> str:
    return FILL.replace("{name}", name)


def index_is_sound(root: Path) -> None:
    """The index file passes SQLite's own check and was never moved aside as corrupt."""
    index = root / "index.sqlite3"
    connection = sqlite3.connect(f"file:{index}?mode=ro", uri=True)
    try:
        assert connection.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    finally:
        connection.close()
    moved = [p.name for p in root.iterdir() if ".corrupt" in p.name]
    assert moved == [], f"the index was taken for damaged: {moved}"


# ---------------------------------------------------------------- a damaged index


def checkpoint(index: Path) -> None:
    """What SQLite's auto-checkpoint does after 1,000 pages: move the WAL's pages into the main file, so
    the main file is what readers read (damage to it is then damage to the index)."""
    connection = sqlite3.connect(index)
    try:
        [(busy, _, _)] = connection.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        assert busy == 0, "the checkpoint could not complete: the damage would not be real"
    finally:
        connection.close()


def damage_index(index: Path, how: str) -> None:
    checkpoint(index)
    if how == "truncated":
        os.truncate(index, 0)
    elif how == "garbage":
        index.write_bytes(os.urandom(index.stat().st_size))
    elif how == "pages":  # the header kept, every page after it garbage
        size = index.stat().st_size
        with open(index, "r+b") as f:
            f.seek(100)
            f.write(os.urandom(size - 100))
    elif how == "deleted":
        for suffix in ("", "-wal", "-shm"):
            Path(f"{index}{suffix}").unlink(missing_ok=True)
    else:
        raise ValueError(how)


# ---------------------------------------------------------------- runs and events


def at(deadline: float, body: str) -> str:
    """Sandbox code that waits for a wall-clock instant, then runs `body`: runs started in several chats
    end within milliseconds of each other, so their bookkeeping races for real."""
    return f"import time\nwhile time.time() < {deadline!r}:\n    time.sleep(0.005)\n{body}"


def write(name: str, size: int, mode: str = "wb") -> str:
    return f"with open({name!r}, {mode!r}) as f:\n    f.write(b'q' * {size})"


async def say(harness: PipeHarness, *args: Any, **kwargs: Any) -> str:
    """harness.say. An exception out of the pipe (Open WebUI shows an error instead of an answer) fails
    the test as just that, in one line: the chained traceback runs through the bundle's exec'd source,
    which pytest's traceback rendering can choke on."""
    try:
        return await harness.say(*args, **kwargs)
    except Exception as error:
        raise AssertionError(
            f"the pipe raised instead of answering: {type(error).__name__}: {error}"
        ) from None


async def say_with_events(harness: PipeHarness, *args: Any, **kwargs: Any) -> tuple[str, list[dict]]:
    """harness.say, plus the events of this message only (harness.events is the latest message's)."""
    task = asyncio.create_task(say(harness, *args, **kwargs))
    await asyncio.sleep(0)  # the task has run to its first await: harness.events is its own list now
    events = harness.events
    return await task, events


def statuses(events: list[dict]) -> list[str]:
    return [e["data"]["description"] for e in events if e.get("type") == "status"]


def run_marked(root: Path, user: str, chat: str) -> bool:
    """Whether the store's mark of a run in this chat is on disk: made under the chat's lock just
    before its sandbox runs, removed once the run is indexed."""
    pattern = re.compile(rf"{re.escape(user)}-[0-9a-f]{{24}}\.{re.escape(chat)}-[0-9a-f]{{24}}")
    marks = root / "running"
    return marks.is_dir() and any(pattern.fullmatch(name) for name in os.listdir(marks))


async def start_running(
    harness: PipeHarness, user: str, chat: str, *args: Any, **kwargs: Any
) -> tuple[asyncio.Task, list[dict]]:
    """Send a message in the background; return once its code runs (its "Running ..." status is out,
    and the chat's lock is held with the run marked): the task (the answer) and the message's events."""
    task = asyncio.create_task(say(harness, user, chat, *args, **kwargs))
    await asyncio.sleep(0)
    events = harness.events
    deadline = time.monotonic() + 30
    while not (
        any(s.startswith("Running") for s in statuses(events))
        and run_marked(harness.sessions_root, user, chat)
    ):
        if task.done() or time.monotonic() > deadline:
            raise AssertionError(f"the message never ran code: {statuses(events)}")
        await asyncio.sleep(0.02)
    assert not task.done(), "the run ended before the test could act during it"
    return task, events


def reopen(harness: PipeHarness) -> PipeHarness:
    """Open WebUI started again on the same DATA_DIR, with the same saved valves."""
    valves = {k: v for k, v in harness.stored_valves.items() if k != "base_models"}
    return PipeHarness(harness.data_dir, valves=valves)


# ---------------------------------------------------------------- an Open WebUI that crashes

_CRASHING = """
import asyncio, json, sys
from pathlib import Path
from tests.support.pipe_harness import PipeHarness, code

async def main():
    spec = json.loads(sys.argv[1])
    harness = PipeHarness(Path(spec["data_dir"]), valves=spec["valves"])
    await asyncio.gather(*(harness.say(spec["user"], chat, code(spec["source"])) for chat in spec["chats"]))

asyncio.run(main())
"""


def crash_mid_run(
    data_dir: Path, valves: dict, user: str, chats: list[str], source: str, ready: Any, timeout_s: float = 40
) -> None:
    """Open WebUI (the function, in a process of its own) runs `source` in several chats at once, and is
    SIGKILLed (its process only, like a crash) as soon as `ready()` is true of the host."""
    spec = {"data_dir": str(data_dir), "valves": valves, "user": user, "chats": chats, "source": source}
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(
        [sys.executable, "-c", _CRASHING, json.dumps(spec)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if process.poll() is not None:
                raise AssertionError(f"it ended before the crash: {process.stdout.read().decode()[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError("the runs never got where the crash should hit")
            time.sleep(0.05)
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
        if process.stdout is not None:
            process.stdout.close()
