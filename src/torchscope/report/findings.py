"""Findings in the terminal, one way for every command: lines for short lists, a table for
the doctor; the evidence (`key=value`) only when asked (`--verbose`), as report.json and
report.html always carry it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich.markup import escape
from rich.table import Table
from rich.text import Text

from torchscope._util import fmt_num
from torchscope.findings import Finding, Severity, rank, ranked
from torchscope.report.terminal import Prose

__all__ = ["SEVERITY_STYLE", "evidence_text", "finding_lines", "findings_table"]

SEVERITY_STYLE = {Severity.ERROR: "bold red", Severity.WARNING: "yellow", Severity.INFO: "cyan"}


def evidence_text(evidence: Mapping[str, Any]) -> str:
    """A finding's evidence on one line: `dead=6, fraction=0.75`."""
    out = []
    for k, v in evidence.items():
        if isinstance(v, float):
            out.append(f"{k}={fmt_num(v)}")
        elif isinstance(v, int) and not isinstance(v, bool):
            out.append(f"{k}={v:,}")
        else:
            out.append(f"{k}={v}")
    return ", ".join(out)


def finding_lines(findings: Sequence[Finding]) -> list[str]:
    """One rich-markup line per finding, most severe first: severity, summary and fix."""
    lines = []
    for f in rank(findings):
        fix = f" [dim]Fix: {escape(f.fix)}[/]" if f.fix else ""
        # Summaries are clauses; those that end a sentence of their own keep one period.
        end = "" if f.summary.endswith((".", "?", "!")) else "."
        lines.append(f"[{SEVERITY_STYLE[f.severity]}]{f.severity.label}[/] "
                     f"{escape(f.summary)}{end}{fix}")
    return lines


def findings_table(findings: Sequence[Finding] | Sequence[tuple[str, Finding]],
                   title: str = "Findings", *, verbose: bool = False) -> Table:
    """Findings in report order (`torchscope.findings.rank`): severity, (section,) summary
    and the fix; with `verbose`, each summary's evidence below it.

    Args:
        findings: findings, or `(section, finding)` pairs (the doctor's), which add a
            section column.
        title: the table's title.
        verbose: show each finding's evidence (`key=value`).
    """
    pairs = ranked((f if isinstance(f, tuple) else ("", f) for f in findings), lambda p: p[1])
    sections = any(section for section, _ in pairs)
    table = Table(title=title, title_justify="left", show_lines=True)
    table.add_column("severity")
    if sections:
        table.add_column("section")
    table.add_column("finding (evidence)" if verbose else "finding", ratio=3)
    table.add_column("suggested fix", ratio=2)
    for section, f in pairs:
        shown = verbose and f.evidence
        evidence = ("\n" + evidence_text(f.evidence), "dim") if shown else ("", "")
        row: list[Any] = [Text(f.severity.label, style=SEVERITY_STYLE[f.severity])]
        if sections:
            row.append(section)
        table.add_row(*row, Prose((f.summary, ""), evidence), Prose((f.fix or "—", "")))
    return table
