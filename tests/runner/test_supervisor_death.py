"""A process started by dying_with_us dies when the process that started it is SIGKILLed, by either
route: setpriv (no preexec_fn, so the spawn is a vfork) or the preexec_fn fallback."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from runner import _supervise

REPO = Path(__file__).resolve().parents[2]

HELPER = textwrap.dedent(
    """
    import subprocess, sys, time
    sys.path.insert(0, sys.argv[1])
    from runner import _supervise
    if sys.argv[2] == "fallback":
        _supervise.setpriv_prefix = lambda: None
    argv, preexec = _supervise.dying_with_us(["/bin/sleep", "300"])
    child = subprocess.Popen(argv, preexec_fn=preexec, start_new_session=True)
    print(child.pid, preexec is None, flush=True)
    time.sleep(300)
    """
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read()
    except FileNotFoundError:
        return b""


@pytest.mark.parametrize("route", ["setpriv", "fallback"])
def test_the_child_dies_with_its_starter(route: str) -> None:
    if route == "setpriv":
        assert _supervise.setpriv_prefix() is not None, "util-linux's setpriv is part of Debian's base"
    helper = subprocess.Popen(
        [sys.executable, "-c", HELPER, str(REPO), route], stdout=subprocess.PIPE, text=True
    )
    pid = None
    try:
        pid_text, vforked = helper.stdout.readline().split()
        pid = int(pid_text)
        assert vforked == ("True" if route == "setpriv" else "False")
        # setpriv asks for the signal after its own exec, then execs sleep: once sleep runs, it is
        # asked for. (A supervisor that dies between setpriv's exec and its prctl leaves the child
        # running without the signal; the next start's sweep of leftovers, runner/_orphans.py, ends it.)
        deadline = time.monotonic() + 10
        while not _cmdline(pid).startswith(b"/bin/sleep") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _alive(pid) and _cmdline(pid).startswith(b"/bin/sleep")
        helper.kill()
        helper.wait()
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), f"{route}: the child outlived its starter"
    finally:
        helper.kill()
        if pid is not None and _alive(pid):
            os.kill(pid, 9)


def test_a_vanished_runsc_is_still_a_file_not_found(tmp_path: Path) -> None:
    if _supervise.setpriv_prefix() is None:
        pytest.fail("util-linux's setpriv is part of Debian's base")
    with pytest.raises(FileNotFoundError):
        _supervise.dying_with_us([str(tmp_path / "runsc")])
