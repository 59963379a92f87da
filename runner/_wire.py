"""Host side of the persistent kernel's wire (the kernel is runner/_kernel_program/).

A frame is a 4-byte big-endian length N followed by N bytes of UTF-8 JSON encoding one object. The
kernel runs the model's code inside its own process, so a cell can write any bytes to the reply
channel: everything here treats the kernel as hostile. ``FrameDecoder`` is strict (any malformed or
unexpected frame raises ``ProtocolError``), bounded (it never buffers more than one frame), pure (no
I/O) and cheap (a few microseconds per frame). ``ProtocolState`` adds the ordering rules a decoder
cannot see. A valid frame can still be forged by a cell: see ``ProtocolState`` for what that buys it.

Pure standard library; of the rest of the package it imports only the wire's constants, which it
shares with the kernel (runner/_kernel_program/protocol.py).
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from ._kernel_program.protocol import MAX_FIGURES_PER_RUN, MAX_REQUEST, MAX_TEXT, PROTOCOL_VERSION

MAX_FRAME = 256 * 1024  # default bound of one kernel->host frame; the largest honest one is ~100 KiB
MAX_MORE_FIGURES = 2**31 - 1
MAX_FIGURE_NAME = 255
MAX_PACKAGES = 50
MAX_SHORT = 64  # package names, versions, the Python version
MAX_RUN_ID = 2**63 - 1

Stream = Literal["stdout", "stderr"]
Status = Literal["ok", "error", "interrupted"]
_STREAMS: dict[str, Stream] = {"o": "stdout", "e": "stderr"}
_STATUSES: frozenset[str] = frozenset(("ok", "error", "interrupted"))
_HEADER = struct.Struct(">I")
_KEYS_READY = frozenset(("t", "v", "python", "pid", "packages"))
_KEYS_OUT = frozenset(("t", "id", "s", "d"))
_KEYS_DONE = frozenset(("t", "id", "status", "exit_code", "figures", "more", "ms"))
_SHORT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+!-]{0,63}\Z")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")


class ProtocolError(Exception):
    """The kernel sent something the protocol does not allow: treat the kernel as compromised or
    broken, stop using it, and start a fresh one. ``decoded`` holds the valid messages that the same
    ``feed`` call decoded before the bad frame (for diagnostics; do not act on them)."""

    def __init__(self, message: str, decoded: tuple[Message, ...] = ()) -> None:
        super().__init__(message)
        self.decoded = decoded


@dataclass(frozen=True, slots=True)
class Ready:
    version: int
    python: str
    pid: int  # as the kernel sees itself: 1 inside its sandbox
    packages: dict[str, str | None]


@dataclass(frozen=True, slots=True)
class Output:
    run_id: int
    stream: Stream
    text: str


@dataclass(frozen=True, slots=True)
class Done:
    run_id: int
    status: Status
    exit_code: int | None
    figures: tuple[str, ...]  # relative to the workdir, as the kernel claims: resolve them safely
    ms: float
    more: int = 0  # figures past MAX_FIGURES_PER_RUN left open in the run, not saved


Message = Ready | Output | Done


def encode(obj: dict[str, Any]) -> bytes:
    """One frame: compact UTF-8 JSON behind its length."""
    try:
        body = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: JSON's \u escape carries it, raw UTF-8 cannot
        body = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode("ascii")
    if len(body) > 0xFFFFFFFF:
        raise ValueError("frame too large")
    return _HEADER.pack(len(body)) + body


def encode_run(run_id: int, lang: Literal["python", "bash"], code: str) -> bytes:
    """The one request the kernel understands. It refuses (and dies on) anything else."""
    if type(run_id) is not int or not 0 <= run_id <= MAX_RUN_ID:
        raise ValueError(f"run id must be an int in 0..2**63-1, not {run_id!r}")
    if lang not in ("python", "bash"):
        raise ValueError(f"lang must be 'python' or 'bash', not {lang!r}")
    frame = encode({"t": "run", "id": run_id, "lang": lang, "code": code})
    if len(frame) - 4 > MAX_REQUEST:
        raise ValueError(f"code too large for one request ({len(frame) - 4} bytes > {MAX_REQUEST})")
    return frame


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


_decode_json = json.JSONDecoder(parse_constant=_reject_constant).decode


def _int(obj: dict[str, Any], key: str, low: int, high: int) -> int:
    value = obj[key]
    if type(value) is not int or not low <= value <= high:  # type(): True is an int, not a number here
        raise ProtocolError(f"{obj['t']}.{key} must be an int in {low}..{high}, not {_show(value)}")
    return value


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_text(what: str, value: Any, limit: int, escapes: bool) -> str:
    if type(value) is not str or len(value) > limit:
        raise ProtocolError(f"{what} must be a string of at most {limit} characters, not {_show(value)}")
    # Only JSON's \u escapes can produce a lone surrogate (the body was strict UTF-8), and a string
    # with one would blow up later when the host encodes it.
    if escapes and _SURROGATE.search(value):
        raise ProtocolError(f"{what} contains a lone surrogate")
    return value


def _parse_ready(obj: dict[str, Any], escapes: bool) -> Ready:
    if obj.keys() != _KEYS_READY:
        raise ProtocolError(f"ready has keys {sorted(obj)}")
    version = _int(obj, "v", 0, 2**31 - 1)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"kernel speaks protocol {version}, the host {PROTOCOL_VERSION}")
    python = _check_text("ready.python", obj["python"], MAX_SHORT, escapes)
    if not _SHORT_NAME.match(python):
        raise ProtocolError(f"ready.python is not a version: {_show(python)}")
    pid = _int(obj, "pid", 1, 2**31 - 1)
    packages = obj["packages"]
    if type(packages) is not dict or len(packages) > MAX_PACKAGES:
        raise ProtocolError(f"ready.packages must be an object of at most {MAX_PACKAGES} entries")
    for name, version_text in packages.items():
        if not _SHORT_NAME.match(name):
            raise ProtocolError(f"ready.packages has a bad name: {_show(name)}")
        if version_text is not None and not (type(version_text) is str and _SHORT_NAME.match(version_text)):
            raise ProtocolError(f"ready.packages[{name!r}] is not a version: {_show(version_text)}")
    return Ready(version, python, pid, dict(packages))


def _parse_out(obj: dict[str, Any], escapes: bool) -> Output:
    if obj.keys() != _KEYS_OUT:
        raise ProtocolError(f"out has keys {sorted(obj)}")
    run_id = _int(obj, "id", 0, MAX_RUN_ID)
    stream = _STREAMS.get(obj["s"]) if type(obj["s"]) is str else None
    if stream is None:
        raise ProtocolError(f"out.s must be 'o' or 'e', not {_show(obj['s'])}")
    return Output(run_id, stream, _check_text("out.d", obj["d"], MAX_TEXT, escapes))


def _figure_name(value: Any, escapes: bool) -> str:
    name = _check_text("done.figures[]", value, MAX_FIGURE_NAME, escapes)
    if (
        not name
        or name.startswith("/")
        or _CONTROL.search(name)
        or "\\" in name
        or any(part in ("", ".", "..") for part in name.split("/"))
    ):
        raise ProtocolError(f"done.figures has a name that is not a plain relative path: {_show(name)}")
    return name


def _parse_done(obj: dict[str, Any], escapes: bool) -> Done:
    if obj.keys() != _KEYS_DONE:
        raise ProtocolError(f"done has keys {sorted(obj)}")
    run_id = _int(obj, "id", 0, MAX_RUN_ID)
    status = obj["status"]
    if type(status) is not str or status not in _STATUSES:
        raise ProtocolError(f"done.status must be one of {sorted(_STATUSES)}, not {_show(status)}")
    exit_code = None if obj["exit_code"] is None else _int(obj, "exit_code", -(2**31), 2**31 - 1)
    figures = obj["figures"]
    if type(figures) is not list or len(figures) > MAX_FIGURES_PER_RUN:
        raise ProtocolError(f"done.figures must be a list of at most {MAX_FIGURES_PER_RUN} names")
    more = _int(obj, "more", 0, MAX_MORE_FIGURES)
    ms = obj["ms"]
    if type(ms) not in (int, float) or not math.isfinite(ms) or not 0 <= ms <= 1e12:
        raise ProtocolError(f"done.ms must be a non-negative number, not {_show(ms)}")
    names = tuple(_figure_name(f, escapes) for f in figures)
    return Done(run_id, status, exit_code, names, float(ms), more)  # type: ignore[arg-type]


_PARSERS: dict[str, Callable[[dict[str, Any], bool], Ready | Output | Done]] = {
    "ready": _parse_ready,
    "out": _parse_out,
    "done": _parse_done,
}


def parse_body(body: bytes | bytearray | memoryview) -> Message:
    """One frame's body (without the length) as a message, or ProtocolError."""
    try:
        text = str(body, "utf-8")  # strict; json.loads on bytes would also accept UTF-16 and UTF-32
        obj = _decode_json(text)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise ProtocolError(f"frame is not UTF-8 JSON: {exc}") from None
    if type(obj) is not dict:
        raise ProtocolError(f"frame is not a JSON object but {type(obj).__name__}")
    kind = obj.get("t")
    parser = _PARSERS.get(kind) if type(kind) is str else None
    if parser is None:
        raise ProtocolError(f"unknown message type {_show(kind)}")
    try:
        return parser(obj, "\\u" in text)
    except KeyError as exc:  # cannot happen after the key checks; kept so nothing but ProtocolError escapes
        raise ProtocolError(f"{kind} lacks {exc}") from None


class FrameDecoder:
    """Incremental, strict decoder of the kernel's frames.

    ``feed`` takes whatever bytes the channel gave and returns the complete messages; a partial
    frame waits inside (at most ``max_frame`` + 4 bytes: a length above ``max_frame`` is refused
    before its body arrives). After a ProtocolError the decoder stays failed: the channel has lost
    its framing and nothing later on it can be trusted."""

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        if not 1 <= max_frame <= 0xFFFFFFFF:
            raise ValueError("max_frame must be in 1..2**32-1")
        self.max_frame = max_frame
        self._buf = bytearray()
        self._need = -1  # length of the body being collected; -1 while collecting a header
        self._failed: ProtocolError | None = None

    @property
    def buffered(self) -> int:
        """Bytes of an incomplete frame held."""
        return len(self._buf)

    @property
    def mid_frame(self) -> bool:
        """Part of a frame (its length, or some of it) has arrived and the rest has not."""
        return self._need >= 0 or bool(self._buf)

    @property
    def received(self) -> int:
        """Bytes of the incomplete frame received so far, its length included."""
        return len(self._buf) + (4 if self._need >= 0 else 0)

    @property
    def failed(self) -> bool:
        return self._failed is not None

    def feed(self, data: bytes | bytearray | memoryview) -> list[Message]:
        if self._failed is not None:
            raise ProtocolError(f"decoder already failed: {self._failed}")
        out: list[Message] = []
        try:
            self._feed(memoryview(data).cast("B"), out)
        except ProtocolError as exc:
            self._failed = exc
            self._buf = bytearray()
            raise ProtocolError(str(exc), tuple(out)) from None
        return out

    def _feed(self, view: memoryview, out: list[Message]) -> None:
        buf, pos, end = self._buf, 0, len(view)
        while pos < end:
            if self._need < 0:
                if not buf and end - pos >= 4:  # the usual case: the header is all there, no copy
                    (length,) = _HEADER.unpack_from(view, pos)
                    pos += 4
                else:
                    take = min(4 - len(buf), end - pos)
                    buf += view[pos : pos + take]
                    pos += take
                    if len(buf) < 4:
                        return
                    (length,) = _HEADER.unpack(buf)
                    buf.clear()
                if not 0 < length <= self.max_frame:
                    raise ProtocolError(f"frame length {length} outside 1..{self.max_frame}")
                self._need = length
            need = self._need
            if not buf and end - pos >= need:  # the whole body is in this chunk: parse it in place
                out.append(parse_body(view[pos : pos + need]))
                pos += need
                self._need = -1
                continue
            take = min(need - len(buf), end - pos)
            buf += view[pos : pos + take]
            pos += take
            if len(buf) == need:
                out.append(parse_body(buf))
                buf.clear()
                self._need = -1

    def eof(self) -> None:
        """The channel closed: fine between frames (the kernel exited), a ProtocolError inside one."""
        if self._failed is None and (self._buf or self._need >= 0):
            self._failed = ProtocolError("the kernel's channel closed in the middle of a frame")
            raise self._failed


class ProtocolState:
    """The ordering rules over decoded messages: "ready" first and once; then, per run the host
    started, only that run's "out" frames and one "done"; nothing while no run is in flight.

    A cell can forge a perfectly valid frame (it runs in the kernel's process and may write to the
    channel's fd). What a forgery can do: add text to its own run's output (which it could print
    anyway), or end its run early with a fake "done" (status, exit code, figure names of its choice:
    names of files in the workdir, which it controls anyway). The kernel's real "done" then arrives
    with no run in flight, or for the wrong run, and ``accept`` raises. So: on ProtocolError from
    here or from the decoder, kill the sandbox and start a new kernel; treat figure names like any
    path the sandbox names (resolved inside the workdir, no links followed)."""

    def __init__(self) -> None:
        self.ready: Ready | None = None
        self.current: int | None = None

    def start(self, run_id: int) -> None:
        """The host is about to send run ``run_id``."""
        if self.ready is None or self.current is not None:
            raise RuntimeError("a run can start only after 'ready' and after the previous run's 'done'")
        self.current = run_id

    def accept(self, message: Message) -> Message:
        if self.ready is None:
            if not isinstance(message, Ready):
                raise ProtocolError(f"the first message must be 'ready', not {type(message).__name__}")
            self.ready = message
            return message
        if isinstance(message, Ready):
            raise ProtocolError("a second 'ready'")
        kind = type(message).__name__
        if self.current is None:
            raise ProtocolError(f"{kind} for run {message.run_id} while no run is in flight")
        if message.run_id != self.current:
            raise ProtocolError(f"{kind} for run {message.run_id} during run {self.current}")
        if isinstance(message, Done):
            self.current = None
        return message
