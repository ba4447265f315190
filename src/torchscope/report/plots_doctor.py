"""Plots of report.html that the capabilities' own plot modules do not draw (matplotlib, no
pyplot state): each function takes a capability's record and returns a Figure.

`figure_svg` turns any figure (these, or `plots_grads`'/`plots_memory`'s) into a
self-contained inline `<svg>` (glyphs as paths, no metadata, no external reference).
"""

from __future__ import annotations

import io
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from matplotlib.figure import Figure

from torchscope.capture import ActivationRecord
from torchscope.compile import ModeResult
from torchscope.profiling import OpRecord, ProfileResult

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = [
    "activation_stats_plot",
    "activation_zeros_plot",
    "compile_speedup_plot",
    "figure_svg",
    "profile_modules_plot",
    "profile_ops_plot",
]

MAX_BARS = 60  # beyond this, labels are unreadable; the tables hold the rest
_ACCENT = "#3b6ea8"
_ACCENT2 = "#d9822b"
_WARN = "#c0392b"
_RC: dict[str, Any] = {"font.size": 8, "svg.fonttype": "path", "svg.hashsalt": "torchscope",
       "axes.spines.top": False, "axes.spines.right": False}


def _axes(n: int, height: float = 3.2) -> tuple[Figure, Axes]:
    """A figure for `n` bars (wider with more of them, 6 to 14 inches) and its one axes."""
    fig = Figure(figsize=(min(max(6.0, 0.22 * n + 2.5), 14.0), height), layout="constrained")
    return fig, fig.add_subplot()


def figure_svg(fig: Figure) -> str:
    """The figure as an inline `<svg>` element: no XML prolog, DOCTYPE or metadata."""
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context(_RC):  # type: ignore[arg-type]
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None, "Format": None,
                                                 "Type": None})
    svg = buf.getvalue()
    svg = svg[svg.index("<svg"):]
    svg = re.sub(r"<metadata>.*?</metadata>", "", svg, flags=re.S)
    return svg.strip()


def _label(r: ActivationRecord) -> str:
    name = r.module or "<root>"
    return f"{name}#{r.call}" if r.call else name


def activation_stats_plot(records: Sequence[ActivationRecord]) -> Figure:
    """Mean ± std of each leaf output in forward order, with its min and max."""
    rows = [r for r in records if r.output is not None and "float" in r.output.dtype][:MAX_BARS]
    stats = [r.output for r in rows if r.output is not None]
    fig, ax = _axes(len(rows))
    xs = list(range(len(rows)))
    ax.errorbar(xs, [s.mean for s in stats], yerr=[s.std for s in stats], fmt="o", color=_ACCENT,
                capsize=3, label="mean ± std")
    ax.scatter(xs, [s.min for s in stats], marker="v", s=14, color="#777777", label="min")
    ax.scatter(xs, [s.max for s in stats], marker="^", s=14, color="#777777", label="max")
    bad = [i for i, r in enumerate(rows) if not r.finite]
    if bad:
        ax.scatter(bad, [0.0] * len(bad), marker="x", s=40, color=_WARN, label="NaN/Inf")
    ax.axhline(0.0, color="#bbbbbb", linewidth=0.8)
    ax.set_xticks(xs, [_label(r) for r in rows], rotation=60, ha="right")
    ax.set_ylabel("output value")
    ax.set_title("Activation statistics per module (forward order)")
    ax.legend(loc="best", fontsize=7)
    return fig


def activation_zeros_plot(records: Sequence[ActivationRecord]) -> Figure:
    """Fraction of exactly-zero output elements per leaf module; dead channels annotated."""
    rows = [r for r in records if r.output is not None][:MAX_BARS]
    stats = [r.output for r in rows if r.output is not None]
    fig, ax = _axes(len(rows))
    xs = list(range(len(rows)))
    ax.bar(xs, [100 * s.zero_frac for s in stats],
           color=[_WARN if s.dead_units else _ACCENT for s in stats])
    for x, s in enumerate(stats):
        if s.dead_units:
            ax.annotate(f"{s.dead_units}/{s.channels} dead", (x, 100 * s.zero_frac),
                        ha="center", va="bottom", fontsize=7, color=_WARN)
    ax.set_ylim(0, 110)
    ax.set_xticks(xs, [_label(r) for r in rows], rotation=60, ha="right")
    ax.set_ylabel("zeros (%)")
    ax.set_title("Zero fraction of each module's output (red: dead channels)")
    return fig


def profile_ops_plot(ops: Sequence[OpRecord]) -> Figure:
    """Top ops by self CPU time."""
    rows = sorted(ops, key=lambda o: -o.self_cpu_ms)[:12]
    fig, ax = _axes(10, height=max(2.5, 0.25 * len(rows) + 1))
    ys = list(range(len(rows)))
    ax.barh(ys, [o.self_cpu_ms for o in rows], color=_ACCENT)
    ax.set_yticks(ys, [f"{o.name} ×{o.calls}" for o in rows])
    ax.invert_yaxis()
    ax.set_xlabel("self CPU (ms, all profiled steps)")
    ax.set_title("Top ops by self CPU time")
    return fig


def profile_modules_plot(result: ProfileResult) -> Figure:
    """Forward and backward self time per step of each module, stacked."""
    steps = max(result.steps, 1)
    rows = sorted(result.modules, key=lambda m: -(m.forward_self_ms + m.backward_self_ms))[:30]
    fig, ax = _axes(10, height=max(2.5, 0.22 * len(rows) + 1))
    ys = list(range(len(rows)))
    fwd = [m.forward_self_ms / steps for m in rows]
    ax.barh(ys, fwd, color=_ACCENT, label="forward")
    ax.barh(ys, [m.backward_self_ms / steps for m in rows], left=fwd, color=_ACCENT2,
            label="backward")
    ax.set_yticks(ys, [m.module or "<root>" for m in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms per step")
    ax.set_title("Self time per module")
    ax.legend(loc="best", fontsize=7)
    return fig


def compile_speedup_plot(modes: Sequence[ModeResult]) -> Figure:
    """Speedup of each torch.compile mode over eager; the line at 1× is break-even per call."""
    fig, ax = _axes(6)
    xs = list(range(len(modes)))
    vals = [m.speedup or 0.0 for m in modes]
    ax.bar(xs, vals, color=[_ACCENT if v >= 1 else _WARN for v in vals])
    ax.axhline(1.0, color="#555555", linestyle="--", linewidth=1)
    ax.set_xticks(xs, [m.mode for m in modes])
    ax.set_ylabel("speedup over eager (×)")
    ax.set_title("torch.compile speedup per mode")
    return fig
