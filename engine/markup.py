"""Text written into markdown so that it means nothing else: notes that quote file names chosen by
sandboxed code, error messages, code shown literally."""

from __future__ import annotations

import re
import unicodedata

from .grammar import BACKTICK_RUNS, MOUNT

__all__ = ["backtick_fence", "code_span", "escape_text", "mention", "visible"]

# Characters that would change the meaning of link text in markdown or HTML.
_LABEL_ESCAPES = str.maketrans(
    {"&": "&amp;", "<": "&lt;", ">": "&gt;", **{c: "\\" + c for c in "\\`*_{}[]()#+!|~"}}
)


def visible(text: str) -> str:
    """Control and format characters (newlines, bidi overrides such as U+202E that make `txt.exe` show
    as `exe.txt`, zero-width characters) written as escapes, so a name shows what it really is."""
    if text.isprintable():
        return text
    return "".join(
        c.encode("unicode_escape").decode("ascii") if c != " " and unicodedata.category(c)[0] in "CZ" else c
        for c in text
    )


def escape_text(text: str) -> str:
    """Any text (e.g. an error message quoting a file name) as one line of markdown that means nothing:
    no HTML, no links, no emphasis, no line breaks. (Whitespace is folded: a newline in a name used as a
    link's text must not break the link apart.)"""
    return " ".join(visible(text).translate(_LABEL_ESCAPES).split())


def backtick_fence(text: str, minimum: int = 1) -> str:
    """A run of backticks longer than any in `text` (and at least `minimum` long): as a code span's or a
    fenced block's delimiter, nothing in `text` can close it early."""
    longest = max(map(len, BACKTICK_RUNS.findall(text)), default=0)
    return "`" * max(minimum, longest + 1)


def code_span(text: str) -> str:
    """Text shown literally: an inline code span, fenced with more backticks than the text holds."""
    text = visible(text)
    fence = backtick_fence(text)
    pad = " " if text.startswith("`") or text.endswith("`") or not text.strip() else ""
    return f"{fence}{pad}{text}{pad}{fence}"


# A name our notes may show bare, for the link rewriter to turn into a link as a whole: nothing that
# markdown or HTML would read, and no trailing punctuation, which the rewriter leaves out of a path.
_PLAIN_COMPONENT = re.compile(r"[\w.,+=@%-]*[\w+=@%-]")


def mention(path: str) -> str:
    """How our own notes name a session file (its name was chosen by sandboxed code): the bare
    `/mnt/data/...` path when it is plain, so it becomes a link; otherwise a code span that shows the
    name literally, never as markup."""
    if path.isprintable() and all(_PLAIN_COMPONENT.fullmatch(part) for part in path.split("/")):
        return MOUNT + path
    return code_span(MOUNT + path)
