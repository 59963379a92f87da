"""The shape the code keeps by choice: the four Open WebUI files only translate Open WebUI's calls into
the engine's entries (each well under 200 lines: the message's life is engine/turn.py's, the buttons'
work engine/actions.py's), and at most
three classes are named after sessions (the word says little on its own: a class says what it is).
How long any other file is follows from what it does, not from a count (docs/development.md)."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORMS = (
    "functions/code_sessions.py",
    "functions/code_sessions_tool.py",
    "functions/code_sessions_filter.py",
    "functions/code_sessions_actions.py",
)
MAX_FORM_LINES = 200
MAX_SESSION_CLASSES = 3


def _tracked() -> list[str]:
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True, timeout=60
    ).stdout
    return [name for name in listed.decode().split("\0") if name]


def _lines(name: str) -> int:
    return len((ROOT / name).read_bytes().splitlines())


def test_the_open_webui_files_only_translate() -> None:
    long = {name: _lines(name) for name in FORMS if _lines(name) > MAX_FORM_LINES}
    assert long == {}, f"over {MAX_FORM_LINES} lines (the message's life belongs in engine/turn.py): {long}"


def test_at_most_three_classes_are_named_after_sessions() -> None:
    named = sorted(
        f"{name}:{node.name}"
        for name in _tracked()
        if name.endswith(".py") and not name.startswith(("tests/", "dist/")) and (ROOT / name).is_file()
        for node in ast.walk(ast.parse((ROOT / name).read_text(encoding="utf-8"), name))
        if isinstance(node, ast.ClassDef) and "session" in node.name.lower()
    )
    assert "storage/session.py:Session" in named  # the walk sees them
    assert len(named) <= MAX_SESSION_CLASSES, named
