"""After every cell: the process as the kernel needs it (fds, streams, signals, hooks), the cell's
leftover processes gone, the kernel's private fds checked."""

from __future__ import annotations

import _signal
import contextlib
import io
import os
import sys
import time

from .basics import (
    _KILL_PATIENCE_S,
    _fatal,
    _monotonic,
    _os_dup2,
    _os_fstat,
    _os_kill,
    _os_listdir,
    _os_waitpid,
)
from .pumps import _Direct, _Pump

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

_ENCODING, _ERRORS = "utf-8", "backslashreplace"  # of the kernel's own stdio

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


class _Restoring:
    """What the Kernel puts back after every cell (a part of Kernel, apart for reading)."""

    pid: int
    null_fd: int
    out_w: int
    err_w: int
    _stdin: Any
    _stdout: Any
    _stderr: Any
    _private_fds: dict[int, tuple[int, int]]
    _recursion_limit: int
    _catchable: list[int]
    _on_sigint_bound: Any
    _pumps: tuple[_Pump, _Pump]
    _send_direct: Callable[[_Pump, bytes], bool]

    @staticmethod
    def _identity(fd: int) -> tuple[int, int]:
        st = _os_fstat(fd)
        return st.st_dev, st.st_ino

    def _restore_fds(self) -> None:
        _os_dup2(self.null_fd, 0)
        _os_dup2(self.out_w, 1)
        _os_dup2(self.err_w, 2)

    def _restore_streams(self) -> None:
        """Our stdio objects back in sys (recreated if a cell closed them); closefd=False, so closing
        them never closes fd 0/1/2."""
        if self._stdin is None or self._stdin.closed:
            self._stdin = open(0, encoding=_ENCODING, errors=_ERRORS, closefd=False)  # noqa: SIM115
        if self._stdout is None or self._stdout.closed:
            self._stdout = self._stream(1)
        if self._stderr is None or self._stderr.closed:
            self._stderr = self._stream(2)
        # The originals too: a cell may have replaced them, and code that restores from them must
        # get ours back.
        sys.stdin = sys.__stdin__ = self._stdin  # type: ignore[misc]
        sys.stdout = sys.__stdout__ = self._stdout  # type: ignore[misc]
        sys.stderr = sys.__stderr__ = self._stderr  # type: ignore[misc]

    def _stream(self, fd: int) -> Any:
        """sys.stdout (fd 1) or sys.stderr (fd 2): line-buffered text straight to the host as frames while
        its pipe is empty, else into the fd (pumps._Direct); closing it never closes the fd."""
        raw = _Direct(fd, self._pumps[fd - 1], self._send_direct)
        return io.TextIOWrapper(raw, encoding=_ENCODING, errors=_ERRORS, line_buffering=True)

    def _note(self, text: str) -> None:
        """The kernel's own words (a traceback, a notice) on the cell's stderr. Written after the cell's
        damage to fd 2 and sys.stderr is undone; from inside a cell (plt.show()) it may find fd 2 closed
        by the cell, and then the notice is lost rather than the kernel."""
        with contextlib.suppress(Exception):
            if self._stderr is None or self._stderr.closed:
                self._restore_streams()
            self._stderr.write(text)

    def _live_stdout(self) -> Any:
        if self._stdout is None or self._stdout.closed:
            self._restore_streams()
        return self._stdout

    def _restore_python_state(self) -> None:
        """Right after a cell, before anything of the kernel's own runs: what a cell may have done to the
        interpreter that could break the kernel's code (sys.std*, signal handlers: a Python handler
        left by a cell could raise inside it; trace and profile hooks; the recursion limit). No
        system call unless the cell changed a handler."""
        self._restore_streams()
        sys.settrace(None)
        sys.setprofile(None)
        if sys.getrecursionlimit() < self._recursion_limit:  # the kernel's own code needs some depth
            sys.setrecursionlimit(self._recursion_limit)
        threading = sys.modules.get("threading")  # hooks for the threads a cell starts, if it can
        if threading is not None:
            threading.settrace(None)
            threading.setprofile(None)
        # _signal, not signal: the latter wraps every answer in an enum, 50 µs for the loop instead of 5.
        getsignal, setsignal = _signal.getsignal, _signal.signal
        for sig in self._catchable:
            handler = getsignal(sig)
            if callable(handler) and handler is not self._on_sigint_bound:
                setsignal(sig, _signal.SIG_DFL)
        if getsignal(_signal.SIGINT) is not self._on_sigint_bound:
            setsignal(_signal.SIGINT, self._on_sigint_bound)
        if getsignal(_signal.SIGCHLD) != _signal.SIG_DFL:  # SIG_IGN would reap children before our waitpid
            setsignal(_signal.SIGCHLD, _signal.SIG_DFL)
        for sig in (_signal.SIGPIPE, _signal.SIGXFSZ):  # as Python starts: errors, not deaths
            if getsignal(sig) != _signal.SIG_IGN:
                setsignal(sig, _signal.SIG_IGN)

    def _restore_process_state(self) -> None:
        """What the next cell needs of the process: fd 0/1/2 (a cell may have closed or redirected
        them), no timer left armed (its signal's default action would end the kernel between cells),
        no signal blocked. Done after "done" is sent: seven system calls off the round trip, before
        the next request is read."""
        for which in (_signal.ITIMER_REAL, _signal.ITIMER_VIRTUAL, _signal.ITIMER_PROF):
            _signal.setitimer(which, 0)
        _signal.pthread_sigmask(_signal.SIG_SETMASK, ())
        self._restore_fds()

    def _flush_streams(self) -> None:
        for stream in (self._stdout, self._stderr):
            try:
                stream.flush()
            except Exception:  # a write the pipe refused: the text is lost, start the stream afresh
                with contextlib.suppress(Exception):
                    stream.close()
        self._restore_streams()

    def _end_leftovers(self) -> None:
        """Kill every process the cell left (daemons, double forks, a shell's background jobs) and reap
        them. Only as PID 1: then kill(-1) means every other process of our own pid namespace. Anywhere
        else (say as root on a host) it would mean every process of the machine."""
        if self.pid != 1:  # the kernel's own pid, taken at its start (a forked child never gets here)
            return
        spared = self._trackers()
        if spared:
            self._end_leftovers_but(spared)
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
            if not self._reap() and _monotonic() > deadline:
                self._note("[code-sessions: some processes of the cell would not die]\n")
                break
            time.sleep(0.0002)
        self._reap()

    @staticmethod
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

    def _end_leftovers_but(self, spared: set[int]) -> None:
        """_end_leftovers, sparing `spared`: every other process of the namespace, found in /proc,
        is killed and reaped, until none is left."""
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
            if not self._reap() and _monotonic() > deadline:
                self._note("[code-sessions: some processes of the cell would not die]\n")
                break
            time.sleep(0.0002)
        self._reap()

    @staticmethod
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

    def _check_private_fds(self) -> None:
        for fd, identity in self._private_fds.items():
            try:
                same = self._identity(fd) == identity
            except OSError:
                same = False
            if not same:
                _fatal(f"a cell closed or replaced the kernel's private fd {fd}")
