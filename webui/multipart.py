"""The file part of a multipart/form-data body, read as it streams (the upload link's POST).

The sender is anyone holding the link, so the body is hostile: the boundary is validated; each part's
header block is at most 16 KiB, whether it arrives in pieces or whole; everything before the file's
data (a preamble, other fields with their headers, delimiters, the file part's own headers) is at
most 1 MiB, however it is cut into parts; and a body that ends before the file's closing delimiter is
refused (the file is then incomplete, and nothing is saved). Data is handed on as it comes, holding
back only what could be the start of the delimiter, so memory stays bounded whatever the file's size,
and each byte is looked at a bounded number of times (the reader runs on the event loop).
"""

from __future__ import annotations

import re

__all__ = ["MultipartError", "MultipartFile", "boundary_of"]

# RFC 2046: 1 to 70 characters of this set (we also take the common quoted form).
_BOUNDARY = re.compile(r"[0-9A-Za-z'()+_,./:=?-]{1,70}")
_MAX_HEADERS = 16 * 1024  # one part's header block (and a line after a delimiter)
_MAX_SKIPPED = 1024 * 1024  # bytes of the body before the file's data
_FIELD = "file"


class MultipartError(ValueError):
    """The body is not the multipart form an upload link takes; the message is the sentence."""


def boundary_of(content_type: str) -> bytes:
    """The boundary named in a Content-Type header, or MultipartError."""
    kind, _, params = content_type.partition(";")
    if kind.strip().lower() != "multipart/form-data":
        raise MultipartError(
            "Send the file as multipart/form-data, in a field named file (for example: "
            "curl -F file=@export.csv <link>)."
        )
    for param in params.split(";"):
        key, _, value = param.strip().partition("=")
        if key.strip().lower() == "boundary":
            value = value.strip()
            if len(value) >= 2 and value[0] == value[-1] == '"':
                value = value[1:-1]
            if _BOUNDARY.fullmatch(value):
                return value.encode("ascii")
    raise MultipartError("The multipart/form-data body names no valid boundary.")


class MultipartFile:
    """Feed the body's bytes in order (`feed`); it returns the file's data found so far. `done` is True
    once the file part ended with its delimiter; `filename` is the name the sender gave, if any."""

    def __init__(self, boundary: bytes) -> None:
        self._delimiter = b"\r\n--" + boundary
        self._buffer = b"\r\n"  # the first delimiter has no CRLF before it: make it look like the others
        self._state = "preamble"
        self._skipped = 0  # bytes of the body before the file's data
        self._searched = 0  # of an unterminated header block, how far it was searched already
        self._in_file = False
        self.filename: str | None = None
        self.done = False

    def feed(self, chunk: bytes) -> list[bytes]:
        if self.done:
            return []
        # What is held back from the last feed is short (at most a header block): join, then read on
        # by position, so that a chunk of many small parts is not copied again for each of them.
        data = self._buffer + chunk if self._buffer else chunk
        out: list[bytes] = []
        at = self._read(data, out)
        self._buffer = b"" if self.done else data[at:]
        return out

    def _read(self, data: bytes, out: list[bytes]) -> int:
        """Read `data` from the start: the file's bytes into `out`; returns where reading stopped."""
        delimiter, pos = self._delimiter, 0
        while True:
            if self._state == "preamble":
                at = data.find(delimiter, pos)
                if at < 0:
                    # Keep what could be the start of a delimiter split across chunks.
                    rest = max(pos, len(data) - len(delimiter) + 1)
                    self._skip(rest - pos)
                    return rest
                self._skip(at + len(delimiter) - pos)
                pos = at + len(delimiter)
                self._state = "after_delimiter"
            if self._state == "after_delimiter":
                if len(data) - pos < 2:
                    return pos
                if data.startswith(b"--", pos):
                    raise MultipartError("The form has no field named file: nothing was uploaded.")
                end = data.find(b"\r\n", pos)
                if (end < 0 and len(data) - pos > _MAX_HEADERS) or end - pos > _MAX_HEADERS:
                    raise MultipartError(
                        "The multipart body is malformed (a line after a delimiter is too long)."
                    )
                if end < 0:
                    return pos
                if data[pos:end].strip(b" \t"):
                    raise MultipartError("The multipart body is malformed (text after a delimiter).")
                self._skip(end + 2 - pos)
                pos = end + 2
                self._state, self._searched = "headers", 0
            if self._state == "headers":
                # An unterminated block arrives in pieces: search only what is new (and 3 bytes before).
                end = data.find(b"\r\n\r\n", max(pos, pos + self._searched - 3))
                if (end < 0 and len(data) - pos > _MAX_HEADERS) or end - pos > _MAX_HEADERS:
                    raise MultipartError("A part of the multipart body has too many headers.")
                if end < 0:
                    self._searched = len(data) - pos
                    return pos
                name, filename = _disposition(data[pos:end])
                self._skip(end + 4 - pos)
                pos = end + 4
                self._in_file = name == _FIELD
                if self._in_file:
                    self.filename = filename
                self._state = "body"
            if self._state == "body":
                at = data.find(delimiter, pos)
                if at < 0:
                    ready = max(pos, len(data) - len(delimiter) + 1)
                    self._take(data[pos:ready], out)
                    return ready
                self._take(data[pos:at], out)
                pos = at + len(delimiter)
                if self._in_file:
                    self.done = True
                    return pos
                self._state = "after_delimiter"

    def _take(self, data: bytes, out: list[bytes]) -> None:
        if not data:
            return
        if self._in_file:
            out.append(data)
        else:
            self._skip(len(data))

    def _skip(self, count: int) -> None:
        """`count` more bytes of the body passed before the file's data."""
        self._skipped += count
        if self._skipped > _MAX_SKIPPED:
            raise MultipartError("The form's first megabyte holds no field named file: nothing was uploaded.")


def _disposition(headers: bytes) -> tuple[str | None, str | None]:
    """(name, filename) from a part's Content-Disposition header."""
    text = headers.decode("utf-8", "replace")
    for line in text.split("\r\n"):
        key, _, value = line.partition(":")
        if key.strip().lower() != "content-disposition":
            continue
        params: dict[str, str] = {}
        for match in re.finditer(r';\s*([A-Za-z*]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^;]*)', value):
            raw = match.group(2).strip()
            if raw.startswith('"') and raw.endswith('"') and len(raw) >= 2:
                raw = re.sub(r"\\(.)", r"\1", raw[1:-1])
            params[match.group(1).lower()] = raw
        return params.get("name"), params.get("filename")
    return None, None
