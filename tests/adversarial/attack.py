"""What the adversarial suite looks at: what the user sees, and what the host holds.

The attacks go through the installed function (dist/code_sessions.py) with real storage and real runsc;
the assertions are about what a user sees (the answer, its links, the published bytes) and about the host
(nothing outside the session published, index equal to disk, other files intact).
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.support.files_api import LINK as FILE_LINK
from tests.support.files_api import URL_PATTERN as FILE_URL
from tests.support.files_api import FileRow
from tests.support.pipe_harness import PipeHarness

# Small limits keep every attack quick; each test raises the one it needs.
SMALL = {"timeout_seconds": 5, "memory_mb": 256, "max_processes": 32}
LINK = re.compile(r"\]\((" + FILE_URL + r")\)")
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


def links(answer: str) -> list[str]:
    return LINK.findall(answer)


def copy_of(harness: PipeHarness, url: str) -> FileRow:
    """The Files API's row behind a link (its name, type, owner, bytes on disk)."""
    found = FILE_LINK.fullmatch(url)
    assert found and found.group(1) in harness.files.rows, f"{url} is not a copy Open WebUI holds"
    return harness.files.rows[found.group(1)]


def published(harness: PipeHarness, url: str, viewer: str | None = None) -> bytes:
    """The bytes behind a link, as its owner (or `viewer`) opens it; AssertionError where Open WebUI
    would answer 404."""
    found = FILE_LINK.fullmatch(url)
    row = harness.files.rows.get(found.group(1)) if found else None
    served = harness.files.fetch(url, viewer or (row.user_id if row else ""))
    assert served is not None, f"{url} does not open for {viewer or 'its owner'}"
    return served.body


def published_files(harness: PipeHarness) -> list[Path]:
    """The bytes of every published copy, where Open WebUI keeps them."""
    return harness.files.stored()


def assert_not_published(harness: PipeHarness, *needles: bytes) -> None:
    """None of the bytes appear in any published copy (what any logged-in user could download)."""
    for path in published_files(harness):
        data = path.read_bytes()
        for needle in needles:
            assert needle not in data, f"{path} leaks {needle[:40]!r}"


def session_dirs(harness: PipeHarness) -> list[Path]:
    root = harness.sessions_root / "sessions"
    return [chat for user in root.iterdir() for chat in user.iterdir()] if root.exists() else []


def special_entries(harness: PipeHarness) -> list[Path]:
    """Anything in any session folder that is neither a regular file nor a real folder."""
    found = []
    for folder in session_dirs(harness):
        for path in folder.rglob("*"):
            if path.is_symlink() or not (path.is_file() or path.is_dir()):
                found.append(path)
    return found


async def assert_index_matches_disk(harness: PipeHarness) -> None:
    drift = await harness.pipe._services.store.check()
    assert drift == [], drift


def outside_code(answer: str) -> str:
    """The answer without fenced code blocks and inline code spans: what markdown would interpret."""
    kept: list[str] = []
    fence: str | None = None
    for line in answer.splitlines():
        match = _FENCE.match(line)
        if fence is None and match:
            fence = match.group(1)
            continue
        if fence is not None:
            stripped = line.strip()
            if stripped.startswith(fence) and set(stripped) <= {fence[0]}:
                fence = None
            continue
        kept.append(_without_code_spans(line))
    return "\n".join(kept)


def _without_code_spans(line: str) -> str:
    out, position = [], 0
    for opening in re.finditer(r"`+", line):
        if opening.start() < position:
            continue
        closing = re.compile(f"(?<!`){opening.group()}(?!`)").search(line, opening.end())
        if closing is None:
            continue
        out.append(line[position : opening.start()])
        position = closing.end()
    out.append(line[position:])
    return "".join(out)


def interpreted(bad: str, text: str) -> bool:
    """Whether `bad` occurs in markdown text where markdown would interpret it: not right after a
    backslash that escapes it (an odd run of backslashes)."""
    for found in re.finditer(re.escape(bad), text):
        backslashes = len(text[: found.start()]) - len(text[: found.start()].rstrip("\\"))
        if backslashes % 2 == 0:
            return True
    return False


def prose(answer: str) -> str:
    """What the model said and the file notes, without the collapsible block of code and output."""
    return re.sub(r"<details>.*?</details>", "", answer, flags=re.S)
