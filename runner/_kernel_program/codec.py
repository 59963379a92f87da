"""The kernel's side of the frames: its own JSON encoder for replies, json's C scanner for requests (the
json package needs re, 24 ms more to import in the sandbox), and the reply channel."""

from __future__ import annotations

import _json
import _thread
from _json import encode_basestring as _json_string  # the C escaper json itself uses

from .basics import _fatal, _write_all

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, NoReturn


def to_json(value: object) -> str:
    """Compact JSON for the kernel's own replies (str, int, float, None, bool, list, tuple, dict)."""
    if type(value) is str:
        return _json_string(value)
    if value is None or value is True or value is False:
        return "null" if value is None else "true" if value else "false"
    if type(value) is int:
        return int.__repr__(value)
    if type(value) is float:
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError("JSON has no NaN or infinity")
        return float.__repr__(value)
    if type(value) is dict:
        return "{" + ",".join(_json_string(k) + ":" + to_json(v) for k, v in value.items()) + "}"
    if type(value) in (list, tuple):
        return "[" + ",".join(map(to_json, value)) + "]"  # type: ignore[call-overload]
    raise TypeError(f"cannot encode {type(value).__name__}")


class _JsonContext:
    """What json's C scanner reads from a decoder: json.loads' defaults, and no NaN or Infinity."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int

    @staticmethod
    def parse_constant(name: str) -> NoReturn:
        raise ValueError(f"{name} is not JSON")


# The C scanner reads only these attributes of its context: a small class stands in for a decoder.
_scan_json = _json.make_scanner(_JsonContext())  # type: ignore[arg-type]


def _json_loads(text: str) -> Any:
    """json.loads for one request frame: a whole JSON value and nothing after it."""
    try:
        value, end = _scan_json(text, 0)
    except StopIteration as exc:
        raise ValueError(f"no JSON value at {exc.value}") from None
    if end != len(text):
        raise ValueError(f"extra data at {end}")
    return value


class _Channel:
    """The reply channel: whole frames, one writer at a time (the pumps and the main thread share it)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._lock = _thread.allocate_lock()

    def send(self, message: dict[str, Any]) -> None:
        body = to_json(message).encode("utf-8")
        frame = len(body).to_bytes(4, "big") + body
        try:
            with self._lock:
                _write_all(self.fd, frame)
        except OSError as exc:  # the host went away, or a cell closed the channel: nobody to answer
            _fatal(f"cannot write to the host: {exc}")
