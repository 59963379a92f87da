"""What every part of the kernel uses: the os calls bound at start, whole writes, and the fatal exit."""

from __future__ import annotations

import os
import time

from .protocol import FATAL_EXIT

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import NoReturn

_READ_SIZE = 64 * 1024
_KILL_PATIENCE_S = 5.0  # SIGKILLed leftovers are normally gone within a millisecond

# Bound once: a cell may monkeypatch os or time (a test double, a careless experiment) without
# breaking the kernel's own I/O. Nothing defends the kernel against a cell that wants to break it.
_os_read = os.read
_os_write = os.write
_os_dup2 = os.dup2
_os_kill = os.kill
_os_waitpid = os.waitpid
_os_getpid = os.getpid
_os_listdir = os.listdir
_os_fstat = os.fstat
_monotonic = time.monotonic
_perf_counter = time.perf_counter

_diag_fd = 2  # the original fd 2 once the kernel has set up; only the kernel's own fatal errors go there


def set_diag_fd(fd: int) -> None:
    """Where _fatal writes from now on: a setter, so the one module that binds the name rebinds it."""
    global _diag_fd
    _diag_fd = fd


def _fatal(message: str) -> NoReturn:
    """End the kernel: a frame it cannot vouch for is worse than none (the host restarts it)."""
    try:
        _os_write(_diag_fd, f"code-sessions kernel: fatal: {message}\n".encode(errors="replace"))
    finally:
        os._exit(FATAL_EXIT)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[_os_write(fd, view) :]
