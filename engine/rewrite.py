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

import functools
import re
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from urllib.parse import unquote

__all__ = ["Resolver", "StreamingRewriter", "Target", "find_paths", "resolve_all", "rewrite"]

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
_TRAILING_PUNCTUATION = ".,;:!?"

_FENCE_OPEN = re.compile(r"^ {0,3}(?P<fence>`{3,}|~{3,})")
_BACKTICKS = re.compile(r"`+")
# Characters that would change the meaning of link text in markdown or HTML.
_MD_SPECIAL = re.compile(r"([\\`*_{}\[\]()#+!|~])")


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
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    text = _MD_SPECIAL.sub(r"\\\1", text)
    return " ".join(text.split())  # a newline in a name must not break the link apart


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


class _FenceTracker:
    """Knows, line by line, whether we are inside a fenced code block."""

    def __init__(self) -> None:
        self._fence: str | None = None

    @property
    def inside(self) -> bool:
        return self._fence is not None

    def is_code(self, line: str) -> bool:
        if self._fence is None:
            match = _FENCE_OPEN.match(line)
            if match:
                self._fence = match.group("fence")
                return True
            return False
        stripped = line.strip()
        if stripped.startswith(self._fence) and set(stripped) <= {self._fence[0]}:
            self._fence = None
        return True


def _iter_prose(text: str) -> Iterator[tuple[int, int]]:
    """(start, end) offsets of all prose in `text`: outside fenced blocks and inline code."""
    fences = _FenceTracker()
    offset = 0
    for line in text.splitlines(keepends=True):
        if "/mnt/data/" in line or "`" in line or "~" in line:
            if not fences.is_code(line):
                for start, end in _prose_spans(line):
                    yield offset + start, offset + end
        elif not fences.inside:
            yield offset, offset + len(line)
        offset += len(line)


def _references(text: str) -> Iterator[tuple[re.Match[str], str | None]]:
    """Each session reference in prose with the relative path it names (None: not a file path)."""
    if "/mnt/data/" not in text:
        return
    for start, end in _iter_prose(text):
        if text.find("/mnt/data/", start, end) < 0:
            continue
        for match in _REFERENCE.finditer(text, start, end):
            if match.group("bare") is not None:
                yield match, _relative(_trim_bare(match.group("bare")))
            else:
                yield match, _relative(match.group("angled") or match.group("plain"))


def _candidates(relative: str) -> list[str]:
    """The path as written, then percent-decoded (models write `my%20file.csv` in link targets)."""
    decoded = unquote(relative)
    return [relative] if decoded == relative else [relative, decoded]


def find_paths(text: str) -> list[str]:
    """Distinct session-relative paths referred to in the prose of `text`, in order of appearance."""
    seen: dict[str, None] = {}
    for _match, relative in _references(text):
        if relative is not None:
            for candidate in _candidates(relative):
                seen.setdefault(candidate, None)
    return list(seen)


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
    """Replace each reference in prose by a link to its target; unknown files stay plain text.

    With `inline_images=False` images become plain links too (for lists of files, where showing every
    picture would repeat what the answer shows)."""
    pieces: list[str] = []
    position = 0
    for match, relative in _references(text):
        pieces.append(text[position : match.start()])
        pieces.append(_replacement(match, relative, targets, inline_images))
        position = match.end()
    if not pieces:
        return text
    pieces.append(text[position:])
    return "".join(pieces)


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
            for path in find_paths(line):
                if path not in self._known:
                    self._known[path] = await self._resolve(path)
            out.append(rewrite(line, self._known))
        return "".join(out)
