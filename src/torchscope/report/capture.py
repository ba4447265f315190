"""Terminal rendering of activation records."""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table

from torchscope._util import fmt_num, fmt_pct, fmt_shape
from torchscope.capture.nonfinite import NonFiniteTrace
from torchscope.capture.records import ActivationRecord
from torchscope.report.terminal import Fitted, ModuleName

__all__ = ["activation_table", "nonfinite_lines"]


def activation_table(records: Sequence[ActivationRecord], title: str = "Activations") -> Fitted:
    """One row per recorded output tensor: module, call, shape, stats, zeros and non-finite;
    the caption says how many the fused kernel reduced. On a narrow console the call, dtype,
    min and max columns go first."""
    table = Table(title=title, title_justify="left")
    for col, justify in (
        ("module", "left"),
        ("call", "right"),
        ("output shape", "left"),
        ("dtype", "left"),
        ("mean", "right"),
        ("std", "right"),
        ("min", "right"),
        ("max", "right"),
        ("zeros %", "right"),
        ("non-finite", "right"),
    ):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for r in records:
        for s in r.outputs:
            name = ModuleName((r.module or "<root>") + (s.path if s.path else ""))
            dead = f" ({s.dead_units}/{s.channels} dead)" if s.dead_units else ""
            if s.saturated_frac:
                dead += f" ({fmt_pct(s.saturated_frac)} saturated)"
            nonfinite = "0" if s.finite else f"[red]{s.nan_count} NaN, {s.inf_count} Inf[/]"
            table.add_row(
                name,
                str(r.call),
                fmt_shape(s.shape),
                s.dtype.replace("torch.", ""),
                fmt_num(s.mean),
                fmt_num(s.std),
                fmt_num(s.min),
                fmt_num(s.max),
                fmt_pct(s.zero_frac) + dead,
                nonfinite,
            )
    stats = [s for r in records for s in r.outputs]
    fused = sum(s.fused for s in stats)
    # Which path reduced the statistics: the fused kernel (one pass each) or eager ops.
    table.caption = f"statistics: {fused} by the fused kernel, {len(stats) - fused} eager"
    return Fitted(table, optional=("call", "dtype", "min", "max"))


def nonfinite_lines(trace: NonFiniteTrace) -> list[str]:
    """Plain sentences about where NaN/Inf appeared (empty when the forward was finite)."""
    if trace.producer is None:
        if trace.clean:
            return []
        if trace.made_between:
            after = trace.entered_after
            return ["first NaN/Inf made outside the captured modules (the input is finite), "
                    + (f"after {after.label} and " if after is not None else "")
                    + f"before {trace.passers[0].label}; carried on by "
                    f"{len(trace.passers)} module(s)."]
        return [f"non-finite values entered the model's input and passed through "
                f"{len(trace.passers)} module(s)."]
    p = trace.producer
    lines = [
        f"first NaN/Inf produced by {p.module or '<root>'} ({p.module_type}), call "
        f"{p.call}, from finite inputs."
    ]
    if trace.passers:
        names = ", ".join(r.module or "<root>" for r in trace.passers[:6])
        lines.append(f"carried on by {len(trace.passers)} later module(s): {names}.")
    return lines
