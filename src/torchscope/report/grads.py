"""Terminal rendering of gradient flow (rich tables). Formats only; never analyses."""

from __future__ import annotations

import math
from collections.abc import Sequence

from rich.table import Table

from torchscope._util import fmt_num, fmt_shape
from torchscope.grads.records import GradFlow, GradHistory, TensorGrad
from torchscope.report.terminal import ModuleName

__all__ = ["grad_table", "history_table", "layer_table", "param_table"]


def _norm(norm: float | None, reason: str | None) -> str:
    """A norm; red when not finite; None with the reason in dim."""
    if norm is None:
        return f"None [dim]({reason})[/]"
    return fmt_num(norm) if math.isfinite(norm) else f"[red]{fmt_num(norm)}[/]"


def _norms(grads: Sequence[TensorGrad]) -> str:
    if not grads:
        return "—"
    return "\n".join((f"{g.path}=" if len(grads) > 1 and g.path else "") + _norm(g.norm, g.reason)
                     for g in grads)


def grad_table(flow: GradFlow, title: str | None = None) -> Table:
    """One row per module call in backward order: grad_output, grad_input, and the module's
    own parameter gradients (weight, bias, ...); the caption gives the total norm and, when
    torchscope ran the step, `flow.step.describe()`."""
    table = Table(title=title or f"Gradient flow, step {flow.index} (backward order)",
                  title_justify="left")
    for col, justify in (("#", "right"), ("module", "left"), ("type", "left"),
                         ("call", "right"), ("grad_output norm", "right"),
                         ("grad_input norm", "right"), ("param grad norms", "left")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    own: dict[str, list[str]] = {}
    for p in flow.params:
        short = p.name[len(p.module) + 1:] if p.module else p.name
        tied = f" [dim](tied to {p.tied_to})[/]" if p.tied_to else ""
        own.setdefault(p.module, []).append(f"{short}={_norm(p.norm, p.reason)}{tied}")
    shown: set[str] = set()
    micro = flow.micro_batches > 1
    for r in flow.modules:
        call = f"{r.micro}.{r.call}" if micro else str(r.call)
        # Parameters hold one gradient per step: shown on the module's first row only.
        pnorms = "\n".join(own.get(r.module, [])) if r.module not in shown else ""
        shown.add(r.module)
        table.add_row("—" if r.order is None else str(r.order), ModuleName(r.module),
                      r.module_type, call, _norms(r.grad_output), _norms(r.grad_input),
                      pnorms)
    scale = f", GradScaler scale {flow.scale:g} divided out" if flow.scale else ""
    if flow.clip_factor > 1:
        scale += (f"; the update used {fmt_num(flow.applied_norm)} (clipped "
                  f"{fmt_num(flow.clip_factor)}×)")
    step = f"\n{flow.step.describe()}" if flow.step is not None else ""
    table.caption = (f"total norm (as clip_grad_norm_): {fmt_num(flow.total_norm)}"
                     f"{scale}{step}")
    table.caption_justify = "left"
    return table


def param_table(flow: GradFlow, title: str = "Parameter gradients") -> Table:
    """One row per parameter: shape, gradient norm and RMS, the relative gradient ‖g‖/‖w‖,
    the update ratio ‖Δw‖/‖w‖ when the optimizer's update was measured, or why there is
    no gradient; a tied parameter's second name says what it is tied to."""
    table = Table(title=title, title_justify="left")
    updates = any(p.update_norm is not None for p in flow.params)
    cols = [("parameter", "left"), ("shape", "left"), ("grad norm", "right"),
            ("grad RMS", "right"), ("‖g‖/‖w‖", "right")]
    cols += [("‖Δw‖/‖w‖", "right")] if updates else []
    for col, justify in (*cols, ("note", "left")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for p in flow.params:
        norm = "None" if p.norm is None else _norm(p.norm, None)  # the reason has a column
        note = f"tied to {p.tied_to}" if p.tied_to else (p.reason or "")
        row = [p.name, fmt_shape(p.shape), norm, fmt_num(p.rms), fmt_num(p.relative)]
        row += [fmt_num(p.update_ratio)] if updates else []
        table.add_row(*row, note)
    return table


def layer_table(flow: GradFlow, title: str | None = None) -> Table:
    """One row per module in backward order, with the scale-free measures the diagnosis
    reads: RMS of the gradient arriving at its outputs, RMS of its weight gradients, the
    relative gradient ‖g‖/‖w‖ and, when measured, the update ratio ‖Δw‖/‖w‖ (see
    `torchscope.grads.LayerGrads`)."""
    layers = [lg for lg in flow.layer_grads() if lg.order is not None or lg.params]
    updates = any(lg.update_norm is not None for lg in layers)
    table = Table(title=title or f"Gradient scale per layer, step {flow.index} (backward "
                  "order)", title_justify="left")
    cols = [("module", "left"), ("type", "left"), ("grad_output RMS", "right"),
            ("param grad RMS", "right"), ("‖g‖/‖w‖", "right")]
    cols += [("‖Δw‖/‖w‖", "right")] if updates else []
    for col, justify in cols:
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for lg in layers:
        row = [lg.module or "<root>", lg.module_type or "—", fmt_num(lg.output_rms),
               fmt_num(lg.rms), fmt_num(lg.relative) + (" [dim](tied)[/]" if lg.tied else "")]
        row += [fmt_num(lg.update_ratio)] if updates else []
        table.add_row(*row)
    return table


def history_table(history: GradHistory, kind: str = "output", max_cols: int = 8) -> Table:
    """One row per layer, one column per sampled step (at most `max_cols`, evenly spread,
    first and last always shown), and the last/first change."""
    label = "grad_output" if kind == "output" else "param grad"
    table = Table(title=f"{label} norm history ({len(history)} samples)", title_justify="left")
    n = len(history)
    cols = list(range(n)) if n <= max_cols else \
        sorted({round(i * (n - 1) / (max_cols - 1)) for i in range(max_cols)})
    table.add_column("layer", justify="left")
    for i in cols:
        table.add_column(f"step {history.steps[i]}", justify="right")
    table.add_column("last/first", justify="right")
    rows = history.output_norms if kind == "output" else history.param_norms
    series = [(name, [rows[i][j] for i in range(n)]) for j, name in enumerate(history.layers)]
    series.append(("total", list(history.total_norms)))
    for name, values in series:
        finite = [v for v in values if math.isfinite(v) and v > 0]
        change = fmt_num(finite[-1] / finite[0]) + "×" if len(finite) >= 2 else "—"
        table.add_row(ModuleName(name), *(fmt_num(values[i]) if not math.isnan(values[i])
                                          else "—" for i in cols), change)
    return table


