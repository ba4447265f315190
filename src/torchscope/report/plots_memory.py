"""Plots of the memory records: saved bytes per module, and each plan's activation memory
against its recompute time (matplotlib `Figure`s, no pyplot: the user's backend is left alone)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from torchscope.memory.records import PlanReport, SavedActivations

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["plot_memory", "plot_plans", "plot_saved"]

_KIB = 1024.0


def _draw_saved(ax: Axes, saved: SavedActivations, limit: int) -> None:
    rows = sorted(saved.modules, key=lambda r: -r.bytes)[:limit]
    labels = [r.module or "<root>" for r in rows]  # OUTSIDE is a label of its own
    ax.barh(range(len(rows)), [r.bytes / _KIB for r in rows], color="#4c72b0")
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("saved for backward (KiB)")
    ax.set_title(f"Saved activations per module (total {saved.total_bytes / _KIB:.1f} KiB)")


def _draw_plans(ax: Axes, report: PlanReport) -> None:
    for p in report.plans:
        m = report.measurement(p.name)
        x = m.recompute_ms if m is not None else p.recompute_ms
        y = (m.saved_bytes if m is not None else p.saved_bytes) / _KIB
        ax.scatter([x], [y], s=50, zorder=3)
        ax.scatter([x], [p.peak_activation_bytes / _KIB], marker="x",
                   color="gray", zorder=2)
        ax.annotate(p.name, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=9)
    kind = "measured" if report.measurements else "predicted"
    ax.set_xlabel(f"recompute time, {kind} (ms)")
    ax.set_ylabel("saved activations (KiB); x = predicted activation peak")
    ax.set_title("Checkpointing plans: memory vs recompute")
    ax.grid(alpha=0.3)


def _plot(panels: Sequence[Callable[[Axes], None]], path: str | Path | None) -> Figure:
    """One figure with `panels` side by side; saved to `path` (folders created) if given."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4 * len(panels), 4.8), layout="constrained")
    for i, draw in enumerate(panels):
        draw(fig.add_subplot(1, len(panels), i + 1))
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
    return fig


def plot_saved(saved: SavedActivations, path: str | Path | None = None, limit: int = 30
               ) -> Figure:
    """Horizontal bars of saved bytes per module (largest first); saved to `path` if given."""
    return _plot([lambda ax: _draw_saved(ax, saved, limit)], path)


def plot_plans(report: PlanReport, path: str | Path | None = None) -> Figure:
    """Each plan's saved bytes against its recompute time; saved to `path` if given."""
    return _plot([lambda ax: _draw_plans(ax, report)], path)


def plot_memory(saved: SavedActivations, report: PlanReport | None = None,
                path: str | Path | None = None) -> Figure:
    """Both panels side by side (the plans panel only with a plan report)."""
    panels = [lambda ax: _draw_saved(ax, saved, 30)]
    if report is not None:
        panels.append(lambda ax: _draw_plans(ax, report))
    return _plot(panels, path)
