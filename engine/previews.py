"""Table previews: the first rows, the columns and their types, and the row count of each CSV, TSV, XLSX or
Parquet file an answer links, written into the answer's own text (so it survives a reload and shows in a
shared chat).

The file's bytes are hostile. CSV and TSV are read on the host: whole up to `COUNTED_BYTES` (its rows
counted); a larger one's first `HEAD_BYTES` and two samples of `SAMPLE_BYTES` for the row count (a 100
MB file is never read whole: its row count is then an estimate, and says so). XLSX and Parquet need
openpyxl and pyarrow, whose parsers have had bugs: they are read in a fresh gVisor sandbox over the
chat's folder (`PROGRAM`), whose one line of output is checked as hostile too. Every cell, column name
and type is written as text that shows as written (`cell_text`): no markdown, HTML, link, math or
line break survives.

Where it appears: after the answer's text, one short table per file in the order the answer links them,
without the file's name (the answer names each file once; the attachments hold it once more).
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import math
import posixpath
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from runner import Limits, Outcome, RunnerError, RunResult
from storage import StorageError, human_bytes

from .markup import escape_text

__all__ = [
    "HEAD_BYTES",
    "MAX_PREVIEWS",
    "PREVIEW_SUFFIXES",
    "PROGRAM",
    "Table",
    "cell_text",
    "is_table",
    "parse_program_output",
    "render",
    "strip_previews",
    "table_from_text",
]

PREVIEW_SUFFIXES = (".csv", ".tsv", ".xlsx", ".parquet")
MAX_PREVIEWS = 4  # files previewed per answer
MAX_ROWS = 8  # rows shown per preview
MAX_COLUMNS = 8  # columns shown per preview
MAX_CELL = 40  # characters shown per cell (and per column name)
HEAD_BYTES = 64 * 1024  # of a CSV or TSV read on the host: its first rows
COUNTED_BYTES = 1024 * 1024  # a CSV or TSV up to this size is read whole: its rows are counted
# A larger one's row count is estimated from two samples, from its middle and its end: its first rows
# are a poor sample (a header, and ids that grow longer further down).
SAMPLE_BYTES = 32 * 1024
_SAMPLE_ROWS = 200  # rows whose values decide a column's type
# The sandbox that reads XLSX and Parquet: a small run, its one line of output bounded.
SANDBOX_LIMITS = Limits(
    timeout_s=20.0,
    memory_mb=512,
    max_processes=16,
    max_file_bytes=1 << 20,
    max_write_bytes=1 << 20,
    max_output_bytes=64 * 1024,
)
_MARK = "code-sessions-preview:"
# A caption at the start of a line, and its table if it has one. Tried at line starts only: tried at
# every "_Preview · " of a line, `[^\n]*_` would scan the rest of the line from each (quadratic).
_CAPTION = re.compile(
    r"^_Preview(?: \d+ of \d+)? · [^\n]*_\n(?:\n(?:\|[^\n]*\|\n)+(?:\n_and [^\n]* not shown_\n)?)?",
    re.MULTILINE,
)

# The cell types, each matched in time linear in the cell (a cell may be 60,000 characters of the
# 64 KiB read): no two parts of a pattern may take the same characters (`\d+\.?\d*` backtracks
# quadratically on a long run of digits that does not end the way it expects).
_INT = re.compile(r"[+-]?\d{1,18}")
_FLOAT = re.compile(r"[+-]?(?:(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?|nan|NaN|inf)")
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}(?:[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?)?")
_BOOL = frozenset({"true", "false", "True", "False", "TRUE", "FALSE"})


@dataclass(frozen=True, slots=True)
class Table:
    """What a preview shows: the first rows of the first columns, as text, and how many there are."""

    columns: tuple[tuple[str, str], ...]  # (name, type) of the columns shown
    rows: tuple[tuple[str, ...], ...]
    total_columns: int
    total_rows: int | None  # None: not known
    exact: bool  # whether total_rows was counted, or estimated
    basis: str = ""  # how an estimate was made ("from the first 256 KiB"), or what was read ("sheet 1 of 3")


def cell_text(value: str) -> str:
    """A cell (or a column's name or type) as text that shows as written, at most MAX_CELL characters
    of it."""
    return escape_text(value if len(value) <= MAX_CELL else value[: MAX_CELL - 1] + "…")


def _kind(values: Sequence[str]) -> str:
    """The type a column's sample of text values reads as."""
    present = [v.strip() for v in values if v.strip()]
    if not present:
        return "empty"
    for name, fits in (
        ("int", _INT.fullmatch),
        ("float", _FLOAT.fullmatch),
        ("bool", _BOOL.__contains__),
        ("date", _DATE.fullmatch),
    ):
        if all(fits(v) for v in present):
            return name
    return "text"


def _line_rate(samples: Sequence[bytes]) -> float | None:
    """Lines per byte in pieces cut from a file (each counted from its first line break to its last)."""
    lines = spanned = 0
    for piece in samples:
        first, last = piece.find(b"\n"), piece.rfind(b"\n")
        if 0 <= first < last:
            lines += piece.count(b"\n", first + 1, last + 1)
            spanned += last - first
    return lines / spanned if spanned else None


def table_from_text(data: bytes, size: int, delimiter: str, samples: Sequence[bytes] = ()) -> Table:
    """A preview of delimited text, from its first bytes (`data`), the file's size and, for a file
    larger than `data`, `samples` of it for the row count. Raises ValueError with a sentence when no
    table can be read."""
    whole = len(data) >= size
    if not whole:  # the last line is cut: leave it out
        end = data.rfind(b"\n")
        data = data[: end + 1] if end >= 0 else b""
    text = data.decode("utf-8-sig", errors="replace")
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter)
    rows: list[list[str]] = []
    count = 0
    header: list[str] | None = None
    try:
        header = next(reader, None)
        for row in reader:
            if not row:
                continue
            count += 1
            if len(rows) < _SAMPLE_ROWS:
                rows.append(row)
            elif samples:  # the samples count the rows: these are enough for the types
                break
    except csv.Error as error:  # a field over the csv module's limit, a NUL: the rows read so far stand
        if header is None:
            raise ValueError(
                f"it is not readable as {'TSV' if delimiter == chr(9) else 'CSV'} ({error})"
            ) from None
        whole = False
    if not header:
        raise ValueError("it is empty" if size == 0 else "its first line is not a header")
    width = len(header)
    shown = header[:MAX_COLUMNS]
    columns = tuple(
        (name, _kind([row[i] if i < len(row) else "" for row in rows])) for i, name in enumerate(shown)
    )
    cells = tuple(tuple(row[i] if i < len(row) else "" for i in range(len(shown))) for row in rows[:MAX_ROWS])
    if whole:
        return Table(columns, cells, width, count, True)
    # Lines per byte in the samples (the head's rows, without them), applied to the file's bytes after
    # its header line (the header is no row: counted in, a 5,000-row file read "about 5,001").
    header_bytes = len(data.split(b"\n", 1)[0]) + 1
    rows_bytes = max(0, len(data) - header_bytes)
    rate = _line_rate(samples) if samples else (count / rows_bytes if count and rows_bytes else None)
    estimate = _rounded(rate * max(0, size - header_bytes)) if rate else None
    basis = f"from samples of {human_bytes(sum(len(s) for s in samples) or len(data))}"
    return Table(columns, cells, width, estimate, False, basis)


def _rounded(estimate: float) -> int:
    """An estimate to three significant digits (1,539,208 reads "about 1,540,000"): no more is known."""
    whole = round(estimate)
    if whole < 1000:
        return whole
    scale: int = 10 ** (len(str(whole)) - 3)
    return round(whole / scale) * scale


# Column types whose cells are floating-point numbers: the host's (`_kind`), the sandbox program's, and
# Parquet's (pyarrow's names).
_FLOAT_KINDS = frozenset({"float", "double", "halffloat", "float16", "float32", "float64"})
_SIGNIFICANT = 6  # digits a float cell shows, as pandas prints a frame


def _short_float(cell: str) -> str:
    """A float cell with at most _SIGNIFICANT significant digits (never fewer than its whole part),
    as pandas shows a frame: full precision (0.30000000000000004) made a wide table wider than the page.
    Anything that is not a plain finite float stays as written."""
    text = cell.strip()
    if len(text) > 40 or not _FLOAT.fullmatch(text) or not any(c in text for c in ".eE"):
        return cell
    value = float(text)
    if not math.isfinite(value):
        return cell
    if value == 0:
        return "0"
    magnitude = abs(value)
    if 1 <= magnitude < 1e15:  # the whole part as it is, decimals up to six digits in all
        short = f"{value:.{max(0, _SIGNIFICANT - len(str(int(magnitude))))}f}"
        if "." in short:
            short = short.rstrip("0").rstrip(".")
    else:
        short = f"{value:.{_SIGNIFICANT}g}"
    return short if len(short) < len(text) else cell


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}" + ("" if n == 1 else "s")


def render(table: Table, index: int = 1, count: int = 1) -> str:
    """The preview as markdown: a caption in italics (the row and column counts, each column's type),
    then a table of the first rows under the columns' names alone: the table is the data's head, as
    Open WebUI's "Export to CSV" of it downloads it (floats to six significant digits)."""
    label = "Preview" if count == 1 else f"Preview {index} of {count}"
    if table.total_rows is None:
        rows = "rows not counted"
    elif table.exact:
        rows = _plural(table.total_rows, "row")
    else:
        rows = f"about {_plural(table.total_rows, 'row')}, estimated {table.basis}"
    columns = escape_text(_plural(table.total_columns, "column"))
    if table.columns:
        kinds = ", ".join(f"{cell_text(name)}: {cell_text(kind)}" for name, kind in table.columns)
        columns += f" ({kinds}{', …' if table.total_columns > len(table.columns) else ''})"
    rest = []
    if table.exact and table.basis:
        rest.append(table.basis)
    if table.rows and (table.total_rows is None or len(table.rows) < table.total_rows):
        rest.append(f"the first {len(table.rows)} shown")
    more_facts = escape_text("".join(f", {fact}" for fact in rest))
    caption = f"_{label} · {escape_text(rows)}, {columns}{more_facts}_\n\n"
    if not table.columns:
        return caption
    head = "| " + " | ".join(cell_text(name) or " " for name, _ in table.columns) + " |\n"
    rule = "|" + "---|" * len(table.columns) + "\n"
    floats = [kind.lower() in _FLOAT_KINDS for _, kind in table.columns]
    body = "".join(
        "| "
        + " | ".join(cell_text(_short_float(c) if floats[i] else c) or " " for i, c in enumerate(row))
        + " |\n"
        for row in table.rows
    )
    more = table.total_columns - len(table.columns)
    tail = f"\n_and {_plural(more, 'more column')} not shown_\n" if more > 0 else ""
    return caption + head + rule + body + tail


def strip_previews(text: str) -> str:
    """The answer without its previews (what the model reads of its earlier answers: it ran the code
    that made the files, and the previews would only cost it tokens)."""
    if "_Preview" not in text:
        return text
    kept: list[str] = []
    end = 0
    for found in _CAPTION.finditer(text):
        kept.append(text[end : found.start()].rstrip("\n"))  # with the blank lines that led to it
        end = found.end()
    kept.append(text[end:])
    return "".join(kept)


# ---- XLSX and Parquet, read in the sandbox -------------------------------------------------------------

_PROGRAM_BODY = r"""

def text(value):
    if value is None:
        return ""
    iso = getattr(value, "isoformat", None)
    out = iso() if callable(iso) else str(value)
    return out[: MAX_CELL + 1]

def kind(values):
    present = [v for v in values if v is not None and v != ""]
    if not present:
        return "empty"
    names = {type(v).__name__ for v in present}
    if names == {"bool"}:
        return "bool"
    if names <= {"int"}:
        return "int"
    if names <= {"int", "float"}:
        return "float"
    if names <= {"datetime", "date", "time"}:
        return names.pop() if len(names) == 1 else "datetime"
    return "text"

def xlsx(path):
    import openpyxl
    book = openpyxl.load_workbook(path, read_only=True, data_only=True)
    try:
        sheets = len(book.worksheets)
        sheet = book.worksheets[0]
        rows = sheet.iter_rows(values_only=True)
        header = next(rows, None) or ()
        sample, whole = [], True
        for row in rows:
            if len(sample) >= SAMPLE:
                whole = False
                break
            sample.append(row)
        width = len(header)
        dims = sheet.max_row if isinstance(sheet.max_row, int) else None
        total = len(sample) if whole else (dims - 1 if dims else None)
        columns = [(text(header[i]), kind([r[i] if i < len(r) else None for r in sample]))
                   for i in range(min(width, MAX_COLUMNS))]
        cells = [[text(r[i] if i < len(r) else None) for i in range(len(columns))] for r in sample[:MAX_ROWS]]
        basis = "sheet 1 of %d" % sheets if sheets > 1 else ""
        return {"columns": columns, "rows": cells, "width": width, "total": total, "exact": whole,
                "basis": basis if whole else "from the sheet's stated size"}
    finally:
        book.close()

def parquet(path):
    import pyarrow.parquet as pq
    handle = pq.ParquetFile(path)
    schema = handle.schema_arrow
    names = schema.names[:MAX_COLUMNS]
    columns = [(text(n), text(schema.field(n).type)) for n in names]
    batch = next(handle.iter_batches(batch_size=MAX_ROWS, columns=names), None)
    records = batch.to_pylist() if batch is not None else []
    cells = [[text(r.get(n)) for n in names] for r in records[:MAX_ROWS]]
    return {"columns": columns, "rows": cells, "width": len(schema.names),
            "total": handle.metadata.num_rows, "exact": True, "basis": ""}

out = {}
for path in json.loads(PATHS):
    try:
        out[path] = (xlsx if path.lower().endswith(".xlsx") else parquet)(path)
    except Exception as error:
        out[path] = {"error": ("%s: %s" % (type(error).__name__, error))[:200]}
print(MARK + json.dumps(out))
"""
PROGRAM = (
    "import json\n"
    f"MAX_ROWS, MAX_COLUMNS, MAX_CELL, SAMPLE = {MAX_ROWS}, {MAX_COLUMNS}, {MAX_CELL}, {_SAMPLE_ROWS}\n"
    f"MARK = {_MARK!r}\n" + _PROGRAM_BODY
)


def _str(value: object) -> str:
    return value[: MAX_CELL + 1] if isinstance(value, str) else ""


def _table_of(found: object) -> Table | str:
    """One file's entry of the program's output, checked as hostile: a Table, or why it has none."""
    if not isinstance(found, dict):
        return "the sandbox gave no answer for it"
    if "error" in found:
        return f"it could not be read ({_str(found['error'])[:200]})"
    columns, rows, width, total = (
        found.get("columns"),
        found.get("rows"),
        found.get("width"),
        found.get("total"),
    )
    if not isinstance(columns, list) or not isinstance(rows, list) or not isinstance(width, int):
        return "the sandbox's answer for it was not understood"
    pairs = tuple(
        (_str(c[0]), _str(c[1])) for c in columns[:MAX_COLUMNS] if isinstance(c, list) and len(c) == 2
    )
    cells = tuple(
        tuple(_str(v) for v in row[: len(pairs)]) for row in rows[:MAX_ROWS] if isinstance(row, list)
    )
    count = total if isinstance(total, int) and not isinstance(total, bool) and 0 <= total < 10**15 else None
    return Table(
        pairs, cells, max(0, min(width, 10**9)), count, found.get("exact") is True, _str(found.get("basis"))
    )


def parse_program_output(stdout: str, paths: Sequence[str]) -> dict[str, Table | str]:
    """What the sandbox's program printed, as a Table or a sentence per path (hostile: the program ran
    beside a hostile file, and its only trusted part is what this function accepts)."""
    line = next((ln for ln in stdout.splitlines() if ln.startswith(_MARK)), None)
    data: object = None
    if line is not None:
        try:
            data = json.loads(line[len(_MARK) :])
        except ValueError:
            data = None
    if not isinstance(data, dict):
        return dict.fromkeys(paths, "the sandbox could not read it")
    return {path: _table_of(data.get(path)) for path in paths}


# ---- the answer's previews ------------------------------------------------------------------------------

HeadReader = Callable[[str, int], Awaitable[tuple[bytes, int]]]
SampleReader = Callable[[str, int, int], Awaitable[bytes]]
SandboxRun = Callable[[str], Awaitable[RunResult]]


async def previews(
    paths: Sequence[str],
    read_head: HeadReader,
    run_in_sandbox: SandboxRun,
    read_at: SampleReader | None = None,
) -> str:
    """Markdown previews of the table files among `paths` (in order, at most MAX_PREVIEWS), each a
    caption and a table; a file that cannot be previewed gets one sentence instead.

    None of it runs on the event loop (it serves every chat of the worker): the reads are the store's
    (in threads), and the parsing, typing and rendering of what they read happen in a thread, on
    bounded input (COUNTED_BYTES, or HEAD_BYTES and two SAMPLE_BYTES, per file, at most MAX_PREVIEWS
    files), in time linear in it."""
    chosen = [p for p in dict.fromkeys(paths) if is_table(p)][:MAX_PREVIEWS]
    if not chosen:
        return ""
    found: dict[str, Table | str] = {}
    in_sandbox = [p for p in chosen if p.lower().endswith((".xlsx", ".parquet"))]
    for path in chosen:
        if path in in_sandbox:
            continue
        try:
            data, size = await read_head(path, HEAD_BYTES)
            if len(data) < size <= COUNTED_BYTES:  # small enough to count its rows exactly
                data, size = await read_head(path, COUNTED_BYTES)
            samples = []
            if read_at is not None and size > len(data):
                for offset in (size // 2, size - SAMPLE_BYTES):
                    samples.append(await read_at(path, max(len(data), offset), SAMPLE_BYTES))
        except StorageError as error:
            found[path] = f"it could not be read ({error})"
            continue
        delimiter = "\t" if path.lower().endswith(".tsv") else ","
        found[path] = await asyncio.to_thread(_table_or_why, data, size, delimiter, samples)
    if in_sandbox:
        found.update(await _in_sandbox(in_sandbox, run_in_sandbox))
    return await asyncio.to_thread(_render_all, chosen, found)


def _table_or_why(data: bytes, size: int, delimiter: str, samples: Sequence[bytes]) -> Table | str:
    try:
        return table_from_text(data, size, delimiter, samples)
    except ValueError as error:
        return str(error)


def _render_all(chosen: Sequence[str], found: dict[str, Table | str]) -> str:
    parts = []
    for index, path in enumerate(chosen, 1):
        table = found[path]
        if isinstance(table, Table):
            parts.append(render(table, index, len(chosen)))
        else:
            label = "Preview" if len(chosen) == 1 else f"Preview {index} of {len(chosen)}"
            parts.append(f"_{label} · none: {escape_text(table)}_\n")
    return "\n\n" + "\n".join(parts)


async def _in_sandbox(paths: list[str], run_in_sandbox: SandboxRun) -> dict[str, Table | str]:
    code = PROGRAM.replace("PATHS", repr(json.dumps(paths)))
    try:
        result = await run_in_sandbox(code)
    except (RunnerError, StorageError) as error:
        return dict.fromkeys(paths, f"the sandbox is not available ({error})")
    if result.outcome != Outcome.OK:
        why = result.reason or result.outcome.value
        return dict.fromkeys(paths, f"reading it in the sandbox failed ({why})")
    return await asyncio.to_thread(parse_program_output, result.stdout, paths)


def is_table(path: str) -> bool:
    return posixpath.basename(path).lower().endswith(PREVIEW_SUFFIXES)
