"""The kernel's stdio: fds 0/1/2 on /dev/null and the pumps' pipes, and sys.std* as the kernel's own
streams, put back whenever a cell closed, replaced or redirected them."""

from __future__ import annotations

import contextlib
import io
import sys

from .basics import _os_dup2
from .pumps import _Direct, _Pump

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

_ENCODING, _ERRORS = "utf-8", "backslashreplace"  # of the kernel's own stdio


class _Stdio:
    """fd 0 on ``null_fd`` (input() gets EOF, never protocol bytes), fds 1 and 2 on the pumps' pipes;
    sys.stdout and sys.stderr write through ``send`` (the print path, _Interrupts.send_direct)."""

    def __init__(
        self,
        null_fd: int,
        out_w: int,
        err_w: int,
        pumps: tuple[_Pump, _Pump],
        send: Callable[[_Pump, bytes], bool],
    ) -> None:
        self._null_fd = null_fd
        self._out_w = out_w
        self._err_w = err_w
        self._pumps = pumps
        self._send = send
        self._stdin: Any = None
        self._stdout: Any = None
        self._stderr: Any = None

    def restore_fds(self) -> None:
        _os_dup2(self._null_fd, 0)
        _os_dup2(self._out_w, 1)
        _os_dup2(self._err_w, 2)

    def restore_streams(self) -> None:
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
        raw = _Direct(fd, self._pumps[fd - 1], self._send)
        return io.TextIOWrapper(raw, encoding=_ENCODING, errors=_ERRORS, line_buffering=True)

    def note(self, text: str) -> None:
        """The kernel's own words (a traceback, a notice) on the cell's stderr. Written after the cell's
        damage to fd 2 and sys.stderr is undone; from inside a cell (plt.show()) it may find fd 2 closed
        by the cell, and then the notice is lost rather than the kernel."""
        with contextlib.suppress(Exception):
            if self._stderr is None or self._stderr.closed:
                self.restore_streams()
            self._stderr.write(text)

    def live_stdout(self) -> Any:
        """The kernel's sys.stdout, recreated if a cell closed it."""
        if self._stdout is None or self._stdout.closed:
            self.restore_streams()
        return self._stdout

    def flush(self) -> None:
        for stream in (self._stdout, self._stderr):
            try:
                stream.flush()
            except Exception:  # a write the pipe refused: the text is lost, start the stream afresh
                with contextlib.suppress(Exception):
                    stream.close()
        self.restore_streams()
