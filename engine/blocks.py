"""Find the runnable fenced code blocks in a reply, for models that cannot call tools."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .rewrite import closes_fence

__all__ = ["CodeBlock", "runnable_blocks"]

_LANGUAGES = {
    "python": "python",
    "py": "python",
    "python3": "python",
    "bash": "bash",
    "sh": "bash",
    "shell": "bash",
}
_OPEN = re.compile(r"^ {0,3}(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\n]*)$")


@dataclass(frozen=True, slots=True)
class CodeBlock:
    language: str  # "python" or "bash"
    code: str


def runnable_blocks(text: str) -> list[CodeBlock]:
    """Fenced blocks tagged python/py/bash/sh/shell, in order. Untagged or other blocks are not run:
    a model showing an example in another language must not have it executed."""
    blocks: list[CodeBlock] = []
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        match = _OPEN.match(lines[index])
        if not match:
            index += 1
            continue
        fence = match.group("fence")
        words = match.group("info").split()
        language = _LANGUAGES.get(words[0].lower()) if words else None
        body: list[str] = []
        index += 1
        while index < len(lines):
            if closes_fence(fence, lines[index]):
                break
            body.append(lines[index])
            index += 1
        index += 1
        code = "\n".join(body).strip("\n")
        if language and code.strip():
            blocks.append(CodeBlock(language, code + "\n"))
    return blocks
