"""Rewrite a model's answer into working links while it streams, with the output of rewriting it whole.

A scan's decisions about a stretch of text depend on at most a few KiB after it (engine/grammar.py), so
`StreamingRewriter` releases text as soon as nothing later can change it, holds back only what a
construct still open might change, and gives the same output as `rewrite` (engine/links.py) gives for
the whole answer.
"""

from __future__ import annotations

import asyncio
import re
from collections import deque
from typing import Any

from .grammar import MOUNT, SINGLE_LINE, TOKEN, PathRun, Ref
from .links import NOT_YET, Resolver, Substitution, Target, destinations
from .scan import LOOK_BEHIND, RESTART_MARGIN, SCAN_ON_LOOP_CHARS, START, Scan, State

__all__ = ["StreamingRewriter", "rewrite_chunk"]

# Where a reference could start, for releasing streamed text that nothing later can change.
_CHANGE = re.compile(r"!\[|\[|<sandbox:/mnt/data/|sandbox:/mnt/data/|/mnt/data/")


def _prefixes(word: str) -> str:
    return "|".join(re.escape(word[:n]) for n in range(len(word) - 1, 0, -1))


_PARTIAL_CHANGE = re.compile(
    rf"(?:{_prefixes('<sandbox:/mnt/data/')}|{_prefixes('sandbox:/mnt/data/')}|{_prefixes(MOUNT)}|!)\Z"
)

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
        self._state = START  # ... knowing this
        self._scanned_to = 0  # end of the text at the last scan
        self._out = 0  # the answer before this has been released
        self._ready: deque[Ref] = deque()  # decided references not released yet
        self._wanted: dict[str, None] = {}  # the paths they name that are not resolved yet
        # Paths to resolve (`resolve_pending`) before more text can be released; usually empty. A plain
        # attribute, not a property: the stream loop reads it after every piece.
        self.pending: tuple[str, ...] = ()
        self._replace = Substitution(self._known, True)

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
            if final or state.fence or state.verbatim or TOKEN.search(text, clean - base):
                scan = Scan(text, end - base, final, base == 0, state)
                at, self._state = scan.run(clean - base)
                if scan.refs:
                    self._decided(scan.refs, base)
                self._clean = at + base
            else:
                quiet = True  # (where a reference could start is a token too)
            if quiet and end - RESTART_MARGIN > clean:
                # Prose without a single token (the usual case for plain text): a scan would find
                # nothing and only move its restart point, with the state of that point's line.
                self._clean = at = end - RESTART_MARGIN
                newline = text.rfind("\n", clean - base, at - base)
                single = state.single if newline < 0 else SINGLE_LINE.match(text, newline + 1) is not None
                if single != state.single or state.escaped:
                    self._state = State(single=single)
        released = self._release(quiet)
        # Drop what is released and what the next scan does not read (it reads LOOK_BEHIND before its
        # start); only when that is a good part of the text, so that copying stays linear.
        drop = min(self._out, self._clean - LOOK_BEHIND) - base
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
        done, not_yet = replace.done, NOT_YET
        pieces: list[str] = []
        position = self._out
        while ready:
            start, end, what = ready[0]
            if isinstance(what, PathRun):
                woven = replace.run_text(what, text[start - base : end - base], resolved_only=True)
                if woven is None:
                    break
                pieces.append(text[position - base : start - base])
                pieces.append(woven)
                position = end
                ready.popleft()
                continue
            replacement = done.get(what, not_yet)
            if replacement is not_yet:
                if not replace.resolved(what):
                    break
                replacement = replace.compute(what)
            if isinstance(replacement, str):  # None: the path stays as written
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

    def _decided(self, refs: list[Ref], base: int) -> None:
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
                for destination in destinations(what):
                    if destination in done:
                        continue
                    for candidate in candidates(destination):
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


async def rewrite_chunk(rewriter: StreamingRewriter, event: dict[str, Any]) -> dict[str, Any]:
    """Rewrite an OpenAI chat.completion.chunk's text in place (the Filter's stream): paths become
    links as they complete; a path split across chunks is held back until it is whole, and the end of
    each model call (its finish_reason) releases the rest. What is not a chunk's text is left as is.

    Called for every chunk of an answer, so the common case (a chunk of plain text) is a few reads and a
    sync push."""
    for choice in event.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            delta = {}
        text = delta.get("content")
        if text and isinstance(text, str):
            if len(text) > SCAN_ON_LOOP_CHARS:  # a whole answer in one piece: scanned in a thread
                visible = await asyncio.to_thread(rewriter.push, text)
            else:
                visible = rewriter.push(text)
            if rewriter.pending:
                visible += await rewriter.resolve_pending()
            delta["content"] = visible
        if choice.get("finish_reason"):
            tail = await rewriter.flush()
            if tail:
                delta["content"] = (delta.get("content") or "") + tail
                choice["delta"] = delta
    return event
