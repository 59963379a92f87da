"""The pumps: a thread per output pipe of the cell (fd 1, fd 2) forwarding it to the host as "out"
frames, and how a run's output ends: at once when both pipes are empty, else by a sentinel."""

from __future__ import annotations

import _thread
import codecs
import io
import os
import select

from .basics import _READ_SIZE, _fatal, _monotonic, _os_read, _write_all
from .condition import _Condition
from .protocol import MAX_TEXT

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

_HELD_CAP = 1024 * 1024  # output written between runs, kept for the next run; past it the pump pauses
_SENTINEL_STALL_S = 5.0  # no byte and no sentinel for this long after draining began: the pipe was tampered
_QUIET_TRIES = 3  # how often the end of a run waits for a pump to take what is in its pipe before a sentinel


def _sentinel_prefix_start(buf: bytes, sentinel: bytes) -> int:
    """Where a tail of ``buf`` that could begin ``sentinel`` starts (len(buf) if none): those bytes wait
    for the next read instead of being forwarded, so a sentinel split across reads is still found."""
    first = sentinel[:1]
    pos = buf.find(first, max(0, len(buf) - len(sentinel) + 1))
    while pos != -1:
        if sentinel.startswith(buf[pos:]):
            return pos
        pos = buf.find(first, pos + 1)
    return len(buf)


class _Pump:
    """Forwards one of the cell's output pipes (fd 1 or fd 2) to the host as "out" frames.

    The pump thread waits in poll() and reads (non-blocking) only holding the pump's lock, and forwards
    what it read before letting go of it. So whoever holds the lock and finds the pipe empty knows that
    every byte written into it before that instant is forwarded: the end of a run (end_quietly) needs
    no round trip through the pipe in the common case, one poll() for both pipes.

    When a pipe is not empty at the end (a thread the cell left keeps writing, a pump that is slow to
    take its bytes), the main thread writes a fresh random sentinel into it; the pump forwards
    everything before the sentinel, then reports. Either way "done" is sent only after, so every byte
    the cell (or its children) wrote before the end comes before it. Bytes after the end are held for
    the next run, up to _HELD_CAP; then the pump pauses until the next run (a writer left running
    blocks on the full pipe instead of filling memory), but never while a sentinel's write is still
    under way: a forged sentinel seen early cannot leave the main thread blocked writing the real one
    into a pipe nobody reads."""

    def __init__(self, send: Callable[[dict[str, Any]], None], read_fd: int, write_fd: int, tag: str) -> None:
        self.read_fd = read_fd
        self.write_fd = write_fd  # the kernel's own write end: the sentinel gets in even if fd 1 is gone
        os.set_blocking(read_fd, False)  # a read under the lock never blocks (a cell may steal the bytes)
        self._poller = select.poll()  # the pump thread's (a poll object is not for two threads at once)
        self._poller.register(read_fd, select.POLLIN)
        self._check = select.poll()  # send_direct's, used holding the lock
        self._check.register(read_fd, select.POLLIN)
        self._send = send
        self._tag = tag
        self._cond = _Condition()
        self._run_id = 0
        self._open = False  # a run is in flight and its output not ended: bytes read are its output
        self._sentinel: bytes | None = None
        self._written = True  # no sentinel write under way
        self._paused = False  # between runs with _HELD_CAP held: the pump reads no more until begin()
        self._waited = False  # the main thread waits for this pump to take bytes (end_quietly)
        self._held = bytearray()
        self._held_cut = False
        self._carry = b""
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._activity = 0.0
        self._drain_started = 0.0
        self.running = False  # the pump thread is between start() and its end

    # -- main thread ---------------------------------------------------------------------------------

    def begin(self, run_id: int) -> None:
        """A run starts: bytes held since the last run go out first, as its output."""
        with self._cond:
            self._run_id = run_id
            self._sentinel = None
            self._carry = b""
            self._open = True
            if self._held:
                held = bytes(self._held)
                self._held.clear()
                self._held_cut = False
                self._forward(held)
            if self._paused:
                self._paused = False
                self._cond.notify_all()

    def drain(self, sentinel: bytes) -> None:
        with self._cond:
            self._sentinel = sentinel
            self._written = False
            self._drain_started = self._activity = _monotonic()
        # Shorter than PIPE_BUF, so the pipe takes it whole; blocks only while the pump still reads.
        _write_all(self.write_fd, sentinel)
        with self._cond:
            self._written = True
            self._cond.notify_all()

    def wait_drained(self) -> None:
        with self._cond:
            while self._open:
                self._cond.wait(0.25)
                if not self._open:
                    break
                if not self.running:
                    _fatal(f"the {self._tag} pump is gone")
                # The lock is ours again, so the pump is not in the middle of a frame to a slow host.
                if _monotonic() - max(self._activity, self._drain_started) > _SENTINEL_STALL_S:
                    _fatal(f"the sentinel never came back through the {self._tag} pipe")

    def send_direct(self, data: bytes) -> bool:
        """Forward bytes the kernel's own sys.stdout/sys.stderr wrote, as a frame, at once: only while a
        run's output is open and the pipe is empty (bytes in the pipe were written first, so these go
        in behind them). False: write them into the pipe instead. Not in a forked child (see _Direct)."""
        with self._cond:
            if not self._open or self._sentinel is not None or self._check.poll(0):
                return False
            self._forward(data)
            return True

    # -- pump thread ---------------------------------------------------------------------------------

    def start(self) -> None:
        self.running = True
        _thread.start_new_thread(self._main, ())

    def _main(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # a pump that stops would make "done" lie or never come
            _fatal(f"the {self._tag} pump failed: {exc!r}")
        finally:
            self.running = False

    def _loop(self) -> None:
        poll = self._poller.poll
        while True:
            with self._cond:
                while self._paused:
                    self._cond.wait()
            poll()  # until the pipe has bytes (a closed fd makes the read below fail: fatal)
            with self._cond:
                if self._paused:
                    continue
                try:
                    data = _os_read(self.read_fd, _READ_SIZE)
                except BlockingIOError:  # someone else took them
                    continue
                if not data:
                    _fatal(f"the {self._tag} pipe was closed")
                if self._sentinel is not None:
                    self._activity = _monotonic()
                self._take(data)
                if self._waited:
                    self._waited = False
                    self._cond.notify_all()

    def take(self, data: bytes) -> None:
        """Account for bytes read from the pipe (the loop's part, apart so tests can drive it)."""
        with self._cond:
            self._take(data)

    def _take(self, data: bytes) -> None:  # holding the lock
        if not self._open:
            self._hold(data)
            return
        sentinel = self._sentinel
        if sentinel is None:
            self._forward(data)
            return
        buf = self._carry + data if self._carry else data
        at = buf.find(sentinel)
        if at < 0:
            keep = _sentinel_prefix_start(buf, sentinel)
            self._carry = buf[keep:]
            self._forward(buf[:keep])
            return
        self._carry = b""
        self._end(buf[:at])
        self._hold(buf[at + len(sentinel) :])
        self._cond.notify_all()

    def _end(self, last: bytes) -> None:  # holding the lock
        self._forward(last, final=True)  # a character cut at the end of a run never joins the next run's
        self._decoder.reset()
        self._open = False

    def _hold(self, data: bytes) -> None:  # holding the lock
        room = _HELD_CAP - len(self._held)
        if len(data) <= room:
            self._held += data
        else:
            self._held += data[: max(room, 0)]
            if not self._held_cut:
                self._held_cut = True
                self._held += b"\n[code-sessions: output written between runs was cut here]\n"
        if len(self._held) >= _HELD_CAP and self._written:
            self._paused = True

    def _forward(self, data: bytes, final: bool = False) -> None:  # holding the lock
        text = self._decoder.decode(data, final)
        for start in range(0, len(text), MAX_TEXT):
            self._send({"t": "out", "id": self._run_id, "s": self._tag, "d": text[start : start + MAX_TEXT]})


def quiet_poller(pumps: tuple[_Pump, ...]) -> Any:
    """What end_quietly polls: every pump's pipe (made once)."""
    poller = select.poll()
    for pump in pumps:
        poller.register(pump.read_fd, select.POLLIN)
    return poller


def end_quietly(pumps: tuple[_Pump, ...], poller: Any) -> bool:
    """End the run's output on every pump without a sentinel when their pipes are empty: holding every
    pump's lock (so no pump is between a read and its frame), one poll() finding no byte in any pipe
    means every byte written before it is forwarded. Bytes in a pipe: wait (a few times) for its pump
    to take them. False when the pipes would not empty: then the sentinel ends the run."""
    for _ in range(_QUIET_TRIES):
        for pump in pumps:
            pump._cond.__enter__()
        try:
            ready = poller.poll(0)
            if not ready:
                for pump in pumps:
                    pump._end(b"")
                return True
            waiting = next(p for p in pumps if p.read_fd == ready[0][0])
            waiting._waited = True
        finally:
            for pump in reversed(pumps):
                pump._cond.__exit__()
        with waiting._cond:
            if waiting._waited and waiting.running:
                waiting._cond.wait(0.05)
    return False


class _Direct(io.RawIOBase):
    """What the kernel's sys.stdout and sys.stderr write into: a print() goes out as one frame, with
    no pump woken and no byte through the pipe, when ``send`` (the kernel's guarded _Pump.send_direct)
    takes it; otherwise into the pump's pipe, behind the bytes already there. So, as in Jupyter, they
    are the kernel's streams to the host, whatever a cell did to fd 1 and 2 (which are the process's:
    subprocesses and C code write there, and the pumps forward that too); fileno() still names fd 1
    or 2. Under a line-buffered TextIOWrapper and no BufferedWriter: TextIOWrapper lets go of its
    bytes before it calls write(), so a KeyboardInterrupt raised after the frame went out can never
    send them twice."""

    def __init__(self, fd: int, pump: _Pump, send: Callable[[_Pump, bytes], bool]) -> None:
        super().__init__()
        self.name = fd
        self._fd = fd
        self._pump = pump
        self._send = send

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def write(self, b: Any) -> int:
        if self.closed:
            raise ValueError("I/O operation on closed file")
        data = bytes(b)
        if data and not self._send(self._pump, data):
            _write_all(self._pump.write_fd, data)
        return len(data)
