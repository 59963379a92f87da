"""The file part of a multipart/form-data body, read as it streams (the upload link's POST).

The sender is anyone holding the link, so the body is hostile: the boundary is validated, headers are
bounded, parts other than the file are skipped within a bound, and a body that ends before the file's
closing delimiter is refused (the file is then incomplete, and nothing is saved). Data is handed on
as it comes, holding back only what could be the start of the delimiter, so memory stays bounded
whatever the file's size.
"""

from __future__ import annotations

import re

__all__ = ["MultipartError", "MultipartFile", "boundary_of"]

# RFC 2046: 1 to 70 characters of this set (we also take the common quoted form).
_BOUNDARY = re.compile(r"[0-9A-Za-z'()+_,./:=?-]{1,70}")
_MAX_HEADERS = 16 * 1024  # one part's header block
_MAX_SKIPPED = 1024 * 1024  # bytes of other fields before the file
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
        self._skipped = 0
        self._in_file = False
        self.filename: str | None = None
        self.done = False

    def feed(self, chunk: bytes) -> list[bytes]:
        if self.done:
            return []
        self._buffer += chunk
        out: list[bytes] = []
        while True:
            if self._state == "preamble":
                at = self._buffer.find(self._delimiter)
                if at < 0:
                    self._skip(len(self._buffer) - len(self._delimiter))
                    return out
                self._buffer = self._buffer[at + len(self._delimiter) :]
                self._state = "after_delimiter"
            if self._state == "after_delimiter":
                if len(self._buffer) < 2:
                    return out
                if self._buffer.startswith(b"--"):
                    raise MultipartError("The form has no field named file: nothing was uploaded.")
                end = self._buffer.find(b"\r\n")
                if end < 0:
                    self._skip_bounded(len(self._buffer), "a line after a delimiter")
                    return out
                if self._buffer[:end].strip(b" \t"):
                    raise MultipartError("The multipart body is malformed (text after a delimiter).")
                self._buffer = self._buffer[end + 2 :]
                self._state = "headers"
            if self._state == "headers":
                end = self._buffer.find(b"\r\n\r\n")
                if end < 0:
                    if len(self._buffer) > _MAX_HEADERS:
                        raise MultipartError("A part of the multipart body has too many headers.")
                    return out
                headers, self._buffer = self._buffer[:end], self._buffer[end + 4 :]
                name, filename = _disposition(headers)
                self._in_file = name == _FIELD
                if self._in_file:
                    self.filename = filename
                self._state = "body"
            if self._state == "body":
                at = self._buffer.find(self._delimiter)
                if at < 0:
                    # Keep what could be the start of a delimiter split across chunks.
                    keep = len(self._delimiter) - 1
                    ready = len(self._buffer) - keep
                    if ready > 0:
                        self._take(self._buffer[:ready], out)
                        self._buffer = self._buffer[ready:]
                    return out
                self._take(self._buffer[:at], out)
                self._buffer = self._buffer[at + len(self._delimiter) :]
                if self._in_file:
                    self.done = True
                    self._buffer = b""
                    return out
                self._state = "after_delimiter"

    def _take(self, data: bytes, out: list[bytes]) -> None:
        if not data:
            return
        if self._in_file:
            out.append(data)
        else:
            self._skip(len(data))

    def _skip(self, count: int) -> None:
        if count <= 0:
            return
        self._skipped += count
        if self._skipped > _MAX_SKIPPED:
            raise MultipartError("The form's first megabyte holds no field named file: nothing was uploaded.")
        if self._state == "preamble":
            self._buffer = self._buffer[count:]

    def _skip_bounded(self, size: int, what: str) -> None:
        if size > _MAX_HEADERS:
            raise MultipartError(f"The multipart body is malformed ({what} is too long).")


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
