"""Gradient-flow plots with matplotlib: scale-free measures per layer and a heatmap.

Renderers only: they take records and return `Figure`s; `save_figure` writes PNG or SVG.
Figures are made with `matplotlib.figure.Figure`, not pyplot, so no backend is chosen and
no global pyplot state is touched (a notebook's backend stays the user's).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure

from torchscope.grads.records import GradFlow, GradHistory

__all__ = ["plot_grad_heatmap", "plot_gradient_flow", "save_figure"]

_FORMATS = (".png", ".svg")


def _positive(v: float | None) -> float:
    return v if v is not None and math.isfinite(v) and v > 0 else math.nan


def plot_gradient_flow(flow: GradFlow, title: str | None = None) -> Figure:
    """The scale-free measures per layer, one row per module (input at the top, the loss at
    the bottom) with its full name, on log axes.

    Left: the relative gradient ‖g‖/‖w‖ of each module's weights (the measure vanishing is
    judged on). Right: the gradient RMS, per element, of its weights (bars) and of the
    gradient arriving at its outputs (dots). Missing, zero and non-finite values are left
    out of the log axes and marked `∅` after the name.
    """
    layers = [lg for lg in reversed(flow.layer_grads()) if lg.order is not None]
    names = [lg.module or "<root>" for lg in layers]
    rel = np.array([_positive(lg.relative) for lg in layers], dtype=float)
    prms = np.array([_positive(lg.rms) for lg in layers], dtype=float)
    orms = np.array([_positive(lg.output_rms) for lg in layers], dtype=float)
    longest = max((len(n) for n in names), default=8)
    height = min(max(3.0, 0.24 * len(layers) + 1.6), 60.0)
    fig = Figure(figsize=(min(9.0 + 0.07 * longest, 16.0), height))
    ax_rel, ax_rms = fig.subplots(1, 2, sharey=True)
    y = np.arange(len(layers))
    if np.isfinite(rel).any():
        ax_rel.barh(y, np.nan_to_num(rel, nan=0.0), color="#4c72b0", alpha=0.8)
        ax_rel.set_xscale("log")
    if np.isfinite(prms).any():
        ax_rms.barh(y, np.nan_to_num(prms, nan=0.0), color="#4c72b0", alpha=0.6,
                    label="weights' gradient")
    if np.isfinite(orms).any():
        ax_rms.plot(orms, y, "o", color="#dd8452", label="gradient arriving at the outputs")
    if np.isfinite(prms).any() or np.isfinite(orms).any():
        ax_rms.set_xscale("log")
    labels = [n + ("" if np.isfinite(r) or np.isfinite(p) or np.isfinite(o) else " ∅")
              for n, r, p, o in zip(names, rel, prms, orms, strict=True)]
    ax_rel.set_yticks(y)
    ax_rel.set_yticklabels(labels, fontsize=7)
    ax_rel.set_ylim(len(layers) - 0.5, -0.5)  # input at the top, the loss at the bottom
    ax_rel.set_xlabel("relative gradient ‖g‖/‖w‖ (log)")
    ax_rms.set_xlabel("gradient RMS per element (log)")
    for ax in (ax_rel, ax_rms):
        ax.grid(True, which="both", axis="x", alpha=0.3)
    if ax_rms.get_legend_handles_labels()[0]:
        ax_rms.legend(loc="best", fontsize=7)
    fig.suptitle(title or f"Gradient flow, step {flow.index} (total norm "
                 f"{flow.total_norm:.3g}); input at the top", fontsize=10)
    fig.tight_layout()
    return fig


def plot_grad_heatmap(history: GradHistory, kind: str = "output",
                      title: str | None = None) -> Figure:
    """Layers × sampled steps, colour = log norm (`kind`: "output" or "params")."""
    rows = history.output_norms if kind == "output" else history.param_norms
    layers = list(history.layers)
    data = np.array(rows, dtype=float).T if rows else np.zeros((len(layers), 0))  # (L, S)
    data = np.where(np.isfinite(data) & (data > 0), data, np.nan)
    fig = Figure(figsize=(min(max(6.0, 0.08 * len(history) + 4.0), 30.0),
                              min(max(3.0, 0.3 * len(layers) + 1.5), 30.0)))
    ax = fig.add_subplot(1, 1, 1)
    finite = data[np.isfinite(data)]
    if finite.size:
        vmin, vmax = float(finite.min()), float(finite.max())
        norm = LogNorm(vmin=vmin, vmax=vmax if vmax > vmin else vmin * 10)
        mesh = ax.imshow(np.ma.masked_invalid(data), aspect="auto", interpolation="nearest",
                         cmap="viridis", norm=norm)
        fig.colorbar(mesh, ax=ax, label="L2 norm")
    ax.set_yticks(np.arange(len(layers)))
    ax.set_yticklabels([m or "<root>" for m in layers], fontsize=7)
    steps = history.steps
    if steps:
        ticks = np.unique(np.linspace(0, len(steps) - 1, min(len(steps), 10)).astype(int))
        ax.set_xticks(ticks)
        ax.set_xticklabels([str(steps[i]) for i in ticks], fontsize=8)
    ax.set_xlabel("step")
    label = "grad_output" if kind == "output" else "parameter grad"
    ax.set_title(title or f"{label} norm per layer over {len(history)} samples")
    fig.tight_layout()
    return fig


def save_figure(fig: Figure, path: str | Path) -> Path:
    """Write `fig` as PNG or SVG (chosen by the suffix).

    Raises:
        ValueError: the suffix is neither .png nor .svg.
    """
    out = Path(path)
    if out.suffix.lower() not in _FORMATS:
        raise ValueError(f"plot path {str(out)!r} must end in .png or .svg")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format=out.suffix.lower()[1:], dpi=120)
    return out
