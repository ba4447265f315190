"""Gradient-flow plots with matplotlib: the classic per-layer plot and a heatmap.

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
    """Per-layer gradient norms on a log scale, input side left, loss side right.

    Bars: each module's own parameter-gradient norm; line: the grad_output norm arriving at
    the module. Missing, zero and non-finite values are left out of the log axis and named
    in the legend of the x labels (`∅`).
    """
    layers = list(reversed(flow.layers()))  # forward order: input left, loss right
    outs = flow.output_norms()
    params = flow.param_norms()
    out_v = np.array([_positive(outs.get(m)) for m in layers], dtype=float)
    par_v = np.array([_positive(params.get(m)) for m in layers], dtype=float)
    width = max(6.0, 0.45 * len(layers) + 2.0)
    fig = Figure(figsize=(min(width, 40.0), 4.5))
    ax = fig.add_subplot(1, 1, 1)
    x = np.arange(len(layers))
    if np.isfinite(par_v).any():
        ax.bar(x, np.nan_to_num(par_v, nan=0.0), color="#4c72b0", alpha=0.75,
               label="parameter grad norm")
    if np.isfinite(out_v).any():
        ax.plot(x, out_v, "o-", color="#dd8452", label="grad_output norm")
    if np.isfinite(out_v).any() or np.isfinite(par_v).any():
        ax.set_yscale("log")
    labels = [(m or "<root>") + ("" if np.isfinite(o) or np.isfinite(p) else " ∅")
              for m, o, p in zip(layers, out_v, par_v, strict=True)]
    ax.set_xticks(x)
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("L2 norm (log)")
    ax.set_xlabel("layer (input → loss)")
    ax.set_title(title or f"Gradient flow, step {flow.index} "
                 f"(total norm {flow.total_norm:.3g})")
    ax.grid(True, which="both", axis="y", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best", fontsize=8)
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
