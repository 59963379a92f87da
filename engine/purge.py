"""The admin's one-shot purge request, as typed into a valve: `all`, `user:ID`, `chat:ID`, `idle:7d`."""

from __future__ import annotations

from storage import Purge, parse_duration

__all__ = ["parse_purge"]


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
        return Purge(idle_longer_than_s=parse_duration(value.lower()))
    raise ValueError(f"{request!r}: expected all, user:<id>, chat:<id> or idle:<duration>")
