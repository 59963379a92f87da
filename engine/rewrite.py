"""Turn `/mnt/data/...` paths in a model's markdown answer into working links.

The model only knows the sandbox's view (`/mnt/data/report.csv`, `sandbox:/mnt/data/report.csv`, markdown
links or images pointing at them). The user's browser needs a URL. Rewriting is two passes so the slow
part, publishing, happens once per distinct file and outside the text scan:

1. `find_paths(text)` lists the distinct session-relative paths the prose refers to;
2. the caller resolves them (publishing copies) into `Target`s, or None for a path with no such file;
3. `rewrite(text, targets)` substitutes: images inline, other files as links, unknown paths as plain text.

Fenced code blocks and inline code spans are left exactly as written: they show code, not references.
`StreamingRewriter` applies the same rules to a streamed answer line by line.
"""

from __future__ import annotations

import bisect
import functools
import re
import unicodedata
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from urllib.parse import unquote

__all__ = [
    "References",
    "Resolver",
    "StreamingRewriter",
    "Target",
    "code_span",
    "escape_text",
    "find_paths",
    "mention",
    "resolve_all",
    "rewrite",
]

MOUNT = "/mnt/data/"


@dataclass(frozen=True, slots=True)
class Target:
    """Where a session file can be fetched by the user's browser."""

    url: str
    name: str
    is_image: bool = False


Resolver = Callable[[str], Awaitable[Target | None]]

# A markdown link or image whose destination is in the session: ![alt](sandbox:/mnt/data/x "title").
# The destination may be wrapped in <...> (CommonMark's form for names with spaces).
_MD_LINK = (
    r"(?P<bang>!?)\[(?P<label>[^\]\n]{0,500})\]\(\s*"
    r"(?:<(?P<angled>(?:sandbox:)?/mnt/data/[^>\n]+)>|(?P<plain>(?:sandbox:)?/mnt/data/[^)\s]+))"
    r"(?:\s+(?:\"[^\"\n]*\"|'[^'\n]*'))?\s*\)"
)
# A bare path in prose. It ends at whitespace or at characters that cannot be part of a path the way a
# model writes one in a sentence; trailing sentence punctuation is trimmed afterwards.
_BARE = r"(?<![\w/.:-])(?P<bare>(?:sandbox:)?/mnt/data/[^\s<>()\[\]{}`\"'|*]+)"
_REFERENCE = re.compile(f"{_MD_LINK}|{_BARE}")
# Between a markdown link's `](` and its /mnt/data destination: spaces, `<`, `sandbox:`.
_DESTINATION_LEAD = re.compile(r"\]\(\s*<?(?:sandbox:)?$")
_TRAILING_PUNCTUATION = ".,;:!?"

_FENCE_OPEN = re.compile(r"^ {0,3}(?P<fence>`{3,}|~{3,})")
_BACKTICKS = re.compile(r"`+")
# Characters that would change the meaning of link text in markdown or HTML.
_LABEL_ESCAPES = str.maketrans(
    {"&": "&amp;", "<": "&lt;", ">": "&gt;", **{c: "\\" + c for c in "\\`*_{}[]()#+!|~"}}
)


def _relative(destination: str) -> str | None:
    """Session-relative path of a `/mnt/data/...` destination, or None if it names no file."""
    path = destination.removeprefix("sandbox:")
    if not path.startswith(MOUNT):
        return None
    relative = path[len(MOUNT) :].rstrip("/")
    return relative or None


def _trim_bare(path: str) -> str:
    return path.rstrip(_TRAILING_PUNCTUATION)


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


def code_span(text: str) -> str:
    """Text shown literally: an inline code span, fenced with more backticks than the text holds."""
    text = _visible(text)
    fence = "`" * (max((len(run) for run in _BACKTICKS.findall(text)), default=0) + 1)
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


@functools.lru_cache(maxsize=16)
def _closing_run(length: int) -> re.Pattern[str]:
    return re.compile(f"(?<!`)`{{{length}}}(?!`)")


def _prose_spans(line: str) -> Iterator[tuple[int, int]]:
    """Yield (start, end) of the parts of one line that are outside inline code spans."""
    position = 0
    start = 0
    while True:
        opening = _BACKTICKS.search(line, position)
        if opening is None:
            break
        # A code span closes at the next run of exactly the same length.
        closing = _closing_run(len(opening.group())).search(line, opening.end())
        if closing is None:
            position = opening.end()
            continue
        yield start, opening.start()
        start = position = closing.end()
    yield start, len(line)


def closes_fence(fence: str, line: str) -> bool:
    """Whether ``line`` closes a code block opened with ``fence`` (as long a run of the same mark)."""
    stripped = line.strip()
    return stripped.startswith(fence) and set(stripped) <= {fence[0]}


class _FenceTracker:
    """Knows, line by line, whether we are inside a fenced code block."""

    def __init__(self) -> None:
        self._fence: str | None = None

    def is_code(self, line: str) -> bool:
        if self._fence is None:
            match = _FENCE_OPEN.match(line)
            if match:
                self._fence = match.group("fence")
                return True
            return False
        if closes_fence(self._fence, line):
            self._fence = None
        return True


_FENCE_LINE = re.compile(r"^ {0,3}(`{3,}|~{3,})[^\n]*", re.MULTILINE)


def _fenced_blocks(text: str) -> list[tuple[int, int]]:
    """(start, end) of each fenced code block, an unclosed one running to the end of the text."""
    blocks: list[tuple[int, int]] = []
    opening: tuple[int, str] | None = None
    for line in _FENCE_LINE.finditer(text):
        if opening is None:
            opening = (line.start(), line.group(1))
            continue
        if closes_fence(opening[1], line.group()):
            blocks.append((opening[0], line.end()))
            opening = None
    if opening is not None:
        blocks.append((opening[0], len(text)))
    return blocks


def _matches_at_mounts(text: str) -> Iterator[re.Match[str]]:
    """The reference matches in `text`, found from each occurrence of `/mnt/data/` rather than by
    trying the pattern at every character (ten times faster on a long answer)."""
    position = 0
    while (found := text.find(MOUNT, position)) >= 0:
        line_start = text.rfind("\n", 0, found) + 1
        match = None
        lead = _DESTINATION_LEAD.search(text, line_start, found)
        if lead is not None:
            # A markdown link's destination: its label opens at the last `[` before the `](`.
            bracket = text.rfind("[", line_start, lead.start())
            if bracket >= 0:
                opening = bracket - 1 if bracket > line_start and text[bracket - 1] == "!" else bracket
                match = _REFERENCE.match(text, opening)
        if match is None:
            start = found - len("sandbox:") if text.startswith("sandbox:", found - len("sandbox:")) else found
            start = max(start, line_start)
            match = _REFERENCE.match(text, start)
        if match is None or match.end() <= found:
            position = found + len(MOUNT)
            continue
        yield match
        position = match.end()


def _references(text: str) -> Iterator[tuple[re.Match[str], str | None]]:
    """Each session reference in prose with the relative path it names (None: not a file path).

    One regex pass over the whole text finds the candidates; code is then excluded per candidate
    (fenced blocks by offset, inline code by looking at that one line), so the cost follows the
    number of references, not the number of lines."""
    if "/mnt/data/" not in text:
        return
    blocks = _fenced_blocks(text) if "```" in text or "~~~" in text else []
    block_starts = [start for start, _ in blocks]
    prose_by_line: dict[int, list[tuple[int, int]]] = {}
    for match in _matches_at_mounts(text):
        start, end = match.span()
        index = bisect.bisect_right(block_starts, start) - 1
        if index >= 0 and start < blocks[index][1]:
            continue
        line_start = text.rfind("\n", 0, start) + 1
        line_end = text.find("\n", end)
        line_end = len(text) if line_end < 0 else line_end
        if text.find("`", line_start, line_end) >= 0:
            spans = prose_by_line.get(line_start)
            if spans is None:
                line = text[line_start:line_end]
                spans = [(line_start + a, line_start + b) for a, b in _prose_spans(line)]
                prose_by_line[line_start] = spans
            if not any(a <= start and end <= b for a, b in spans):
                continue
        if match.group("bare") is not None:
            yield match, _relative(_trim_bare(match.group("bare")))
        else:
            yield match, _relative(match.group("angled") or match.group("plain"))


def _candidates(relative: str) -> list[str]:
    """The path as written, then percent-decoded (models write `my%20file.csv` in link targets)."""
    decoded = unquote(relative)
    return [relative] if decoded == relative else [relative, decoded]


class References:
    """The session references found in one text: scan once, then list the paths and substitute."""

    __slots__ = ("_found", "_text")

    def __init__(self, text: str) -> None:
        self._text = text
        self._found = list(_references(text))

    @property
    def paths(self) -> list[str]:
        """Distinct session-relative paths, in order of appearance (each also percent-decoded)."""
        seen: dict[str, None] = {}
        for _match, relative in self._found:
            if relative is not None:
                for candidate in _candidates(relative):
                    seen.setdefault(candidate, None)
        return list(seen)

    def rewrite(self, targets: Mapping[str, Target | None], *, inline_images: bool = True) -> str:
        """Replace each reference by a link to its target; unknown files stay plain text.

        With `inline_images=False` images become plain links too (for lists of files, where showing
        every picture would repeat what the answer shows)."""
        if not self._found:
            return self._text
        text = self._text
        pieces: list[str] = []
        position = 0
        for match, relative in self._found:
            pieces.append(text[position : match.start()])
            pieces.append(_replacement(match, relative, targets, inline_images))
            position = match.end()
        pieces.append(text[position:])
        return "".join(pieces)


def find_paths(text: str) -> list[str]:
    """Distinct session-relative paths referred to in the prose of `text`, in order of appearance."""
    return References(text).paths


async def resolve_all(paths: list[str], resolve: Resolver) -> dict[str, Target | None]:
    return {path: await resolve(path) for path in paths}


def _lookup(targets: Mapping[str, Target | None], relative: str | None) -> Target | None:
    if relative is None:
        return None
    for candidate in _candidates(relative):
        target = targets.get(candidate)
        if target is not None:
            return target
    return None


def _render(target: Target, label: str | None, inline_images: bool = True) -> str:
    text = _escape_label(label if label else target.name)
    if target.is_image and inline_images:
        return f"![{text}]({target.url})"
    return f"[{text}]({target.url})"


def _replacement(
    match: re.Match[str], relative: str | None, targets: Mapping[str, Target | None], inline_images: bool
) -> str:
    target = _lookup(targets, relative)
    bare = match.group("bare")
    if bare is not None:
        trimmed = _trim_bare(bare)
        tail = bare[len(trimmed) :]
        if target is None:
            return match.group()
        return _render(target, None, inline_images) + tail
    label = match.group("label")
    destination = match.group("angled") or match.group("plain")
    if target is None:
        # Never leave a dead link: keep what the model said, as plain text.
        shown = label.strip() or destination
        return shown if shown == destination else f"{shown} ({destination})"
    if match.group("bang") and not (target.is_image and inline_images):
        # An image of a file the browser will not render inline: offer it as a download instead.
        return f"[{_escape_label(label or target.name)}]({target.url})"
    return _render(target, label, inline_images)


def rewrite(text: str, targets: Mapping[str, Target | None], *, inline_images: bool = True) -> str:
    """`References(text).rewrite(targets)`: links for known files, plain text for the others."""
    return References(text).rewrite(targets, inline_images=inline_images)


class StreamingRewriter:
    """Rewrite a streamed answer: whole lines are rewritten and released, the partial last line is held.

    Holding back only the unfinished line keeps streaming responsive while making sure a path split
    across chunks (`/mnt/` + `data/x.csv`) is still seen whole.
    """

    def __init__(self, resolve: Resolver) -> None:
        self._resolve = resolve
        self._pending = ""
        self._fences = _FenceTracker()
        self._known: dict[str, Target | None] = {}

    async def feed(self, chunk: str) -> str:
        self._pending += chunk
        cut = self._pending.rfind("\n") + 1
        if cut == 0:
            return ""
        ready, self._pending = self._pending[:cut], self._pending[cut:]
        return await self._release(ready)

    async def flush(self) -> str:
        ready, self._pending = self._pending, ""
        return await self._release(ready)

    async def _release(self, text: str) -> str:
        out: list[str] = []
        for line in text.splitlines(keepends=True):
            if self._fences.is_code(line) or "/mnt/data/" not in line:
                out.append(line)
                continue
            references = References(line)
            for path in references.paths:
                if path not in self._known:
                    self._known[path] = await self._resolve(path)
            out.append(references.rewrite(self._known))
        return "".join(out)
