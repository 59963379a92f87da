"""Bare paths in a row, taken at once by the scan (engine/scan.py): a line of 70,000 `](/mnt/data/x `
is one reference (grammar.PathRun), judged by the main loop's rules in C, not a microsecond of Python
per path.

After a path, outside any link text, the stretch up to the first character that starts another kind of
token (an escape, a backtick, a tilde, a link opener, a tag, a URL's `:`) holds only paths and text no
token starts with. When no path in it is in doubt (grammar.PATH_RUN_DOUBT: one the main loop would
judge otherwise), every /mnt/data/ in it starts a path token, and one regex pass lists the distinct
paths. Otherwise the stretch is split into gaps and paths and judged in windows, and the run ends
before the first path that fails; the main loop takes it from there.
"""

from __future__ import annotations

from operator import itemgetter

from .grammar import (
    MAX_PATH,
    MOUNT,
    NOT_BEFORE_PATH,
    PATH_RUN_DOUBT,
    PATH_SPLIT,
    PATH_STOP,
    PATH_TOKEN,
    TRAILING_PUNCTUATION,
    PathRun,
    Ref,
    doubt_or_other_path,
)

__all__ = ["path_run"]

_RUN_WINDOW = 64  # a judged stretch's first window
_RUN_ENDS = "\\`~[<:"  # what ends a stretch: the first characters of the other tokens
_NOT_BEFORE_RUN_PATH = frozenset(NOT_BEFORE_PATH)
_NOT_LAST_IN_RUN_PATH = frozenset(TRAILING_PUNCTUATION + "/")


def path_run(text: str, end: int, final: bool, pos: int, refs: list[Ref]) -> int:
    """The plain paths after `pos` (the end of a path token the main loop took), added to `refs` as
    one PathRun; returns where scanning goes on (`pos`: no run). `final`: the text ends at `end`
    (else a path touching `end` may go on)."""
    limit = end
    for char in _RUN_ENDS:  # (a find per character is memchr's speed; a regex class is not)
        at = text.find(char, pos, limit)
        if at >= 0:
            limit = at
    last = text.rfind(MOUNT, pos, limit)
    if last < 0:
        return pos
    stop = PATH_TOKEN.match(text, last, limit).end()  # type: ignore[union-attr]
    if stop == limit and (limit < end or not final):
        before = text[last - 1]
        if before not in PATH_STOP and not before.isspace():
            return _judged_run(text, end, final, pos, limit, refs)  # that /mnt/data/ may be inside a path
        stop = last  # the last path may go on (or its token be cut): the main loop takes it
        if text.rfind(MOUNT, pos, stop) < 0:
            return pos
    paths = _plain_paths(text, pos, stop)
    if paths is None:
        return _judged_run(text, end, final, pos, limit, refs)
    # No doubt: every /mnt/data/ up to `stop` starts a path token.
    refs.append((pos, stop, PathRun(paths)))
    return stop


def _judged_run(text: str, end: int, final: bool, pos: int, limit: int, refs: list[Ref]) -> int:
    """path_run for a stretch with a path in doubt: split into gaps and paths and judged (_judged), in
    windows that grow while every path in them passes, so a text whose paths fail every other time
    costs a small window per path. The run ends before the first path that fails."""
    paths: list[str] = []
    at, size = pos, _RUN_WINDOW
    while at < limit:
        stop = min(limit, at + size)
        parts = PATH_SPLIT.split(text[at:stop])  # gap, path, gap, ..., path, gap
        n = len(parts) // 2
        if n and not parts[-1] and (stop < end or not final):
            n -= 1  # the last path touches the window's end: it may go on
        gaps, window_paths = parts[0 : 2 * n : 2], parts[1 : 2 * n : 2]
        good = _judged(gaps, window_paths)
        if good:
            paths += window_paths[:good]
            at += sum(map(len, gaps[:good])) + sum(map(len, window_paths[:good]))
        if good < n or stop == limit:
            break
        size *= 4
    if paths:
        refs.append((pos, at, PathRun(list(dict.fromkeys(paths)))))
    return at


_LAST = itemgetter(-1)
_FEW_PATHS = 8  # distinct paths found by a search each (beyond: all listed)


def _plain_paths(text: str, pos: int, stop: int) -> list[str] | None:
    """The distinct paths of a stretch, in order, or None when a path in it is in doubt: usually a few
    however many times each is named, each found by one search for a path in doubt or none of those
    found so far (C, nothing allocated per path)."""
    found: tuple[str, ...] = ()
    at = pos
    while len(found) < _FEW_PATHS:
        hit = doubt_or_other_path(found).search(text, at, stop)
        if hit is None:
            return list(found)
        if hit.group("doubt") is not None:
            return None
        token = PATH_TOKEN.match(text, hit.start(), stop)
        assert token is not None
        found += (token.group(),)
        at = token.end()
    if PATH_RUN_DOUBT.search(text, at, stop):
        return None
    return list(dict.fromkeys([*found, *PATH_TOKEN.findall(text, at, stop)]))


def _judged(gaps: list[str], paths: list[str]) -> int:
    """How many of the (gap, path) pairs, from the first, the main loop would take as they are: a path
    after a character that does not join it to a word or URL, with no trailing punctuation or `/` to
    cut off, shorter than the longest path a token holds. Checked on the distinct last characters (C);
    one at a time only to find the first that fails. (Gaps are never empty: paths are whole tokens.)"""
    befores = set(map(_LAST, gaps))
    if (
        not any(c in _NOT_BEFORE_RUN_PATH or c.isalnum() for c in befores)
        and _NOT_LAST_IN_RUN_PATH.isdisjoint(map(_LAST, paths))
        and (not paths or max(map(len, paths)) < 10 + MAX_PATH)
    ):
        return len(paths)
    for n, (gap, path) in enumerate(zip(gaps, paths, strict=True)):
        before = gap[-1]
        if before in _NOT_BEFORE_RUN_PATH or before.isalnum():
            return n
        if path[-1] in _NOT_LAST_IN_RUN_PATH or len(path) >= 10 + MAX_PATH:
            return n
    return len(paths)
