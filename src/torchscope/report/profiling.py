"""Terminal and text rendering of a `ProfileResult`: op, phase and module tables."""

from __future__ import annotations

import io
from collections.abc import Sequence

from rich.console import Console, RenderableType
from rich.table import Table
from rich.text import Text

from torchscope._timing import fmt_ratio
from torchscope._util import fmt_pct
from torchscope.findings import Finding
from torchscope.profiling.ops import sort_ops
from torchscope.profiling.records import ModuleTime, OpRecord, ProfileResult
from torchscope.report.findings import finding_lines
from torchscope.report.terminal import ModuleName

__all__ = [
    "module_table",
    "op_table",
    "phase_table",
    "profile_text",
    "summary_renderables",
    "timing_line",
]


def _ms(x: float | None) -> str:
    if x is None:
        return "—"
    if x == 0:
        return "0"
    return f"{x:.3f}" if abs(x) < 10 else f"{x:.1f}"


def _shapes(r: OpRecord) -> str:
    if r.input_shapes is None:
        return ""
    return ", ".join("[" + "x".join(map(str, s)) + "]" if s else "—" for s in r.input_shapes)


def op_table(result: ProfileResult, sort: str = "self_cpu", limit: int | None = 15,
             title: str | None = None) -> Table:
    """Top ops, per step: calls, self and total CPU time, device times when recorded.

    Args:
        result: the profile.
        sort: row order, one of `SORT_KEYS`.
        limit: rows shown; None for all.
        title: the table's title; default names the sort key.
    """
    device = any(o.self_device_ms or o.device_total_ms for o in result.ops)
    shapes = any(o.input_shapes is not None for o in result.ops)
    n = max(result.steps, 1)
    table = Table(title=title or f"Top ops by {sort} (ms per step, mean of {n} profiled steps)",
                  title_justify="left")
    table.add_column("op")
    if shapes:
        table.add_column("input shapes")
    for col in ("calls/step", "self CPU", "self CPU %", "CPU total",
                *(("self CUDA", "self CUDA %", "CUDA total") if device else ())):
        table.add_column(col, justify="right")
    for r in sort_ops(result.ops, sort, limit):
        row = [r.name]
        if shapes:
            row.append(_shapes(r))
        row += [f"{r.calls / n:g}", _ms(r.self_cpu_ms / n), fmt_pct(r.self_cpu_frac),
                _ms(r.cpu_total_ms / n)]
        if device:
            row += [_ms(r.self_device_ms / n), fmt_pct(r.self_device_frac),
                    _ms(r.device_total_ms / n)]
        table.add_row(*row)
    return table


def phase_table(result: ProfileResult) -> Table:
    """Forward/backward/optimizer per step, their share of the step, and the step wall time."""
    n = max(result.steps, 1)
    step_ms = result.timing.profiled_total_ms / n
    device = any(p.device_ms for p in result.phases)
    derived = " from torch's own ranges (the loss outside forward)" \
        if any(p.derived for p in result.phases) else ""
    table = Table(title=f"Phases (ms/step, {n} steps){derived}", title_justify="left")
    table.add_column("phase")
    for col in ("host ms", "% of step", *(("CUDA ms",) if device else ())):
        table.add_column(col, justify="right")
    for p in result.phases:
        row = [p.name, _ms(p.cpu_ms / n), fmt_pct(p.cpu_ms / n / step_ms if step_ms else None)]
        if device:
            row.append(_ms(p.device_ms / n))
        table.add_row(*row)
    other = step_ms - result.phase_total_ms / n
    wait = result.input_wait
    if wait is not None:  # outside every phase: the next batch, from a DataLoader
        other -= wait.ms / n
        table.add_row("input (DataLoader)", _ms(wait.ms / n),
                      fmt_pct(wait.ms / n / step_ms if step_ms else None),
                      *([""] if device else []))
    table.add_row("[dim]between phases[/]", f"[dim]{_ms(max(other, 0.0))}[/]",
                  f"[dim]{fmt_pct(max(other, 0.0) / step_ms if step_ms else None)}[/]",
                  *([""] if device else []))
    table.add_row("[bold]step (wall)[/]", f"[bold]{_ms(step_ms)}[/]", "100.0%",
                  *([""] if device else []))
    return table


def module_table(result: ProfileResult, limit: int | None = None) -> Table:
    """Per module, per step: calls, forward and backward (inclusive and self) time.

    With `limit`, only the modules with the most self time are listed (in model order) and
    the others are summed in one row. Footer rows add the time outside modules, so the self
    columns sum to the phase totals.
    """
    n = max(result.steps, 1)
    rec = result.reconciliation
    device = any(m.forward_device_ms or m.backward_device_ms for m in result.modules)
    table = Table(title=f"Time per module (ms per step, mean of {n} profiled steps; "
                  "self = without timed child modules)", title_justify="left")
    for col, justify in (("module", "left"), ("type", "left"), ("calls/step", "right"),
                         ("forward", "right"), ("fwd self", "right"), ("backward", "right"),
                         ("bwd self", "right"), ("self %", "right")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for col in ("CUDA fwd", "CUDA bwd") if device else ():
        table.add_column(col, justify="right")
    total_self = (rec.forward_ms + rec.backward_ms) or sum(m.total_self_ms for m in result.modules)
    mods = list(result.modules)
    hidden: list[ModuleTime] = []
    if limit is not None and len(mods) > limit:
        keep = {m.module for m in sorted(mods, key=lambda m: -m.total_self_ms)[:limit]}
        hidden = [m for m in mods if m.module not in keep]
        mods = [m for m in mods if m.module in keep]
    blank = [""] * (2 if device else 0)

    def share(ms: float) -> str:
        return fmt_pct(ms / total_self if total_self else None)

    def dim_row(label: str, fwd: float, bwd: float) -> None:
        table.add_row(f"[dim]{label}[/]", "", "", "", f"[dim]{_ms(fwd / n)}[/]", "",
                      f"[dim]{_ms(bwd / n)}[/]", f"[dim]{share(fwd + bwd)}[/]", *blank)

    for m in mods:
        depth = 0 if m.module == "" else m.module.count(".") + 1
        row: list[RenderableType] = [
            ModuleName(m.module, indent=2 * depth), m.module_type, f"{m.calls / n:g}",
            _ms(m.forward_ms / n), _ms(m.forward_self_ms / n), _ms(m.backward_ms / n),
            _ms(m.backward_self_ms / n), share(m.total_self_ms)]
        if device:
            row += [_ms(m.forward_device_ms / n), _ms(m.backward_device_ms / n)]
        table.add_row(*row)
    if hidden:
        dim_row(f"{len(hidden)} more modules", sum(m.forward_self_ms for m in hidden),
                sum(m.backward_self_ms for m in hidden))
    if rec.forward_ms or rec.backward_ms:
        table.add_section()
        dim_row("outside modules (loss, glue)", rec.forward_outside_ms, rec.backward_outside_ms)
        dim_row("AccumulateGrad (param .grad)", 0.0, rec.backward_accumulate_ms)
        dim_row("autograd engine", 0.0, rec.backward_engine_ms)
        table.add_row("[bold]phase total[/]", "", "", "", f"[bold]{_ms(rec.forward_ms / n)}[/]",
                      "", f"[bold]{_ms(rec.backward_ms / n)}[/]", "100.0%", *blank)
    return table


def timing_line(result: ProfileResult) -> str:
    """`step 5.83 ms (5.61–6.02) without profiler, 8.34 ms profiled (1.43× (1.31–1.52)
    overhead; ...)`, or `(no measurable profiler overhead (0.87–1.21×); ...)` when it is
    inside the noise. The plain step's interval is the one `torchscope diff` compares."""
    t = result.timing
    if t.baseline_ms is None:
        return f"step {_ms(t.profiled_ms)} ms profiled (median of {t.profiled_steps})."
    r = t.overhead_ratio
    overhead = ("overhead not compared" if r is None else
                f"{fmt_ratio(r)} overhead" if r.above else
                fmt_ratio(r, none="no measurable profiler overhead", above=True))
    spread = t.baseline_interval
    within = f" ({_ms(spread.low)}–{_ms(spread.high)})" \
        if spread is not None and spread.n > 1 else ""
    return (f"step {_ms(t.baseline_ms)} ms{within} without profiler, {_ms(t.profiled_ms)} ms "
            f"profiled ({overhead}; medians of {t.baseline_steps} and {t.profiled_steps} "
            "steps).")






def summary_renderables(result: ProfileResult, findings: Sequence[Finding] = (), *,
                        sort: str = "self_cpu", by: str = "op", limit: int | None = 15
                        ) -> list[RenderableType]:
    """The summary in print order: the step (when torchscope ran it), phase table, op or
    module table, timing, findings.

    Args:
        result: the profile.
        findings: its findings (`result.findings()`).
        sort: op order (see `SORT_KEYS`).
        by: `module` for the module table (when modules were timed), else the op table.
        limit: rows of the op or module table.
    """
    if by == "module" and result.modules:
        table = module_table(result, limit)
    else:
        table = op_table(result, sort, limit)
    head = [Text(result.step.describe())] if result.step is not None else []
    return [*head, phase_table(result), table, timing_line(result), *finding_lines(findings)]


def profile_text(result: ProfileResult, findings: Sequence[Finding] = (), *,
                 sort: str = "self_cpu", by: str = "op", limit: int | None = 15,
                 width: int = 140) -> str:
    """The whole summary as plain text (tables without colour), e.g. to save with the run.

    Args:
        result, findings, sort, by, limit: as for `summary_renderables`.
        width: the text's width in characters.
    """
    console = Console(file=io.StringIO(), width=width, record=True, color_system=None)
    for part in summary_renderables(result, findings, sort=sort, by=by, limit=limit):
        console.print(part)
    return console.export_text()
