"""The monitor's flight recorder: every step's loss and per-parameter gradient magnitudes in
a small ring on the device, read at each sample, so that a spike between two samples is in
the report with its lead-up.

Each step writes one row (the magnitudes the every-step NaN/Inf check computes anyway, one
per gradient; on the CPU the check writes them into the row itself) and, where the loss is
seen, one number: at most two copies on the device, no host sync. At a sampled step
(already a sync) the ring is copied to the host once, its new steps are scanned for a
spike against the recent median, and the layer that moved first in the steps before it is
kept (`Spike`). Only a bounded series of per-step scalars stays on the host.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

import torch

from torchscope.monitoring.records import Spike

__all__ = ["FlightRecorder"]

# A gradient magnitude this many times the recent median is a spike; its rise starts, and
# it ends, at `GRAD_BACK` times. A loss lives on a compressed scale (a cross-entropy grows
# with the logits' margin, not their square): it spikes at `LOSS_RATIO` times the median
# when it is also `LOSS_MADS` median absolute deviations above it (a noisy loss of small
# batches does not), and rises from `LOSS_BACK` times.
GRAD_RATIO = 10.0
GRAD_BACK = 3.0
LOSS_RATIO = 2.0
LOSS_MADS = 8.0
LOSS_BACK = 1.5
RISE_RATIO = 3.0  # a parameter "moved" when its magnitude passed this many times its own
MAX_RISE = 5  # steps a rise may take to be a spike (a steady growth is no spike)
RECENT = 20  # steps whose median is the reference
MIN_RECENT = 5  # ...at least this many (a loss: `MIN_RECENT_LOSS`, so that a spike at step
MIN_RECENT_LOSS = 3  # 4 is judged; a loss does not double by chance in its first steps)
MAX_SPIKES = 5
_CPU = torch.device("cpu")


class FlightRecorder:
    """A ring of the last `capacity` steps' loss and per-parameter gradient magnitudes.

    Args:
        capacity: steps the ring holds (at least the sampling interval, so that every
            step between two samples is read).
        names: the trainable parameters' names, in the order the gradient check passes
            their magnitudes.
    """

    def __init__(self, capacity: int, names: list[str]) -> None:
        self.capacity = capacity
        self.names = names
        self._grads: torch.Tensor | None = None  # (capacity, n) float64 on the device
        self._loss: torch.Tensor | None = None  # (capacity,) float32 on the device
        # Views of their rows, made once: a step's write is one copy, no indexing.
        self._grad_rows: tuple[torch.Tensor, ...] = ()
        self._loss_rows: tuple[torch.Tensor, ...] = ()
        self._grad_step = [-1] * capacity  # the step each row holds
        self._loss_step = [-1] * capacity
        self._read = -1  # the newest step read
        self._recent: deque[float] = deque(maxlen=RECENT)
        self._kind: str | None = None  # "loss" or "gradient": what the series holds
        self._rising: int | None = None  # first step of a rise in progress
        self._in_spike = False
        self.spikes: list[Spike] = []

    def on_grads(self, step: int, magnitudes: torch.Tensor) -> None:
        """Step `step`'s per-gradient magnitudes, (n,) on the device (`GradWatch.on_check`).
        Steps where fewer parameters had a gradient are left out (the columns would not
        line up)."""
        row = self.row_for(step, magnitudes.numel(), magnitudes.device)
        if row is not None:
            row.copy_(magnitudes.detach(), non_blocking=True)  # (n,)

    def row_for(self, step: int, n: int, device: torch.device = _CPU) -> torch.Tensor | None:
        """The row that holds step `step`'s n magnitudes, a contiguous float64 (n,) view
        on `device` for the caller to fill, now noted as that step's
        (`GradWatch.check_row`); None where n is not the number of parameters."""
        if n != len(self.names):
            return None
        if self._grads is None:
            # float64: the NaN/Inf check's norms as they are (a finite one may pass float32's
            # range).
            self._grads = torch.full((self.capacity, n), math.nan, dtype=torch.float64,
                                     device=device)
            self._grad_rows = self._grads.unbind(0)
        at = step % self.capacity
        self._grad_step[at] = step
        return self._grad_rows[at]

    def on_loss(self, step: int, loss: torch.Tensor) -> None:
        """The loss of step `step` (a scalar; the last micro-batch's where there are more)."""
        if loss.numel() != 1 or not loss.is_floating_point():
            return
        if self._loss is None:
            self._loss = torch.full((self.capacity,), math.nan, dtype=torch.float32,
                                    device=loss.device)
            self._loss_rows = self._loss.unbind(0)
        row = step % self.capacity
        loss = loss.detach()  # the copy joins no graph
        self._loss_rows[row].copy_(loss if loss.dim() == 0 else loss.reshape(()),
                                   non_blocking=True)
        self._loss_step[row] = step

    def read(self) -> None:
        """Copy the ring to the host (a sampled step, or the run's end) and scan the steps
        not read yet for a spike."""
        grads = None if self._grads is None else self._grads.tolist()
        loss = None if self._loss is None else self._loss.tolist()
        rows: dict[int, tuple[float | None, list[float] | None]] = {}
        for r in range(self.capacity):
            gs, ls = self._grad_step[r], self._loss_step[r]
            if gs > self._read and grads is not None:
                rows.setdefault(gs, (None, None))
                rows[gs] = (rows[gs][0], grads[r])
            if ls > self._read and loss is not None:
                rows.setdefault(ls, (None, None))
                rows[ls] = (loss[r], rows[ls][1])
        if not rows:
            return
        by_step = {self._grad_step[r]: grads[r] for r in range(self.capacity)
                   if grads is not None and self._grad_step[r] >= 0}
        for step in sorted(rows):
            value, mags = rows[step]
            kind = "loss" if value is not None else "gradient"
            if self._kind is None:
                self._kind = kind
            if kind != self._kind:  # the loss stopped or started being seen: keep one
                value = None if self._kind == "gradient" else value
                if self._kind == "gradient" and mags is not None:
                    value = max(mags)
            elif kind == "gradient" and mags is not None:
                value = max(mags)
            if value is not None:
                self._scan(step, value, by_step)
            self._read = max(self._read, step)

    def _scan(self, step: int, value: float, by_step: dict[int, list[float]]) -> None:
        if not math.isfinite(value):
            return  # NaN/Inf is the run's onset finding, not a spike
        recent = list(self._recent)
        least = MIN_RECENT_LOSS if self._kind == "loss" else MIN_RECENT
        median = statistics.median(recent) if len(recent) >= least else None
        if median is None or not median > 0:
            self._recent.append(value)
            return
        loss = self._kind == "loss"
        back = (LOSS_BACK if loss else GRAD_BACK) * median
        if self._in_spike:
            if value < back:  # over: the reference stays the one before it
                self._in_spike, self._rising = False, None
                self._recent.append(value)
            return
        mad = max(statistics.median(abs(v - median) for v in recent), 0.01 * median)
        sudden = self._rising is None or step - self._rising <= MAX_RISE
        if sudden and ((value >= LOSS_RATIO * median and value - median >= LOSS_MADS * mad)
                       if loss else value >= GRAD_RATIO * median):
            self._in_spike = True
            if self.spikes and step - self.spikes[-1].step <= RECENT:
                return  # the same event's aftermath (momentum carries it a few steps)
            if len(self.spikes) < MAX_SPIKES:
                start = step if self._rising is None else self._rising
                self.spikes.append(self._spike(step, start, value, median, by_step))
            return
        if value >= back:  # rising: kept out of the reference
            if self._rising is None:
                self._rising = step
            return
        self._rising = None
        self._recent.append(value)

    def _spike(self, step: int, start: int, value: float, median: float,
               by_step: dict[int, list[float]]) -> Spike:
        """The spike at `step`, with the parameter whose magnitude rose `RISE_RATIO` times
        its own earlier median first in the ring's steps up to it."""
        steps = sorted(s for s in by_step if s <= step)
        first: tuple[int, float, str] | None = None  # (step, -ratio at the spike, name)
        name: str | None
        if len(steps) >= 3:
            lead = [s for s in steps if s >= start - 2] or steps[-1:]
            base_steps = [s for s in steps if s < lead[0]] or steps[:1]
            for j, name in enumerate(self.names):
                base = statistics.median(by_step[s][j] for s in base_steps)
                if not (math.isfinite(base) and base > 0):
                    continue
                peak = by_step[step][j] / base if step in by_step else math.nan
                moved = next((s for s in lead
                              if math.isfinite(by_step[s][j])
                              and by_step[s][j] >= RISE_RATIO * base), None)
                if moved is None:
                    continue
                key = (moved, -peak if math.isfinite(peak) else 0.0, name)
                if first is None or key[:2] < first[:2]:
                    first = key
        name = None if first is None else first[2]
        return Spike(
            step=step, start=start, value=value, median=median,
            kind=self._kind or "gradient",
            first_param=name, first_step=None if first is None else first[0],
            first_ratio=None if first is None or not math.isfinite(-first[1]) else -first[1])
