"""Bounded history of a long run: a ring buffer of the newest samples, a downsampled view of
the whole run, and per-step numbers merged into buckets whose width doubles.

Nothing here grows with the length of the run: `SampleHistory` keeps at most
`capacity + recent` rows and `StepBuckets` at most `capacity` buckets, however many steps
pass. Plain Python (no tensors): what the monitor puts in has already been copied to the host.
"""

from __future__ import annotations

import math
from array import array
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["METRICS", "SampleHistory", "SampleRow", "StepBuckets"]

# Per-layer numbers of one sample, in this order in `SampleRow.values`.
# `grad_weight` and `update` are over a layer's own weight matrices and kernels (2+
# dimensions; all its parameters where it has none): the gradient norm, and the update
# ratio ‖Δw‖/‖w‖ of the optimizer's step, filled in once the update is read (`fill`).
METRICS: tuple[str, ...] = ("grad_param", "grad_output", "act_std", "act_zero", "act_dead",
                             "weight", "act_sat", "grad_weight", "update")
_WIDTH = len(METRICS)
_BYTES_PER_VALUE = 8  # array('d')


@dataclass(frozen=True)
class SampleRow:
    """One sampled step: per-layer numbers packed as doubles, and the step's scalars.

    Attributes:
        step: the optimizer step the sample belongs to.
        sample: the sample's number (0 for the first sample of the run).
        values: `len(METRICS)` doubles per layer slot (the history's `layers` order; NaN
            where the layer had no such number).
        total_norm: the step's total gradient norm (as `clip_grad_norm_` returns it).
        saved_bytes: activations the sampled forward saved for backward (None: unmeasured).
        nonfinite: whether any sampled activation held NaN/Inf.
    """

    step: int
    sample: int
    values: array[float]
    total_norm: float
    saved_bytes: int | None = None
    nonfinite: bool = False


class SampleHistory:
    """The newest `recent` samples in full, plus at most `capacity` samples spread evenly over
    the whole run.

    The spread view is decimated: when it is full, every other row is dropped and from then
    on only every `stride`-th sample is kept, so the heat map of a 100,000-step run still
    covers step 0 to the last step with at most `capacity` columns.

    Args:
        capacity: rows of the whole-run view.
        recent: rows of the ring buffer of the newest samples.
    """

    def __init__(self, capacity: int = 512, recent: int = 128) -> None:
        self.capacity = capacity
        self.recent = recent
        self.stride = 1
        self.samples = 0
        self.layers: list[str] = []
        self._slot: dict[str, int] = {}
        self._spread: list[SampleRow] = []
        self._recent: deque[SampleRow] = deque(maxlen=recent)

    def slot(self, layer: str) -> int:
        """The layer's column, added at the end the first time it is seen."""
        found = self._slot.get(layer)
        if found is None:
            found = self._slot[layer] = len(self.layers)
            self.layers.append(layer)
        return found

    def add(self, step: int, per_layer: Mapping[str, Sequence[float]], *, total_norm: float,
            saved_bytes: int | None = None, nonfinite: bool = False) -> SampleRow:
        """Add one sample: `per_layer` maps a layer to its `METRICS` values."""
        values = array("d", [math.nan]) * (_WIDTH * (len(self.layers) + len(per_layer)))
        for layer, numbers in per_layer.items():
            j = self.slot(layer) * _WIDTH
            values[j:j + _WIDTH] = array("d", numbers)
        del values[_WIDTH * len(self.layers):]  # room reserved for layers that were not new
        row = SampleRow(step, self.samples, values, total_norm, saved_bytes, nonfinite)
        if self.samples % self.stride == 0:
            self._spread.append(row)
            if len(self._spread) > self.capacity:
                self._spread = self._spread[::2]  # keeps the samples at multiples of 2*stride
                self.stride *= 2
        self._recent.append(row)
        self.samples += 1
        return row

    def fill(self, step: int, metric: str, per_layer: Mapping[str, float]) -> None:
        """Set one metric of the kept row of `step` (a number read after its sample was
        added: the update the step applied), for the layers that have a slot."""
        k = METRICS.index(metric)
        # The step's row is the newest, or the one before it: only those are looked at.
        newest = [*self._spread[-2:], *list(self._recent)[-2:]]
        for row in {id(r): r for r in newest if r.step == step}.values():
            v = row.values
            for layer, value in per_layer.items():
                j = self._slot.get(layer)
                if j is not None and (j + 1) * _WIDTH <= len(v):
                    v[j * _WIDTH + k] = value

    def rows(self) -> list[SampleRow]:
        """The whole-run view and the newest samples together, oldest first."""
        merged = {r.sample: r for r in self._spread}
        merged.update((r.sample, r) for r in self._recent)
        return [merged[k] for k in sorted(merged)]

    def matrix(self, metric: str, rows: Iterable[SampleRow] | None = None
               ) -> list[list[float]]:
        """`[row][layer]` values of one metric (NaN where missing)."""
        k = METRICS.index(metric)
        n = len(self.layers)
        out = []
        for r in self.rows() if rows is None else rows:
            v = r.values
            out.append([v[j * _WIDTH + k] if (j + 1) * _WIDTH <= len(v) else math.nan
                        for j in range(n)])
        return out

    def budget_bytes(self) -> int:
        """The most the rows can hold for the layers seen so far: (capacity + recent) rows
        of `len(METRICS)` doubles per layer, plus each row's own fields (about 120 bytes)."""
        return (self.capacity + self.recent) * (
            _WIDTH * len(self.layers) * _BYTES_PER_VALUE + 120)


@dataclass(frozen=True)
class Bucket:
    """Consecutive steps merged: the first step, how many, and their sum, min and max."""

    first_step: int
    count: int
    total: float
    low: float
    high: float

    @property
    def mean(self) -> float:
        """The mean over the bucket's steps."""
        return self.total / self.count


class StepBuckets:
    """A number per step (step time, device memory) in at most `capacity` buckets.

    Each bucket holds `width` consecutive steps; when the buckets run out, neighbours are
    merged in pairs and `width` doubles. Means, minima and maxima stay exact per bucket.
    """

    def __init__(self, capacity: int = 512) -> None:
        self.capacity = capacity
        self.width = 1
        self._buckets: list[list[float]] = []  # [first_step, count, total, low, high]

    def add(self, step: int, value: float) -> None:
        """Add the value of `step` (steps arrive in order)."""
        last = self._buckets[-1] if self._buckets else None
        if last is None or last[1] >= self.width:
            self._buckets.append([step, 1, value, value, value])
            if len(self._buckets) > self.capacity:
                pairs = [self._buckets[i:i + 2] for i in range(0, len(self._buckets), 2)]
                self._buckets = [[p[0][0], sum(b[1] for b in p), sum(b[2] for b in p),
                                  min(b[3] for b in p), max(b[4] for b in p)] for p in pairs]
                self.width *= 2
            return
        last[1] += 1
        last[2] += value
        last[3] = min(last[3], value)
        last[4] = max(last[4], value)

    def last_mean(self) -> float | None:
        """The newest bucket's mean (None before the first value), without building them."""
        if not self._buckets:
            return None
        last = self._buckets[-1]
        return last[2] / last[1]

    def buckets(self) -> tuple[Bucket, ...]:
        """The buckets, oldest first."""
        return tuple(Bucket(int(b[0]), int(b[1]), b[2], b[3], b[4]) for b in self._buckets)

    def __len__(self) -> int:
        return sum(int(b[1]) for b in self._buckets)
