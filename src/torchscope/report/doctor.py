"""Terminal rendering of reports, report diffs and lab results (rich)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from rich.table import Table
from rich.text import Text

from torchscope._util import fmt_bytes, fmt_num
from torchscope.report.diff import MetricChange, ReportDiff
from torchscope.report.document import Report

__all__ = ["LabClaimView", "LabTableView", "diff_table", "lab_tables", "metric_text",
           "sections_table"]


class LabTableView(Protocol):
    """A comparison table of a lab run (`torchscope.lab.LabTable` is one)."""

    @property
    def title(self) -> str: ...
    @property
    def columns(self) -> tuple[str, ...]: ...
    @property
    def rows(self) -> tuple[tuple[Any, ...], ...]: ...


class LabClaimView(Protocol):
    """A checked claim of a lab run (`torchscope.lab.LabClaim` is one)."""

    @property
    def milestone(self) -> str: ...
    @property
    def claim(self) -> str: ...
    @property
    def expected(self) -> Any: ...
    @property
    def measured(self) -> Any: ...
    @property
    def held(self) -> bool | None: ...
    @property
    def note(self) -> str: ...


_STATUS_STYLE = {"ok": "green", "skipped": "dim", "failed": "bold red",
                 "regressed": "bold red", "improved": "green", "unchanged": "dim", "new": "cyan",
                 "gone": "cyan", "n/a": "dim"}


def sections_table(report: Report, title: str = "torchscope doctor") -> Table:
    """One row per section: status, time, note."""
    table = Table(title=f"{title}: {report.target.name}", title_justify="left")
    for col in ("section", "status", "seconds", "findings", "note"):
        table.add_column(col, justify="right" if col in ("seconds", "findings") else "left")
    for o in report.outcomes:
        table.add_row(o.title, Text(o.status, style=_STATUS_STYLE[o.status]),
                      f"{o.seconds:.1f}", str(len(o.findings)), o.note or "")
    return table


_UNIT_TEXT: dict[str, Callable[[float], str]] = {
    "bytes": fmt_bytes, "x": "{:.2f}×".format, "ms": "{:.2f} ms".format, "s": "{:.2f} s".format,
    "count": "{:,.0f}".format,
}


def metric_text(value: float | None, unit: str) -> str:
    """A metric value in its unit."""
    return "—" if value is None else _UNIT_TEXT.get(unit, fmt_num)(value)


def _change(c: MetricChange) -> str:
    if c.change is None:
        return "—"
    if math.isinf(c.change):
        return "+∞" if c.change > 0 else "−∞"
    return f"{100 * c.change:+.1f}%"


def diff_table(diff: ReportDiff) -> Table:
    """One row per metric: old, new, change, threshold, verdict."""
    table = Table(title=f"torchscope diff: {diff.old} → {diff.new}", title_justify="left")
    for col in ("metric", "old", "new", "change", "threshold", "better", "verdict"):
        table.add_column(col, justify="left" if col in ("metric", "better", "verdict") else "right")
    for c in diff.changes:
        table.add_row(c.name, metric_text(c.old, c.unit), metric_text(c.new, c.unit), _change(c),
                      f"{100 * c.threshold:.0f}%", c.better,
                      Text(c.status, style=_STATUS_STYLE.get(c.status, "")))
    return table


def _claim_status(claim: LabClaimView) -> Text:
    if claim.held is None:
        return Text("not checked", style="dim")
    return Text("held", style="green") if claim.held else Text("failed", style="bold red")


def lab_tables(milestones: Sequence[LabTableView], claims: Sequence[LabClaimView]
               ) -> list[Table]:
    """The lesson's comparison tables as measured, then every claim with its verdict."""
    tables = []
    for m in milestones:
        t = Table(title=m.title, title_justify="left")
        for col in m.columns:
            t.add_column(col)
        for row in m.rows:
            t.add_row(*[_lab_cell(v) for v in row])
        tables.append(t)
    verdicts = Table(title="Lesson claims", title_justify="left", show_lines=False)
    for col in ("#", "milestone", "claim", "expected", "measured", "verdict"):
        verdicts.add_column(col, justify="right" if col == "#" else "left")
    for i, c in enumerate(claims, 1):
        measured = _lab_cell(c.measured) + (f" ({c.note})" if c.note else "")
        verdicts.add_row(str(i), c.milestone, c.claim, _lab_cell(c.expected), measured,
                         _claim_status(c))
    tables.append(verdicts)
    return tables


def _lab_cell(v: object) -> str:
    if v is None:
        return "None"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return fmt_num(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, tuple):
        return "(" + ", ".join(_lab_cell(x) for x in v) + ("," if len(v) == 1 else "") + ")"
    return str(v)
