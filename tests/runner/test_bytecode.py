"""Bytecode compiled once by the sandbox's interpreter on the host (runner/_bytecode.py)."""

from __future__ import annotations

import importlib.util
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from runner import _bytecode, environment
from runner._bytecode import BytecodeCache

SOURCE = "import sys\nprint('ran', __name__, (lambda: 0).__code__.co_filename)\n"


def test_the_bytecode_runs_as_the_program_under_its_in_sandbox_name(tmp_path: Path) -> None:
    pyc = BytecodeCache().get([sys.executable], "/run/code/main.py", SOURCE)
    assert pyc is not None
    (tmp_path / "main.pyc").write_bytes(pyc)
    done = subprocess.run([sys.executable, tmp_path / "main.pyc"], capture_output=True, text=True, check=True)
    assert done.stdout == "ran __main__ /run/code/main.py\n"


def test_one_compile_per_program(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = _bytecode._compile

    def counting(interpreter: list[str], filename: str, source: str) -> bytes | None:
        calls.append(source)
        return real(interpreter, filename, source)

    monkeypatch.setattr(_bytecode, "_compile", counting)
    cache = BytecodeCache()
    first = cache.get([sys.executable], "/run/code/main.py", SOURCE)
    assert cache.get([sys.executable], "/run/code/main.py", SOURCE) == first
    assert cache.get([sys.executable], "/run/code/main.py", SOURCE + "\n") is not None
    assert len(calls) == 2


@pytest.mark.parametrize(
    ("interpreter", "source", "said"),
    [
        ("/nonexistent/python3", SOURCE, "No such file"),
        (sys.executable, "def broken(:\n", "SyntaxError"),
        ("/bin/true", SOURCE, "exit 0"),  # runs, prints nothing: not bytecode
    ],
)
def test_no_bytecode_means_none_and_a_warning(
    interpreter: str, source: str, said: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="runner._bytecode"):
        assert BytecodeCache().get([interpreter], "/run/code/main.py", source) is None
    assert said in caplog.text and "the sandbox compiles it" in caplog.text


def test_the_environments_interpreter_compiles_chrooted_into_it(tmp_path: Path) -> None:
    """A built sandbox environment has its own libc: its python3 runs on the host chrooted into its
    root, and the bytecode it makes is what that python3 (3.13, not the host's) starts from."""
    env = environment.locate()
    if not env.built:
        pytest.fail("no sandbox environment: scripts/setup builds it (sandbox/build)")
    pyc = BytecodeCache().get(env.host_command("/usr/bin/python3"), "/run/code/main.py", SOURCE)
    assert pyc is not None
    magic = subprocess.run(
        [
            *env.host_command("/usr/bin/python3"),
            "-c",
            "import importlib.util, sys; sys.stdout.buffer.write(importlib.util.MAGIC_NUMBER)",
        ],
        capture_output=True,
        check=True,
    ).stdout
    assert pyc[:4] == magic
    assert magic != importlib.util.MAGIC_NUMBER  # the host's Python is another version
