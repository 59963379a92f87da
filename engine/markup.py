"""Text written into markdown so that Open WebUI shows it as written: notes that quote file names chosen
by sandboxed code, error messages, code shown literally.

What Open WebUI 0.12's renderer reads beyond CommonMark (checked in its frontend bundle and, for each
rule below, in Chromium by tests/e2e/test_browser.py):

* HTML entities are shown as written (`&lt;` stays `&lt;`), so `&` needs no escape and entities are
  no escape either: a backslash escape is the one way to write a markdown character as itself.
* Its KaTeX extension reads `$...$`, `\\(...\\)` and `\\[...\\]` (the closer followed by a space,
  punctuation or the end) as math, even where `\\(` and `\\[` were meant as escaped brackets.
* The same extension cuts a paragraph before `\\[`, `\\b` or `$$` that follows a space or punctuation
  (a backslash included), and joins the pieces with a line break: `C:\\\\bin` would show as `C:`, a
  break, `\\bin`.

Where a backslash escape would be read as one of these, an invisible WORD JOINER (U+2060) goes in
between instead: it is not a space or punctuation, so it breaks the pattern and shows nothing.
"""

from __future__ import annotations

import re
import unicodedata

from .grammar import BACKTICK_RUNS, MOUNT

__all__ = [
    "JOINER",
    "backtick_fence",
    "code_span",
    "details",
    "details_as_read",
    "escape_text",
    "mention",
    "visible",
]

JOINER = "\u2060"

# What markdown or Open WebUI reads in a line of text, and how each is written to mean itself: a
# backslash escape, except for brackets (see the module's docstring): `[` gets a joiner before its
# escape (no paragraph cut), `]` one after (never the closer of KaTeX's `\[ ... \]`). In a link's text
# marked takes the backslashes off brackets before reading it, so there a `[` must not start what Open
# WebUI reads as a citation (`[1]`: a joiner after the `[`) or a footnote (`[^1]`: `^` is escaped). A
# backslash is escaped, and kept apart from a `b` after it (`\b`: the cut). Autolinks (`http://`,
# `www.`, `a@b.example`) are broken with an escaped `:`, `.` or `@`.
_ESCAPED = str.maketrans(
    {**{c: "\\" + c for c in "\\`*_{}<>#+!|~$@^"}, "[": JOINER + "\\[", "]": "\\]" + JOINER}
)
_CITATION = re.compile(r"\[(?=\d)")
_WWW = re.compile(r"(www)\.", re.IGNORECASE)
# At the start of a line: a list item (`- x`, `1. x`, `1) x`) or a thematic break (`---`). A text may
# begin a line wherever it is used, so its start is written so that it is none of them.
_LIST_NUMBER = re.compile(r"(\d{1,9})([.)])(?=\s|$)")


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
    """Any text (an error message quoting a file name, a link's text) as one line of markdown that Open
    WebUI shows as that text: no HTML, link, image, math, emphasis, code or line break. Control
    characters are shown as escapes (`visible`) and runs of spaces folded into one (a newline in a name
    used as a link's text must not break the link apart). The characters shown are the text's own, with
    invisible word joiners where a backslash escape would not do (around brackets, between a backslash
    and a `b`)."""
    text = " ".join(visible(text).split())
    written = text.translate(_ESCAPED)
    if "[" in text:
        written = _CITATION.sub("[" + JOINER, written)
    if "\\b" in text:
        written = written.replace("\\\\b", "\\\\" + JOINER + "b")
    if "//" in text:
        written = written.replace("://", "\\://")
    if "www" in text.lower():
        written = _WWW.sub(r"\1\\.", written)
    if written.startswith(JOINER + "\\["):
        # First in its paragraph, the `\[` would be the paragraph's second character, which the cut
        # takes whatever precedes it: one more joiner.
        written = JOINER + written
    elif written.startswith("-"):
        written = "\\" + written
    elif written[:1].isdigit():
        number = _LIST_NUMBER.match(written)
        if number:
            mark = "\\." if number.group(2) == "." else JOINER + ")"
            written = number.group(1) + mark + written[number.end() :]
    return written


def backtick_fence(text: str, minimum: int = 1) -> str:
    """A run of backticks longer than any in `text` (and at least `minimum` long): as a code span's or a
    fenced block's delimiter, nothing in `text` can close it early."""
    longest = max(map(len, BACKTICK_RUNS.findall(text)), default=0)
    return "`" * max(minimum, longest + 1)


# Open WebUI replaces `{{user}}`, `{{char}}` and `{{VIDEO_FILE_ID_<id>}}` (a video of that file) or
# `{{HTML_FILE_ID_<id>}}` (the file shown as a page) in a message before it reads the markdown, except
# between backticks, which it pairs up without knowing escapes or fences: in code too, a joiner keeps
# the braces apart. (Elsewhere `escape_text` escapes each brace.)
_TOKEN = re.compile(r"(?<=\{)(?=\{(?i:user\}\}|char\}\}|VIDEO_FILE_ID_|HTML_FILE_ID_))")
# Inside a code span nothing is markup, but Open WebUI's paragraph cut (see the module's docstring) still
# happens, and turns into a space in the code: a joiner goes before each place it could.
_CUT = re.compile(r"(?=\\[\[b])|(?<=\$)(?=\$)|" + _TOKEN.pattern)


def code_span(text: str) -> str:
    """Text shown literally: an inline code span, fenced with more backticks than the text holds."""
    text = _CUT.sub(JOINER, visible(text))
    fence = backtick_fence(text)
    pad = " " if text.startswith("`") or text.endswith("`") or not text.strip() else ""
    return f"{fence}{pad}{text}{pad}{fence}"


# A name our notes may show bare, for the link rewriter to turn into a link as a whole: nothing that
# markdown or HTML would read, and no trailing punctuation, which the rewriter leaves out of a path.
_PLAIN_COMPONENT = re.compile(r"[\w.,+=@%-]*[\w+=@%-]")
# ... nor what would still be read in those characters if the name stays text (a file that no longer
# exists is not linked): an autolink (`www.`, an e-mail address) or emphasis (an underscore that is not
# between two letters or digits, as in `__init__.py`).
_READ_BARE = re.compile(
    r"www\.|@[A-Za-z0-9_-]+\.[A-Za-z0-9_-]*[A-Za-z0-9]|(?:^|\W)_|_(?:\W|$)", re.IGNORECASE
)


def mention(path: str) -> str:
    """How our own notes name a session file (its name was chosen by sandboxed code): the bare
    `/mnt/data/...` path when it is plain, so it becomes a link; otherwise a code span that shows the
    name literally, never as markup."""
    parts = path.split("/")
    if path.isprintable() and all(map(_PLAIN_COMPONENT.fullmatch, parts)) and not _READ_BARE.search(path):
        return MOUNT + path
    return code_span(MOUNT + path)


# Open WebUI's <details> extension finds where its block ends by counting `<details` and `</details>` in
# the raw text, shows the summary as plain text, and decodes HTML entities in the body before reading it
# as markdown: `&#91;x&#93;(https://e.example)` there would be a link, `&#96;&#96;&#96;` the end of a code
# block.
_DETAILS_TAG = re.compile(r"<(?=/?(?:details|summary))", re.IGNORECASE)


def details(summary: str, body: str) -> str:
    """A collapsible block: `summary` (one line of plain text, not markdown) and `body` (markdown) are
    shown as written, whatever they hold (a failed run's summary quotes its error): entities in the body
    are written so that decoding them gives the body back; a tag of the block's own in either, and Open
    WebUI's `{{...}}` tokens (replaced in the whole message before it is read), are broken apart by a
    joiner."""
    summary = _TOKEN.sub(JOINER, _DETAILS_TAG.sub("<" + JOINER, " ".join(visible(summary).split())))
    body = _TOKEN.sub(JOINER, _DETAILS_TAG.sub("<" + JOINER, body.replace("&", "&amp;")))
    return f"<details>\n<summary>{summary}</summary>\n\n{body}\n</details>"


_BODY = re.compile(r"(<details>\n<summary>[^\n]*</summary>\n\n)(.*?)(\n</details>)", re.DOTALL)


def details_as_read(text: str) -> str:
    """`text` with the body of each block `details` wrote as the user reads it (entities decoded, which
    gives back the body as it was given): what the model reads of its earlier answers."""
    if "<details>" not in text:
        return text
    return _BODY.sub(lambda block: block[1] + block[2].replace("&amp;", "&") + block[3], text)
