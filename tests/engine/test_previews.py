"""Table previews and chart embeds, as text: bounded, hostile contents inert, row counts honest.

What the page makes of them (the table rendered, the chart drawn and hovered) is proven in a real Open
WebUI with headless Chromium: tests/e2e/test_browser.py.
"""

from __future__ import annotations

import html
import json
import re
import time

import pytest

from engine.charts import _spec_json, embed_html
from engine.markup import escape_text
from engine.previews import (
    COUNTED_BYTES,
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
from tests.support.loop_lag import LoopLag

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
    assert shown.startswith(
        "_Preview · 30 rows, 5 columns (n: int, x: float, when: date, ok: bool, name: text), the first 8 "
        "shown_\n\n| n | x | when | ok | name |\n|---|---|---|---|---|\n| 0 | 0.5 | 2024-01-01 | true | a |\n"
    )
    assert shown.count("\n|") == 2 + MAX_ROWS  # header, rule, rows


def test_the_table_is_the_datas_head_with_floats_as_pandas_shows_them() -> None:
    # What Open WebUI's "Export to CSV" of the table downloads: the columns' names alone as its header
    # (their types are in the caption), then the rows; floats at six significant digits, so that a wide
    # table fits the page (full precision cut a table of floats at its fifth column).
    rows = [["when", "ratio", "big", "tiny", "count", "label"]]
    rows += [["2024-01-01", repr(0.1 + 0.2), "1234567.891", "0.0001234567", "7", "3.14159265358979"]]
    data = _csv(rows)
    shown = render(table_from_text(data, len(data), ","))
    table = [line for line in shown.splitlines() if line.startswith("|")]
    assert table == [
        "| when | ratio | big | tiny | count | label |",
        "|---|---|---|---|---|---|",
        "| 2024-01-01 | 0.3 | 1234568 | 0.000123457 | 7 | 3.14159 |",
    ], table
    assert "(when: date, ratio: float, big: float, tiny: float, count: int, label: float)" in shown
    # A text column keeps its digits as written, and a float column keeps what is not a plain number.
    data = _csv([["code", "x"], ["3.14159265358979", "nan"], ["A-7", "1e400"]])
    shown = render(table_from_text(data, len(data), ","))
    assert "(code: text, x: float)" in shown, shown
    assert "| 3.14159265358979 | nan |" in shown and "| A-7 | 1e400 |" in shown, shown


def test_a_csv_of_a_few_thousand_rows_is_counted_not_estimated() -> None:
    data = _csv([["month", "visitors", "ratio"], *[["Jan", str(1000 + i), f"{i / 7}"] for i in range(5000)]])
    assert HEAD_BYTES < len(data) <= COUNTED_BYTES
    table = table_from_text(data, len(data), ",")
    assert table.exact and table.total_rows == 5000, table.total_rows
    assert render(table).startswith("_Preview · 5,000 rows, 3 columns")


async def test_a_file_up_to_the_counted_size_is_read_whole_and_a_larger_one_sampled() -> None:
    row = b"2024-01-01,1234,5.5\n"
    small = b"when,n,x\n" + row * 5000
    big = b"when,n,x\n" + row * 100_000
    asked: list[tuple[str, int]] = []

    async def read_head(path: str, limit: int) -> tuple[bytes, int]:
        data = small if path == "small.csv" else big
        asked.append((path, limit))
        return data[:limit], len(data)

    async def read_at(path: str, offset: int, limit: int) -> bytes:
        return big[offset : offset + limit]

    async def no_sandbox(code: str) -> RunResult:
        raise AssertionError("a CSV is read on the host")

    shown = await previews(["small.csv", "big.csv"], read_head, no_sandbox, read_at)
    assert asked == [("small.csv", HEAD_BYTES), ("small.csv", COUNTED_BYTES), ("big.csv", HEAD_BYTES)]
    assert "_Preview 1 of 2 · 5,000 rows, 3 columns" in shown
    # The header line is no row: 100,000 rows of the same length are estimated as exactly that.
    assert "_Preview 2 of 2 · about 100,000 rows, estimated from samples of 64 KiB, 3 columns" in shown


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


# A cell of digits that ends in a letter, as long as the 64 KiB a preview reads allows: a float pattern
# that backtracks took 1.6 s on 8,000 digits (quadratic: about 90 s on these), on the event loop.
HOSTILE_DIGITS = b"n,m\n" + b"1" * 60_000 + b"x,2\n" + b"3,4\n"


def _cpu(function) -> float:
    start = time.process_time()
    function()
    return time.process_time() - start


def test_a_long_run_of_digits_is_typed_in_linear_time() -> None:
    found: list[Table] = []
    assert _cpu(lambda: found.append(table_from_text(HOSTILE_DIGITS, len(HOSTILE_DIGITS), ","))) < 0.05
    assert found[0].columns == (("n", "text"), ("m", "int"))
    for value, kind in (("1.5", "float"), ("-2e5", "float"), (".5", "float"), ("-inf", "float")):
        data = f"v\n{value}\n".encode()
        assert table_from_text(data, len(data), ",").columns == (("v", kind),), value


async def test_a_hostile_preview_keeps_the_event_loop_free() -> None:
    async def read_head(path: str, limit: int) -> tuple[bytes, int]:
        return HOSTILE_DIGITS[:limit], len(HOSTILE_DIGITS)

    async def no_sandbox(code: str) -> RunResult:
        raise AssertionError("a CSV is read on the host")

    async with LoopLag() as lag:
        shown = await previews(["a.csv", "b.csv", "c.csv", "d.csv"], read_head, no_sandbox)
    lag.assert_quiet()
    assert shown.count("2 columns (n: text, m: int)_\n\n| n | m |") == 4


def test_stripping_previews_is_linear_in_the_text() -> None:
    # What the model reads of earlier answers (an API caller sends any history): tried at every
    # "_Preview · " of one line, the caption's pattern scanned the rest of the line from each.
    hostile = "_Preview · " * 100_000
    assert _cpu(lambda: strip_previews(hostile)) < 0.1
    assert strip_previews(hostile) == hostile
    blank = "\n" * 1_000_000 + "_Preview · x"
    assert _cpu(lambda: strip_previews(blank)) < 0.1


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
    page = embed_html([safe], "/code-sessions/plotly/abc.js")
    # The outer document: no script but the one that says its height, and the inner one in an attribute.
    outer_scripts = re.findall(
        r"<script>(.*?)</script>", page.split("srcdoc=")[0] + page.split('"></iframe>')[-1]
    )
    assert outer_scripts == ["parent.postMessage({type:'iframe:height',height:440},'*')"]
    assert '<iframe sandbox="allow-scripts allow-downloads" ' in page and "allow-same-origin" not in page
    inner = html.unescape(re.search(r'srcdoc="([^"]*)"', page).group(1))
    assert "default-src 'none'" in inner and "alert(1)</script>" not in inner
    # Scripts: the two inline ones by their hashes (no 'unsafe-inline'), and Open WebUI's own origin.
    [policy] = set(re.findall(r'Content-Security-Policy" content="([^"]*)"', page + inner))
    assert re.search(r"script-src 'self' 'sha256-[^']+' 'sha256-[^']+';", policy), policy
    assert "unsafe-inline' ;" not in policy and "script-src 'self' 'unsafe" not in policy
    assert 'script.src = "/code-sessions/plotly/abc.js"' in inner
    assert _spec_json(b"[1, 2]") is None and _spec_json(b"not json") is None
