"""The pumps: a thread per output pipe of the cell (fd 1, fd 2) forwarding it to the host as "out"
frames, and the sentinel that ends a run's output."""

from __future__ import annotations

import _thread
import codecs

from .basics import _READ_SIZE, _fatal, _monotonic, _os_read, _write_all
from .condition import _Condition
from .protocol import MAX_TEXT

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

_HELD_CAP = 1024 * 1024  # output written between runs, kept for the next run; the rest is dropped
_SENTINEL_STALL_S = 5.0  # no byte and no sentinel for this long after draining began: the pipe was tampered


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

    End of a run: the main thread writes a fresh random sentinel into the pipe; the pump forwards
    everything before it, then reports. Only then does the main thread send "done", so every byte the
    cell (or its children) wrote comes before it. Bytes after the sentinel are held for the next run,
    and the pump stops reading until then (a writer left running blocks on the full pipe instead of
    filling memory), but never before the sentinel's write has completed: a forged sentinel seen early
    cannot leave the main thread blocked writing the real one into a pipe nobody reads."""

    def __init__(self, send: Callable[[dict[str, Any]], None], read_fd: int, write_fd: int, tag: str) -> None:
        self.read_fd = read_fd
        self.write_fd = write_fd  # the kernel's own write end: the sentinel gets in even if fd 1 is gone
        self._send = send
        self._tag = tag
        self._cond = _Condition()
        self._run_id = 0
        self._sentinel: bytes | None = None
        self._seen = True  # idle until the first run: nothing is forwarded
        self._written = True
        self._held = bytearray()
        self._held_cut = False
        self._carry = b""
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._busy = False  # blocked writing a frame: a slow host, not a lost sentinel
        self._activity = _monotonic()
        self._drain_started = 0.0
        self.running = False  # the pump thread is between start() and its end

    # -- main thread ---------------------------------------------------------------------------------

    def begin(self, run_id: int) -> None:
        with self._cond:
            self._run_id = run_id
            self._sentinel = None
            self._seen = False
            self._written = False
            self._cond.notify_all()

    def drain(self, sentinel: bytes) -> None:
        with self._cond:
            self._sentinel = sentinel
            self._drain_started = _monotonic()
        # Shorter than PIPE_BUF, so the pipe takes it whole; blocks only while the pump still reads.
        _write_all(self.write_fd, sentinel)
        with self._cond:
            self._written = True
            self._cond.notify_all()

    def wait_drained(self) -> None:
        with self._cond:
            while not self._seen:
                self._cond.wait(0.25)
                if self._seen:
                    break
                if not self.running:
                    _fatal(f"the {self._tag} pump is gone")
                quiet = _monotonic() - max(self._activity, self._drain_started)
                if not self._busy and quiet > _SENTINEL_STALL_S:
                    _fatal(f"the sentinel never came back through the {self._tag} pipe")

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
        while True:
            with self._cond:
                while self._seen and self._written:
                    self._cond.wait()
            self.take(b"")  # bytes held since the last run go first
            data = _os_read(self.read_fd, _READ_SIZE)
            if not data:
                _fatal(f"the {self._tag} pipe was closed")
            self._activity = _monotonic()
            self.take(data)

    def take(self, data: bytes) -> None:
        """Account for bytes read from the pipe (split out of the loop so tests can drive it)."""
        with self._cond:
            if self._seen:
                self._hold(data)
                return
            run_id, sentinel = self._run_id, self._sentinel
            if self._held:
                data = bytes(self._held) + data
                self._held.clear()
                self._held_cut = False
        if sentinel is None:
            self._forward(run_id, data)
            return
        buf = self._carry + data if self._carry else data
        at = buf.find(sentinel)
        if at < 0:
            keep = _sentinel_prefix_start(buf, sentinel)
            self._carry = buf[keep:]
            self._forward(run_id, buf[:keep])
            return
        self._carry = b""
        self._forward(run_id, buf[:at], final=True)
        with self._cond:
            self._seen = True
            self._hold(buf[at + len(sentinel) :])
            self._cond.notify_all()

    def _hold(self, data: bytes) -> None:
        room = _HELD_CAP - len(self._held)
        if len(data) <= room:
            self._held += data
            return
        self._held += data[: max(room, 0)]
        if not self._held_cut:
            self._held_cut = True
            self._held += b"\n[code-sessions: output written between runs was cut here]\n"

    def _forward(self, run_id: int, data: bytes, final: bool = False) -> None:
        text = self._decoder.decode(data, final)
        if final:
            self._decoder.reset()  # a character cut at the end of a run never joins the next run's bytes
        for start in range(0, len(text), MAX_TEXT):
            self._busy = True
            try:
                self._send({"t": "out", "id": run_id, "s": self._tag, "d": text[start : start + MAX_TEXT]})
            finally:
                self._busy = False
                self._activity = _monotonic()
