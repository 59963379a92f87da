"""The corpus of model-written cells (tests/corpus/*.md): read into categories of cells."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

CORPUS = Path(__file__).resolve().parents[1] / "corpus"

_CELL = re.compile(
    r"^## (?P<name>[a-z0-9][a-z0-9-]*)\n"
    r"(?P<known><!-- known failure: (?P<why>[^\n]*?) -->\n)?"
    r"> (?P<request>[^\n]+)\n\n"
    r"```(?P<language>python|bash)\n(?P<code>.*?)\n```\n",
    re.MULTILINE | re.DOTALL,
)


@dataclass(frozen=True)
class Cell:
    category: str  # the file's stem: one chat
    name: str
    request: str  # what the user asked
    language: str
    code: str
    known_failure: str | None  # why this environment cannot do it (the test checks that it fails)

    @property
    def id(self) -> str:
        return f"{self.category}/{self.name}"

    def source(self) -> str:
        """The cell as run: it prints DONE only when all of it ran (bash stops at its first error). The
        marker is computed, so that the code shown in an answer does not contain it."""
        if self.language == "bash":
            return f'set -euo pipefail\n{self.code}\necho "corpus-cell-""ran-to-its-end"'
        return f'{self.code}\nprint("corpus-cell-" + "ran-to-its-end")'


DONE = "corpus-cell-ran-to-its-end"


def load(folder: Path = CORPUS) -> dict[str, list[Cell]]:
    """Every category's cells, in file order. A heading that does not parse as a cell is an error."""
    categories: dict[str, list[Cell]] = {}
    for path in sorted(folder.glob("*.md")):
        if path.name == "README.md":
            continue
        text = path.read_text(encoding="utf-8")
        cells = [
            Cell(
                category=path.stem,
                name=m["name"],
                request=m["request"],
                language=m["language"],
                code=m["code"],
                known_failure=m["why"],
            )
            for m in _CELL.finditer(text)
        ]
        headings = re.findall(r"^## (.*)$", text, re.MULTILINE)
        if len(headings) != len(cells):
            parsed = {c.name for c in cells}
            broken = [h for h in headings if h not in parsed]
            raise ValueError(f"{path.name}: cells that do not parse: {broken}")
        names = [c.name for c in cells]
        if len(set(names)) != len(names):
            raise ValueError(f"{path.name}: two cells share a name")
        categories[path.stem] = cells
    return categories
