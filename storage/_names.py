"""Validation of relative paths given by callers, and the safe file names we make up ourselves."""

from __future__ import annotations

import mimetypes
import re
import unicodedata
from collections.abc import Mapping
from types import MappingProxyType

from .errors import InvalidPath

MAX_DEPTH = 32  # path components; deeper content is removed by reconcile
MAX_NAME_BYTES = 255  # Linux NAME_MAX
# A whole relative path, in UTF-8: within what every index backend can key (PostgreSQL's btree entries
# stop near 2.7 KB); longer content is removed by reconcile, like content too deep.
MAX_PATH_BYTES = 2048

_PUBLISH_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_PUBLISH_NAME_MAX = 100
_EXT_MAX = 16
_EXT = re.compile(rf"^(.+?)((?:\.tar)?\.[A-Za-z0-9]{{1,{_EXT_MAX}}})$")

# Types the web server may render inline without any risk of script: plain raster images and plain
# audio/video containers. Anything else it would render inline (SVG, XML-based or unknown image
# types) gets `.txt` appended so it is downloaded instead. The one allowlist of passive images: each
# with the extension a copy of that type is stored under where a server guesses the type from a name.
PASSIVE_IMAGE_TYPES: Mapping[str, str] = MappingProxyType(
    {
        "image/png": ".png",
        "image/jpeg": ".jpg",
        "image/pjpeg": ".jpg",
        "image/gif": ".gif",
        "image/webp": ".webp",
        "image/bmp": ".bmp",
        "image/x-ms-bmp": ".bmp",
        "image/avif": ".avif",
        "image/x-icon": ".ico",
        "image/vnd.microsoft.icon": ".ico",
    }
)
PASSIVE_MEDIA_TYPES = frozenset(PASSIVE_IMAGE_TYPES) | frozenset(
    {
        "audio/mpeg",
        "audio/mp3",
        "audio/wav",
        "audio/x-wav",
        "audio/wave",
        "audio/vnd.wave",
        "audio/ogg",
        "audio/flac",
        "audio/x-flac",
        "audio/webm",
        "audio/mp4",
        "video/webm",
        "video/mp4",
        "video/ogg",
    }
)
_INLINE_PREFIXES = ("image/", "audio/", "video/")
# The built-in table alone, so a host whose /etc/mime.types lacks an entry cannot hide an SVG.
_BUILTIN_TYPES = mimetypes.MimeTypes()


def split_path(path: str) -> tuple[str, ...]:
    """Validate a caller's relative POSIX path and return its components.

    `.` components are dropped; absolute paths, `..`, empty components (`a//b`, trailing `/`), NUL,
    names that cannot be encoded as UTF-8, over-long names, paths deeper than MAX_DEPTH and paths
    longer than MAX_PATH_BYTES are refused.
    """
    if not isinstance(path, str):
        raise InvalidPath(f"a path must be a str, not {type(path).__name__}")
    if path == "":
        raise InvalidPath("the path is empty")
    if "\x00" in path:
        raise InvalidPath(f"the path {path!r} contains a NUL character")
    if path.startswith("/"):
        raise InvalidPath(f"the path {path!r} is absolute; give it relative to the session folder")
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidPath(f"the path {path!r} is not valid text") from None
    parts: list[str] = []
    for part in path.split("/"):
        if part == "":
            raise InvalidPath(f"the path {path!r} has an empty component")
        if part == ".":
            continue
        if part == "..":
            raise InvalidPath(f"the path {path!r} goes up with '..'")
        if len(part.encode("utf-8")) > MAX_NAME_BYTES:
            raise InvalidPath(f"a name in {path!r} is longer than {MAX_NAME_BYTES} bytes")
        parts.append(part)
    if not parts:
        raise InvalidPath(f"the path {path!r} names the session folder itself, not a file")
    if len(parts) > MAX_DEPTH:
        raise InvalidPath(f"the path {path!r} is deeper than {MAX_DEPTH} levels")
    if len("/".join(parts).encode("utf-8")) > MAX_PATH_BYTES:
        raise InvalidPath(f"the path {path[:80]!r}... is longer than {MAX_PATH_BYTES} bytes")
    return tuple(parts)


def is_utf8(name: str) -> bool:
    """Whether a name read from disk is valid UTF-8 (no undecodable bytes held as surrogate escapes)."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def display(name: str) -> str:
    """A name read from disk, with undecodable bytes (surrogate escapes) shown as \\xNN."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def attachment_name(name: str) -> str:
    """A safe single-component name for an uploaded file, keeping unicode and the extension.

    Only the last component of whatever the client sent is kept (`C:\\x\\a.csv` -> `a.csv`); control
    characters become `_`; hidden or dot-only names get a visible prefix; the result fits NAME_MAX with
    room for a ` (NN)` suffix.
    """
    if not isinstance(name, str):
        raise InvalidPath(f"a file name must be a str, not {type(name).__name__}")
    name = name.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    name = re.split(r"[/\\]", name)[-1]
    name = "".join("_" if unicodedata.category(c) in ("Cc", "Cf", "Cs", "Co", "Cn") else c for c in name)
    name = name.strip()
    if not name.strip(". "):
        name = "file"
    if name.startswith("."):
        name = "_" + name[1:]
    return _fit(name, MAX_NAME_BYTES - 16)


def numbered(name: str, n: int) -> str:
    """`a.csv`, 2 -> `a (2).csv`; `archive.tar.gz` -> `archive (2).tar.gz`."""
    stem, ext = split_ext(name)
    return f"{stem} ({n}){ext}"


def split_ext(name: str) -> tuple[str, str]:
    """Split off the extension, treating `.tar.gz`-style double extensions as one."""
    match = _EXT.match(name)
    if not match:
        return name, ""
    return match.group(1), match.group(2)


def publish_name(path: str) -> tuple[str, str | None]:
    """The name a published copy gets, and its guessed MIME type.

    The web server puts the name unescaped in a Content-Disposition header, so only [A-Za-z0-9._-]
    survive. It renders image/audio/video inline, so a type outside the passive allowlist (SVG, ...)
    gets `.txt` appended and is downloaded as text instead of running in the site's origin.
    """
    base = path.rsplit("/", 1)[-1]
    name = _PUBLISH_UNSAFE.sub("_", base)
    if name.startswith("."):
        name = "_" + name[1:]
    stem, ext = split_ext(name)
    if not stem.strip("._-"):
        # Nothing readable left (e.g. a name written in another script): keep only the extension.
        stem = "file"
    name = _fit(stem + ext, _PUBLISH_NAME_MAX)
    kind = _guess(name)
    if _renders_actively(name, kind):
        name += ".txt"
        kind = "text/plain"
    return name, kind


def is_passive_image(kind: str | None) -> bool:
    return kind in PASSIVE_IMAGE_TYPES


def _guess(name: str) -> str | None:
    return mimetypes.guess_type(name, strict=False)[0]


def _renders_actively(name: str, kind: str | None) -> bool:
    # Check both the process-wide table (what the web server in this process will use) and the
    # built-in one; either saying "inline but not passive" is enough.
    builtin = _BUILTIN_TYPES.guess_type(name, strict=False)[0]
    for guess in (kind, builtin):
        if guess and guess.startswith(_INLINE_PREFIXES) and guess not in PASSIVE_MEDIA_TYPES:
            return True
    return False


def _fit(name: str, max_bytes: int) -> str:
    """Shorten a name to max_bytes of UTF-8, keeping its extension."""
    if len(name.encode("utf-8")) <= max_bytes:
        return name
    stem, ext = split_ext(name)
    if len(ext.encode("utf-8")) > max_bytes // 2:
        stem, ext = name, ""
    budget = max_bytes - len(ext.encode("utf-8"))
    stem = stem.encode("utf-8")[:budget].decode("utf-8", "ignore")
    return stem + ext
