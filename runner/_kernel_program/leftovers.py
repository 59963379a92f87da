"""After every cell: every process the cell left (daemons, double forks, a shell's background jobs)
killed and reaped, but the resource trackers that live from cell to cell."""

from __future__ import annotations

import _signal
import contextlib
import os
import sys
import time

from .basics import _KILL_PATIENCE_S, _monotonic, _os_kill, _os_listdir, _os_waitpid

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

# The resource trackers multiprocessing and joblib (loky) start once per process and use again from
# cell to cell. Killed with the cell's leftovers, their next use warns "process died unexpectedly"
# and the new tracker prints a KeyError traceback for every resource the old one knew: so they are
# spared. A process that abuses the pass (a cell can point these at any pid) is still bound by the
# sandbox's memory limit and by the host's CPU watch between runs, as a thread is.
_TRACKER_MODULES = (
    "multiprocessing.resource_tracker",
    "joblib.externals.loky.backend.resource_tracker",
    "loky.backend.resource_tracker",
)


def end_leftovers(kernel_pid: int, note: Callable[[str], None]) -> None:
    """Kill every process the cell left and reap them; ``note`` tells the cell of those that would not
    die. Only as PID 1: then kill(-1) means every other process of our own pid namespace. Anywhere
    else (say as root on a host) it would mean every process of the machine."""
    if kernel_pid != 1:  # the kernel's own pid, taken at its start (a forked child never gets here)
        return
    spared = _trackers()
    if spared:
        _end_leftovers_but(spared, note)
        return
    try:
        _os_kill(-1, _signal.SIGKILL)  # zombies count too, so ESRCH means: nobody else is left
    except ProcessLookupError:
        return  # the common case: one system call, nothing to reap
    except PermissionError:
        pass
    deadline = _monotonic() + _KILL_PATIENCE_S
    while True:
        try:
            _os_kill(-1, _signal.SIGKILL)
        except ProcessLookupError:
            break
        except PermissionError:  # only processes we may not signal are left: nothing to do
            break
        if not _reap() and _monotonic() > deadline:
            note("[code-sessions: some processes of the cell would not die]\n")
            break
        time.sleep(0.0002)
    _reap()


def _trackers() -> set[int]:
    """The pids of the resource trackers this process started (three dict lookups when none)."""
    pids: set[int] = set()
    for name in _TRACKER_MODULES:
        module = sys.modules.get(name)
        if module is None:
            continue
        pid = getattr(getattr(module, "_resource_tracker", None), "_pid", None)
        if type(pid) is int and pid > 1:
            pids.add(pid)
    return pids


def _end_leftovers_but(spared: set[int], note: Callable[[str], None]) -> None:
    """end_leftovers, sparing `spared`: every other process of the namespace, found in /proc, is
    killed and reaped, until none is left."""
    deadline = _monotonic() + _KILL_PATIENCE_S
    while True:
        try:
            others = [int(n) for n in _os_listdir("/proc") if n.isdigit() and int(n) != 1]
        except OSError:
            return
        others = [pid for pid in others if pid not in spared]
        if not others:
            break
        signalled = 0
        for pid in others:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                _os_kill(pid, _signal.SIGKILL)
                signalled += 1
        if not signalled:  # only processes we may not signal are left: nothing to do
            break
        if not _reap() and _monotonic() > deadline:
            note("[code-sessions: some processes of the cell would not die]\n")
            break
        time.sleep(0.0002)
    _reap()


def _reap() -> int:
    n = 0
    while True:
        try:
            pid, _status = _os_waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return n
        if pid == 0:
            return n
        n += 1
