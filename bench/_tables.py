"""How the benchmarks print: aligned tables and timings (what report.py and each section's own table
use; a module of its own so that no section imports the report that imports it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["ms", "num", "ratio", "table", "thousands"]


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[int] = ()) -> str:
    width = len(headers)
    cells = [[str(h) for h in headers]]
    cells += [(["" if c is None else str(c) for c in row] + [""] * width)[:width] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        out = [
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        return "  ".join(out).rstrip()

    return "\n".join([line(cells[0]), line(["-" * w for w in widths]), *(line(r) for r in cells[1:])])


def ms(stats: dict[str, Any] | None, spread: bool = True) -> str:
    """'12.3 (11.0-14.1)': median and p25-p75 of a summary(), in ms."""
    if not stats:
        return "-"
    med = num(stats["median_ms"])
    if not spread or stats.get("n", 0) < 2:
        return med
    return f"{med} ({num(stats['p25_ms'])}-{num(stats['p75_ms'])})"


def num(value: float) -> str:
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    if value >= 1:
        return f"{value:.2f}"
    return f"{value:.3f}"


def ratio(stats: dict[str, Any] | None) -> str:
    if not stats:
        return "-"
    return f"{stats['median']:.2f} ({stats['p25']:.2f}-{stats['p75']:.2f})"


def thousands(n: int) -> str:
    return f"{n // 1000}k" if n >= 1000 and n % 1000 == 0 else str(n)
