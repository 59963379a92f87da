"""The upload link's multipart reader: whatever the chunking, the file's bytes come out exactly; a hostile
or truncated body is refused with a sentence; memory stays bounded."""

from __future__ import annotations

import random
import time

import pytest

from webui.multipart import MultipartError, MultipartFile, boundary_of

BOUNDARY = b"----cs-test-boundary-7f3a"


def body(data: bytes, *, before: bytes = b"", filename: str = "export.csv", end: bool = True) -> bytes:
    head = b"--" + BOUNDARY + b"\r\n"
    extra = b""
    if before:
        extra = head + b'Content-Disposition: form-data; name="note"\r\n\r\n' + before + b"\r\n"
    part = (
        head
        + f'Content-Disposition: form-data; name="file"; filename="{filename}"\r\n'.encode()
        + b"Content-Type: text/csv\r\n\r\n"
        + data
    )
    return extra + part + (b"\r\n--" + BOUNDARY + b"--\r\n" if end else b"")


def read(raw: bytes, sizes: list[int]) -> tuple[bytes, MultipartFile]:
    parser = MultipartFile(BOUNDARY)
    out, at, i = [], 0, 0
    while at < len(raw):
        size = sizes[i % len(sizes)]
        out.extend(parser.feed(raw[at : at + size]))
        at += size
        i += 1
    return b"".join(out), parser


@pytest.mark.parametrize("seed", range(20))
def test_any_chunking_gives_the_exact_bytes(seed: int):
    rng = random.Random(seed)
    # Data that holds near-delimiters: a CRLF, dashes, the boundary without its CRLF.
    data = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 5000)))
    data += b"\r\n--" + BOUNDARY[:-1] + b"x" + b"--" + BOUNDARY + b"\r\n-"
    sizes = [rng.randrange(1, 97) for _ in range(7)]
    got, parser = read(body(data, before=b"hello"), sizes)
    assert got == data and parser.done and parser.filename == "export.csv"


def test_a_body_that_ends_early_is_not_done():
    got, parser = read(body(b"abc" * 1000, end=False), [100])
    assert not parser.done  # the caller refuses it: the file may be incomplete
    assert len(got) < 3000


def test_a_form_without_a_file_field_is_refused():
    raw = (
        b"--"
        + BOUNDARY
        + b'\r\nContent-Disposition: form-data; name="x"\r\n\r\n1\r\n--'
        + BOUNDARY
        + b"--\r\n"
    )
    with pytest.raises(MultipartError, match="no field named file"):
        read(raw, [7])


def test_endless_headers_are_refused():
    raw = b"--" + BOUNDARY + b"\r\n" + b"X-A: " + b"a" * 20000
    with pytest.raises(MultipartError, match="too many headers"):
        read(raw, [1000])


def test_a_header_block_over_16_kib_is_refused_even_when_it_arrives_whole():
    raw = body(b"data").replace(b"Content-Type: text/csv", b"X-A: " + b"a" * 200 * 1024)
    for chunks in ([len(raw)], [65536], [1000]):
        with pytest.raises(MultipartError, match="too many headers"):
            read(raw, chunks)


def test_a_long_line_after_a_delimiter_is_refused_even_when_it_arrives_whole():
    raw = body(b"data").replace(b"--" + BOUNDARY + b"\r\n", b"--" + BOUNDARY + b" " * 20000 + b"\r\n", 1)
    with pytest.raises(MultipartError, match="too long"):
        read(raw, [len(raw)])


EMPTY_PART = b"--" + BOUNDARY + b'\r\nContent-Disposition: form-data; name="x"\r\n\r\n\r\n'


def _empty_parts(size: int) -> bytes:
    return EMPTY_PART * (size // len(EMPTY_PART))


@pytest.mark.parametrize("size", [2 << 20, 16 << 20])
def test_empty_fields_before_the_file_count_toward_the_megabyte(size: int):
    # Their headers and delimiters are bytes before the file as much as a field's value is.
    with pytest.raises(MultipartError, match="first megabyte"):
        read(_empty_parts(size) + body(b"data"), [65536])


def test_fields_within_the_megabyte_are_read_in_linear_time():
    # 18,000 small parts in one piece, against the same parts fed one by one (the floor: nothing held
    # back to copy). Copying the rest of the piece after each part made the first about 10x the floor.
    raw = _empty_parts(900 * 1024) + body(b"data")

    def cpu(sizes: list[int]) -> float:
        started = time.process_time()
        got, parser = read(raw, sizes)
        assert got == b"data" and parser.done
        return time.process_time() - started

    floor = cpu([len(EMPTY_PART)])
    assert cpu([len(raw)]) < 3 * floor + 0.01, floor


def test_a_megabyte_of_other_fields_is_refused():
    with pytest.raises(MultipartError, match="first megabyte"):
        read(body(b"x", before=b"y" * (2 << 20)), [65536])


def test_memory_stays_bounded_while_a_big_file_streams():
    parser = MultipartFile(BOUNDARY)
    parser.feed(body(b"", end=False))
    for _ in range(100):
        assert sum(map(len, parser.feed(b"z" * 65536))) >= 65536 - 64


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("multipart/form-data; boundary=abc", b"abc"),
        ('multipart/form-data; charset=utf-8; boundary="a b"', None),
        ('multipart/form-data; boundary="quoted-1"', b"quoted-1"),
        ("application/json", None),
        ("multipart/form-data", None),
        ("multipart/form-data; boundary=" + "x" * 71, None),
    ],
)
def test_the_boundary_is_validated(header: str, expected: bytes | None):
    if expected is None:
        with pytest.raises(MultipartError):
            boundary_of(header)
    else:
        assert boundary_of(header) == expected
