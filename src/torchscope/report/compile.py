"""Terminal rendering of the torch.compile doctor: the per-mode table, breaks, recompiles."""

from __future__ import annotations

from collections.abc import Sequence

from rich.markup import escape
from rich.table import Table

from torchscope._timing import fmt_ratio
from torchscope._util import fmt_num
from torchscope.compile.records import CompileReport, GraphBreak, ModeResult, Recompile

__all__ = [
    "compile_table",
    "graph_break_table",
    "recompile_table",
    "shape_call_lines",
    "speed_label",
    "speed_verdict",
]

_STATUS_STYLE = {"ok": "green", "error": "red", "crashed": "red", "timeout": "yellow",
                 "no_compiler": "red"}


def _fmt(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def speed_verdict(m: ModeResult, report: CompileReport | None = None) -> str | None:
    """What a mode's timing says, as its findings say it: `faster` or `slower` (the
    speedup's interval lies above or below 1), `undecided` (it includes 1: not measurable
    here), `nothing compiled` (Dynamo made no graph: eager against eager); None for a mode
    that was not timed. Without an interval, the median decides."""
    if not m.ok or m.speedup is None:
        return None
    if report is not None and report.graph_count == 0:
        return "nothing compiled"
    if m.undecided:
        return "undecided"
    return "faster" if m.faster else "slower" if m.slower else "undecided"


def speed_label(m: ModeResult, report: CompileReport | None = None) -> str:
    """The verdict in words with its numbers, as the findings write them (`fmt_ratio`):
    `1.84× (1.61–2.10) faster`, `no measurable speedup (0.66–6.95×)`, `0.77× (0.71–0.83)
    slower`, `nothing compiled`; `—` untimed. Without an interval, the median alone."""
    verdict = speed_verdict(m, report)
    r = m.speedup_ratio
    if verdict is None or m.speedup is None:
        return "—"
    if verdict == "nothing compiled":
        return "nothing compiled"
    if r is None:
        return "no measurable speedup" if verdict == "undecided" else \
            f"{m.speedup:.2f}× {verdict}"
    if verdict == "undecided":
        return fmt_ratio(r, none="no measurable speedup")
    return f"{fmt_ratio(r)} {verdict}"


def _speedup(m: ModeResult) -> str:
    if m.speedup is None:
        return "—"
    r = m.speedup_ratio
    if r is not None:  # with its interval; inside the noise it is no speedup at all
        style = "green" if r.above else "red" if r.below else "yellow"
        return f"[{style}]{fmt_ratio(r, none='no measurable difference')}[/]"
    style = "green" if m.speedup > 1 else "red"
    return f"[{style}]{m.speedup:.2f}×[/]"


def _break_even(m: ModeResult) -> str:
    if not m.ok:
        return "—"
    return "never" if m.break_even_calls is None else f"{m.break_even_calls:,}"


def _diff(m: ModeResult) -> str:
    parts = []
    if m.max_abs_diff is not None:
        parts.append(fmt_num(m.max_abs_diff, 2))
    if m.grad_max_abs_diff is not None:
        parts.append(f"grad {fmt_num(m.grad_max_abs_diff, 2)}")
    return " / ".join(parts) or "—"


def compile_table(report: CompileReport, title: str | None = None) -> Table:
    """One row per mode: compile cost, latency, speedup, break-even, breaks, recompiles, diff."""
    kind = "training step" if report.measure == "step" else "inference"
    table = Table(
        title=title or f"torch.compile on {report.model} {report.inputs}, {kind}, "
                       f"{report.device} (torch {report.torch_version})",
        title_justify="left")
    for col in ("mode", "status", "cold s", "warm s", "eager ms", "compiled ms", "speedup",
                "break-even calls", "breaks", "recompiles", "max diff"):
        table.add_column(col, justify="left" if col in ("mode", "status") else "right")
    breaks = str(len(report.graph_breaks)) if report.graph_count is not None else "?"
    for m in report.modes:
        style = _STATUS_STYLE.get(m.status, "red")
        rec = f"{len(m.recompiles)}/{m.recompile_limit}" + (" [red]limit hit[/]"
                                                             if m.limit_hit else "")
        table.add_row(escape(m.mode), f"[{style}]{m.status}[/]", _fmt(m.cold_compile_s, ".2f"),
                      _fmt(m.warm_compile_s, ".2f"), _fmt(m.eager_ms, ".3g"),
                      _fmt(m.compiled_ms, ".3g"), _speedup(m), _break_even(m),
                      breaks if m.ok else "—", rec if m.ok else "—", _diff(m))
    return table


def graph_break_table(breaks: Sequence[GraphBreak], title: str = "Graph breaks") -> Table:
    """One row per graph break: where, what kind, torch's reason."""
    table = Table(title=title, title_justify="left")
    for col in ("#", "where", "function", "kind", "reason"):
        table.add_column(col, overflow="fold")
    for i, b in enumerate(breaks, 1):
        reason = b.reason + (f" — {b.explanation}" if b.explanation else "")
        kind = b.kind + (f" (in {b.hook})" if b.hook else "")
        table.add_row(str(i), escape(b.where), escape(b.function or "?"), escape(kind),
                      escape(reason))
    return table


def recompile_table(recompiles: Sequence[Recompile], limit: int,
                    title: str = "Recompiles") -> Table:
    """One row per recompile: id, function, failing guard, shown against the limit."""
    table = Table(title=f"{title} (limit {limit} per frame)", title_justify="left")
    for col in ("id", "function", "failing guard", "from"):
        table.add_column(col, overflow="fold")
    for r in recompiles:
        src = r.source.rsplit("/", 1)[-1] if r.source else "—"
        table.add_row(r.compile_id, escape(r.where), escape(r.guard), escape(src))
    return table


def shape_call_lines(m: ModeResult) -> list[str]:
    """`batch 16: 2.08 s, recompiled` per extra batch size."""
    return [f"{m.mode}: batch {c.batch_size}: {c.call_s:.2f} s"
            + (", recompiled" if c.compiled else ", reused the compiled graph")
            for c in m.shape_calls]


