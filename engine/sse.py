"""Read an OpenAI-compatible chat completion (streamed or not) as a sequence of model events."""

from __future__ import annotations

import codecs
import json
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ModelError",
    "TextDelta",
    "ToolCall",
    "ToolCallCollector",
    "events_from_message",
    "events_from_response",
    "events_from_sse",
]


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str = ""


@dataclass(frozen=True, slots=True)
class ModelError:
    message: str


@dataclass
class ToolCallCollector:
    """Joins the fragments of streamed tool calls (OpenAI sends them piecewise, keyed by index)."""

    calls: dict[int, ToolCall] = field(default_factory=dict)

    def add(self, fragments: list[dict[str, Any]]) -> None:
        for position, fragment in enumerate(fragments):
            index = fragment.get("index", position)
            function = fragment.get("function") or {}
            call = self.calls.get(index)
            if call is None:
                call = self.calls[index] = ToolCall(id=fragment.get("id") or f"call_{index}", name="")
            elif fragment.get("id"):
                call.id = fragment["id"]
            call.name += function.get("name") or ""
            call.arguments += function.get("arguments") or ""

    def done(self) -> list[ToolCall]:
        return [self.calls[index] for index in sorted(self.calls)]


def _error_text(payload: dict[str, Any]) -> str | None:
    error = payload.get("error")
    if error is None:
        return None
    if isinstance(error, dict):
        return str(error.get("message") or error.get("detail") or error)
    return str(error)


async def events_from_sse(
    chunks: AsyncIterable[bytes | str],
) -> AsyncIterator[TextDelta | ToolCall | ModelError]:
    """Parse `data: {...}` lines of a streamed completion; yields text as it comes, tool calls at the end.

    Each piece is scanned once (a line that arrives in thousands of pieces is joined once it ends,
    not split again at every piece), and a character whose UTF-8 bytes are split between two pieces
    is decoded whole."""
    collector = ToolCallCollector()
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    pending: list[str] = []  # the pieces of the line not ended yet
    async for chunk in chunks:
        text = decoder.decode(chunk) if isinstance(chunk, bytes) else chunk
        if "\n" not in text:
            pending.append(text)
            continue
        lines = text.split("\n")
        lines[0] = "".join(pending) + lines[0]
        pending = [lines.pop()]
        for line in lines:
            event = _parse_line(line.strip(), collector)
            if event is not None:
                yield event
    pending.append(decoder.decode(b"", final=True))
    event = _parse_line("".join(pending).strip(), collector)
    if event is not None:
        yield event
    for call in collector.done():
        yield call


def _parse_line(line: str, collector: ToolCallCollector) -> TextDelta | ModelError | None:
    if not line.startswith("data:"):
        return None
    data = line[len("data:") :].strip()
    if not data or data == "[DONE]":
        return None
    try:
        payload = json.loads(data)
    except json.JSONDecodeError:
        return None
    if not isinstance(payload, dict):
        return None
    error = _error_text(payload)
    if error is not None:
        return ModelError(error)
    text = ""
    for choice in payload.get("choices") or []:
        delta = choice.get("delta") or choice.get("message") or {}
        text += delta.get("content") or ""
        if delta.get("tool_calls"):
            collector.add(delta["tool_calls"])
    return TextDelta(text) if text else None


def events_from_message(payload: dict[str, Any]) -> list[TextDelta | ToolCall | ModelError]:
    """The same events from a non-streamed completion body."""
    error = _error_text(payload)
    if error is not None:
        return [ModelError(error)]
    events: list[TextDelta | ToolCall | ModelError] = []
    collector = ToolCallCollector()
    for choice in payload.get("choices") or []:
        message = choice.get("message") or {}
        if message.get("content"):
            events.append(TextDelta(message["content"]))
        if message.get("tool_calls"):
            collector.add(message["tool_calls"])
    events.extend(collector.done())
    return events


async def events_from_response(response: object) -> AsyncIterator[TextDelta | ToolCall | ModelError]:
    """The events of whatever the host's model call returned (engine.Host.call_model): a completion
    body (a dict), a stream (an object with a `body_iterator` of SSE bytes), or an error response (an
    object with a `body` and a `status_code`)."""
    if isinstance(response, dict):
        for event in events_from_message(response):
            yield event
        return
    chunks = getattr(response, "body_iterator", None)
    if chunks is not None:
        async for event in events_from_sse(chunks):
            yield event
        return
    body = getattr(response, "body", b"")
    try:
        payload = json.loads(body) if body else {}
    except (TypeError, ValueError):
        payload = {}
    status = getattr(response, "status_code", "?")
    events = events_from_message(payload) if isinstance(payload, dict) else []
    for event in events or [ModelError(f"the base model answered with HTTP {status}")]:
        yield event
