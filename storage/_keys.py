"""Directory names derived from untrusted user and chat ids.

A key is a readable slug plus a hash of the exact id: the slug helps a human find a folder, the
hash makes keys distinct and fixed-length whatever the id contains (`..`, `/`, NUL, 10 KB, look-alike
unicode, NFC vs NFD all give different, safe names). Nothing is normalised before hashing: two ids that
differ in any code point are two sessions.
"""

from __future__ import annotations

import hashlib
import re

_SLUG_MAX = 32
_HASH_HEX = 24  # 96 bits: collisions are not a practical concern for ids we did not choose
_NOT_SLUG = re.compile(r"[^A-Za-z0-9_-]")


def id_key(value: str) -> str:
    """`<slug>-<24 hex of sha256(value)>`, at most 57 ASCII characters from [A-Za-z0-9_-]."""
    if not isinstance(value, str):
        raise TypeError(f"ids must be str, not {type(value).__name__}")
    digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:_HASH_HEX]
    slug = _NOT_SLUG.sub("_", value[:_SLUG_MAX]) or "empty"
    # A leading '-' would read as an option when an admin pastes the name into a shell command.
    if slug.startswith("-"):
        slug = "_" + slug[1:]
    return f"{slug}-{digest}"


def db_text(value: str) -> str:
    """The id as stored in SQLite, which cannot hold lone surrogates; other ids are stored exactly.

    Rows are found by key (hash of the exact id), so this lossy form is only for display and SUMs.
    """
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return value.encode("utf-8", "surrogatepass").decode("utf-8", "backslashreplace")
    return value
