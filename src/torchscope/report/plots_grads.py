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

from torchscope.grads.records import GradFlow, GradHistory, combine_norms
from torchscope.report.charts import (
    DEEP_ROWS,
    EmptyPlot,
    Series,
    block_groups,
    block_label,
    module_chart,
)

__all__ = ["plot_grad_heatmap", "plot_gradient_flow", "save_figure"]

_FORMATS = (".png", ".svg")


def _positive(v: float | None) -> float:
    return v if v is not None and math.isfinite(v) and v > 0 else math.nan


def plot_gradient_flow(flow: GradFlow, title: str | None = None) -> Figure:
    """Per-layer gradient norms on a log scale, one row per layer in forward order (input at
    the top), full names grouped by block; per block beyond `DEEP_ROWS` layers.

    Bars: each module's own parameter-gradient norm; points: the grad_output norm arriving at
    the module. Missing, zero and non-finite values leave their row empty (log axis).
    """
    layers = list(reversed(flow.layers()))  # forward order: input at the top, loss below
    outs = flow.output_norms()
    params = flow.param_norms()
    out_v = [_positive(outs.get(m)) for m in layers]
    par_v = [_positive(params.get(m)) for m in layers]
    if not any(math.isfinite(v) for v in out_v + par_v):
        return EmptyPlot("No layer received a finite, non-zero gradient, so there is no "
                         "gradient-flow chart.")
    names, group = layers, len(layers) <= DEEP_ROWS
    what = "layer"
    if not group:
        groups = block_groups(layers)
        names = [block_label(b, [layers[i] for i in idx]) for b, idx in groups]
        par_v = [_positive(combine_norms(params.get(layers[i]) for i in idx)) for _, idx in groups]
        out_v = [max((out_v[i] for i in idx if math.isfinite(out_v[i])), default=math.nan)
                 for _, idx in groups]
        what = "block (parameter norms combined, the largest grad_output)"
    return module_chart(names, [
        Series("parameter grad norm", par_v, color="#4c72b0"),
        Series("grad_output norm", out_v, kind="point", color="#dd8452")],
        title=title or f"Gradient flow per {what}, step {flow.index} "
        f"(total norm {flow.total_norm:.3g})", xlabel="L2 norm (log)", log=True, group=group)


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
