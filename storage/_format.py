"""Human-readable formatting for reports and the CLI (sizes, times, durations, tables)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import datetime

_MAX_CELL = 64
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            if unit == "B" or value == int(value):
                return f"{int(value)} {unit}"
            return f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def human_limit(n: float | None) -> str:
    return "no limit" if not n else human_bytes(n)


def human_duration(seconds: float | None, *, zero: str = "never") -> str:
    """7d, 12h, 30m, 45s (or 2.5h when not a whole unit); `zero` for 0/None ("no limit")."""
    if not seconds:
        return zero
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            value = seconds / size
            return f"{int(value)}{unit}" if value == int(value) else f"{value:.1f}{unit}"
    return f"{seconds:g}s"


def parse_duration(text: str) -> float:
    """'7d', '12h', '30m', '45s', '2w' or a bare number of seconds."""
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"not a duration: {text!r} (use e.g. 7d, 12h, 30m, 45s)")
    return float(match.group(1)) * _SECONDS[match.group(2)]


def iso_time(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.fromtimestamp(ts).astimezone().isoformat(timespec="seconds")


def table(
    headers: Sequence[str],
    rows: Sequence[Sequence[object]],
    *,
    right: Sequence[int] = (),
    whole: Sequence[int] = (),
) -> str:
    """An aligned plain-text table; columns in `right` are right-aligned (numbers), columns in
    `whole` are never shortened (URLs, paths to copy)."""
    cells = [
        [str(h) for h in headers],
        *[[_cell(c, i in whole) for i, c in enumerate(row)] for row in rows],
    ]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for n, row in enumerate(cells):
        parts = [c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(row)]
        lines.append("  ".join(parts).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _cell(value: object, whole: bool = False) -> str:
    text = "-" if value is None else str(value)
    # A hostile id must not break the table or the terminal: show control characters escaped
    # and cut very long values (the --json output keeps them whole).
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if whole or len(text) <= _MAX_CELL else text[: _MAX_CELL - 3] + "..."
