"""Table previews and chart embeds, as text: bounded, hostile contents inert, row counts honest.

What the page makes of them (the table rendered, the chart drawn and hovered) is proven in a real Open
WebUI with headless Chromium: tests/e2e/test_browser.py.
"""

from __future__ import annotations

import html
import json
import re

import pytest

from engine.charts import _spec_json, embed_html
from engine.markup import escape_text
from engine.previews import (
    HEAD_BYTES,
    MAX_CELL,
    MAX_COLUMNS,
    MAX_ROWS,
    SAMPLE_BYTES,
    Table,
    cell_text,
    parse_program_output,
    previews,
    render,
    strip_previews,
    table_from_text,
)
from runner import Outcome, RunResult

HOSTILE = [
    "a|b",
    "``` code",
    "<script>alert(1)</script>",
    '<img src=x onerror="alert(1)">',
    "[click](https://evil.example)",
    "https://evil.example/x",
    "www.evil.example",
    "mail@evil.example",
    "$x^2$",
    "line one\nline two",
    "**bold** _it_ ~~s~~ # h",
    "&lt;b&gt;",
]


def test_hostile_cells_are_written_to_show_as_themselves() -> None:
    # Written as our notes' hostile text is (engine/markup.py, tests/engine/test_hostile_names.py), which
    # also keeps a cell's `|` from ending it.
    for value in HOSTILE:
        assert cell_text(value) == escape_text(value)
        assert "\n" not in cell_text(value) and "|" not in re.sub(r"\\\|", "", cell_text(value))
    assert cell_text("x" * 500).endswith("…") and len(cell_text("x" * 500)) == MAX_CELL


def _csv(rows: list[list[str]]) -> bytes:
    import csv
    import io

    out = io.StringIO()
    csv.writer(out).writerows(rows)
    return out.getvalue().encode()


def test_a_small_csv_is_counted_exactly_and_typed() -> None:
    data = _csv(
        [
            ["n", "x", "when", "ok", "name"],
            *[[str(i), f"{i}.5", "2024-01-0" + str(i % 9 + 1), "true", "a"] for i in range(30)],
        ]
    )
    table = table_from_text(data, len(data), ",")
    assert table.exact and table.total_rows == 30 and table.total_columns == 5
    assert table.columns == (("n", "int"), ("x", "float"), ("when", "date"), ("ok", "bool"), ("name", "text"))
    assert len(table.rows) == MAX_ROWS
    shown = render(table)
    assert shown.startswith("_Preview · 30 rows, 5 columns, the first 8 shown_")
    assert shown.count("\n|") == 2 + MAX_ROWS  # header, rule, rows


def test_a_large_csv_is_estimated_from_samples_and_says_so() -> None:
    row = b"1,hello,2.5\n"
    head = b"a,b,c\n" + row * (HEAD_BYTES // len(row) + 10)
    size = 100 * 1024 * 1024
    middle = b"x" * 5 + row * (SAMPLE_BYTES // len(row))
    table = table_from_text(head[:HEAD_BYTES], size, ",", [middle, middle])
    assert not table.exact and table.total_rows is not None
    assert abs(table.total_rows - size // len(row)) / (size // len(row)) < 0.01
    assert f"about {table.total_rows:,} rows, estimated from samples of 64" in render(table)
    assert table.columns == (("a", "int"), ("b", "text"), ("c", "float"))


def test_many_columns_are_cut_and_counted() -> None:
    data = _csv([[f"c{i}" for i in range(30)], [str(i) for i in range(30)]])
    table = table_from_text(data, len(data), ",")
    assert len(table.columns) == MAX_COLUMNS and table.total_columns == 30
    assert "_and 22 more columns not shown_" in render(table)


def test_hostile_table_renders_one_row_per_record() -> None:
    data = _csv([["<b>name</b>", "a|b"], *[[value, value] for value in HOSTILE]])
    shown = render(table_from_text(data, len(data), ","))
    lines = [line for line in shown.splitlines() if line.startswith("|")]
    assert len(lines) == 2 + MAX_ROWS  # every record on its own line: a newline in a cell broke nothing
    assert all(len(re.findall(r"(?<!\\)\|", line)) == 3 for line in lines)  # two columns in each


def test_unreadable_text_is_a_sentence() -> None:
    with pytest.raises(ValueError, match="empty"):
        table_from_text(b"", 0, ",")


def test_previews_are_stripped_from_what_the_model_reads() -> None:
    data = _csv([["a"], ["1"]])
    answer = "Here: [t.csv](/api/v1/files/x/content)" + "\n\n" + render(table_from_text(data, len(data), ","))
    assert strip_previews(answer) == "Here: [t.csv](/api/v1/files/x/content)"
    none = "Here.\n\n_Preview 1 of 2 · none: it is empty_\n" + render(
        table_from_text(data, len(data), ","), 2, 2
    )
    assert strip_previews(none) == "Here."


def test_the_sandbox_answer_is_checked() -> None:
    good = {"t.xlsx": {"columns": [["a", "int"]], "rows": [["1"]], "width": 1, "total": 1, "exact": True}}
    parsed = parse_program_output("noise\ncode-sessions-preview:" + json.dumps(good), ["t.xlsx", "u.parquet"])
    assert parsed["t.xlsx"] == Table((("a", "int"),), (("1",),), 1, 1, True)
    assert parsed["u.parquet"] == "the sandbox gave no answer for it"
    forged = {"t.xlsx": {"columns": "x", "rows": [], "width": 1}}
    assert "not understood" in str(
        parse_program_output("code-sessions-preview:" + json.dumps(forged), ["t.xlsx"])["t.xlsx"]
    )
    assert parse_program_output("nothing", ["t.xlsx"]) == {"t.xlsx": "the sandbox could not read it"}


async def test_previews_read_a_bounded_head_and_go_to_the_sandbox_for_xlsx() -> None:
    asked: list[tuple[str, int]] = []
    ran: list[str] = []

    async def read_head(path: str, limit: int) -> tuple[bytes, int]:
        asked.append((path, limit))
        return b"a,b\n1,2\n", 100 * 1024 * 1024

    async def run(code: str) -> RunResult:
        ran.append(code)
        return RunResult(
            outcome=Outcome.OK,
            exit_code=0,
            stdout="code-sessions-preview:{}",
            stderr="",
            stdout_truncated=False,
            stderr_truncated=False,
            duration_s=0.1,
            reason=None,
        )

    async def read_at(path: str, offset: int, limit: int) -> bytes:
        asked.append((path, offset, limit))
        return b"1,2\n" * (limit // 4)

    shown = await previews(["a.csv", "b.png", "c.xlsx", "a.csv"], read_head, run, read_at)
    middle, end = 50 * 1024 * 1024, 100 * 1024 * 1024 - SAMPLE_BYTES
    assert asked == [("a.csv", HEAD_BYTES), ("a.csv", middle, SAMPLE_BYTES), ("a.csv", end, SAMPLE_BYTES)]
    assert len(ran) == 1 and '["c.xlsx"]' in ran[0]
    assert (
        "_Preview 1 of 2 · about" in shown and "_Preview 2 of 2 · none: the sandbox gave no answer" in shown
    )


def test_a_chart_spec_cannot_leave_its_script_or_its_frame() -> None:
    spec = {
        "data": [{"type": "scatter", "x": [1], "y": [2], "name": "</script><script>alert(1)</script>"}],
        "layout": {"title": {"text": '" onload="alert(1)'}},
    }
    safe = _spec_json(json.dumps(spec).encode())
    assert safe is not None and "<" not in safe and ">" not in safe
    assert json.loads(safe)["data"][0]["name"] == spec["data"][0]["name"]
    page = embed_html([safe], "QUJD")
    # The outer document: no script but the one that says its height, and the inner one in an attribute.
    outer_scripts = re.findall(
        r"<script>(.*?)</script>", page.split("srcdoc=")[0] + page.split('"></iframe>')[-1]
    )
    assert outer_scripts == ["parent.postMessage({type:'iframe:height',height:440},'*')"]
    assert '<iframe sandbox="allow-scripts" ' in page and "allow-same-origin" not in page
    inner = html.unescape(re.search(r'srcdoc="([^"]*)"', page).group(1))
    assert "default-src 'none'" in inner and "alert(1)</script>" not in inner
    assert _spec_json(b"[1, 2]") is None and _spec_json(b"not json") is None
