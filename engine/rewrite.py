"""Turn `/mnt/data/...` paths in a model's markdown answer into working links.

The model only knows the sandbox's view (`/mnt/data/report.csv`, `sandbox:/mnt/data/report.csv`, markdown
links or images pointing at them). The user's browser needs a URL. Rewriting is two passes so the slow
part, publishing, happens once per distinct file and outside the text scan:

1. `References(text)` scans the text once and `.paths` lists the distinct session-relative paths;
2. the caller resolves them (publishing copies) into `Target`s, or None for a path with no such file;
3. `.rewrite(targets)` substitutes: images inline, other files as links, unknown paths as plain text.

Only markdown prose and the destinations of markdown links and images are rewritten. Fenced code blocks,
inline code spans (also across lines), HTML tags and comments, URLs, link titles and links that point
elsewhere (label and destination) stay exactly as written.

The scan is linear in the length of the text: one regex finds the characters that can matter (backticks,
brackets, `<`, `://`, `/mnt/data/`, escapes, fences) and each construct is read from its start by a regex
bounded by the constants below, with forward-only lookups for what comes later (the closing backticks of
a code span, the end of a paragraph), so no character is examined more than a few times.

Those bounds are part of the grammar (a link text longer than MAX_LABEL is not a link text), so every
decision about a stretch of text depends on at most a few KiB after it. `StreamingRewriter` uses exactly
this scan on a streamed answer: it releases text as soon as nothing later can change it, holds back only
what a construct still open might change, and gives the same output as rewriting the whole answer.
"""

from __future__ import annotations

import re
import unicodedata
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Final
from urllib.parse import unquote

from .blocks import MAX_RUN, Fence, NeedMore, closing_line, fence_line_start, fence_opening

__all__ = [
    "MAX_CODE_SPAN",
    "MAX_DESTINATION",
    "MAX_LABEL",
    "MAX_PATH",
    "MAX_TAG",
    "MAX_URL",
    "References",
    "Resolver",
    "StreamingRewriter",
    "Target",
    "backtick_fence",
    "code_span",
    "escape_text",
    "find_paths",
    "mention",
    "resolve_all",
    "rewrite",
]

MOUNT = "/mnt/data/"
# Scanning is linear (about 10 ms per MB of prose): a text or a piece longer than this is scanned in a
# worker thread, so no answer holds Open WebUI's event loop for the other users.
SCAN_ON_LOOP_CHARS = 64 * 1024
_SANDBOX = "sandbox:"

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
# A resumed scan restarts at least this far before the end of the text it had (a token may still be
# forming there: `sandbox:/mnt/data` is 17 characters) and keeps this much text before its restart point
# (look-behinds: `sandbox:`, a line's indentation, an image's `!`).
_TAIL = 24
_CONTEXT = 16


@dataclass(frozen=True, slots=True)
class Target:
    """Where a session file can be fetched by the user's browser."""

    url: str
    name: str
    is_image: bool = False


Resolver = Callable[[str], Awaitable[Target | None]]

_TRAILING_PUNCTUATION = ".,;:!?"
_PATH_STOP = frozenset(" \t\n\r\f\v<>()[]{}`\"'|*")
_NOT_BEFORE_PATH = frozenset("_/.:-")  # with letters and digits: a path inside a word or a URL

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
_HTML = re.compile(f"<(?:{_AFTER_LT})")
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
_OUTSIDE = re.compile(_TOKENS)
# Inside a link text `]` matters too; outside it is ignored, so a line of `](` costs nothing.
_INSIDE = re.compile(_TOKENS + r"|\]\]{0,63}")
_RUNS = re.compile(r"``*")

# A paragraph ends at a newline before a blank line or a line that starts another block (CommonMark's
# interruptions, approximated by the line's first characters only). Inline constructs never cross one.
_PARAGRAPH_BREAK = re.compile(
    r"\n(?=[ \t\r]{0,64}\n| {0,3}(?:```|~~~|#{1,6}[ \t\r\n]|>|\||[-+*][ \t\r\n]|\d{1,9}[.)][ \t\r\n]"
    r"|\*\*\*|---|___|===))"
)
# What a line may still become a paragraph break with, when only its start has arrived.
_BREAK_PREFIX = re.compile(
    r"[ \t\r]{0,64}| {0,3}(?:`{1,2}|~{1,2}|#{1,6}|[-+*]|\d{1,9}[.)]?|\*{1,2}|-{1,2}|_{1,2}|={1,2})"
)
# Lines that are a block of their own: ATX headings and table rows.
_SINGLE_LINE = re.compile(r" {0,3}(?:#{1,6}[ \t\r\n]|\|)")

# From a link's `(` to its `)`: spaces (one line break at most), a destination (`<...>` or balanced
# parentheses one level deep), an optional title. Possessive everywhere: one way to match, no backtracking.
_SPACE = r"[ \t]*+(?:\r?\n[ \t]*+)?+"
_NESTED = r"\((?:[^\s()\\]++|\\.)*+\)"  # one level of parentheses inside a destination
_LINK_TAIL = re.compile(
    rf"\({_SPACE}"
    r"(?:<(?P<angled>(?:[^<>\n\\]++|\\.)*+)>"
    rf"|(?P<plain>(?:[^\s()<\\]|\\.|{_NESTED})(?:[^\s()\\]++|\\.|{_NESTED})*+)?+)"
    r"(?:(?:[ \t]++(?:\r?\n[ \t]*+)?+|\r?\n[ \t]*+)"
    r"(?:\"(?:[^\"\\]++|\\.)*+\"|'(?:[^'\\]++|\\.)*+'|\((?:[^()\\]++|\\.)*+\)))?+"
    rf"{_SPACE}\)"
)
# Where a reference could start, for releasing streamed text that nothing later can change.
_CHANGE = re.compile(r"!\[|\[|<sandbox:/mnt/data/|sandbox:/mnt/data/|/mnt/data/")


def _prefixes(word: str) -> str:
    return "|".join(re.escape(word[:n]) for n in range(len(word) - 1, 0, -1))


_PARTIAL_CHANGE = re.compile(
    rf"(?:{_prefixes('<sandbox:/mnt/data/')}|{_prefixes('sandbox:/mnt/data/')}|{_prefixes(MOUNT)}|!)\Z"
)

# A reference: (start, end, what). `what` is the path as written for a bare path (the usual case, kept
# cheap), else (kind, destination as written, link text): a link, an image, an autolink <sandbox:...>.
_LINK, _IMAGE, _AUTO = range(3)
_What = str | tuple[int, str, str]
_Ref = tuple[int, int, _What]
_UNDECIDED = -2  # _Runs.find: the text ends before the answer is known
_FAR = 1 << 62  # a paragraph end beyond what the text shows yet

# Characters that would change the meaning of link text in markdown or HTML.
_LABEL_ESCAPES = str.maketrans(
    {"&": "&amp;", "<": "&lt;", ">": "&gt;", **{c: "\\" + c for c in "\\`*_{}[]()#+!|~"}}
)


def _relative(destination: str) -> str | None:
    """Session-relative path of a `/mnt/data/...` destination, or None if it names no file."""
    path = destination.removeprefix(_SANDBOX)
    if not path.startswith(MOUNT):
        return None
    relative = path[len(MOUNT) :].rstrip("/")
    return relative or None


def _escape_label(text: str) -> str:
    # Whitespace folded: a newline in a name must not break the link apart.
    return " ".join(_visible(text).translate(_LABEL_ESCAPES).split())


def _visible(text: str) -> str:
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
    no HTML, no links, no emphasis, no line breaks."""
    return _escape_label(text)


def backtick_fence(text: str, minimum: int = 1) -> str:
    """A run of backticks longer than any in `text` (and at least `minimum` long): as a code span's or a
    fenced block's delimiter, nothing in `text` can close it early."""
    longest = max(map(len, _RUNS.findall(text)), default=0)
    return "`" * max(minimum, longest + 1)


def code_span(text: str) -> str:
    """Text shown literally: an inline code span, fenced with more backticks than the text holds."""
    text = _visible(text)
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


# ---------------------------------------------------------------------------------------------- the scan


@dataclass(frozen=True, slots=True)
class _State:
    """What a scan must know about the text before the point where it starts."""

    fence: Fence | None = None  # inside this fenced code block
    verbatim: int = 0  # >0: inside a long code span of this many backticks (MAX_CODE_SPAN); -1: a comment
    single: bool = False  # the line holding the start point is a block of its own (heading, table row)
    escaped: bool = False  # the character before the start point was escaped by a backslash


_START = _State()


class _Runs:
    """The backtick runs of a text, each found once and filed by length, so that finding the closing run
    of every code span costs one pass over the text however many spans fail to close."""

    __slots__ = ("_by_length", "_complete", "_end", "_final", "_iterator", "_partial")

    def __init__(self, text: str, pos: int, end: int, final: bool) -> None:
        rest = _RUNS.match(text, pos, end) if pos and text[pos - 1] == "`" else None
        if rest is not None:
            pos = rest.end()  # resumed inside a run: only a long one (MAX_RUN), which closes nothing
        self._iterator: Iterator[re.Match[str]] = _RUNS.finditer(text, pos, end)
        self._end = end
        self._final = final
        self._by_length: dict[int, deque[int]] = {}
        self._complete = pos  # every run that starts before this is filed
        self._partial = 0  # length so far of a run that reaches the end of the text (from _complete)

    def find(self, length: int, start: int, limit: int) -> int | None:
        """The first run of exactly `length` backticks starting in [start, limit), None if there is
        none, _UNDECIDED if the text ends before that is known. `start` never decreases between calls."""
        queue = self._by_length.get(length)
        if queue:
            while queue and queue[0] < start:
                queue.popleft()
            if queue:
                return queue[0] if queue[0] < limit else None
        if self._complete >= limit:
            return None
        for match in self._iterator:
            run, run_end = match.span()
            if run_end == self._end and not self._final:
                self._complete = run  # this run may still grow: nothing from here on is known
                self._partial = run_end - run
                self._iterator = iter(())
                break
            self._complete = run_end
            self._by_length.setdefault(run_end - run, deque()).append(run)
            if run >= limit:
                return None
            if run_end - run == length and run >= start:
                return run
        else:
            self._complete = _FAR if self._final else self._end
        if self._complete >= limit:
            return None
        if self._partial > length and self._complete + self._partial >= limit:
            return None  # the run at the end is already longer: it is not this closer, nor is any before
        return _UNDECIDED


class _Scan:
    """One scan of `text[pos:end]`: the references in prose and where the scan could stop for good.

    With `final` the text is complete. Without it (a streamed answer so far) the scan stops at the first
    thing it cannot decide yet and reports a restart point before which everything is decided; text from
    the restart point on is scanned again when more has arrived."""

    __slots__ = (
        "_floor",
        "_par_end",
        "_par_from",
        "_paren",
        "_runs",
        "_start",
        "end",
        "final",
        "horizon",
        "origin",
        "refs",
        "state",
        "text",
    )

    def __init__(self, text: str, end: int, final: bool, origin: bool, state: _State) -> None:
        self.text = text
        self.end = end
        self.final = final
        self.origin = origin  # index 0 is the start of the answer (else the scan resumes: context before)
        self.state = state
        # From the horizon on, a paragraph break may still be on its way: every newline before it is
        # decided, a break or not (see _undecided_newline).
        self.horizon = end if final else _undecided_newline(text, end)
        self.refs: list[_Ref] = []
        self._floor = 0
        self._par_from = -1
        self._par_end = -1
        self._runs: _Runs | None = None
        self._paren = -2  # the next `)` after the last link looked for (-1: none, -2: not looked yet)
        self._start = 0  # where run() started

    # ----------------------------------------------------------------------------- helpers

    def paragraph_end(self, pos: int) -> int:
        """Index of the newline that ends the paragraph holding `pos` (the text's end if none), _FAR if
        that is not known yet."""
        if self._par_from <= pos <= self._par_end:  # (the newline that ends a paragraph is its own)
            return self._par_end
        text = self.text
        newline = text.rfind("\n", min(self._floor, pos), pos)
        if newline >= 0 or self.origin:
            single = _SINGLE_LINE.match(text, newline + 1) is not None
        else:
            single = self.state.single  # the scan started inside this line
        if single:
            found = text.find("\n", pos, self.end)
        else:
            match = _PARAGRAPH_BREAK.search(text, pos, self.end)
            found = match.start() if match and (self.final or match.start() < self.horizon) else -1
        if found < 0:
            found = self.end if self.final else _FAR
        else:
            self._floor = found
        self._par_from, self._par_end = pos, found
        return found

    def _known(self, limit: int) -> int:
        """Up to where the text is surely inside the paragraph that ends at `limit`."""
        return self.horizon if limit == _FAR else limit

    def runs(self, pos: int) -> _Runs:
        if self._runs is None:
            self._runs = _Runs(self.text, pos, self.end, self.final)
        return self._runs

    def safe_point(self, pos: int, verbatim: bool = False) -> int:
        """A restart point at or after `pos` near the end of the text, not inside a run of backticks
        (whose length matters) unless the run is too long to delimit anything (MAX_RUN). Inside a region
        left as written (`verbatim`), not past a newline that may still end its paragraph."""
        text = self.text
        tail = self.end - _TAIL
        at = start = max(pos, min(tail, self.horizon) if verbatim else tail)
        while start > pos and text[start - 1] == "`" and at - start <= MAX_RUN:
            start -= 1
        if at - start > MAX_RUN or (start == pos and pos and text[pos - 1] == "`"):
            return at  # (a scan resumed inside a run only ever does so inside a long one)
        return start

    def skip_verbatim(self, pos: int, verbatim: int) -> int:
        """End of a region left as written from `pos`: the rest of a long code span of `verbatim`
        backticks (up to its closing run or the paragraph's end), or of an HTML comment (-1)."""
        limit = self.paragraph_end(pos)
        if verbatim > 0:
            found = self.runs(pos).find(verbatim, pos, self._known(limit))
            if found is not None and found != _UNDECIDED:
                return found + verbatim
            if found is None and limit != _FAR:
                return limit
            raise NeedMore(self.safe_point(pos, verbatim=True), verbatim=verbatim)
        known = self._known(limit)
        found = self.text.find("-->", pos, known)
        if found >= 0:
            return found + 3
        if limit != _FAR:
            return limit
        raise NeedMore(max(pos, known - 2), verbatim=-1)  # a "-->" may start just before the horizon

    def code_span(self, run: int, run_end: int) -> int:
        """Where scanning goes on after the backticks at `run`: after the code span they open, or right
        after them when they open none."""
        length = run_end - run
        limit = self.paragraph_end(run)
        known = self._known(limit)
        window = run_end + MAX_CODE_SPAN
        found = self.runs(run_end).find(length, run_end, min(window, known))
        if found == _UNDECIDED:
            raise NeedMore(run)
        if found is not None:
            return found + length
        if limit != _FAR and limit <= window:
            return run_end  # no closing run in the paragraph: literal backticks
        if limit == _FAR and window >= known:
            raise NeedMore(run)  # the paragraph may still end inside the window (or right at its end)
        return self.skip_verbatim(window, length)

    def html(self, lt: int) -> int:
        """Where scanning goes on after the `<` at `lt`: after the tag, comment or autolink it opens (an
        autolink to a session file is a reference), or right after it when it opens nothing."""
        text = self.text
        if text.startswith("<!", lt) and lt + 6 > self.end and not self.final:
            raise NeedMore(lt)  # maybe a comment: "<!-->" and "<!--->" are whole comments
        if text.startswith("<!--", lt):
            if text.startswith("<!-->", lt):
                return lt + 5
            if text.startswith("<!--->", lt):
                return lt + 6
            return self.skip_verbatim(lt + 4, -1)
        limit = self.paragraph_end(lt)
        match = _HTML.match(text, lt, min(lt + MAX_TAG, self._known(limit)))
        if match is None:
            # Nothing here crosses a `<`: a failure before the next one is final.
            if limit == _FAR and lt + MAX_TAG > self.horizon and text.find("<", lt + 1, self.horizon) < 0:
                raise NeedMore(lt)
            return lt + 1
        autolink = match.group("autolink")
        if autolink is not None and autolink.startswith(_SANDBOX + MOUNT):
            self.refs.append((lt, match.end(), (_AUTO, autolink, "")))
        return match.end()

    def close(
        self, run: int, run_end: int, stack: deque[list], inactive_below: int
    ) -> tuple[int, int] | None:
        """A run of `]`. Openers too far back are dropped, each `]` but the last closes the latest
        opener, and the last may close a link. Returns None if scanning goes on after the run, else
        (where it goes on, the opener before which openers are now inside a link, or -1)."""
        last = run_end - 1
        threshold = last - MAX_LABEL
        while stack and stack[0][0] < threshold:
            oldest = stack[0]
            if oldest[0] + oldest[1] <= threshold:
                stack.popleft()
            else:
                oldest[1] -= threshold - oldest[0]
                oldest[0], oldest[2], oldest[3] = threshold, False, False
        pops = last - run
        while pops and stack:
            top = stack[-1]
            if top[1] <= pops:
                pops -= top[1]
                stack.pop()
            else:
                top[1] -= pops
                pops = 0
        if not stack:
            return None
        top = stack[-1]
        opener = top[0] + top[1] - 1
        first = top[1] == 1
        image, escaped = top[2] and first, top[3] and first
        top[1] -= 1
        if first:
            stack.pop()
        text = self.text
        if not text.startswith("(", run_end) or (opener < inactive_below and not image):
            return None
        # The `(destination "title")`, inside the paragraph and MAX_DESTINATION (inlined: a line of `[](`
        # makes this the hot path).
        limit = self._par_end if self._par_from <= last < self._par_end else self.paragraph_end(last)
        window = run_end + MAX_DESTINATION
        bound = min(window, self.horizon if limit == _FAR else limit)
        # A link ends at a `)`: without one in reach, no need to try (a line of `[](` has none).
        if self._paren < run_end and self._paren != -1:
            self._paren = text.find(")", run_end, self.end)  # the next `)`, found once for all openers
        paren_in_reach = self._paren != -1 and self._paren < bound
        tail = _LINK_TAIL.match(text, run_end, bound) if paren_in_reach else None
        if tail is None:
            if limit == _FAR and window > self.horizon:
                stack.append([opener, 1, image, escaped])  # the restart point must be before it
                raise NeedMore(last)
            return None
        start = opener - 1 if image else opener
        refs = self.refs
        while refs and refs[-1][0] >= start:
            refs.pop()  # what was found in the link text is the link's
        destination = tail.group("angled")
        if destination is None:
            destination = tail.group("plain") or ""
        if destination.startswith(MOUNT) or destination.startswith(_SANDBOX + MOUNT):
            what = (_IMAGE if image else _LINK, destination, text[opener + 1 : last])
            refs.append((start, tail.end(), what))
        return tail.end(), (-1 if image else opener)

    # -------------------------------------------------------------------------------- the main loop

    def run(self, pos: int) -> tuple[int, _State]:
        """Scan from `pos`; returns (restart point, the state there): (end, ...) when final."""
        text, end, final, refs, origin = self.text, self.end, self.final, self.refs, self.origin
        self._start = pos
        # (module constants as locals: the path branch runs once per path in the answer)
        not_before_path, trailing_punctuation = _NOT_BEFORE_PATH, _TRAILING_PUNCTUATION
        longest_path = 10 + MAX_PATH
        fence = self.state.fence
        last_escape = pos if self.state.escaped else -1
        # Link and image openers, oldest first: [position of the first `[` of a run, how many, the first
        # is an image's `![`, a backslash escape ended right before the first].
        stack: deque[list] = deque()
        stack_limit = _FAR  # the openers' paragraph surely goes on up to here
        stack_known = True  # ... and ends there
        inactive_below = -1  # openers before this are inside a link already (no links in links)
        try:
            if fence is None and self.state.verbatim:
                pos = self.skip_verbatim(pos, self.state.verbatim)
            while pos < end:
                if fence is not None:
                    pos = closing_line(fence, text, pos, end, final)[1]
                    fence = None
                    continue
                regex = _INSIDE if stack else _OUTSIDE
                resume = -1
                match = None
                for match in regex.finditer(text, pos, end):
                    token, token_end = match.span()
                    char = text[token]
                    # A token at the end may still grow (html() and runs know what they need).
                    if token_end == end and not final and char not in "<`~":
                        raise NeedMore(token)
                    if stack and token >= stack_limit:
                        if not stack_known:
                            raise NeedMore(token)
                        stack.clear()  # a new paragraph: those openers never closed
                    if char == "/":
                        # A path, unless inside a word or a URL (x.com/mnt/data/...).
                        start = token
                        before = text[token - 1] if token else " "
                        if before == ":" and token >= 8 and text.startswith(_SANDBOX, token - 8):
                            start = token - 8
                            before = text[start - 1] if start else " "
                        if before in not_before_path or before.isalnum():
                            continue
                        if token_end - token == longest_path and token_end < end:
                            after = text[token_end]
                            if after not in _PATH_STOP and not after.isspace():
                                continue  # longer than any stored path
                        path = text[start:token_end].rstrip(trailing_punctuation)
                        mount_end = token - start + 10
                        if len(path) > mount_end and (path[-1] != "/" or path[mount_end:].strip("/")):
                            refs.append((start, start + len(path), path))
                    elif char == "`":
                        if token and text[token - 1] == "`" and last_escape != token:
                            # The rest of a run too long to delimit anything (a scan resumed in it).
                            if token_end - token > 1 and text[token + 1] != "`":
                                resume = token + 1  # (the token took its last backtick for a code span)
                                break
                            continue
                        length = token_end - token
                        if length > 1 and text[token + 1] != "`":
                            if token_end == end and not final:
                                raise NeedMore(token)  # its closing backtick may become a longer run
                            continue  # a whole one-line code span: code
                        if length > MAX_RUN:
                            continue  # a run too long to delimit anything
                        if token_end == end and not final:
                            raise NeedMore(token)
                        if length >= 3:
                            line = fence_line_start(text, token, origin)
                            if line >= 0 and (
                                opened := fence_opening(text, line, token, token_end, end, final)
                            ):
                                fence = opened
                                stack.clear()
                                resume = token_end
                                break
                        after = self.code_span(token, token_end)
                        if after != token_end:
                            resume = after
                            break
                    elif char == "[":
                        if not stack:
                            if self._par_from <= token < self._par_end:
                                limit = self._par_end
                            else:
                                limit = self.paragraph_end(token)
                            stack_limit = self.horizon if limit == _FAR else limit
                            stack_known = limit != _FAR
                        bang = token > 0 and text[token - 1] == "!" and last_escape != token
                        stack.append([token, token_end - token, bang, last_escape == token])
                        if regex is _OUTSIDE:
                            resume = token_end  # `]` matters now
                            break
                    elif char == "]":
                        if not stack:
                            resume = token_end  # no opener: leave `]` out of the scan until a `[` comes
                            break
                        closed = self.close(token, token_end, stack, inactive_below)
                        if closed is not None:
                            resume, opener = closed
                            if opener >= 0:
                                inactive_below = opener
                            break
                    elif char == "<":
                        after = self.html(token)
                        if after != token_end:
                            resume = after  # (also when the token is not what it looked like)
                            break
                    elif char == "\\":
                        last_escape = token_end
                    elif char == "~":
                        if token_end - token > MAX_RUN or (token and text[token - 1] == "~"):
                            continue  # too long for a fence (or the rest of such a run)
                        if token_end == end and not final:
                            raise NeedMore(token)
                        line = fence_line_start(text, token, origin)
                        if line >= 0:
                            fence = fence_opening(text, line, token, token_end, end, final)
                            stack.clear()
                            resume = token_end
                            break
                    # else "://": a URL's rest, skipped whole by its token
                if resume < 0:
                    if match is not None:
                        pos = max(pos, match.end())
                    break
                pos = resume
        except NeedMore as stop:
            return self._stopped(stop, stack, stack_limit, stack_known, last_escape)
        if final:
            return end, _START
        return self._stopped(NeedMore(self.safe_point(pos)), stack, stack_limit, stack_known, last_escape)

    def _stopped(
        self, stop: NeedMore, stack: deque[list], stack_limit: int, stack_known: bool, last_escape: int
    ) -> tuple[int, _State]:
        """The restart point for a scan that stopped at `stop`: before the first opener that may still
        start a link, if any; what was found from there on is found again by the next scan."""
        text = self.text
        at = stop.at
        # A construct starts before its token: at `sandbox:` before a path, at an image's `!`.
        if text.startswith("/", at) and at >= 8 and text.startswith(_SANDBOX, at - 8):
            at -= 8
        elif text.startswith("[", at) and at and text[at - 1] == "!" and last_escape != at:
            at -= 1
        fence, verbatim, escaped = stop.fence, stop.verbatim, last_escape == at
        if stack and (at <= stack_limit or not stack_known):
            threshold = at - MAX_LABEL
            for opener in stack:
                first = max(opener[0], threshold)
                if first < opener[0] + opener[1]:  # an opener of this run may still be closed
                    bang = opener[2] and first == opener[0]
                    point = first - 1 if bang else first
                    if point < at:
                        at, fence, verbatim = point, None, 0
                        escaped = opener[3] and first == opener[0] and not bang
                    break
        refs = self.refs
        while refs and refs[-1][0] >= at:
            refs.pop()
        # The state knows the line holding the scan's start: only a newline after that start matters (a
        # search from the buffer's start would read a long line's held text again on every scan).
        newline = text.rfind("\n", 0 if self.origin else min(self._start, at), at)
        if newline >= 0 or self.origin:
            single = _SINGLE_LINE.match(text, newline + 1) is not None
        else:
            single = self.state.single
        if fence is None and not (verbatim or single or escaped):
            return at, _START  # the usual case: no new object
        return at, _State(fence, verbatim, single, escaped)


def _undecided_newline(text: str, end: int) -> int:
    """Where the text may still turn out to end a paragraph: its last newline, if what follows it so far
    could still become a blank line or the start of another block; else the end. (Earlier newlines are
    decided: the line after each is complete, and a break needs at most 66 characters of it.)"""
    newline = text.rfind("\n", max(0, end - 70), end)
    if newline < 0 or _PARAGRAPH_BREAK.match(text, newline, end):
        return end
    return newline if _BREAK_PREFIX.fullmatch(text, newline + 1, end) else end


def _scan(text: str) -> list[_Ref]:
    """The references in the prose of a complete text."""
    if MOUNT not in text:
        return []
    scan = _Scan(text, len(text), True, True, _START)
    scan.run(0)
    return scan.refs


# ------------------------------------------------------------------------------------- substitution


def _candidates(relative: str) -> list[str]:
    """The path as written, then percent-decoded (models write `my%20file.csv` in link targets)."""
    decoded = unquote(relative)
    return [relative] if decoded == relative else [relative, decoded]


def _render(target: Target, label: str | None, inline_images: bool = True) -> str:
    text = _escape_label(label if label else target.name)
    if target.is_image and inline_images:
        return f"![{text}]({target.url})"
    return f"[{text}]({target.url})"


def _replacement(what: _What, target: Target | None, inline_images: bool) -> str | None:
    """What replaces a reference; None: the text as written."""
    if isinstance(what, str):  # a bare path
        return None if target is None else _render(target, None, inline_images)
    kind, destination, label = what
    if kind == _AUTO:
        # Unknown: the path as text (an autolink to sandbox: would be a dead link).
        return destination if target is None else _render(target, None, inline_images)
    if target is None:
        # Never leave a dead link: keep what the model said, as plain text.
        shown = label.strip() or destination
        return shown if shown == destination else f"{shown} ({destination})"
    if kind == _IMAGE and not (target.is_image and inline_images):
        # An image of a file the browser will not render inline: offer it as a download instead.
        return f"[{_escape_label(label or target.name)}]({target.url})"
    return _render(target, label, inline_images)


def _destination(what: _What) -> str:
    return what if isinstance(what, str) else what[1]


_NOT_YET: Final = object()


class _Substitution:
    """Replacements, computed once per distinct reference: an answer may name one file a thousand times,
    and percent-decoding and rendering cost more than a lookup. `done` maps a reference's `what` to its
    replacement (None: keep the text)."""

    __slots__ = ("_candidates", "_inline", "_targets", "done")

    def __init__(self, targets: Mapping[str, Target | None], inline_images: bool) -> None:
        self._targets = targets
        self._inline = inline_images
        self._candidates: dict[str, list[str]] = {}
        self.done: dict[_What, str | None] = {}

    def candidates(self, destination: str) -> list[str]:
        """The session paths a destination may name (none if it names no file)."""
        found = self._candidates.get(destination)
        if found is None:
            relative = _relative(destination)
            found = self._candidates[destination] = [] if relative is None else _candidates(relative)
        return found

    def resolved(self, what: _What) -> bool:
        """Whether every path the reference may name is in the targets (streaming: resolved)."""
        targets = self._targets
        return all(candidate in targets for candidate in self.candidates(_destination(what)))

    def compute(self, what: _What) -> str | None:
        target = None
        for candidate in self.candidates(_destination(what)):
            target = self._targets.get(candidate)
            if target is not None:
                break
        replacement = self.done[what] = _replacement(what, target, self._inline)
        return replacement


def _paths_of(refs: list[_Ref]) -> list[str]:
    substitution = _Substitution({}, True)
    seen: dict[str, None] = {}
    for what in dict.fromkeys(ref[2] for ref in refs):
        for candidate in substitution.candidates(_destination(what)):
            seen.setdefault(candidate, None)
    return list(seen)


class References:
    """The session references found in one text: scan once, then list the paths and substitute.

    Constructing one is pure computation on the text (no shared state), so a large answer can be scanned
    in a worker thread; both the scan and `rewrite` are linear in the length of the text."""

    __slots__ = ("_found", "_text")

    def __init__(self, text: str) -> None:
        self._text = text
        self._found = _scan(text)

    @property
    def paths(self) -> list[str]:
        """Distinct session-relative paths, in order of appearance (each also percent-decoded)."""
        return _paths_of(self._found)

    def rewrite(self, targets: Mapping[str, Target | None], *, inline_images: bool = True) -> str:
        """Replace each reference by a link to its target; unknown files stay plain text.

        With `inline_images=False` images become plain links too (for lists of files, where showing
        every picture would repeat what the answer shows)."""
        if not self._found:
            return self._text
        text = self._text
        replace = _Substitution(targets, inline_images)
        done, not_yet = replace.done, _NOT_YET
        pieces: list[str] = []
        append = pieces.append
        position = 0
        for start, end, what in self._found:
            replacement = done.get(what, not_yet)
            if replacement is not_yet:
                replacement = replace.compute(what)
            if replacement is not None:
                append(text[position:start])
                append(replacement)
                position = end
        append(text[position:])
        return "".join(pieces)


def find_paths(text: str) -> list[str]:
    """Distinct session-relative paths referred to in the prose of `text`, in order of appearance."""
    return References(text).paths


async def resolve_all(paths: list[str], resolve: Resolver) -> dict[str, Target | None]:
    return {path: await resolve(path) for path in paths}


def rewrite(text: str, targets: Mapping[str, Target | None], *, inline_images: bool = True) -> str:
    """`References(text).rewrite(targets)`: links for known files, plain text for the others."""
    return References(text).rewrite(targets, inline_images=inline_images)


# ---------------------------------------------------------------------------------------- streaming

# push() only collects until a batch has arrived (or a newline, once _BATCH_AT_NEWLINE has): streamed
# pieces are often a few characters, and a scan per piece would cost more than the piece. A batch is
# _BATCH characters, or an eighth of the line so far when that is more, up to _BATCH_MAX: the first
# kilobyte of every line (all of a usual answer) shows after at most 128 characters, as it arrives,
# and a 1 MB line costs a few hundred scans instead of thousands, the batch holding back at most 1/8
# of what is already out on that line.
_BATCH = 128
_BATCH_MAX = 4096
_BATCH_AT_NEWLINE = 16
# Held text is scanned again only when half as much new text has arrived (or it is short): each
# character is scanned a few times at most however long a construct stays open, and what is held waits
# at most half its length again for the scan that releases it.
_RESCAN_FREE = 512


class StreamingRewriter:
    """Rewrite a streamed answer as it comes, with exactly the output `rewrite()` gives for the whole.

    Intended use, on the event loop (nothing here blocks: each call does work in proportion to the text
    it is given; resolving, which publishes files, is the only thing awaited)::

        rewriter = chat.streaming_rewriter()
        async for piece in stream:
            text = rewriter.push(piece)             # sync and cheap: what can be shown now
            if rewriter.pending:                    # paths to publish before more can be shown
                text += await rewriter.resolve_pending()
            if text:
                yield text
        yield await rewriter.flush()                # the rest; resolves what it still names

    `await feed(piece)` is that loop's body in one call and gives the same text; `finish()` is the sync
    first half of `flush()`.

    Text is released as soon as nothing that may follow can change it. What is held is the start of a
    construct still open (a link text, a code span that may still close, a path that may go on), bounded
    by the grammar's limits (MAX_LABEL, MAX_CODE_SPAN, MAX_DESTINATION, ...): a few KiB at most, however
    long the answer. The resolver is called once per distinct path.
    """

    def __init__(self, resolve: Resolver) -> None:
        self._resolve = resolve
        self._known: dict[str, Target | None] = {}
        self._start()

    def _start(self) -> None:
        self._batch = ""  # pieces pushed since _parts
        self._parts: list[str] = []  # batches of _BATCH pushed since the last scan ...
        self._held = 0  # ... and their length
        self._batch_limit = _BATCH  # its length that starts a scan
        self._line = 0  # where the last line pushed starts (a position in the whole answer)
        self._text = ""  # the answer from _base on
        self._base = 0
        self._clean = 0  # the next scan starts here (a position in the whole answer) ...
        self._state = _START  # ... knowing this
        self._scanned_to = 0  # end of the text at the last scan
        self._out = 0  # the answer before this has been released
        self._ready: deque[_Ref] = deque()  # decided references not released yet
        self._wanted: dict[str, None] = {}  # the paths they name that are not resolved yet
        # Paths to resolve (`resolve_pending`) before more text can be released; usually empty. A plain
        # attribute, not a property: the stream loop reads it after every piece.
        self.pending: tuple[str, ...] = ()
        self._replace = _Substitution(self._known, True)

    # ------------------------------------------------------------------------------------ sync API

    def push(self, chunk: str) -> str:
        """Take the next piece of the answer; return the text that can be shown now. Never awaits."""
        # Called once per streamed piece (250,000 times for a 1 MB answer in 4-character pieces): the
        # common case is one short concatenation and two comparisons, close to a call that does nothing
        # (bench/rewrite.py measures both). Copying the piece's batch each time costs less than a list's
        # append and a running count: it is never longer than _BATCH (longer batches are lists of these).
        batch = self._batch = self._batch + chunk
        if len(batch) < _BATCH and ("\n" not in chunk or len(batch) < _BATCH_AT_NEWLINE):
            return ""
        self._parts.append(batch)
        self._batch = ""
        held = self._held = self._held + len(batch)
        if held < self._batch_limit and "\n" not in batch:
            return ""
        return self._advance(False)

    def finish(self) -> str:
        """The answer is complete: decide the rest, return what can be shown without resolving."""
        return self._advance(True)

    # ----------------------------------------------------------------------------------- async API

    async def resolve_pending(self) -> str:
        """Resolve the pending paths (each once per rewriter); return the text this releases."""
        for path in self.pending:
            if path not in self._known:
                self._known[path] = await self._resolve(path)
        self._wanted.clear()
        return self._release()

    async def feed(self, chunk: str) -> str:
        text = self.push(chunk)
        if self.pending:
            text += await self.resolve_pending()
        return text

    async def flush(self) -> str:
        """The answer is complete: the rest of it, rewritten. The rewriter then takes a new answer (and
        keeps what it resolved)."""
        text = self.finish()
        if self.pending:
            text += await self.resolve_pending()
        self._start()
        return text

    # ---------------------------------------------------------------------------------- machinery

    def _advance(self, final: bool) -> str:
        if self._parts:
            self._parts.append(self._batch)
            batch = "".join(self._parts)
            self._parts.clear()
            self._held = 0
        else:
            batch = self._batch
        if batch:
            self._text += batch
            self._batch = ""
        text, base, clean = self._text, self._base, self._clean
        end = base + len(text)
        if batch:
            newline = batch.rfind("\n")
            if newline >= 0:
                self._line = end - len(batch) + newline + 1
            self._batch_limit = min(_BATCH_MAX, max(_BATCH, (end - self._line) >> 3))
        quiet = False
        if final or end - clean <= _RESCAN_FREE or 2 * (end - self._scanned_to) >= self._scanned_to - clean:
            self._scanned_to = end
            state = self._state
            if final or state.fence or state.verbatim or _OUTSIDE.search(text, clean - base):
                scan = _Scan(text, end - base, final, base == 0, state)
                at, self._state = scan.run(clean - base)
                if scan.refs:
                    self._decided(scan.refs, base)
                self._clean = at + base
            else:
                quiet = True  # (where a reference could start is a token too)
            if quiet and end - _TAIL > clean:
                # Prose without a single token (the usual case for plain text): a scan would find
                # nothing and only move its restart point, with the state of that point's line.
                self._clean = at = end - _TAIL
                newline = text.rfind("\n", clean - base, at - base)
                single = state.single if newline < 0 else _SINGLE_LINE.match(text, newline + 1) is not None
                if single != state.single or state.escaped:
                    self._state = _State(single=single)
        released = self._release(quiet)
        # Drop what is released and what the next scan does not read (it reads _CONTEXT before its
        # start); only when that is a good part of the text, so that copying stays linear.
        drop = min(self._out, self._clean - _CONTEXT) - base
        if drop > 4096 or drop * 2 > len(self._text):
            self._text = self._text[drop:]
            self._base += drop
        return released

    def _release(self, quiet: bool = False) -> str:
        """Decided text up to the first reference not resolved yet, rewritten; when all decided text is
        out, also what follows in which no reference can start, whatever comes next. `quiet`: the text
        from the restart point on holds no token, so nothing but its last characters could start one."""
        text, base, ready = self._text, self._base, self._ready
        replace = self._replace
        done, not_yet = replace.done, _NOT_YET
        pieces: list[str] = []
        position = self._out
        while ready:
            start, end, what = ready[0]
            replacement = done.get(what, not_yet)
            if replacement is not_yet:
                if not replace.resolved(what):
                    break
                replacement = replace.compute(what)
            if replacement is not None:
                pieces.append(text[position - base : start - base])
                pieces.append(replacement)
                position = end
            ready.popleft()
        if ready:
            upto = ready[0][0]
            self.pending = tuple(self._wanted)
        else:
            upto = self._unchangeable(max(position, self._clean), quiet)
            self.pending = ()
        if upto > position:
            pieces.append(text[position - base : upto - base])
            position = upto
        self._out = position
        return "".join(pieces)

    def _decided(self, refs: list[_Ref], base: int) -> None:
        """Queue references a scan decided (at positions in the buffer from `base`), noting what they
        need resolved: once here, so that asking what is pending never walks the queue."""
        if base:
            self._ready.extend((r[0] + base, r[1] + base, r[2]) for r in refs)
        else:
            self._ready.extend(refs)
        done, known, wanted = self._replace.done, self._known, self._wanted
        candidates = self._replace.candidates
        for ref in refs:
            what = ref[2]
            if what not in done:
                for candidate in candidates(_destination(what)):
                    if candidate not in known:
                        wanted[candidate] = None

    def _unchangeable(self, start: int, quiet: bool = False) -> int:
        """The end of the text from `start` (a decided point) in which no reference can start."""
        text = self._text
        found = None if quiet else _CHANGE.search(text, start - self._base)
        if found is not None:
            return found.start() + self._base
        partial = _PARTIAL_CHANGE.search(text, max(start - self._base, len(text) - 20))
        return (partial.start() if partial else len(text)) + self._base
