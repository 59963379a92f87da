"""Print the valves of the Pipe, the Tool and the Filter as the markdown tables the README shows (tests
keep them in step).

    python tools/valves_table.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from functions.adapter import SessionValves
from functions.code_sessions import Pipe
from functions.code_sessions_filter import Filter


def _default(value: object) -> str:
    if value == "":
        return '`""`'
    return f"`{value}`"


def table(model: type, skip: type | None = None) -> str:
    rows = ["| valve | default | what it does |", "|---|---|---|"]
    for name, field in model.model_fields.items():
        if skip is not None and name in skip.model_fields:
            continue
        description = (field.description or "").replace("|", "\\|")
        rows.append(f"| `{name}` | {_default(field.default)} | {description} |")
    return "\n".join(rows)


def main() -> None:
    print("The Pipe's own admin valves:\n")
    print(table(Pipe.Valves, skip=SessionValves))
    print("\nSession valves (the Pipe's and the Tool's):\n")
    print(table(SessionValves))
    print("\nThe Filter's valves:\n")
    print(table(Filter.Valves))
    print("\nThe Pipe's user valves (each user, in the chat's controls):\n")
    print(table(Pipe.UserValves))


if __name__ == "__main__":
    main()
