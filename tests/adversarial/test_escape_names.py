"""Escape through names: paths in the answer that climb out, and file names that are markup, huge or many."""

from __future__ import annotations

import contextlib
import resource
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.adversarial.attack import (
    assert_index_matches_disk,
    assert_not_published,
    copy_of,
    links,
    outside_code,
    prose,
    published,
    published_files,
    session_dirs,
)
from tests.support.pipe_harness import PipeHarness, code

pytestmark = pytest.mark.runsc

TRAVERSALS = [
    "/mnt/data/../../etc/passwd",
    "sandbox:/mnt/data/../../../etc/passwd",
    "/mnt/data/%2e%2e/%2e%2e/etc/passwd",
    "/mnt/data/%2E%2E%2F%2E%2E%2Fetc%2Fpasswd",
    "/mnt/data/..%2f..%2f..%2fwebui.db",
    "/mnt/data/%252e%252e/%252e%252e/etc/passwd",
    "/mnt/data/\uff0e\uff0e/\uff0e\uff0e/etc/passwd",  # fullwidth dots: '..' only after NFKC
    "/mnt/data/\u2024\u2024/webui.db",  # one-dot leaders
    "/mnt/data/..\\..\\etc\\passwd",
    "/mnt/data//etc/passwd",
    "/mnt/data/a.txt/../../../webui.db",
    "/mnt/data/a.txt%00.png",
]


async def test_traversal_paths_in_the_answer_stay_plain_text(harness: PipeHarness, host_secret):
    """Naive: the answer's /mnt/data/../../etc/passwd (or a %2e / NFKC variant) is joined and published."""
    _db, secret = host_secret
    named = " ".join(TRAVERSALS)
    markdown = " ".join(f"[x{i}]({path})" for i, path in enumerate(TRAVERSALS[:6]))
    make = code("open('/mnt/data/a.txt', 'w').write('fine')", f"{named} {markdown} ok: /mnt/data/a.txt")
    answer = await harness.say("mallory", "chat-1", make)
    reply = answer.splitlines()[-1]
    [url] = links(reply)  # only the real file
    assert published(harness, url) == b"fine"
    for path in TRAVERSALS[6:]:
        assert path in reply  # left exactly as the model wrote it
    assert_not_published(harness, secret, Path("/etc/passwd").read_bytes())
    assert len(published_files(harness)) == 1


HOSTILE_NAMES = [
    "a\nb.txt",
    "x\n\n# Injected heading\n\n.txt",
    "](javascript:alert(1)).txt",
    "<img src=x onerror=alert(1)>.txt",
    "[click me](https:/evil.example).txt",  # a folder '[click me](https:' and a file in it
    "![t](https:/evil.example/t.png).txt",
    "tick`s.txt",
    "```fence.txt",
    "\u202eexe.txt",  # right-to-left override: shows as 'txt.exe'
    "plain.txt",
]


async def test_markup_and_control_characters_in_file_names_stay_literal(harness: PipeHarness):
    """Naive: the 'Saved: /mnt/data/<name>' line pastes names as markdown: HTML, links, headings, bidi.
    (The line names the files the answer did not: the harness's message holds no attachments.)"""
    make = (
        "import os\nnames = " + repr(HOSTILE_NAMES).replace("`", "\\x60") + "\n"
        "for name in names:\n"
        "    os.makedirs(os.path.dirname(name) or '.', exist_ok=True)\n"
        "    open(name, 'w').write('x')\n"
    )
    answer = await harness.say("mallory", "chat-1", code(make, "Done."))
    interpreted = outside_code(prose(answer))
    for markup in ("<img", "javascript:", "](https:", "\u202e"):
        assert markup not in interpreted, interpreted
    assert "\u202e" not in answer
    assert "# Injected heading" not in interpreted.splitlines()
    [saved] = [line for line in prose(answer).splitlines() if line.startswith("Saved:")]  # not broken apart
    [url] = links(saved)  # the plain name is still a working link
    assert saved.count("/mnt/data/") == len(HOSTILE_NAMES) - 1
    assert copy_of(harness, url).name == "plain.txt" and published(harness, url) == b"x"
    await assert_index_matches_disk(harness)


async def test_very_long_names_link_to_the_right_bytes(harness: PipeHarness):
    """Naive: a 255-byte (or multibyte) name overflows the published name or its header: a broken link."""
    names = ["a" * 251 + ".txt", "é" * 125 + ".csv", "数" * 83 + ".png", "b" * 200 + ".svg"]
    make = "\n".join(f"open({name!r}, 'w').write({name[:3]!r})" for name in names)
    reply = " ".join(f"/mnt/data/{name}" for name in names)
    answer = await harness.say("mallory", "chat-1", code(make, reply))
    # The answer's own line (table previews of the CSV follow it; they link nothing).
    [line] = [line for line in answer.splitlines() if links(line)]
    found = links(line)
    assert len(found) == len(names)
    for url, name in zip(found, names, strict=True):
        assert published(harness, url) == name[:3].encode()
        assert len(copy_of(harness, url).name.encode()) <= 104  # the download's name, bounded
    svg = copy_of(harness, found[-1])
    assert svg.name.endswith(".svg.txt")  # never an image: a download, under a .bin name
    assert svg.content_type == "application/octet-stream" and svg.path.suffix == ".bin"
    await assert_index_matches_disk(harness)


async def test_ten_thousand_files_in_one_run_give_a_bounded_answer(harness: PipeHarness):
    """Naive: every one of 10,000 new files is kept past the per-run limit, or listed in the answer."""
    harness.set_valves(timeout_seconds=60)
    make = (
        "import os\nfor i in range(10000):\n"
        "    os.close(os.open(f'f{i:05}.txt', os.O_CREAT | os.O_WRONLY, 0o644))\nprint('made')"
    )
    started = time.monotonic()
    answer = await harness.say("mallory", "chat-1", code(make, "Done."))
    assert time.monotonic() - started < 60
    assert "made" in answer
    assert len(answer) < 20_000
    assert "more than the 500 new files allowed in one run" in answer
    assert "... and 9480 more files removed by limits" in answer
    [folder] = session_dirs(harness)
    assert len(list(folder.iterdir())) == 500
    await assert_index_matches_disk(harness)
    # The next turn still works, and the model is shown a bounded list.
    again = await harness.say("mallory", "chat-1", code("print(len(__import__('os').listdir('.')))"))
    assert "500" in again
    system = harness.requests[-1]["messages"][0]["content"]
    assert "... and 460 more" in system and len(system) < 10_000


async def test_a_directory_tree_thousands_of_levels_deep_does_not_break_the_chat(harness: PipeHarness):
    """Naive: indexing or deleting a 3,000-level tree recurses once per level and crashes every later turn."""
    harness.set_valves(timeout_seconds=30)
    make = (
        "import os\nfor i in range(3000):\n    os.mkdir('d')\n    os.chdir('d')\nopen('x', 'w').write('deep')"
    )
    answer = await harness.say("mallory", "chat-1", code(make, "See /mnt/data/d/d/d/x"))
    assert "nested" in answer and "too deep" in answer  # told what happened to it
    assert links(answer) == []
    [folder] = session_dirs(harness)
    depth = max(len(p.relative_to(folder).parts) for p in folder.rglob("*"))
    assert depth <= 32
    await assert_index_matches_disk(harness)
    again = await harness.say("mallory", "chat-1", code("print('still fine')"))
    assert "still fine" in again


@contextlib.contextmanager
def open_files_limit(limit: int) -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(limit, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_thousands_of_sibling_folders_do_not_exhaust_file_descriptors(harness: PipeHarness):
    """Naive: indexing opens every sibling folder at once and fails with EMFILE under a 1024-file ulimit."""
    harness.set_valves(timeout_seconds=30)
    make = "import os\nfor i in range(450):\n    os.mkdir(f'{P}{i}')\nopen(f'{P}7/x', 'w').write('x')"
    with open_files_limit(1024):  # systemd's default soft limit for services
        for prefix in ("a", "b", "c"):
            answer = await harness.say(
                "mallory", "chat-1", code(make.replace("{P}", prefix), f"See /mnt/data/{prefix}7/x")
            )
            assert len(links(answer.splitlines()[-1])) == 1, answer[-2000:]
    await assert_index_matches_disk(harness)
