"""An answer's branch as a notebook (engine/notebook.py), checked with nbformat's own validator: prose and
requests as markdown, each run in its place as a code cell with its outputs, bash as `%%bash`, our links
back to /mnt/data paths, and a cell that says so where a run's code is not kept."""

from __future__ import annotations

import base64
import json

import nbformat

from engine.markup import details
from engine.notebook import NOT_KEPT, BranchMessage, build_notebook, notebook_bytes, notebook_name
from storage import AnswerRuns, Figure, RunRecord

PNG = b"\x89PNG\r\n\x1a\nfake"
URL = "/api/v1/files/code-sessions-1234/content"


def run(code: str, language: str = "python", **extra) -> RunRecord:
    return RunRecord(language, code, "ok", **extra)


def kept(*runs: RunRecord, more_runs: int = 0) -> AnswerRuns:
    return AnswerRuns("a1", runs, more_runs)


def check(notebook: dict) -> list[dict]:
    nbformat.validate(nbformat.reads(notebook_bytes(notebook).decode(), as_version=4))
    return notebook["cells"]


def build(branch, records, links=None) -> list[dict]:
    return check(
        build_notebook(
            branch, records, links or {}, title="Sales", environment="Debian 13, Python 3.13", python="3.13.5"
        )
    )


def test_the_pipes_answer_becomes_prose_and_runs_in_their_places() -> None:
    answer = (
        "Loading it.\n"
        + details("Python finished in 1.0 s", "```python\nimport pandas\n```")
        + f"\n\nSaved [report.csv]({URL}).\n\n![figure-1.png](/api/v1/files/code-sessions-fig/content)\n"
        + details("Bash finished in 10 ms", "```bash\nls\n```")
        + "\nDone."
    )
    branch = [BranchMessage("u1", "user", "make a report"), BranchMessage("a1", "assistant", answer)]
    figure = Figure("figure-1.png", "image/png", base64.b64encode(PNG).decode())
    records = {
        "a1": kept(run("import pandas", stdout="ok\n", figures=(figure,)), run("ls", "bash", stdout="x\n"))
    }
    links = {URL: "report.csv", "/api/v1/files/code-sessions-fig/content": "figure-1.png"}
    cells = build(branch, records, links)
    kinds = [(c["cell_type"], c["source"][:20]) for c in cells]
    assert cells[1]["source"].startswith('import os\n\nos.chdir("/mnt/data")')  # the chat's folder, first
    assert [k for k, _ in kinds[2:]] == ["markdown", "markdown", "code", "markdown", "code", "markdown"]
    assert "make a report" in cells[2]["source"]
    python, bash = cells[4], cells[6]
    assert python["source"] == "import pandas"
    assert python["outputs"][0] == {"output_type": "stream", "name": "stdout", "text": "ok\n"}
    assert base64.b64decode(python["outputs"][1]["data"]["image/png"]) == PNG
    assert bash["source"] == "%%bash\nls"
    # Our links are the /mnt/data paths again; the figure the cell shows is not shown twice.
    assert "[report.csv](/mnt/data/report.csv)" in cells[5]["source"]
    assert "figure-1.png" not in cells[5]["source"]
    assert [c["execution_count"] for c in cells if c["cell_type"] == "code"] == [1, 2, 3]


def test_the_tools_answer_places_its_runs_by_its_output_items() -> None:
    output = (
        {"type": "message", "content": [{"type": "output_text", "text": "First I look."}]},
        {"type": "function_call", "name": "run_code", "arguments": "{}"},
        {"type": "function_call_output", "output": "..."},
        {"type": "message", "content": [{"type": "output_text", "text": "It is there."}]},
    )
    branch = [
        BranchMessage("u1", "user", "look"),
        BranchMessage("a1", "assistant", "First I look.\nIt is there.", output),
    ]
    cells = build(branch, {"a1": kept(run("print(1)"))})
    assert [c["source"] for c in cells[3:]] == ["First I look.", "print(1)", "It is there."]


def test_a_run_whose_code_is_not_kept_says_so_in_its_cell() -> None:
    answer = "Before.\n" + details("Python finished in 1.0 s", "```python\nx = 1\n```") + "\nAfter."
    branch = [BranchMessage("u1", "user", "go"), BranchMessage("a1", "assistant", answer)]
    cells = build(branch, {})
    [cell] = [c for c in cells if c["cell_type"] == "code" and c["source"] == NOT_KEPT]
    assert cell["execution_count"] is None and cell["outputs"] == []


def test_hostile_text_stays_data_and_the_name_is_plain() -> None:
    hostile = '</script><img src=x onerror=alert(1)> "\\u0000 \ud800'
    branch = [BranchMessage("u1", "user", hostile), BranchMessage("a1", "assistant", hostile)]
    cells = build(branch, {"a1": kept(run(hostile, stderr=hostile), more_runs=2)})
    assert json.loads(notebook_bytes({"cells": cells}))  # valid JSON whatever the text
    assert "2 more runs of this answer are not kept" in cells[-1]["source"]
    assert notebook_name("../../etc/passwd <b>", 3) == "etc-passwd-b-answer-3.ipynb"
    assert notebook_name("", 1) == "chat-answer-1.ipynb"
