"""Fenced code blocks: the one parser behind the fenced execution mode and the link rewriter.

`runnable_blocks` finds the blocks to run for models that cannot call tools. The link scan
(engine/scan.py) drives the same functions (`fence_line_start`, `fence_opening`, `closing_line`) from its
own scan, with `final=False` while an answer is still streaming in: then a question this text cannot
answer yet (is this line, still unfinished, a fence?) raises `NeedMore` instead of guessing.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = [
    "MAX_FENCE_LINE",
    "MAX_RUN",
    "CodeBlock",
    "Fence",
    "NeedMore",
    "closing_line",
    "fence_line_start",
    "fence_opening",
    "fenced_blocks",
    "runnable_blocks",
]

_LANGUAGES = {
    "python": "python",
    "py": "python",
    "python3": "python",
    "bash": "bash",
    "sh": "bash",
    "shell": "bash",
}
# Only this much of an opening line is read for its info string, and a longer line does not close a
# block. Bounds, so that a streamed line that never ends cannot keep the rewriter from deciding.
MAX_FENCE_LINE = 1024
# A longer run of backticks or tildes delimits nothing (no fence here, no code span in the rewriter).
MAX_RUN = 1000
# Three or more backticks or tildes. Written with a literal first character so that `re` can skip to
# candidates quickly instead of trying the pattern at every position.
_RUN = re.compile(r"````*|~~~~*")
# An unfinished last line that could still turn out to close the block.
_COULD_CLOSE = re.compile(r"[^\S\n]*(?:`*|~*)[^\S\n]*")


class NeedMore(Exception):
    """The text ends before this can be decided. Scanning resumes at `at` with the state given."""

    def __init__(self, at: int, *, fence: Fence | None = None, verbatim: int = 0) -> None:
        super().__init__(at)
        self.at = at
        self.fence = fence
        self.verbatim = verbatim


@dataclass(frozen=True, slots=True)
class Fence:
    """An open fenced code block: its mark (` or ~), how many, and the info string after them."""

    mark: str
    length: int
    info: str


@dataclass(frozen=True, slots=True)
class CodeBlock:
    language: str  # "python" or "bash"
    code: str


def fence_line_start(text: str, run: int, origin: bool) -> int:
    """Where the line starts if the run of marks at `run` opens its line after at most three spaces,
    else -1. `origin`: index 0 is the start of the whole text (not a resumed piece of it)."""
    start = run
    while start > 0 and run - start < 3 and text[start - 1] == " ":
        start -= 1
    if start == 0:
        return 0 if origin else -1
    return start if text[start - 1] == "\n" else -1


def fence_opening(text: str, line: int, run: int, run_end: int, end: int, final: bool) -> Fence | None:
    """The fence that the run `text[run:run_end]` (at the start of the line at `line`) opens, or None:
    a backtick fence's info string cannot hold a backtick (CommonMark), else it is inline code."""
    if run_end - run > MAX_RUN:
        return None
    limit = min(end, line + MAX_FENCE_LINE)
    newline = text.find("\n", run_end, limit)
    stop = newline if newline >= 0 else limit
    mark = text[run]
    if mark == "`" and text.find("`", run_end, stop) >= 0:
        return None
    if newline < 0 and not final and end < line + MAX_FENCE_LINE:
        raise NeedMore(line)
    return Fence(mark, run_end - run, text[run_end:stop].strip())


def closing_line(fence: Fence, text: str, pos: int, end: int, final: bool) -> tuple[int, int]:
    """(start, end) of the line that closes `fence`, reading whole lines from `pos` (a line start, or a
    point inside a line that cannot close it); (end, end) if the text ends first. A closing line is the
    same mark, at least as many, alone on its line with any indentation, the line at most MAX_FENCE_LINE."""
    if pos > 0 and text[pos - 1] != "\n":
        newline = text.find("\n", pos, end)
        if newline < 0:
            if final:
                return end, end
            raise NeedMore(end, fence=fence)
        pos = newline + 1
    line = pos
    while (match := _RUN.search(text, line, end)) is not None:
        run, run_end = match.span()
        newline = text.rfind("\n", line, run)
        start = newline + 1 if newline >= 0 else line
        eol = text.find("\n", run_end, end)
        line_end = eol if eol >= 0 else end
        if (
            text[run] == fence.mark
            and run_end - run >= fence.length
            and line_end - start <= MAX_FENCE_LINE
            and (start == run or text[start:run].isspace())
            and (run_end == line_end or text[run_end:line_end].isspace())
        ):
            if eol < 0 and not final:
                raise NeedMore(start, fence=fence)
            return start, (eol + 1 if eol >= 0 else end)
        if eol < 0:
            line = start
            break
        line = eol + 1  # one candidate per line: each line is looked at once
    if final:
        return end, end
    newline = text.rfind("\n", line, end)
    last = newline + 1 if newline >= 0 else line
    if end - last <= MAX_FENCE_LINE and _COULD_CLOSE.fullmatch(text, last, end):
        raise NeedMore(last, fence=fence)
    raise NeedMore(end, fence=fence)  # the rest of this line cannot close the block: skip to the next


def fenced_blocks(text: str) -> Iterator[tuple[Fence, int, int]]:
    """Each fenced code block as (fence, body start, body end); an unclosed one runs to the end."""
    end = len(text)
    pos = 0
    while (match := _RUN.search(text, pos)) is not None:
        run, run_end = match.span()
        line = fence_line_start(text, run, True)
        fence = fence_opening(text, line, run, run_end, end, True) if line >= 0 else None
        if fence is None:
            pos = run_end
            continue
        newline = text.find("\n", run_end)
        body = newline + 1 if newline >= 0 else end
        close, pos = closing_line(fence, text, run_end, end, True)
        yield fence, body, max(body, close)


def runnable_blocks(text: str) -> list[CodeBlock]:
    """Fenced blocks tagged python/py/bash/sh/shell, in order. Untagged or other blocks are not run:
    a model showing an example in another language must not have it executed."""
    blocks: list[CodeBlock] = []
    for fence, start, end in fenced_blocks(text):
        words = fence.info.split()
        language = _LANGUAGES.get(words[0].lower()) if words else None
        # splitlines, as the block's lines: \r\n and the other line breaks Python knows end a line.
        code = "\n".join(text[start:end].splitlines()).strip("\n")
        if language and code.strip():
            blocks.append(CodeBlock(language, code + "\n"))
    return blocks
