"""When a SIGINT interrupts: the handler, the flags the cells arm it with, and the print path it must
never cut in the middle of a frame."""

from __future__ import annotations

import _thread

from .pumps import _Direct, _Pump

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


class _Interrupts:
    """The kernel's SIGINT handler (``on_sigint``) and what it decides by. The Python and bash cells,
    and the kernel while it saves figures, set ``armed`` (and the Python cells ``cell_running``) around
    the work an interrupt may stop; ``send_direct`` is the print path of the kernel's sys.stdout and
    sys.stderr (pumps._Direct's ``send``)."""

    def __init__(self, namespace: dict[str, Any]) -> None:
        self.armed = False  # a SIGINT now interrupts the cell (one shot: the handler disarms)
        self.cell_running = False  # between the start and the end of a Python cell's own code
        self.forked = False  # this is a child a cell forked: its prints go through the pipes
        self._namespace = namespace  # the cells' globals: a frame running there is the cell's own code
        self._main_thread = _thread.get_ident()
        self._writing = False  # the main thread is sending a frame of sys.stdout/stderr (send_direct)
        self._deferred = False  # a SIGINT came meanwhile: raised once the frame is whole
        self._print_path = {_Direct.write.__code__, _Interrupts.send_direct.__code__}

    def begin_run(self) -> None:
        self._deferred = False

    def after_fork_in_child(self) -> None:
        self.forked = True  # the pumps (and their locks, maybe held at the fork) are the parent's

    def send_direct(self, pump: _Pump, data: bytes) -> bool:
        """pump.send_direct, with an interrupt that comes in the middle of the frame raised once the frame
        is whole (a frame cut short would break the protocol, and the kernel with it)."""
        if self.forked:
            return False
        if _thread.get_ident() != self._main_thread:  # only the main thread runs signal handlers
            return pump.send_direct(data)
        self._writing = True
        try:
            sent = pump.send_direct(data)
        finally:
            self._writing = False
        if self._deferred:
            self.armed = self._deferred = False
            raise KeyboardInterrupt
        return sent

    def on_sigint(self, signum: int, frame: Any) -> None:
        # Idle, or in the kernel's own code after a cell: ignored. Armed: one KeyboardInterrupt, and
        # disarmed first, so a second SIGINT can never raise inside the kernel's own code. A cell that
        # caught it and runs on is interrupted again only where that is safe to tell: while the frame
        # on top is the cell's own code (its globals are the namespace; kernel code never runs there),
        # or the print path's own code outside a frame being sent (_Direct.write, send_direct: the
        # cell's text is then either not sent yet or sent whole). In the middle of a frame: deferred,
        # and raised by send_direct once the frame is whole.
        if self._writing:
            if self.armed or self.cell_running:
                self._deferred = True
            return
        if self.armed or (
            self.cell_running
            and frame is not None
            and (frame.f_globals is self._namespace or frame.f_code in self._print_path)
        ):
            self.armed = self._deferred = False
            raise KeyboardInterrupt
