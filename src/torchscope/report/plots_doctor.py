"""Plots of report.html that the capabilities' own plot modules do not draw: each function
takes a capability's record and returns a Figure (`torchscope.report.charts` draws them),
or an `EmptyPlot` saying in one line why there is nothing to chart.

Per-module charts list modules in forward order with their full names, grouped by block;
beyond `DEEP_ROWS` modules they summarise each block instead (the tables keep every module).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from matplotlib.figure import Figure

from torchscope.capture import ActivationRecord, TensorStats
from torchscope.compile import CompileReport, ModeResult
from torchscope.profiling import OpRecord, ProfileResult
from torchscope.report.charts import (
    ACCENT,
    ACCENT2,
    DEEP_ROWS,
    GREY,
    WARN,
    EmptyPlot,
    Series,
    block_groups,
    block_label,
    module_chart,
)
from torchscope.report.compile import speed_label, speed_verdict

__all__ = [
    "activation_stats_plot",
    "activation_zeros_plot",
    "compile_speedup_plot",
    "pooled_stats",
    "profile_modules_plot",
    "profile_ops_plot",
]

NAN = math.nan
TOP_MODULES = 30  # rows of the time-per-module chart (the costliest)


def _label(r: ActivationRecord) -> str:
    name = r.module or "<root>"
    return f"{name}#{r.call}" if r.call else name


def _finite(values: Sequence[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


def pooled_stats(stats: Sequence[TensorStats]) -> tuple[float, float]:
    """Mean and standard deviation of several outputs' elements taken together (each
    output's statistics weighted by its element count); NaN for none."""
    if not stats:
        return NAN, NAN
    n = sum(s.numel for s in stats) or 1
    mean = math.fsum(s.numel * s.mean for s in stats) / n
    square = math.fsum(s.numel * (s.std ** 2 + s.mean ** 2) for s in stats) / n
    return mean, math.sqrt(max(square - mean * mean, 0.0))


def activation_stats_plot(records: Sequence[ActivationRecord]) -> Figure:
    """Each leaf output's min–max range and mean ± std, in forward order; per block beyond
    `DEEP_ROWS` outputs (the statistics of the block's outputs pooled)."""
    rows = [r for r in records if r.output is not None and "float" in r.output.dtype]
    if not rows:
        return EmptyPlot("No module output is a floating-point tensor, so there are no "
                         "activation statistics to chart.")
    stats = [r.output for r in rows if r.output is not None]
    names = [_label(r) for r in rows]
    bad = [not r.finite for r in rows]
    what = "module (forward order)"
    if len(rows) > DEEP_ROWS:
        groups = block_groups(names)
        names = [block_label(b, [names[i] for i in idx]) for b, idx in groups]
        pooled = [pooled_stats([stats[i] for i in idx if rows[i].finite]) for _, idx in groups]
        lo = [min(_finite([stats[i].min for i in idx]), default=NAN) for _, idx in groups]
        hi = [max(_finite([stats[i].max for i in idx]), default=NAN) for _, idx in groups]
        bad = [any(bad[i] for i in idx) for _, idx in groups]
        means, stds = [m for m, _ in pooled], [s for _, s in pooled]
        what = f"block ({len(rows)} module outputs pooled per block; every module in the table)"
    else:
        lo, hi = [s.min for s in stats], [s.max for s in stats]
        means, stds = [s.mean for s in stats], [s.std for s in stats]
    series = [Series("min – max", hi, kind="range", start=lo, color="#9aa5b4"),
              Series("mean ± std", means, kind="point", err=stds)]
    if any(bad):
        series.append(Series("NaN/Inf", [0.0 if b else NAN for b in bad], kind="point",
                             marker="x", color=WARN))
    return module_chart(names, series, title=f"Activation statistics per {what}",
                        xlabel="output value", group=len(rows) <= DEEP_ROWS)


def activation_zeros_plot(records: Sequence[ActivationRecord]) -> Figure:
    """Share of exactly-zero output elements of the modules that have any (dropout left out:
    its zeros are by design), dead channels annotated; per block beyond `DEEP_ROWS`."""
    rows = [r for r in records if r.output is not None and "Dropout" not in r.module_type
            and (r.output.zero_frac > 0 or r.output.dead_units)]
    if not rows:
        return EmptyPlot("No module's output holds an exact zero (dropout aside), so there "
                         "is no zero-fraction chart.")
    stats = [r.output for r in rows if r.output is not None]
    names = [_label(r) for r in rows]
    zeros = [100 * s.zero_frac for s in stats]
    dead = [s.dead_units or 0 for s in stats]
    notes = [f"{s.dead_units}/{s.channels} dead" if s.dead_units else "" for s in stats]
    group = len(rows) <= DEEP_ROWS
    if not group:
        groups = block_groups(names)
        names = [block_label(b, [names[i] for i in idx]) for b, idx in groups]
        zeros = [max(zeros[i] for i in idx) for _, idx in groups]
        dead = [sum(dead[i] for i in idx) for _, idx in groups]
        notes = [f"{d} dead" if d else "" for d in dead]
    title = ("Zero fraction of each module's output" if group else
             "Largest zero fraction in each block") + \
        " (modules without zeros and dropout left out; red: dead channels)"
    return module_chart(names, [Series("zeros (%)", zeros, colors=[
        WARN if d else ACCENT for d in dead], notes=notes)], title=title, xlabel="zeros (%)",
        group=group)


def profile_ops_plot(ops: Sequence[OpRecord]) -> Figure:
    """Top ops by self CPU time."""
    rows = sorted(ops, key=lambda o: -o.self_cpu_ms)[:12]
    return module_chart([f"{o.name} ×{o.calls}" for o in rows],
                        [Series("self CPU", [o.self_cpu_ms for o in rows])],
                        title=f"Top {len(rows)} ops by self CPU time",
                        xlabel="self CPU (ms, all profiled steps)", group=False)


def profile_modules_plot(result: ProfileResult) -> Figure:
    """Forward and backward self time per step of the costliest modules, stacked."""
    steps = max(result.steps, 1)
    rows = sorted(result.modules,
                  key=lambda m: -(m.forward_self_ms + m.backward_self_ms))[:TOP_MODULES]
    fwd = [m.forward_self_ms / steps for m in rows]
    of = f"the {len(rows)} costliest of {len(result.modules)} modules" \
        if len(result.modules) > len(rows) else "each module"
    return module_chart([m.module for m in rows], [
        Series("forward", fwd),
        Series("backward", [m.backward_self_ms / steps for m in rows], start=fwd,
               color=ACCENT2)], title=f"Self time per step of {of}", xlabel="ms per step",
        group=False)


def compile_speedup_plot(modes: Sequence[ModeResult],
                         report: CompileReport | None = None) -> Figure:
    """Speedup of each torch.compile mode over eager, as its findings judge it: the median
    with its interval as a bar across it, coloured and labelled by the verdict (faster,
    slower, no measurable speedup, nothing compiled); the line at 1× is break-even per
    call."""
    if not modes:
        return EmptyPlot("No torch.compile mode was measured, so there is no speedup chart.")
    verdicts = [speed_verdict(m, report) for m in modes]
    colors = [ACCENT if v == "faster" else WARN if v == "slower" else GREY for v in verdicts]
    vals = [m.speedup if m.speedup is not None else NAN for m in modes]
    low = [m.speedup_ratio.low if m.speedup_ratio is not None else v
           for m, v in zip(modes, vals, strict=True)]
    high = [m.speedup_ratio.high if m.speedup_ratio is not None else v
            for m, v in zip(modes, vals, strict=True)]
    fig = module_chart([m.mode for m in modes], [
        Series("interval", high, kind="range", start=low, colors=colors),
        Series("median", vals, kind="point", color="#333333",
               notes=[speed_label(m, report) for m in modes], note_colors=colors)],
        title="torch.compile speedup per mode: median and interval (dashed: 1×, no "
              "difference; grey: not a verdict)", xlabel="speedup over eager (×)",
        group=False, log=True, ref=1.0)
    from matplotlib.ticker import FuncFormatter

    # 0.5×, 1×, 2× rather than powers of ten: a speedup reads as a factor.
    fig.axes[0].xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}×"))
    return fig
