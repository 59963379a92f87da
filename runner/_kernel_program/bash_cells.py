"""Bash cells: a script in a private directory, run by bash in its own process group."""

from __future__ import annotations

import _signal
import contextlib
import os
import time

from .basics import _KILL_PATIENCE_S, _monotonic, _os_waitpid, _write_all
from .interrupts import _Interrupts

BASH = "/bin/bash"
PRIVATE_TMP = "/tmp"
_BASH_SIGINT_GRACE_S = 1.0


class _BashCells:
    """The kernel's bash cells: each a script in a private directory, run by bash in the workdir, in
    its own process group, with ``interrupts`` armed while the kernel waits for it."""

    def __init__(self, workdir: str, interrupts: _Interrupts) -> None:
        self._workdir = workdir
        self._interrupts = interrupts
        self._dir: str | None = None
        self._count = 0

    def _script_path(self) -> str:
        if self._dir is None or not os.path.isdir(self._dir):
            # Created on first use and again if a cell removed it; not in the workdir: it is not the
            # user's file.
            self._dir = os.path.join(PRIVATE_TMP, f".code-sessions-kernel-{os.urandom(8).hex()}")
            os.mkdir(self._dir, 0o700)
        self._count += 1
        return os.path.join(self._dir, f"cell-{self._count}.sh")

    def run(self, code: str) -> tuple[str, int | None, str]:
        try:
            data = code.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            data = code.encode("utf-8", "replace")
        try:
            script = self._script_path()
            fd = os.open(script, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                _write_all(fd, data)
            finally:
                os.close(fd)
        except OSError as exc:
            return "error", None, f"[code-sessions: cannot write the bash script: {exc}]\n"
        try:
            return self._spawn_and_wait(script)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(script)

    def _spawn_and_wait(self, script: str) -> tuple[str, int | None, str]:
        # posix_spawn has no cwd argument: step into the workdir for the spawn only. A Python cell's
        # os.chdir persists for Python cells; bash cells always start in the workdir.
        try:
            here: int | None = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:  # the cell's cwd is gone or unreadable: Python cells carry on in the workdir
            here = None
        try:
            os.chdir(self._workdir)
            pid = os.posix_spawn(
                BASH,
                [BASH, script],
                os.environ,
                file_actions=[(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0)],
                setpgroup=0,  # its own group: an interrupt reaches the whole pipeline
                setsigmask=(),
                # Python ignores these; ignored signals survive exec. A shell expects the defaults.
                setsigdef=(_signal.SIGPIPE, _signal.SIGXFSZ, _signal.SIGINT),
            )
        except OSError as exc:
            return "error", None, f"[code-sessions: cannot start {BASH}: {exc}]\n"
        finally:
            if here is not None:
                with contextlib.suppress(OSError):
                    os.fchdir(here)
                os.close(here)
        status: int | None = None
        try:
            self._interrupts.armed = True
            status = _os_waitpid(pid, 0)[1]
            self._interrupts.armed = False
            interrupted = False
        except KeyboardInterrupt:
            self._interrupts.armed = False
            interrupted = True
            status = self._stop_group(pid) if status is None else status
        if status is None:
            return ("interrupted" if interrupted else "error"), None, ""
        code = os.waitstatus_to_exitcode(status)
        if code < 0:
            code = 128 - code  # killed by a signal: report it as a shell would ($? = 128 + n)
        if interrupted:
            return "interrupted", code, ""
        return ("ok" if code == 0 else "error"), code, ""

    @staticmethod
    def _stop_group(pid: int) -> int | None:
        """SIGINT to the shell's group, SIGKILL after a grace period; the shell's wait status."""
        for sig, patience in ((_signal.SIGINT, _BASH_SIGINT_GRACE_S), (_signal.SIGKILL, _KILL_PATIENCE_S)):
            with contextlib.suppress(OSError):
                os.killpg(pid, sig)
            deadline = _monotonic() + patience
            while True:
                try:
                    done, status = _os_waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    return None
                if done:
                    return status
                if _monotonic() > deadline:
                    break
                time.sleep(0.005)
        return None
