"""An answer's branch of the conversation as a Jupyter notebook (nbformat 4.5): the user's requests and the
assistant's prose as markdown cells, every run as a code cell (bash as `%%bash`) with its outputs as
they were (streams, figures), and a first cell that says where it ran.

The runs come from their records (storage/_history_runs.py); the prose from the saved messages, where
each run has its place: the Pipe's answers hold one collapsible block per run (`markup.details`), the
Tool's a `function_call` item per call in the message's `output`. A run whose record is not kept (an
answer older than the records, a record dropped) becomes a cell that says so. Our links in the prose are
turned back into the /mnt/data paths they stand for. Everything in the notebook (code, output, names) is
the sandbox's or the users' text: it is data in JSON strings, never executed or rendered here.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from storage import AnswerRuns, RunRecord

__all__ = ["NOT_KEPT", "BranchMessage", "build_notebook", "notebook_bytes", "notebook_name"]

NOT_KEPT = (
    "# The code of this run is not kept: its answer was written before runs were recorded, or its "
    "record was dropped (a chat keeps the records of its newest answers)."
)
_SETUP = 'import os\n\nos.chdir("/mnt/data")  # the chat\'s folder: every run of the chat ran there\n'
# A block of ours (`markup.details`) or one of Open WebUI's (tool calls, reasoning): the first mark a run.
_BLOCK = re.compile(r"<details\b[^<>]*>(?:(?!<details\b).)*?</details>", re.S | re.I)
_OURS = re.compile(r"<details>\n<summary>")
_TOOL_CALL = re.compile(r'<details\b[^<>]*type="tool_calls"[^<>]*name="(?:[^"]*\.)?run_code"', re.I)
_IMAGE_LINE = re.compile(r"^!\[[^\]\n]*\]\(/mnt/data/([^)\s]+)\)\s*$", re.M)
_MAX_NAME = 60


@dataclass(frozen=True, slots=True)
class BranchMessage:
    """One message of the branch, from the host's saved chat: its role, its text, and (the Tool's
    answers) Open WebUI's `output` items, which place each tool call in the text."""

    id: str
    role: str
    content: str
    output: tuple[Mapping[str, Any], ...] = ()


def _pieces(message: BranchMessage) -> list[str | None]:
    """The answer as text pieces and run places (None), in order."""
    pieces: list[str | None] = []
    if message.output:
        for item in message.output:
            kind = item.get("type")
            if kind == "message":
                parts = item.get("content") or []
                text = "".join(
                    str(p.get("text"))
                    for p in parts
                    if isinstance(p, Mapping) and isinstance(p.get("text"), str)
                )
                pieces.append(_BLOCK.sub("", text))
            elif kind == "function_call" and str(item.get("name") or "").rsplit(".", 1)[-1] == "run_code":
                pieces.append(None)
        return pieces
    at = 0
    for block in _BLOCK.finditer(message.content):
        pieces.append(message.content[at : block.start()])
        if _OURS.match(block.group()) or _TOOL_CALL.match(block.group()):
            pieces.append(None)
        at = block.end()
    pieces.append(message.content[at:])
    return pieces


def _unlinked(text: str, links: Mapping[str, str]) -> str:
    """Our link URLs in the text turned back into the /mnt/data paths they stand for."""
    if not links or "/" not in text:
        return text
    pattern = re.compile("|".join(re.escape(url) for url in sorted(links, key=len, reverse=True)))
    return pattern.sub(lambda m: f"/mnt/data/{links[m.group()]}", text)


class _Cells:
    def __init__(self) -> None:
        self.cells: list[dict[str, Any]] = []
        self.count = 0

    def _id(self) -> str:
        return f"cell-{len(self.cells) + 1}"

    def markdown(self, text: str) -> None:
        if text.strip():
            self.cells.append(
                {"cell_type": "markdown", "id": self._id(), "metadata": {}, "source": text.strip()}
            )

    def code(
        self, source: str, outputs: list[dict[str, Any]], metadata: dict[str, Any], *, ran: bool
    ) -> None:
        if ran:
            self.count += 1
        self.cells.append(
            {
                "cell_type": "code",
                "id": self._id(),
                "metadata": metadata,
                "execution_count": self.count if ran else None,
                "source": source,
                "outputs": outputs,
            }
        )

    def run(self, run: RunRecord | None) -> None:
        if run is None:
            self.code(NOT_KEPT, [], {}, ran=False)
            return
        code = run.code
        clipped = list(run.clipped)
        if "code" in clipped:
            code += "\n# (clipped: the code was longer than a record keeps)"
        source = f"%%bash\n{code}" if run.language == "bash" else code
        outputs: list[dict[str, Any]] = []
        for name, text in (("stdout", run.stdout), ("stderr", run.stderr)):
            if text:
                outputs.append({"output_type": "stream", "name": name, "text": text})
        for figure in run.figures:
            data = figure.data
            if figure.type == "image/svg+xml":  # text in a notebook, not base64
                data = base64.b64decode(data).decode("utf-8", "replace")
            outputs.append({"output_type": "display_data", "data": {figure.type: data}, "metadata": {}})
        meta = {"code_sessions": {"outcome": run.outcome, **({"clipped": clipped} if clipped else {})}}
        self.code(source, outputs, meta, ran=True)


def build_notebook(
    branch: Sequence[BranchMessage],
    records: Mapping[str, AnswerRuns],
    links: Mapping[str, str],
    *,
    title: str,
    environment: str,
    python: str,
) -> dict[str, Any]:
    """The notebook (a dict in nbformat 4.5) of `branch` (its messages from the first, the answer last).
    `records`: the runs' records by answer id; `links`: our link URLs and the paths they stand for;
    `environment`: where the runs ran, in words; `python`: its version."""
    cells = _Cells()
    cells.markdown(
        f"# {title}\n\n"
        "Exported from a Code Sessions chat in Open WebUI: the conversation up to this answer, each run "
        "as it ran, with its output.\n\n"
        f"**Where it ran.** In gVisor, in the Code Sessions sandbox environment ({environment}). Python "
        "ran in one live kernel per chat (variables carry over from run to run); bash runs are the "
        "`%%bash` cells. Every run had the chat's folder, `/mnt/data`, as its working directory: the "
        "first code cell goes there. Files that came into the chat by upload were made by no run: put "
        "them in `/mnt/data` before running the notebook."
    )
    cells.code(_SETUP, [], {"code_sessions": {"setup": True}}, ran=True)
    for message in branch:
        if message.role == "user":
            cells.markdown(f"**User:**\n\n{_unlinked(message.content, links)}")
            continue
        if message.role != "assistant":
            continue
        record = records.get(message.id) or AnswerRuns(message.id)
        runs = list(record.runs)
        figures = {figure.path for run in runs for figure in run.figures}
        taken = 0
        for piece in _pieces(message):
            if piece is None:
                cells.run(runs[taken] if taken < len(runs) else None)
                taken += 1
                continue
            text = _unlinked(piece, links)
            # A figure the run's cell shows as its output is not repeated as a picture in the prose.
            text = _without_shown(_IMAGE_LINE, text, figures)
            cells.markdown(text)
        for run in runs[taken:]:  # runs the text does not place (kept, not shown): after it
            cells.run(run)
        more = record.more_runs
        if more:
            cells.markdown(
                f"_{more} more runs of this answer are not kept (an answer keeps its first runs)._"
            )
    return {
        "nbformat": 4,
        "nbformat_minor": 5,
        "metadata": {
            "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
            "language_info": {"name": "python", "version": python},
            "code_sessions": {"environment": environment},
        },
        "cells": cells.cells,
    }


def _without_shown(pattern: re.Pattern[str], text: str, shown: set[str]) -> str:
    return pattern.sub(lambda m: "" if m.group(1) in shown else m.group(), text)


def notebook_bytes(notebook: dict[str, Any]) -> bytes:
    return (json.dumps(notebook, indent=1, ensure_ascii=False) + "\n").encode("utf-8", "replace")


def notebook_name(title: str, position: int) -> str:
    """A file name for the notebook of the `position`th answer of a chat titled `title`."""
    stem = re.sub(r"[^A-Za-z0-9]+", "-", title).strip("-")[:_MAX_NAME].strip("-") or "chat"
    return f"{stem}-answer-{position}.ipynb"
