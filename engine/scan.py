"""Find the `/mnt/data/...` references in the prose of a model's markdown answer.

Only markdown prose and the destinations of markdown links and images count. Fenced code blocks, inline
code spans (also across lines), HTML tags and comments, URLs, link titles and links that point elsewhere
(label and destination) are read past as written.

The scan is linear in the length of the text: one regex finds the characters that can matter (backticks,
brackets, `<`, `://`, `/mnt/data/`, escapes, fences) and each construct is read from its start by a regex
bounded by the grammar's limits (engine/grammar.py), with forward-only lookups for what comes later (the
closing backticks of a code span, the end of a paragraph), so no character is examined more than a few
times. Bare paths one after the other, with nothing else a token starts with between them (a line of
70,000 `](/mnt/data/x `), are taken as one PathRun, judged by the main loop's rules in C (Scan.path_run):
a path costs nanoseconds there, not the microsecond of Python a token costs.

A `Scan` also runs over a streamed answer so far (engine/streaming.py): it stops at the first thing it
cannot decide yet and reports where to restart once more text has come, with the `State` there.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .blocks import MAX_RUN, Fence, NeedMore, closing_line, fence_line_start, fence_opening
from .grammar import (
    AUTO,
    BACKTICK_RUNS,
    BREAK_PREFIX,
    HTML,
    IMAGE,
    LINK,
    LINK_TAIL,
    MAX_CODE_SPAN,
    MAX_DESTINATION,
    MAX_LABEL,
    MAX_PATH,
    MAX_TAG,
    MOUNT,
    NOT_BEFORE_PATH,
    PARAGRAPH_BREAK,
    PATH_STOP,
    SANDBOX,
    SINGLE_LINE,
    TOKEN,
    TOKEN_IN_LINK_TEXT,
    TRAILING_PUNCTUATION,
    Ref,
)
from .path_runs import path_run

__all__ = ["LOOK_BEHIND", "RESTART_MARGIN", "SCAN_ON_LOOP_CHARS", "START", "Scan", "State", "find_references"]

# Scanning is linear (about 10 ms per MB of prose): a text or a piece longer than this is scanned in a
# worker thread, so no answer holds Open WebUI's event loop for the other users.
SCAN_ON_LOOP_CHARS = 64 * 1024
# A resumed scan restarts at least this far before the end of the text it had (a token may still be
# forming there: `sandbox:/mnt/data` is 17 characters) and keeps this much text before its restart point
# (look-behinds: `sandbox:`, a line's indentation, an image's `!`).
RESTART_MARGIN = 24
LOOK_BEHIND = 16
_UNDECIDED = -2  # _Runs.find: the text ends before the answer is known
_FAR = 1 << 62  # a paragraph end beyond what the text shows yet


@dataclass(frozen=True, slots=True)
class State:
    """What a scan must know about the text before the point where it starts."""

    fence: Fence | None = None  # inside this fenced code block
    verbatim: int = 0  # >0: inside a long code span of this many backticks (MAX_CODE_SPAN); -1: a comment
    single: bool = False  # the line holding the start point is a block of its own (heading, table row)
    escaped: bool = False  # the character before the start point was escaped by a backslash


START = State()


class _Runs:
    """The backtick runs of a text, each found once and filed by length, so that finding the closing run
    of every code span costs one pass over the text however many spans fail to close."""

    __slots__ = ("_by_length", "_complete", "_end", "_final", "_iterator", "_partial")

    def __init__(self, text: str, pos: int, end: int, final: bool) -> None:
        rest = BACKTICK_RUNS.match(text, pos, end) if pos and text[pos - 1] == "`" else None
        if rest is not None:
            pos = rest.end()  # resumed inside a run: only a long one (MAX_RUN), which closes nothing
        self._iterator: Iterator[re.Match[str]] = BACKTICK_RUNS.finditer(text, pos, end)
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


class Scan:
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

    def __init__(self, text: str, end: int, final: bool, origin: bool, state: State) -> None:
        self.text = text
        self.end = end
        self.final = final
        self.origin = origin  # index 0 is the start of the answer (else the scan resumes: context before)
        self.state = state
        # From the horizon on, a paragraph break may still be on its way: every newline before it is
        # decided, a break or not (see _undecided_newline).
        self.horizon = end if final else _undecided_newline(text, end)
        self.refs: list[Ref] = []
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
            single = SINGLE_LINE.match(text, newline + 1) is not None
        else:
            single = self.state.single  # the scan started inside this line
        if single:
            found = text.find("\n", pos, self.end)
        else:
            match = PARAGRAPH_BREAK.search(text, pos, self.end)
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
        tail = self.end - RESTART_MARGIN
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
        match = HTML.match(text, lt, min(lt + MAX_TAG, self._known(limit)))
        if match is None:
            # Nothing here crosses a `<`: a failure before the next one is final.
            if limit == _FAR and lt + MAX_TAG > self.horizon and text.find("<", lt + 1, self.horizon) < 0:
                raise NeedMore(lt)
            return lt + 1
        autolink = match.group("autolink")
        if autolink is not None and autolink.startswith(SANDBOX + MOUNT):
            self.refs.append((lt, match.end(), (AUTO, autolink, "")))
        return match.end()

    def close(
        self, run: int, run_end: int, stack: deque[list[Any]], inactive_below: int
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
        tail = LINK_TAIL.match(text, run_end, bound) if paren_in_reach else None
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
        if destination.startswith(MOUNT) or destination.startswith(SANDBOX + MOUNT):
            what = (IMAGE if image else LINK, destination, text[opener + 1 : last])
            refs.append((start, tail.end(), what))
        return tail.end(), (-1 if image else opener)

    def path_run(self, pos: int) -> int:
        """After a path, outside any link text: the plain paths that follow, as one PathRun (see
        engine/path_runs.py). Returns where scanning goes on (`pos`: no run)."""
        return path_run(self.text, self.end, self.final, pos, self.refs)

    # -------------------------------------------------------------------------------- the main loop

    def run(self, pos: int) -> tuple[int, State]:
        """Scan from `pos`; returns (restart point, the state there): (end, ...) when final."""
        text, end, final, refs, origin = self.text, self.end, self.final, self.refs, self.origin
        self._start = pos
        # (module constants as locals: the path branch runs once per path in the answer)
        not_before_path, trailing_punctuation = NOT_BEFORE_PATH, TRAILING_PUNCTUATION
        longest_path = 10 + MAX_PATH
        fence = self.state.fence
        last_escape = pos if self.state.escaped else -1
        # Link and image openers, oldest first: [position of the first `[` of a run, how many, the first
        # is an image's `![`, a backslash escape ended right before the first].
        stack: deque[list[Any]] = deque()
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
                regex = TOKEN_IN_LINK_TEXT if stack else TOKEN
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
                        if before == ":" and token >= 8 and text.startswith(SANDBOX, token - 8):
                            start = token - 8
                            before = text[start - 1] if start else " "
                        if before in not_before_path or before.isalnum():
                            continue
                        if token_end - token == longest_path and token_end < end:
                            next_char = text[token_end]
                            if next_char not in PATH_STOP and not next_char.isspace():
                                continue  # longer than any stored path
                        path = text[start:token_end].rstrip(trailing_punctuation)
                        mount_end = token - start + 10
                        if len(path) > mount_end and (path[-1] != "/" or path[mount_end:].strip("/")):
                            refs.append((start, start + len(path), path))
                            if not stack and token_end < end:
                                after = self.path_run(token_end)
                                if after > token_end:
                                    resume = after
                                    break
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
                        if regex is TOKEN:
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
            return end, START
        return self._stopped(NeedMore(self.safe_point(pos)), stack, stack_limit, stack_known, last_escape)

    def _stopped(
        self, stop: NeedMore, stack: deque[list[Any]], stack_limit: int, stack_known: bool, last_escape: int
    ) -> tuple[int, State]:
        """The restart point for a scan that stopped at `stop`: before the first opener that may still
        start a link, if any; what was found from there on is found again by the next scan."""
        text = self.text
        at = stop.at
        # A construct starts before its token: at `sandbox:` before a path, at an image's `!`.
        if text.startswith("/", at) and at >= 8 and text.startswith(SANDBOX, at - 8):
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
            single = SINGLE_LINE.match(text, newline + 1) is not None
        else:
            single = self.state.single
        if fence is None and not (verbatim or single or escaped):
            return at, START  # the usual case: no new object
        return at, State(fence, verbatim, single, escaped)


def _undecided_newline(text: str, end: int) -> int:
    """Where the text may still turn out to end a paragraph: its last newline, if what follows it so far
    could still become a blank line or the start of another block; else the end. (Earlier newlines are
    decided: the line after each is complete, and a break needs at most 66 characters of it.)"""
    newline = text.rfind("\n", max(0, end - 70), end)
    if newline < 0 or PARAGRAPH_BREAK.match(text, newline, end):
        return end
    return newline if BREAK_PREFIX.fullmatch(text, newline + 1, end) else end


def find_references(text: str) -> list[Ref]:
    """The references in the prose of a complete text."""
    if MOUNT not in text:
        return []
    scan = Scan(text, len(text), True, True, START)
    scan.run(0)
    return scan.refs
