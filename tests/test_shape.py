"""The code stays in pieces a reader can hold (issue 26): no source file outside tests/ and dist/ over
600 lines, the Pipe, a thin adapter, at most 250, and at most three classes named after sessions (the
word says little on its own: a class says what it is).

Source files are the Python modules and the executable scripts git tracks (a shebang on the first line:
scripts/, sandbox/build, deploy/...); documentation, lock files and images are not code. dist/ is
generated (each file is every package joined), tests/ is allowed to be long.
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 600
PIPE = "functions/code_sessions.py"
MAX_PIPE_LINES = 250
MAX_SESSION_CLASSES = 3


def _tracked() -> list[str]:
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True, timeout=60
    ).stdout
    return [name for name in listed.decode().split("\0") if name]


def _is_source(name: str) -> bool:
    if name.startswith(("tests/", "dist/")):
        return False
    path = ROOT / name
    if not path.is_file():  # deleted in the work tree, not yet in git
        return False
    if name.endswith(".py"):
        return True
    with open(path, "rb") as fh:
        return fh.read(2) == b"#!"


def _lines(name: str) -> int:
    return len((ROOT / name).read_bytes().splitlines())


def test_the_source_files_are_found() -> None:
    """The guard below sees the files it guards (an empty listing would pass anything)."""
    sources = [name for name in _tracked() if _is_source(name)]
    assert PIPE in sources and "runner/_kernel.py" in sources and "scripts/setup" in sources
    assert "sandbox/build" in sources
    assert not any(name.startswith(("tests/", "dist/")) or name.endswith(".md") for name in sources)


def test_no_source_file_is_over_600_lines() -> None:
    long = {name: n for name in _tracked() if _is_source(name) and (n := _lines(name)) > MAX_LINES}
    assert long == {}, f"over {MAX_LINES} lines (split them by concern): {long}"


def test_the_pipe_stays_a_thin_adapter() -> None:
    assert _lines(PIPE) <= MAX_PIPE_LINES, f"{PIPE} has {_lines(PIPE)} lines, over {MAX_PIPE_LINES}"


def test_at_most_three_classes_are_named_after_sessions() -> None:
    named = sorted(
        f"{name}:{node.name}"
        for name in _tracked()
        if _is_source(name) and name.endswith(".py")
        for node in ast.walk(ast.parse((ROOT / name).read_text(encoding="utf-8"), name))
        if isinstance(node, ast.ClassDef) and "session" in node.name.lower()
    )
    assert "storage/session.py:Session" in named  # the walk sees them
    assert len(named) <= MAX_SESSION_CLASSES, named
