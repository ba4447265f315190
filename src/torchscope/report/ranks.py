"""Per-rank tables: one row per rank, for the terminal (rich) and report.html.

The producer (the doctor's distributed mode) decides which columns a rank has and fills the
cells with numbers; these functions only format them, bytes as bytes and times in ms.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

from rich.table import Table

from torchscope._util import fmt_bytes, fmt_num
from torchscope.report.html import table

__all__ = ["Column", "rank_cell", "ranks_fragment", "ranks_table"]

Cell = str | int | float | None
#: A column: (header, unit), the unit `bytes`, `ms`, `x`, `norm` or `text`.
Column = tuple[str, str]


def rank_cell(value: Cell, unit: str) -> str:
    """One cell as text: `1.5 KiB`, `3.2 ms`, `2.50×`, `0.7156`, or `—` for None."""
    if value is None:
        return "—"
    if isinstance(value, str) or unit == "text":
        return str(value)
    if unit == "bytes":
        return fmt_bytes(int(value))
    if unit == "ms":
        return f"{value:.3g} ms"
    if unit == "x":
        return f"{value:.2f}×"
    return fmt_num(float(value))


def ranks_table(columns: Sequence[Column], rows: Sequence[Sequence[Cell]], *,
                title: str = "Per rank") -> Table:
    """A rich table, one row per rank."""
    out = Table(title=title, title_justify="left")
    for header, unit in columns:
        out.add_column(header, justify="left" if unit == "text" else "right")
    for row in rows:
        out.add_row(*(rank_cell(v, unit) for v, (_, unit) in zip(row, columns, strict=True)))
    return out


def ranks_fragment(columns: Sequence[Column], rows: Sequence[Sequence[Cell]], *,
                   caption: str = "", bad_rows: Sequence[int] = ()) -> str:
    """An HTML fragment: the per-rank table (rows in `bad_rows` highlighted) and a caption."""
    numeric = [i for i, (_, unit) in enumerate(columns) if unit != "text"]
    cells = [[rank_cell(v, unit) for v, (_, unit) in zip(row, columns, strict=True)]
             for row in rows]
    note = f"<p>{html.escape(caption)}</p>" if caption else ""
    return note + table([h for h, _ in columns], cells, numeric=numeric, bad_rows=bad_rows)
