"""The run report's plots and HTML fragments: series over the steps of a training run.

A run report (`kind` "run", filled by `torchscope.monitor` and the framework callbacks) is
the doctor's document with other sections. Its producer hands these functions plain views of
its record (`SeriesView`, `BucketView`: `torchscope.monitoring`'s `LayerSeries` and
`Bucket` are ones), so this layer never imports the producer. Figures are matplotlib
`Figure`s (never pyplot); fragments only format.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np
from matplotlib.figure import Figure

from torchscope._util import fmt_bytes, fmt_num, fmt_pct
from torchscope.grads import GradHistory
from torchscope.report.html import Cell, _plots, table
from torchscope.report.plots_grads import plot_grad_heatmap

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = [
    "MAX_LINES",
    "BucketView",
    "SeriesView",
    "activity_fragment",
    "bucket_plot",
    "grad_heatmap",
    "layer_change_rows",
    "overview_fragment",
    "saved_plot",
    "series_fragment",
    "series_lines_plot",
    "total_norm_plot",
]

MAX_LINES = 10  # layers drawn in a line plot: the ones that changed most
_ACCENT = "#3b6ea8"
_WARN = "#c0392b"


class SeriesView(Protocol):
    """A per-layer number over sampled steps (`torchscope.monitoring.LayerSeries` is one)."""

    @property
    def name(self) -> str: ...
    @property
    def steps(self) -> tuple[int, ...]: ...
    @property
    def layers(self) -> tuple[str, ...]: ...
    @property
    def values(self) -> tuple[tuple[float, ...], ...]: ...


class BucketView(Protocol):
    """Consecutive steps merged (`torchscope.monitoring.history.Bucket` is one)."""

    @property
    def first_step(self) -> int: ...
    @property
    def count(self) -> int: ...
    @property
    def mean(self) -> float: ...
    @property
    def low(self) -> float: ...
    @property
    def high(self) -> float: ...


def _figure(height: float = 3.2) -> tuple[Figure, Axes]:
    fig = Figure(figsize=(8.0, height), layout="constrained")
    return fig, fig.add_subplot()


def _column(series: SeriesView, j: int) -> list[float]:
    return [row[j] for row in series.values]


def _finite(values: Iterable[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


# ---------------------------------------------------------------------------- plots
def grad_heatmap(series: SeriesView) -> Figure:
    """The gradient-flow history: layers (in the series' order, top down) × sampled steps,
    colour the log of each layer's parameter-gradient norm (`torchscope.grads` draws it)."""
    layers = series.layers
    rows = series.values
    nan_rows = tuple(tuple(math.nan for _ in layers) for _ in rows)
    history = GradHistory(steps=series.steps, layers=layers, output_norms=nan_rows,
                          param_norms=rows, total_norms=tuple(math.nan for _ in rows))
    return plot_grad_heatmap(history, kind="params",
                             title=f"Gradient flow, {len(rows)} sampled steps")


def total_norm_plot(steps: Sequence[int], totals: Sequence[float], *,
                    onset: int | None = None, skipped: Sequence[int] = ()) -> Figure:
    """The total gradient norm of each sampled step (log), with the first step whose
    gradients held NaN/Inf and the steps the GradScaler skipped marked."""
    fig, ax = _figure()
    ys = [v if math.isfinite(v) and v > 0 else math.nan for v in totals]
    ax.plot(steps, ys, "o-", color=_ACCENT, markersize=3, label="total gradient norm")
    if _finite(ys):
        ax.set_yscale("log")
    if onset is not None:
        ax.axvline(onset, color=_WARN, linestyle="--", label=f"first NaN/Inf (step {onset})")
    if skipped:
        ax.scatter(list(skipped), [min(_finite(ys), default=1.0)] * len(skipped), marker="|",
                   s=60, color="#777777", label="skipped by the GradScaler")
    ax.set_xlabel("step")
    ax.set_ylabel("L2 norm (log)")
    ax.set_title("Total gradient norm (as clip_grad_norm_ returns it)")
    ax.legend(loc="best", fontsize=7)
    return fig


def bucket_plot(buckets: Sequence[BucketView], *, title: str, ylabel: str,
                scale: float = 1.0) -> Figure:
    """A per-step number: its mean per bucket of steps, between the bucket's min and max."""
    fig, ax = _figure(2.8)
    xs = [b.first_step + (b.count - 1) / 2 for b in buckets]
    ax.fill_between(xs, [b.low / scale for b in buckets], [b.high / scale for b in buckets],
                    color=_ACCENT, alpha=0.2, linewidth=0, label="min–max")
    ax.plot(xs, [b.mean / scale for b in buckets], color=_ACCENT, label="mean")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(loc="best", fontsize=7)
    return fig


def _spread(values: Sequence[float], log: bool) -> float:
    vals = [v for v in _finite(values) if v > 0 or not log]
    if len(vals) < 2:
        return 0.0
    lo, hi = min(vals), max(vals)
    return math.log(hi / lo) if log and lo > 0 else hi - lo


def series_lines_plot(series: SeriesView, *, title: str, ylabel: str, log: bool = False,
                      percent: bool = False) -> Figure:
    """One line per layer over the sampled steps, the `MAX_LINES` that changed most."""
    fig, ax = _figure()
    ranked = sorted(range(len(series.layers)),
                    key=lambda j: -_spread(_column(series, j), log))[:MAX_LINES]
    k = 100.0 if percent else 1.0
    for j in ranked:
        ys = [v * k if math.isfinite(v) and (v > 0 or not log) else math.nan
              for v in _column(series, j)]
        ax.plot(series.steps, ys, marker="o", markersize=2.5, linewidth=1,
                label=series.layers[j] or "<root>")
    if log and any(_finite(r) for r in series.values):
        ax.set_yscale("log")
    elif percent:
        ax.set_ylim(0, max(5.0, *(v * k for r in series.values for v in _finite(r))) * 1.1)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if ranked:
        ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=7)
    return fig


# ---------------------------------------------------------------------------- fragments
def layer_change_rows(series: SeriesView, fmt: str = "num") -> list[tuple[Cell, ...]]:
    """Per layer: the value at the first and the last sample that had one, the change
    (last / first), the smallest and the largest. `fmt`: "num" or "pct"."""
    show = fmt_pct if fmt == "pct" else fmt_num
    rows: list[tuple[Cell, ...]] = []
    for j, layer in enumerate(series.layers):
        pairs = [(s, v) for s, v in zip(series.steps, _column(series, j), strict=True)
                 if math.isfinite(v)]
        if not pairs:
            continue
        (s0, v0), (s1, v1) = pairs[0], pairs[-1]
        ratio = v1 / v0 if v0 else None
        vals = [v for _, v in pairs]
        rows.append((layer or "<root>", s0, show(v0), s1, show(v1),
                     None if ratio is None else f"{ratio:.3g}×", show(min(vals)),
                     show(max(vals))))
    return rows


def _layer_table(series: SeriesView, fmt: str = "num") -> str:
    return table(("layer", "first step", "value", "last step", "value", "last / first",
                  "min", "max"), layer_change_rows(series, fmt), numeric=(1, 2, 3, 4, 5, 6, 7))


def overview_fragment(facts: Sequence[tuple[str, Cell]], plots: Mapping[str, str],
                      note: str = "") -> str:
    """The run's facts (steps, samples, status, step time, history budget) and its plots."""
    head = f'<p class="note">{note}</p>' if note else ""
    return head + table(("what", "value"), facts, numeric=(1,)) + _plots(plots, {
        "run-total-norm": ("Total gradient norm", "The total gradient norm of each sampled "
                                                  "step."),
        "run-step-time": ("Step time", "Wall time between optimizer steps (host clock)."),
    })


def series_fragment(tables: Sequence[tuple[str, SeriesView, str]], plots: Mapping[str, str],
                    captions: Mapping[str, tuple[str, str]], note: str = "") -> str:
    """Plots, then per series a table of how each layer changed: `(heading, series, fmt)`."""
    head = f'<p class="note">{note}</p>' if note else ""
    body = "".join(f"<h3>{heading}</h3>" + _layer_table(s, fmt)
                   for heading, s, fmt in tables if s.layers)
    return head + _plots(plots, captions) + body


def activity_fragment(steps: Sequence[int], saved: Sequence[int | None],
                      peaks: Sequence[BucketView], plots: Mapping[str, str]) -> str:
    """What each sampled forward saved for backward, and the device's peak per step."""
    known = [(s, b) for s, b in zip(steps, saved, strict=True) if b is not None]
    note = ""
    if known:
        low, high = min(b for _, b in known), max(b for _, b in known)
        note = ('<p class="note">Activations saved for backward by the sampled forwards: '
                + (f"{fmt_bytes(low)} in every one" if low == high else
                   f"{fmt_bytes(low)} to {fmt_bytes(high)}, {fmt_bytes(known[-1][1])} at "
                   f"step {known[-1][0]}") + ".</p>")
    if peaks:
        note += (f'<p class="note">Device memory peak per step: up to '
                 f"{fmt_bytes(max(b.high for b in peaks))}.</p>")
    else:
        note += ('<p class="note">The device does not report its memory (CPU): no '
                 "per-step peak.</p>")
    return note + _plots(plots, {
        "run-saved": ("Saved activations", "Activations saved for backward per sampled "
                                           "forward."),
        "run-device-peak": ("Device memory peak", "Device memory peak during each step.")})


def saved_plot(steps: Sequence[int], saved: Sequence[int | None]) -> Figure:
    """Bytes each sampled forward saved for backward."""
    fig, ax = _figure(2.8)
    pairs = [(s, b) for s, b in zip(steps, saved, strict=True) if b is not None]
    ax.plot([s for s, _ in pairs], np.array([b for _, b in pairs], dtype=float) / 2**20,
            "o-", markersize=3, color=_ACCENT)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("step")
    ax.set_ylabel("MiB")
    ax.set_title("Activations saved for backward (sampled forwards)")
    return fig
