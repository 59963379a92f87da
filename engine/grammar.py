"""The markdown a link scan reads: how far each construct may reach, and the regexes that read them.

The bounds are part of the grammar (a link text longer than MAX_LABEL is not a link text): beyond them the
text is read as if the construct were not there. So every decision about a stretch of text depends on at
most a few KiB after it, which is what lets a streamed answer be rewritten as it comes (engine/scan.py,
engine/streaming.py).
"""

from __future__ import annotations

import re

__all__ = [
    "AUTO",
    "BACKTICK_RUNS",
    "BREAK_PREFIX",
    "HTML",
    "IMAGE",
    "LINK",
    "LINK_TAIL",
    "MAX_CODE_SPAN",
    "MAX_DESTINATION",
    "MAX_LABEL",
    "MAX_PATH",
    "MAX_TAG",
    "MAX_URL",
    "MOUNT",
    "NOT_BEFORE_PATH",
    "PARAGRAPH_BREAK",
    "PATH_RUN_DOUBT",
    "PATH_SPLIT",
    "PATH_STOP",
    "PATH_TOKEN",
    "SANDBOX",
    "SINGLE_LINE",
    "TOKEN",
    "TOKEN_IN_LINK_TEXT",
    "TRAILING_PUNCTUATION",
    "PathRun",
    "Ref",
    "What",
    "doubt_or_other_path",
]

MOUNT = "/mnt/data/"
SANDBOX = "sandbox:"

# How far one construct may reach, in characters. Beyond these, the text is read as if the construct were
# not there (a `[` further back than MAX_LABEL is a plain `[`), with one exception that errs on the safe
# side: see MAX_CODE_SPAN.
MAX_LABEL = 1000  # a link's text, `[` to `]` (CommonMark bounds reference labels at 999)
MAX_DESTINATION = 2048  # `(` to `)`: a link's destination and title
# Backticks whose closing run is further away than this, in a paragraph that goes on past that point, make
# the rest of the code span's paragraph (up to a closing run, if one comes) code: nothing in it is
# rewritten. CommonMark would call it code if the run closes, prose if not; holding a streamed answer
# back until the end of the paragraph to tell is what this bound avoids.
MAX_CODE_SPAN = 4096
MAX_TAG = 1024  # an HTML tag or autolink, `<` to `>`
MAX_PATH = 2048  # the characters of a path after /mnt/data/; longer is not a file name the store has
MAX_URL = 2048  # the part of a URL after `://` that hides a /mnt/data it contains

TRAILING_PUNCTUATION = ".,;:!?"
PATH_STOP = frozenset(" \t\n\r\f\v<>()[]{}`\"'|*")
NOT_BEFORE_PATH = frozenset("_/.:-")  # with letters and digits: a path inside a word or a URL

# What may follow `<`: an autolink, an e-mail autolink, an open or closing tag, a processing instruction
# or a declaration (comments are found separately). No part can cross another `<` (quoted attribute
# values included, a small departure from HTML), so a failed attempt ends at the next `<` at the latest.
_ATTRIBUTE = r"(?:\s++[A-Za-z_:][A-Za-z0-9_.:-]*+(?:\s*+=\s*+(?:[^\s\"'=<>`]++|'[^'<]*+'|\"[^\"<]*+\"))?+)"
_AFTER_LT = (  # what follows the `<`
    r"(?P<autolink>[A-Za-z][A-Za-z0-9+.-]{1,31}:[^\s<>]*+)>"
    r"|[A-Za-z0-9.!#$%&'*+/=?^_`{|}~-]++@[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*+>"
    rf"|[A-Za-z][A-Za-z0-9-]*+{_ATTRIBUTE}*+\s*+/?>"
    r"|/[A-Za-z][A-Za-z0-9-]*+\s*+>"
    r"|\?[^<]*?\?>"
    r"|![A-Za-z][^<>]*+>"
)
HTML = re.compile(f"<(?:{_AFTER_LT})")
# As a token: a comment, a tag or autolink, or a `<` that may still open one when more text comes. One
# look at the next character first, so that a line of `<` costs one test per `<`. (The group name is
# dropped: a name may appear once per regex.)
_LT_TOKEN = (
    r"<(?=[A-Za-z0-9!?/.#$%&'*+=^_`{|}~-])(?:!--|"
    + _AFTER_LT.replace("(?P<autolink>", "(?:")
    + r"|(?=[A-Za-z!?/])[^<]*+\Z)"
)

# The characters a scan stops at. Every alternative starts with a literal character so that `re` skips
# ahead with its fast prefix search (named groups or a leading class would make it try each position).
# Runs of brackets and escapes are cut into bounded tokens (each bracket or escape acts alone), so that no
# token of a streamed answer is ever waited for long; backtick runs are whole (see MAX_RUN).
_TOKENS = (
    r"\\[!-/:-@\[-`{-~](?:\\[!-/:-@\[-`{-~]){0,31}"  # backslash escapes
    rf"|`[^`\n]{{1,{MAX_CODE_SPAN}}}`(?!`)"  # a one-line `code span` (the usual kind), whole
    r"|``*"  # a backtick run: a code span's start or a fence
    r"|~~~~*"  # a tilde fence
    r"|\[\[{0,63}"  # link or image openers
    rf"|{_LT_TOKEN}"  # an HTML comment, tag or autolink
    rf"|://[^\s<>`\[\]\"']{{0,{MAX_URL}}}"  # a URL's path and query: a /mnt/data in there is not a file
    rf"|/mnt/data/[^\s<>()\[\]{{}}`\"'|*]{{0,{MAX_PATH}}}"  # a path
)
TOKEN = re.compile(_TOKENS)
# Inside a link text `]` matters too; outside it is ignored, so a line of `](` costs nothing.
TOKEN_IN_LINK_TEXT = re.compile(_TOKENS + r"|\]\]{0,63}")
BACKTICK_RUNS = re.compile(r"``*")

# A stretch of plain paths (the scan's bulk path, engine/scan.py: Scan.path_run) ends at a character
# that may start a token other than a path (an escape, a backtick, a tilde, a link opener, a tag, a
# URL's `:`: scan._RUN_ENDS); in it, each path is a whole token (PATH_TOKEN, greedy like TOKEN's), and
# the stretch is taken at once when PATH_RUN_DOUBT finds nothing in it (then every /mnt/data/ in it
# starts a token).
_PATH_CHARS = r"[^\s<>()\[\]{}`\"'|*]"
PATH_TOKEN = re.compile(rf"/mnt/data/{_PATH_CHARS}*+")
PATH_SPLIT = re.compile(rf"(/mnt/data/{_PATH_CHARS}*+)")  # a stretch into gap, path, gap, ..., path, gap
# A /mnt/data/ right after a path character (it may be inside a path, or joined to a word or URL), a
# path ending in punctuation or `/`, a path as long as the longest token. (The literal first: re then
# looks for it alone, and checks the character before it only there.)
_DOUBT = rf"(?<={_PATH_CHARS}/mnt/data/)|{_PATH_CHARS}*+(?<=[/.,;!?])|{_PATH_CHARS}{{{MAX_PATH}}}"
PATH_RUN_DOUBT = re.compile(rf"/mnt/data/(?:{_DOUBT})")
_DOUBT_OR_OTHER: dict[tuple[str, ...], re.Pattern[str]] = {}


def doubt_or_other_path(known: tuple[str, ...]) -> re.Pattern[str]:
    """A path in doubt (PATH_RUN_DOUBT: its group `doubt` matched) or a path token that is none of
    `known`: one pass over a stretch finds either (compiled once per `known`)."""
    pattern = _DOUBT_OR_OTHER.get(known)
    if pattern is None:
        names = "|".join(re.escape(path[len(MOUNT) :]) for path in known)
        other = rf"(?!(?:{names})(?!{_PATH_CHARS}))" if known else ""
        if len(_DOUBT_OR_OTHER) >= 256:
            _DOUBT_OR_OTHER.clear()
        pattern = _DOUBT_OR_OTHER[known] = re.compile(rf"/mnt/data/(?:(?P<doubt>{_DOUBT})|{other})")
    return pattern


# A paragraph ends at a newline before a blank line or a line that starts another block (CommonMark's
# interruptions, approximated by the line's first characters only). Inline constructs never cross one.
PARAGRAPH_BREAK = re.compile(
    r"\n(?=[ \t\r]{0,64}\n| {0,3}(?:```|~~~|#{1,6}[ \t\r\n]|>|\||[-+*][ \t\r\n]|\d{1,9}[.)][ \t\r\n]"
    r"|\*\*\*|---|___|===))"
)
# What a line may still become a paragraph break with, when only its start has arrived.
BREAK_PREFIX = re.compile(
    r"[ \t\r]{0,64}| {0,3}(?:`{1,2}|~{1,2}|#{1,6}|[-+*]|\d{1,9}[.)]?|\*{1,2}|-{1,2}|_{1,2}|={1,2})"
)
# Lines that are a block of their own: ATX headings and table rows.
SINGLE_LINE = re.compile(r" {0,3}(?:#{1,6}[ \t\r\n]|\|)")

# From a link's `(` to its `)`: spaces (one line break at most), a destination (`<...>` or balanced
# parentheses one level deep), an optional title. Possessive everywhere: one way to match, no backtracking.
_SPACE = r"[ \t]*+(?:\r?\n[ \t]*+)?+"
_NESTED = r"\((?:[^\s()\\]++|\\.)*+\)"  # one level of parentheses inside a destination
LINK_TAIL = re.compile(
    rf"\({_SPACE}"
    r"(?:<(?P<angled>(?:[^<>\n\\]++|\\.)*+)>"
    rf"|(?P<plain>(?:[^\s()<\\]|\\.|{_NESTED})(?:[^\s()\\]++|\\.|{_NESTED})*+)?+)"
    r"(?:(?:[ \t]++(?:\r?\n[ \t]*+)?+|\r?\n[ \t]*+)"
    r"(?:\"(?:[^\"\\]++|\\.)*+\"|'(?:[^'\\]++|\\.)*+'|\((?:[^()\\]++|\\.)*+\)))?+"
    rf"{_SPACE}\)"
)


class PathRun:
    """Bare paths in a row, with nothing else a scan looks at between them (a line of 70,000 paths):
    one reference for the whole stretch, which names `paths` (distinct, in order). Listing them and
    substituting them takes a few passes of C over the stretch (dict.fromkeys, str.replace, re.split)
    rather than a Python tuple per path."""

    __slots__ = ("paths",)

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths


# A reference: (start, end, what). `what` is the path as written for a bare path (the usual case, kept
# cheap), else (kind, destination as written, link text): a link, an image, an autolink <sandbox:...>;
# or a PathRun, bare paths in a row.
LINK, IMAGE, AUTO = range(3)
What = str | tuple[int, str, str] | PathRun
Ref = tuple[int, int, What]
