"""Plots of the memory records: saved bytes per module, and each plan's activation memory
against its recompute time (matplotlib `Figure`s, no pyplot: the user's backend is left alone)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from torchscope._util import fmt_bytes
from torchscope.memory.records import PlanReport, SavedActivations
from torchscope.report.charts import (
    FONT,
    LABEL_GID,
    Series,
    chart_size,
    draw_rows,
    label_width,
    wrap,
)
from torchscope.report.memory import fmt_recompute, recompute_cost

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["plot_memory", "plot_plans", "plot_saved"]

_KIB = 1024.0
_PANEL_IN = 6.4  # width of the plans panel


def _saved_rows(saved: SavedActivations, limit: int) -> list[str]:
    return [r.module or "<root>" for r in sorted(saved.modules, key=lambda r: -r.bytes)[:limit]]


def _saved_title(saved: SavedActivations, limit: int) -> str:
    shown = min(limit, len(saved.modules))
    which = f"the {shown} largest of {len(saved.modules)} modules" \
        if len(saved.modules) > shown else "each module"
    return f"Saved activations of {which} (total {fmt_bytes(saved.total_bytes)})"


def _draw_saved(ax: Axes, saved: SavedActivations, limit: int) -> None:
    rows = sorted(saved.modules, key=lambda r: -r.bytes)[:limit]
    # Largest first, full names (OUTSIDE is a label of its own).
    draw_rows(ax, [r.module or "<root>" for r in rows],
              [Series("saved", [r.bytes / _KIB for r in rows], color="#4c72b0")],
              group=False, xlabel="saved for backward (KiB)")


@dataclass(frozen=True)
class _PlanPoint:
    """One point of the plans chart: the plans that land on it, recompute (ms) with its
    interval, saved and predicted peak (KiB), the words of its recompute as the tables
    say them, and whether the recompute is a measured cost (False: no measurable cost)."""

    names: list[str]
    x: float
    low: float
    high: float
    y: float
    peak: float
    words: str
    measurable: bool


def _plan_points(report: PlanReport) -> list[_PlanPoint]:
    """One point per distinct spot: plans that land on the same one share it and its label.
    The recompute is `recompute_cost`'s, as the tables and report.json give it; one inside
    the noise (no figure there) sits at its measured median, with its interval."""
    points: dict[tuple[float, float], _PlanPoint] = {}
    for p in report.plans:
        m = report.measurement(p.name)
        ms, low, high = recompute_cost(p, m)  # ms None: no measurable cost, a hollow point
        measurable = ms is not None
        x = p.recompute_ms if m is None else m.recompute_ms  # the median, measurable or not
        y = (m.saved_bytes if m is not None else p.saved_bytes) / _KIB
        point = points.setdefault((round(x, 6), round(y, 3)), _PlanPoint(
            [], x, x if low is None else low, x if high is None else high, y,
            p.peak_activation_bytes / _KIB, fmt_recompute(p, m), measurable))
        point.names.append(p.name)
    return list(points.values())


def _draw_plans(ax: Axes, report: PlanReport) -> None:
    # Plans are told apart by colour and named in the legend, never by text at the point:
    # two plans often land close together (sqrt and auto), and their labels would overlap.
    # A recompute inside the noise is a hollow point with its interval as a bar.
    for pt in _plan_points(report):
        label = " = ".join(pt.names)
        bar = [[pt.x - pt.low], [pt.high - pt.x]]
        drawn = ax.errorbar([pt.x], [pt.y], xerr=bar, fmt="o", markersize=7, capsize=3,
                            zorder=3, label=f"{label}: {fmt_bytes(pt.y * _KIB)}, {pt.words}")
        if not pt.measurable:
            drawn.lines[0].set_markerfacecolor("none")
        ax.scatter([pt.x], [pt.peak], marker="x", color="gray", zorder=2)
    kind = "measured" if report.measurements else "predicted"
    ax.set_xlabel(f"recompute time, {kind} (ms; bar: interval, hollow: no measurable cost)",
                  fontsize=FONT)
    ax.set_xlim(left=0)
    ax.set_ylabel("saved activations (KiB); x = predicted peak", fontsize=FONT)
    ax.tick_params(labelsize=FONT)
    ax.grid(alpha=0.3)
    legend = ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=FONT - 1,
                       title="plan: saved, recompute", title_fontsize=FONT - 1, frameon=False)
    for text in legend.get_texts():  # the plans' names: this chart's labels
        text.set_gid(LABEL_GID + "_".join(text.get_text().split()))


_PLANS_TITLE = "Checkpointing plans: saved memory against recompute time"
_PLANS_BESIDE_IN = 3.2  # the plans panel's axis labels and the legend right of it

Panel = tuple[Callable[["Axes"], None], str, float]  # draw, title, inches beside the axes


def _plot(panels: Sequence[Panel], labels: Sequence[str], path: str | Path | None) -> Figure:
    """One figure with `panels` side by side, the first sized for the row `labels`; saved to
    `path` (folders created) if given."""
    from matplotlib.figure import Figure

    width, height = chart_size(labels, max(len(labels), 14))
    first = width
    width += _PANEL_IN * (len(panels) - 1)
    fig = Figure(figsize=(width, height), layout="constrained")
    for i, (draw, title, beside) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        draw(ax)
        # A left-aligned title starts at the axes: wrapped to what the panel leaves it.
        room = (first if i == 0 else _PANEL_IN) - beside
        ax.set_title(wrap(title, room - 0.3), loc="left", fontsize=FONT + 1)
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
    return fig


def _saved_panel(saved: SavedActivations, limit: int) -> Panel:
    return (lambda ax: _draw_saved(ax, saved, limit), _saved_title(saved, limit),
            label_width(_saved_rows(saved, limit)) + 0.3)


def _plans_panel(report: PlanReport) -> Panel:
    return (lambda ax: _draw_plans(ax, report), _PLANS_TITLE, _PLANS_BESIDE_IN)


def plot_saved(saved: SavedActivations, path: str | Path | None = None, limit: int = 30
               ) -> Figure:
    """Horizontal bars of saved bytes per module (largest first); saved to `path` if given."""
    return _plot([_saved_panel(saved, limit)], _saved_rows(saved, limit), path)


def plot_plans(report: PlanReport, path: str | Path | None = None) -> Figure:
    """Each plan's saved bytes against its recompute time; saved to `path` if given."""
    return _plot([_plans_panel(report)], [], path)


def plot_memory(saved: SavedActivations, report: PlanReport | None = None,
                path: str | Path | None = None) -> Figure:
    """Both panels side by side (the plans panel only with a plan report)."""
    panels = [_saved_panel(saved, 30)]
    if report is not None:
        panels.append(_plans_panel(report))
    return _plot(panels, _saved_rows(saved, 30), path)
