"""The host's decoder of the kernel's wire (runner/_wire.py): strict, bounded, incremental, fast.

The kernel is hostile (the model's code runs inside it and can write to the channel), so every
malformed input must end in ProtocolError, never in another exception, a hang or unbounded memory.
"""

from __future__ import annotations

import json
import random
import struct
import time

import pytest

from runner._kernel_program import codec
from runner._wire import (
    MAX_FIGURES_PER_RUN,
    MAX_FRAME,
    MAX_TEXT,
    Done,
    FrameDecoder,
    Output,
    ProtocolError,
    ProtocolState,
    Ready,
    encode,
    encode_run,
)

READY = {
    "t": "ready",
    "v": 2,
    "python": "3.11.2",
    "pid": 1,
    "packages": {"numpy": "1.24.2", "pandas": None, "PIL": "9.4.0"},
}
OUT = {"t": "out", "id": 7, "s": "o", "d": "héllo\n\x00\x1b[1m😀"}
DONE = {
    "t": "done",
    "id": 7,
    "status": "ok",
    "exit_code": 0,
    "figures": ["figure-1.png"],
    "more": 0,
    "ms": 1.25,
}


def frame_of_body(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def frame_of(obj: object) -> bytes:
    return frame_of_body(json.dumps(obj).encode())


def decode_one(data: bytes, max_frame: int = MAX_FRAME) -> list[object]:
    return list(FrameDecoder(max_frame).feed(data))


def test_round_trips() -> None:
    data = encode(READY) + encode(OUT) + encode(DONE) + encode({**DONE, "exit_code": None, "figures": []})
    ready, out, done, done2 = FrameDecoder().feed(data)
    assert ready == Ready(2, "3.11.2", 1, {"numpy": "1.24.2", "pandas": None, "PIL": "9.4.0"})
    assert out == Output(7, "stdout", "héllo\n\x00\x1b[1m😀")
    assert done == Done(7, "ok", 0, ("figure-1.png",), 1.25)
    assert done2 == Done(7, "ok", None, (), 1.25)
    assert decode_one(encode({**OUT, "s": "e"})) == [Output(7, "stderr", OUT["d"])]
    assert decode_one(encode({**DONE, "ms": 3})) == [Done(7, "ok", 0, ("figure-1.png",), 3.0)]
    assert decode_one(encode({**DONE, "more": 180}))[0].more == 180
    with pytest.raises(AttributeError):
        out.text = "x"


def test_the_kernels_own_encoder_speaks_the_same_wire() -> None:
    for obj in (READY, OUT, DONE, {**OUT, "d": '\ud7ff\ue000\u2028"\\/\t'}):
        body = codec.to_json(obj).encode("utf-8")
        assert json.loads(body) == obj
        assert decode_one(frame_of_body(body)) == decode_one(encode(obj))
    with pytest.raises(ValueError):
        codec.to_json({"ms": float("nan")})


def test_the_largest_honest_frames_fit() -> None:
    # JSON may take 6 bytes (\u0000) for one character: a full "out" frame still fits the default bound.
    for char in ("\x00", "😀", "\\", "é"):
        frame = codec.to_json({**OUT, "d": char * MAX_TEXT}).encode()
        assert len(frame) <= MAX_FRAME
        assert decode_one(frame_of_body(frame)) == [Output(7, "stdout", char * MAX_TEXT)]
    names = [f"figure-{i}.png" for i in range(MAX_FIGURES_PER_RUN)]
    assert decode_one(encode({**DONE, "figures": names}))[0].figures == tuple(names)


def test_encode_run() -> None:
    frame = encode_run(3, "bash", "echo ü")
    assert struct.unpack(">I", frame[:4])[0] == len(frame) - 4
    assert json.loads(frame[4:]) == {"t": "run", "id": 3, "lang": "bash", "code": "echo ü"}
    assert json.loads(encode_run(1, "python", "'\udcff'")[4:])["code"] == "'\udcff'"  # escaped, not raw
    for bad in ((True, "python"), (-1, "python"), (2**63, "python"), (1, "ruby"), (1.0, "python")):
        with pytest.raises(ValueError):
            encode_run(bad[0], bad[1], "x")


def test_frames_split_at_every_byte_boundary() -> None:
    stream = encode(READY) + encode(OUT) + encode({**OUT, "d": "x" * 5000}) + encode(DONE)
    expected = FrameDecoder().feed(stream)
    assert len(expected) == 4
    for cut in range(len(stream) + 1):
        decoder = FrameDecoder()
        got = decoder.feed(stream[:cut]) + decoder.feed(stream[cut:])
        assert got == expected, cut
        assert decoder.buffered == 0
    decoder = FrameDecoder()
    got = []
    for i in range(len(stream)):
        got += decoder.feed(stream[i : i + 1])
        assert decoder.buffered <= 5000 + 100
    assert got == expected
    assert decoder.feed(b"") == []
    decoder.eof()  # between frames: a clean end


MALFORMED_BODIES: dict[str, bytes] = {
    "not utf-8": b'{"t": "out", "id": 1, "s": "o", "d": "\xff"}',
    "utf-16 json": '{"t":"out","id":1,"s":"o","d":""}'.encode("utf-16"),
    "bom": b"\xef\xbb\xbf" + json.dumps(OUT).encode(),
    "not json": b"hello",
    "trailing data": json.dumps(OUT).encode() + b" {}",
    "array": b"[1, 2]",
    "string": b'"out"',
    "number": b"12",
    "null": b"null",
    "deep nesting": b"[" * 100_000 + b"]" * 100_000,
    "huge int": b'{"t": "out", "id": ' + b"9" * 5000 + b', "s": "o", "d": ""}',
    "NaN": b'{"t": "done", "id": 1, "status": "ok", "exit_code": 0, "figures": [], "more": 0, "ms": NaN}',
    "Infinity": b'{"t": "done", "id": 1, "status": "ok", "exit_code": 0, "figures": [], "more": 0, '
    b'"ms": Infinity}',
    "lone surrogate": b'{"t": "out", "id": 1, "s": "o", "d": "a\\ud800b"}',
    "lone low surrogate in a name": b'{"t": "done", "id": 1, "status": "ok", "exit_code": 0, '
    b'"figures": ["\\udc80.png"], "more": 0, "ms": 1}',
}


def _variants() -> dict[str, object]:
    cases: dict[str, object] = {
        "no t": {k: v for k, v in OUT.items() if k != "t"},
        "unknown t": {**OUT, "t": "exec"},
        "t not a string": {**OUT, "t": 1},
        "run from the kernel": {"t": "run", "id": 1, "lang": "python", "code": "x"},
    }
    for name, good in (("ready", READY), ("out", OUT), ("done", DONE)):
        for key in good:
            if key != "t":
                cases[f"{name} without {key}"] = {k: v for k, v in good.items() if k != key}
        cases[f"{name} with an extra key"] = {**good, "extra": 1}
    bad_values = {
        "out": {
            "id": [True, False, 1.0, -1, 2**63, "1", None],
            "s": ["stdout", "", None, 1, "oe"],
            "d": [None, 1, ["x"], "x" * (MAX_TEXT + 1)],
        },
        "done": {
            "id": [True, 1.5, -3, None],
            "status": ["OK", "", None, 0, "timeout"],
            "exit_code": [True, 1.0, "0", 2**31, -(2**31) - 1],
            "figures": [
                None,
                "figure-1.png",
                [1],
                [None],
                ["a" * 256],
                [f"f{i}.png" for i in range(MAX_FIGURES_PER_RUN + 1)],
                ["/etc/passwd"],
                ["../x.png"],
                ["a/../../b.png"],
                ["./a.png"],
                ["a//b.png"],
                [""],
                ["a\x00.png"],
                ["a\nb.png"],
                ["a\\b.png"],
                ["dir/"],
            ],
            "more": [-1, "1", True, None, 2**31, [1]],
            "ms": [-1, "1", True, None, 1e13, [1]],
        },
        "ready": {
            "v": [0, 1, 3, True, "2", 2.0],
            "python": ["", "x" * 65, None, 3.11, "3.11 evil\n", "\u00e9"],
            "pid": [0, -1, True, 2**31, "1"],
            "packages": [
                None,
                [],
                "numpy",
                {f"p{i}": "1" for i in range(51)},
                {"": "1"},
                {"a b": "1"},
                {"numpy": 1},
                {"numpy": ""},
                {"numpy": "1" * 65},
                {"numpy": "1.0\n"},
                {"x" * 65: "1"},
            ],
        },
    }
    good_of = {"out": OUT, "done": DONE, "ready": READY}
    for name, fields in bad_values.items():
        for key, values in fields.items():
            for value in values:
                cases[f"{name}.{key}={value!r:.40}"] = {**good_of[name], key: value}
    return cases


@pytest.mark.parametrize("body", list(MALFORMED_BODIES.values()), ids=list(MALFORMED_BODIES))
def test_malformed_bodies_are_protocol_errors(body: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_one(frame_of_body(body), max_frame=1 << 20)


@pytest.mark.parametrize("obj", list(_variants().values()), ids=list(_variants()))
def test_malformed_messages_are_protocol_errors(obj: object) -> None:
    with pytest.raises(ProtocolError):
        decode_one(frame_of(obj))


def test_bad_lengths_fail_before_the_body_arrives() -> None:
    for header in (b"\x00\x00\x00\x00", struct.pack(">I", MAX_FRAME + 1), b"\xff\xff\xff\xff"):
        decoder = FrameDecoder()
        with pytest.raises(ProtocolError, match="frame length"):
            decoder.feed(header)
        assert decoder.buffered == 0
    decoder = FrameDecoder(max_frame=10)
    with pytest.raises(ProtocolError):
        decoder.feed(frame_of(OUT))  # a valid frame, but above this decoder's bound


def test_the_buffer_never_exceeds_one_frame() -> None:
    decoder = FrameDecoder(max_frame=1000)
    decoder.feed(struct.pack(">I", 1000))
    for _ in range(999):
        decoder.feed(b" ")
        assert decoder.buffered <= 1000 + 4
    with pytest.raises(ProtocolError):
        decoder.feed(b" " * 10_000)  # completes a frame of spaces (not JSON): refused, not buffered
    assert decoder.buffered == 0
    # One huge chunk of many frames is decoded in place, never copied into the buffer whole.
    decoder = FrameDecoder(max_frame=100)
    frames = encode({**OUT, "d": "x"}) * 10_000
    assert len(decoder.feed(frames + encode(OUT)[:10])) == 10_000
    assert decoder.buffered == 6


def test_after_an_error_the_decoder_stays_failed_and_reports_what_came_before() -> None:
    decoder = FrameDecoder()
    with pytest.raises(ProtocolError) as info:
        decoder.feed(encode(OUT) + encode(DONE) + frame_of_body(b"junk") + encode(OUT))
    assert info.value.decoded == (Output(7, "stdout", OUT["d"]), Done(7, "ok", 0, ("figure-1.png",), 1.25))
    assert decoder.failed
    with pytest.raises(ProtocolError, match="already failed"):
        decoder.feed(encode(OUT))


def test_eof_inside_a_frame_is_a_protocol_error() -> None:
    decoder = FrameDecoder()
    decoder.feed(encode(OUT)[:-1])
    with pytest.raises(ProtocolError, match="middle of a frame"):
        decoder.eof()
    decoder = FrameDecoder()
    decoder.feed(b"\x00\x00")
    with pytest.raises(ProtocolError):
        decoder.eof()


def test_fuzz_random_bytes_and_mutated_frames() -> None:
    rng = random.Random(20261130)
    valid = encode(READY) + encode(OUT) + encode(DONE) + encode({**DONE, "figures": ["a/b.png"], "ms": 0})
    outcomes = {"messages": 0, "errors": 0}
    for i in range(3000):
        if i % 3 == 0:
            data = rng.randbytes(rng.randrange(0, 400))
        elif i % 3 == 1:  # a valid stream with a few bytes changed: the length stays plausible
            buf = bytearray(valid)
            for _ in range(rng.randrange(1, 4)):
                buf[rng.randrange(len(buf))] = rng.randrange(256)
            data = bytes(buf)
        else:  # valid lengths around random (often almost-JSON) bodies
            body = bytearray(json.dumps(rng.choice([READY, OUT, DONE])).encode())
            for _ in range(rng.randrange(1, 3)):
                body[rng.randrange(len(body))] = rng.choice(b'{}[]",:0123456789tfn\\u ')
            data = frame_of_body(bytes(body))
        decoder = FrameDecoder(max_frame=rng.choice([64, 4096, MAX_FRAME]))
        pos = 0
        try:
            while pos < len(data):
                step = rng.randrange(1, 64)
                result = decoder.feed(data[pos : pos + step])
                assert isinstance(result, list)
                assert all(isinstance(m, Ready | Output | Done) for m in result)
                outcomes["messages"] += len(result)
                pos += step
                assert decoder.buffered <= decoder.max_frame + 4
        except ProtocolError:
            outcomes["errors"] += 1
    assert outcomes["messages"] > 100 and outcomes["errors"] > 1000, outcomes


def test_decoding_is_linear_in_the_frames_whole_or_split() -> None:
    """Ten times the frames take about ten times as long, fed whole or split mid-header (a decoder
    that re-reads what it holds would take a hundred). A ratio measured in one run, so a busy machine
    slows both sides alike; the absolute figures are the bench's (bench/kernel.py)."""

    def cost(count: int, split: bool) -> float:
        frames = [encode({**OUT, "d": f"line {i}\n"}) for i in range(count)]
        decoder = FrameDecoder()
        began = time.perf_counter()
        if split:
            for frame in frames:
                decoder.feed(frame[:3])
                decoder.feed(frame[3:])
        else:
            assert len(decoder.feed(b"".join(frames))) == count
        return time.perf_counter() - began

    for split in (False, True):
        small = min(cost(2_000, split) for _ in range(3))
        large = min(cost(20_000, split) for _ in range(3))
        assert large / small < 40, f"20,000 frames took {large / small:.0f}x 2,000 (split={split})"


def test_protocol_state_enforces_the_order() -> None:
    state = ProtocolState()
    with pytest.raises(RuntimeError):
        state.start(1)  # no ready yet
    with pytest.raises(ProtocolError, match="first message"):
        ProtocolState().accept(Output(1, "stdout", "x"))
    ready = Ready(1, "3.11.2", 1, {})
    assert state.accept(ready) is ready
    with pytest.raises(ProtocolError, match="no run is in flight"):
        state.accept(Output(1, "stdout", "early"))
    state.start(1)
    with pytest.raises(RuntimeError):
        state.start(2)  # one run at a time
    state.accept(Output(1, "stdout", "x"))
    state.accept(Output(1, "stderr", "y"))
    with pytest.raises(ProtocolError, match="during run 1"):
        state.accept(Output(2, "stdout", "z"))
    state.accept(Done(1, "ok", 0, (), 1.0))
    assert state.current is None
    with pytest.raises(ProtocolError, match="no run is in flight"):
        state.accept(Done(1, "ok", 0, (), 1.0))  # e.g. the real done after a forged one
    state.start(2)
    with pytest.raises(ProtocolError, match="second 'ready'"):
        state.accept(ready)
