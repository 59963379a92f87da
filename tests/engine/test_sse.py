import json
import time

from engine.sse import ModelError, TextDelta, ToolCall, events_from_message, events_from_sse


def sse(*payloads) -> bytes:
    return b"".join(f"data: {json.dumps(p)}\n\n".encode() for p in payloads) + b"data: [DONE]\n\n"


async def chunks_of(data: bytes, size: int):
    for start in range(0, len(data), size):
        yield data[start : start + size]


async def collect(stream):
    return [event async for event in stream]


async def test_text_and_tool_call_fragments_survive_any_chunking():
    data = sse(
        {"choices": [{"delta": {"role": "assistant", "content": "Hi "}}]},
        {"choices": [{"delta": {"content": "there"}}]},
        {
            "choices": [
                {
                    "delta": {
                        "tool_calls": [
                            {"index": 0, "id": "c9", "function": {"name": "run_", "arguments": '{"co'}}
                        ]
                    }
                }
            ]
        },
        {
            "choices": [
                {
                    "delta": {
                        "tool_calls": [{"index": 0, "function": {"name": "code", "arguments": 'de": "x"}'}}]
                    }
                }
            ]
        },
    )
    for size in (1, 5, 64, len(data)):
        events = await collect(events_from_sse(chunks_of(data, size)))
        text = "".join(e.text for e in events if isinstance(e, TextDelta))
        calls = [e for e in events if isinstance(e, ToolCall)]
        assert text == "Hi there"
        assert calls == [ToolCall("c9", "run_code", '{"code": "x"}')]


async def test_a_character_split_between_pieces_is_read_whole():
    data = sse({"choices": [{"delta": {"content": "Grüße, 東京"}}]}).replace(b"\\u00fc", "ü".encode())
    data = data.replace(b"\\u00df", "ß".encode()).replace(b"\\u6771\\u4eac", "東京".encode())
    assert "東京".encode() in data
    events = await collect(events_from_sse(chunks_of(data, 1)))
    assert events == [TextDelta("Grüße, 東京")]


async def test_a_long_line_in_many_pieces_is_read_in_linear_time():
    # One event of 8 MB in 4 KiB pieces: split again at every piece, the growing line was scanned
    # about 2,000 times (4 GB of scanning).
    data = sse({"choices": [{"delta": {"content": "x" * 8_000_000}}]})
    started = time.process_time()
    events = await collect(events_from_sse(chunks_of(data, 4096)))
    assert time.process_time() - started < 0.5
    assert events == [TextDelta("x" * 8_000_000)]


async def test_error_payload_becomes_a_model_error():
    events = await collect(events_from_sse(chunks_of(sse({"error": {"message": "boom"}}), 7)))
    assert events == [ModelError("boom")]


def test_non_streamed_message():
    body = {
        "choices": [
            {
                "message": {
                    "content": "ok",
                    "tool_calls": [{"id": "a", "function": {"name": "run_code", "arguments": "{}"}}],
                }
            }
        ]
    }
    assert events_from_message(body) == [TextDelta("ok"), ToolCall("a", "run_code", "{}")]
    assert events_from_message({"error": {"detail": "no"}}) == [ModelError("no")]
