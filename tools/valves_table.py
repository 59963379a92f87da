"""Print the valves of the function as the markdown table the README shows (tests keep them in step).

    python tools/valves_table.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from functions.code_sessions import Pipe


def _default(value: object) -> str:
    if value == "":
        return '`""`'
    return f"`{value}`"


def table(model: type) -> str:
    rows = ["| valve | default | what it does |", "|---|---|---|"]
    for name, field in model.model_fields.items():
        description = (field.description or "").replace("|", "\\|")
        rows.append(f"| `{name}` | {_default(field.default)} | {description} |")
    return "\n".join(rows)


def main() -> None:
    print("Admin valves:\n")
    print(table(Pipe.Valves))
    print("\nUser valves (each user, in the chat's controls):\n")
    print(table(Pipe.UserValves))


if __name__ == "__main__":
    main()
