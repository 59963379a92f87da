"""Turn `/mnt/data/...` paths in a model's markdown answer into working links.

The model only knows the sandbox's view (`/mnt/data/report.csv`, `sandbox:/mnt/data/report.csv`, markdown
links or images pointing at them). The user's browser needs a URL. Rewriting is two passes so the slow
part, publishing, happens once per distinct file and outside the text scan:

1. `References(text)` scans the text once (engine/scan.py) and `.paths` lists the distinct
   session-relative paths;
2. the caller resolves them (publishing copies) into `Target`s, or None for a path with no such file;
3. `.rewrite(targets)` substitutes: images inline, other files as links, unknown paths as plain text.

`StreamingRewriter` (engine/streaming.py) does the same to an answer as it streams.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Final
from urllib.parse import unquote

from .grammar import AUTO, IMAGE, MOUNT, PATH_SPLIT, SANDBOX, PathRun, Ref, What
from .markup import escape_text
from .scan import find_references

__all__ = [
    "NOT_YET",
    "References",
    "Resolver",
    "Substitution",
    "Target",
    "destination_of",
    "destinations",
    "find_paths",
    "resolve_all",
    "rewrite",
]


@dataclass(frozen=True, slots=True)
class Target:
    """Where a session file can be fetched by the user's browser."""

    url: str
    name: str
    is_image: bool = False


Resolver = Callable[[str], Awaitable[Target | None]]


def _relative(destination: str) -> str | None:
    """Session-relative path of a `/mnt/data/...` destination, or None if it names no file."""
    path = destination.removeprefix(SANDBOX)
    if not path.startswith(MOUNT):
        return None
    relative = path[len(MOUNT) :].rstrip("/")
    return relative or None


def _candidates(relative: str) -> list[str]:
    """The path as written, then percent-decoded (models write `my%20file.csv` in link targets)."""
    decoded = unquote(relative)
    return [relative] if decoded == relative else [relative, decoded]


def _render(target: Target, label: str | None, inline_images: bool = True) -> str:
    text = escape_text(label if label else target.name)
    if target.is_image and inline_images:
        return f"![{text}]({target.url})"
    return f"[{text}]({target.url})"


def _replacement(what: str | tuple[int, str, str], target: Target | None, inline_images: bool) -> str | None:
    """What replaces a reference; None: the text as written."""
    if isinstance(what, str):  # a bare path
        return None if target is None else _render(target, None, inline_images)
    kind, destination, label = what
    if kind == AUTO:
        # Unknown: the path as text (an autolink to sandbox: would be a dead link).
        return destination if target is None else _render(target, None, inline_images)
    if target is None:
        # Never leave a dead link: keep what the model said, as plain text.
        shown = label.strip() or destination
        return shown if shown == destination else f"{shown} ({destination})"
    if kind == IMAGE and not (target.is_image and inline_images):
        # An image of a file the browser will not render inline: offer it as a download instead.
        return f"[{escape_text(label or target.name)}]({target.url})"
    return _render(target, label, inline_images)


def destination_of(what: str | tuple[int, str, str]) -> str:
    """The destination a reference names, as written (a bare path is its own)."""
    return what if isinstance(what, str) else what[1]


def destinations(what: What) -> Iterable[str]:
    """The destinations a reference names: one, or a PathRun's distinct paths."""
    if isinstance(what, PathRun):
        return what.paths
    return (destination_of(what),)


NOT_YET: Final = object()  # `Substitution.done` has no entry for this reference yet


class Substitution:
    """Replacements, computed once per distinct reference: an answer may name one file a thousand times,
    and percent-decoding and rendering cost more than a lookup. `done` maps a reference's `what` to its
    replacement (None: keep the text)."""

    __slots__ = ("_candidates", "_inline", "_targets", "done")

    def __init__(self, targets: Mapping[str, Target | None], inline_images: bool) -> None:
        self._targets = targets
        self._inline = inline_images
        self._candidates: dict[str, list[str]] = {}
        self.done: dict[What, str | None] = {}

    def candidates(self, destination: str) -> list[str]:
        """The session paths a destination may name (none if it names no file)."""
        found = self._candidates.get(destination)
        if found is None:
            relative = _relative(destination)
            found = self._candidates[destination] = [] if relative is None else _candidates(relative)
        return found

    def resolved(self, what: str | tuple[int, str, str]) -> bool:
        """Whether every path the reference may name is in the targets (streaming: resolved)."""
        targets = self._targets
        return all(candidate in targets for candidate in self.candidates(destination_of(what)))

    def compute(self, what: str | tuple[int, str, str]) -> str | None:
        target = None
        for candidate in self.candidates(destination_of(what)):
            target = self._targets.get(candidate)
            if target is not None:
                break
        replacement = self.done[what] = _replacement(what, target, self._inline)
        return replacement

    def run_text(self, run: PathRun, text: str, *, resolved_only: bool = False) -> str | None:
        """A PathRun's `text` with each path replaced (or as written, for no file). `resolved_only`
        (streaming): None when a path it names is not resolved yet."""
        done, paths = self.done, run.paths
        for path in paths:  # distinct
            if path not in done:
                if resolved_only and not self.resolved(path):
                    return None
                self.compute(path)
        new = {path: done[path] for path in paths}
        kept = [path for path, replacement in new.items() if replacement is None]
        if (
            len(paths) <= _REPLACE_AT_MOST
            and not any(MOUNT in path[1:] for path in paths)
            and not any(k.startswith(p) for k in kept for p in paths if p != k)
        ):
            # Every /mnt/data/ in the stretch then starts a path, each a whole token: replaced longest
            # first, what is left of a shorter one is that path (replacements name no /mnt/data/).
            for path in sorted(paths, key=len, reverse=True):
                replacement = new[path]
                if replacement is not None:
                    text = text.replace(path, replacement)
            return text
        parts = PATH_SPLIT.split(text)  # gap, path, gap, ..., path, gap
        parts[1::2] = [new[path] or path for path in parts[1::2]]
        return "".join(parts)


_REPLACE_AT_MOST = 8  # distinct paths in a PathRun substituted by str.replace (one pass each)


def _paths_of(refs: list[Ref]) -> list[str]:
    substitution = Substitution({}, True)
    seen: dict[str, None] = {}
    for what in dict.fromkeys(ref[2] for ref in refs):
        for destination in destinations(what):
            for candidate in substitution.candidates(destination):
                seen.setdefault(candidate, None)
    return list(seen)


class References:
    """The session references found in one text: scan once, then list the paths and substitute.

    Constructing one is pure computation on the text (no shared state), so a large answer can be scanned
    in a worker thread; both the scan and `rewrite` are linear in the length of the text."""

    __slots__ = ("_found", "_text")

    def __init__(self, text: str) -> None:
        self._text = text
        self._found = find_references(text)

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
        replace = Substitution(targets, inline_images)
        done, not_yet = replace.done, NOT_YET
        pieces: list[str] = []
        append = pieces.append
        position = 0
        for start, end, what in self._found:
            if isinstance(what, PathRun):
                append(text[position:start])
                append(replace.run_text(what, text[start:end]))  # type: ignore[arg-type]
                position = end
                continue
            replacement = done.get(what, not_yet)
            if replacement is not_yet:
                replacement = replace.compute(what)
            if isinstance(replacement, str):  # None: the path stays as written
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
