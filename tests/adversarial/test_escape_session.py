"""Escape through the session folder: links, special files and swaps that point a published copy elsewhere.

The sandbox writes /mnt/data, which is a host folder; everything it leaves there is hostile. The model's
answer then names it, hoping the function follows it on the host and publishes what it points to.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import stat
import threading
import time
from pathlib import Path

import pytest

from storage._keys import id_key
from tests.adversarial.attack import (
    assert_index_matches_disk,
    assert_not_published,
    links,
    published,
    published_files,
    session_dirs,
    special_entries,
)
from tests.support.pipe_harness import PipeHarness, code

pytestmark = pytest.mark.runsc

HOST_PASSWD = Path("/etc/passwd").read_bytes()


async def test_symlinks_to_host_files_are_removed_and_never_linked(harness: PipeHarness, host_secret):
    """Naive: publishing follows /mnt/data/pw -> /etc/passwd (or DATA_DIR/webui.db) and serves that file."""
    db, secret = host_secret
    attack = code(
        f"import os\nos.symlink('/etc/passwd', 'pw')\nos.symlink({str(db)!r}, 'db')\n"
        "os.symlink('/etc/passwd', 'report.png')\nprint(sorted(os.listdir('.')))",
        "Here: /mnt/data/pw, [the db](/mnt/data/db), ![chart](sandbox:/mnt/data/report.png)",
    )
    answer = await harness.say("mallory", "chat-1", attack)
    assert "['db', 'pw', 'report.png']" in answer  # the links really were made in the sandbox
    assert links(answer) == []
    for name in ("pw", "db", "report.png"):
        assert f"Removed /mnt/data/{name}: a symlink is not allowed" in answer
    assert published_files(harness) == []
    assert_not_published(harness, secret, HOST_PASSWD)
    assert special_entries(harness) == []
    await assert_index_matches_disk(harness)


async def test_symlink_into_another_chats_folder_is_not_followed(harness: PipeHarness):
    """Naive: a link to the host path of another user's session file publishes that user's file."""
    diary = code("open('/mnt/data/diary.txt', 'w').write('alice secret 42')")
    await harness.say("alice", "alice-chat", diary)
    alice_copies = published_files(harness)
    target = harness.sessions_root / "sessions" / id_key("alice") / id_key("alice-chat") / "diary.txt"
    assert target.read_bytes() == b"alice secret 42"
    attack = code(
        f"import os\nos.symlink({str(target)!r}, 'diary.txt')\nos.symlink({str(target.parent)!r}, 'alice')",
        "Her diary: /mnt/data/diary.txt and /mnt/data/alice/diary.txt",
    )
    answer = await harness.say("mallory", "mallory-chat", attack)
    assert links(answer) == []
    assert published_files(harness) == alice_copies  # nothing new was published
    assert target.read_bytes() == b"alice secret 42"
    await assert_index_matches_disk(harness)


async def test_symlinked_directory_is_not_walked(harness: PipeHarness, host_secret):
    """Naive: /mnt/data/etc -> /etc (or -> DATA_DIR) makes /mnt/data/etc/passwd a host file."""
    db, secret = host_secret
    attack = code(
        f"import os\nos.symlink('/etc', 'etc')\nos.symlink({str(db.parent)!r}, 'owui')\nos.mkdir('real')\n"
        f"os.symlink({str(db.parent)!r}, 'real/inner')",
        "See /mnt/data/etc/passwd, /mnt/data/owui/webui.db and /mnt/data/real/inner/webui.db",
    )
    answer = await harness.say("mallory", "chat-1", attack)
    assert links(answer) == []
    assert (
        "Removed /mnt/data/etc: a symlink" in answer and "Removed /mnt/data/real/inner: a symlink" in answer
    )
    assert_not_published(harness, secret, HOST_PASSWD)
    assert special_entries(harness) == []
    await assert_index_matches_disk(harness)


async def test_hardlinks_cannot_reach_outside_the_session(harness: PipeHarness):
    """Naive sandbox: /mnt/data shares a filesystem with / so link('/etc/passwd') makes a host file ours."""
    attack = code(
        "import os\nopen('mine.txt', 'w').write('mine')\n"
        "for target in ('/etc/passwd', '/usr/bin/python3', '/run/code/main.py', 'mine.txt'):\n"
        "    try:\n"
        "        os.link(target, os.path.basename(target) + '.link')\n"
        "        print('linked', target)\n"
        "    except OSError as error:\n"
        "        print('refused', target, error.errno)",
        "See /mnt/data/passwd.link and /mnt/data/mine.txt.link",
    )
    answer = await harness.say("mallory", "chat-1", attack)
    for target in ("/etc/passwd", "/usr/bin/python3", "/run/code/main.py"):
        assert f"refused {target}" in answer
    assert "linked mine.txt" in answer  # a link inside the session is allowed: it is the same file
    [url] = links(answer.splitlines()[-1])  # the model's sentence: passwd.link plain, mine.txt.link linked
    assert published(harness, url) == b"mine"
    # Every hard link of a session file is inside that session: its link count is what the folder holds.
    for folder in session_dirs(harness):
        files = [p.lstat() for p in folder.rglob("*") if stat.S_ISREG(p.lstat().st_mode)]
        for st in files:
            assert st.st_nlink == sum(other.st_ino == st.st_ino for other in files)
    await assert_index_matches_disk(harness)


async def test_fifo_socket_and_device_are_never_opened_or_linked(harness: PipeHarness):
    """Naive: opening /mnt/data/fifo to publish it blocks the answer forever; a device node reads the host."""
    attack = code(
        "import os, socket, stat\nos.mkfifo('fifo')\nsocket.socket(socket.AF_UNIX).bind('sock')\n"
        "try:\n    os.mknod('null', stat.S_IFCHR | 0o666, os.makedev(1, 3))\n"
        "except OSError as error:\n    print('mknod refused', error.errno)",
        "See /mnt/data/fifo, /mnt/data/sock and /mnt/data/null",
    )
    answer = await asyncio.wait_for(harness.say("mallory", "chat-1", attack), 30)
    assert "mknod refused" in answer
    assert links(answer) == []
    assert special_entries(harness) == []
    # A gVisor that does pass FIFOs through to the host (directfs, newer releases) is covered too: a FIFO
    # that appears on the host during a run is removed after it, never opened.
    [folder] = session_dirs(harness)
    slow = code(
        "import os, time\nopen('started', 'w').close()\ntime.sleep(1.5)\nos.remove('started')",
        "See /mnt/data/planted",
    )
    running = asyncio.create_task(harness.say("mallory", "chat-1", slow))
    deadline = time.monotonic() + 30
    while not (folder / "started").exists():  # the sandboxed code runs
        assert time.monotonic() < deadline and not running.done(), "the run did not start"
        await asyncio.sleep(0.02)
    os.mkfifo(folder / "planted")
    answer = await asyncio.wait_for(running, 30)
    assert "Removed /mnt/data/planted: a fifo is not allowed" in answer
    assert links(answer) == [] and special_entries(harness) == []
    await assert_index_matches_disk(harness)


async def test_file_swapped_for_a_symlink_while_being_published(harness: PipeHarness, host_secret):
    """Naive: the file is checked, then swapped for a host symlink, then copied by its path."""
    db, secret = host_secret
    harness.set_valves(timeout_seconds=10)
    # Through the product: messages of one chat take turns (the chat lock), so a publish never runs
    # during a run; a run that leaves the name a symlink gets it removed, never linked.
    await harness.say("mallory", "chat-1", code("open('/mnt/data/report.txt', 'w').write('public')"))
    swapper = code(
        "import os, time\nend = time.time() + 1\nwhile time.time() < end:\n"
        f"    os.symlink({str(db)!r}, 'tmp-link')\n    os.replace('tmp-link', 'report.txt')\n"
        "    open('tmp-file', 'w').write('public')\n    os.replace('tmp-file', 'report.txt')\n"
        f"os.symlink({str(db)!r}, 'tmp-link')\nos.replace('tmp-link', 'report.txt')\nprint('swapped')",
        "Your report: /mnt/data/report.txt",
    )
    answer = await harness.say("mallory", "chat-1", swapper)
    assert "swapped" in answer and links(answer) == []
    # The race itself, at the publisher: a host thread swaps the name while publishes run.
    session = await harness.pipe._services.store.session("mallory", "chat-1")
    errors = importlib.import_module(type(session).__module__.rsplit(".", 1)[0] + ".errors")
    folder = session.path
    stop = threading.Event()

    def swap() -> None:
        while not stop.is_set():
            os.symlink(db, folder / "tmp-link")
            os.replace(folder / "tmp-link", folder / "report.txt")
            (folder / "tmp-file").write_text("public")
            os.replace(folder / "tmp-file", folder / "report.txt")

    swapper_thread = threading.Thread(target=swap)
    swapper_thread.start()
    published_urls, refused = [], 0
    try:
        for _ in range(2000):  # until both outcomes were seen often enough
            try:
                published_urls.append((await session.publish("report.txt")).url)
            except errors.StorageError:  # the bundle's own class, not the package's
                refused += 1
            if len(published_urls) >= 20 and refused >= 20:
                break
    finally:
        stop.set()
        swapper_thread.join()
    assert published_urls and refused, (len(published_urls), refused)  # both sides of the race happened
    for url in published_urls:
        assert published(harness, url) == b"public"
    assert_not_published(harness, secret)
