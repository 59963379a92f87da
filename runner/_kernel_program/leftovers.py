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
    _kill_until_gone(_kill_all_but(spared) if spared else _kill_all, note)


def _kill_until_gone(kill_round: Callable[[], bool], note: Callable[[str], None]) -> None:
    """Signal and reap until ``kill_round`` finds nobody left to signal, or the patience is over."""
    if not kill_round():
        return  # the common case: one round, nothing to reap
    deadline = _monotonic() + _KILL_PATIENCE_S
    while kill_round():
        if not _reap() and _monotonic() > deadline:
            note("[code-sessions: some processes of the cell would not die]\n")
            break
        time.sleep(0.0002)
    _reap()


def _kill_all() -> bool:
    """SIGKILL every other process of the namespace: one system call. False when nobody is left to
    signal (zombies count too, so ESRCH means none) or only processes we may not signal are."""
    try:
        _os_kill(-1, _signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return False
    return True


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


def _kill_all_but(spared: set[int]) -> Callable[[], bool]:
    """A round of _kill_all that spares ``spared``: every other process of the namespace, found in
    /proc, is signalled one by one."""

    def kill_round() -> bool:
        try:
            names = _os_listdir("/proc")
        except OSError:
            return False
        signalled = False
        for name in names:
            if not name.isdigit() or (pid := int(name)) == 1 or pid in spared:
                continue
            with contextlib.suppress(ProcessLookupError, PermissionError):
                _os_kill(pid, _signal.SIGKILL)
                signalled = True
        return signalled

    return kill_round


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
