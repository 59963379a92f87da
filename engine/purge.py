"""The admin's one-shot purge request, as typed into a valve: `all`, `user:ID`, `chat:ID`, `idle:7d`."""

from __future__ import annotations

import re

from storage import Purge

__all__ = ["parse_duration", "parse_purge"]

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$", re.IGNORECASE)


def parse_duration(text: str) -> float:
    """Seconds in `30m`, `12h`, `7d`, `2w` (a bare number is seconds)."""
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a duration like 30m, 12h, 7d or 2w")
    return float(match.group(1)) * _UNITS[match.group(2).lower()]


def parse_purge(request: str) -> Purge:
    kind, _, value = request.strip().partition(":")
    kind = kind.strip().lower()
    value = value.strip()
    if kind == "all" and not value:
        return Purge(everything=True)
    if kind == "user" and value:
        return Purge(user_id=value)
    if kind == "chat" and value:
        return Purge(chat_id=value)
    if kind == "idle" and value:
        return Purge(idle_longer_than_s=parse_duration(value))
    raise ValueError(f"{request!r}: expected all, user:<id>, chat:<id> or idle:<duration>")
