"""Timings that know their noise: repeat a timed call until its spread is known, report the
median with a confidence interval, and compare two timings without turning noise into a fact.

The interval of a median is the distribution-free order-statistic interval: for `n` sorted
samples `x(1) <= ... <= x(n)`, `[x(k), x(n + 1 - k)]` covers the true median with probability
`1 - 2 P(B <= k - 1)`, `B ~ Binomial(n, 1/2)`, whatever the distribution of the samples
(W. J. Conover, *Practical Nonparametric Statistics*, 3rd ed., 1999, §3.2). `k` is the
largest that keeps that coverage at or above 95 %; below 6 samples no interval reaches 95 %
and the whole range `[min, max]` is used, with its lower coverage (94 % at 5 samples, 75 % at
3). No assumption of normality, no random resampling: the same samples always give the same
interval.

Two timings `a` and `b` compare as the ratio of their medians `a / b`, with the interval
`[low(a) / high(b), high(a) / low(b)]`. When both medians lie in their intervals, the ratio
lies in this one, so its coverage is at least `1 - (1 - c_a) - (1 - c_b)` (Bonferroni): about
90 % for two 95 % intervals. It is deliberately conservative: a ratio whose interval includes
1 is "no measurable difference", never a negative cost or an overhead below 1×.

Pure Python: nothing here imports torch or the rest of torchscope, so any layer may use it.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = [
    "CONFIDENCE",
    "MIN_SAMPLES",
    "Interval",
    "Ratio",
    "compare",
    "fmt_ratio",
    "median_interval",
    "repeat",
    "repeat_interleaved",
    "timed_ms",
]

CONFIDENCE = 0.95
"""Coverage each median interval aims for."""

MIN_SAMPLES = 3
"""Fewer samples than this give no spread worth the name: such a comparison is never
measurable."""


@dataclass(frozen=True)
class Interval:
    """The median of some timings with its confidence interval (see the module docstring).

    Attributes:
        median: the sample median.
        low: lower end of the interval, an order statistic.
        high: upper end.
        n: how many samples.
        confidence: the interval's coverage of the true median (exact, from the binomial
            distribution); 0 for a single sample.
    """

    median: float
    low: float
    high: float
    n: int
    confidence: float

    @property
    def rel_width(self) -> float:
        """`(high - low) / median`: how precise the median is (inf for a median of 0)."""
        return (self.high - self.low) / self.median if self.median > 0 else math.inf


@dataclass(frozen=True)
class Ratio:
    """`a / b` of two timings, with its interval (see `compare`).

    Attributes:
        value: `median(a) / median(b)`.
        low: lower end of the interval.
        high: upper end.
        n_a: samples of `a`.
        n_b: samples of `b`.
        confidence: a lower bound of the interval's coverage.
    """

    value: float
    low: float
    high: float
    n_a: int
    n_b: int
    confidence: float

    @property
    def measurable(self) -> bool:
        """True when `a` and `b` differ beyond the noise: both have at least `MIN_SAMPLES`
        samples and the interval excludes 1."""
        return (min(self.n_a, self.n_b) >= MIN_SAMPLES
                and not self.low <= 1.0 <= self.high)

    @property
    def above(self) -> bool:
        """True when `a` is measurably larger than `b` (a slowdown, an overhead, a speedup
        when `a` is the slower baseline)."""
        return self.measurable and self.low > 1.0

    @property
    def below(self) -> bool:
        """True when `a` is measurably smaller than `b`."""
        return self.measurable and self.high < 1.0


def _coverage(n: int, k: int) -> float:
    """Coverage of `[x(k), x(n + 1 - k)]` for the median of `n` samples."""
    tail = sum(math.comb(n, i) for i in range(k)) / (1 << n)
    return 1.0 - 2.0 * tail


def median_interval(samples: Sequence[float], confidence: float = CONFIDENCE) -> Interval:
    """The median of `samples` and its order-statistic confidence interval.

    Args:
        samples: one or more timings (any unit).
        confidence: the coverage to aim for; the widest interval `[min, max]` is used when
            too few samples reach it.

    Raises:
        ValueError: no samples.
    """
    if not samples:
        raise ValueError("median_interval needs at least one sample")
    xs = sorted(float(s) for s in samples)
    n = len(xs)
    k = 1
    while k + 1 <= (n + 1) // 2 and _coverage(n, k + 1) >= confidence:
        k += 1
    return Interval(float(statistics.median(xs)), xs[k - 1], xs[n - k], n,
                    _coverage(n, k) if n > 1 else 0.0)


def compare(a: Sequence[float] | Interval, b: Sequence[float] | Interval) -> Ratio:
    """`a / b` of two timings with a conservative interval (see the module docstring).

    Args:
        a: the timings (or their `Interval`) on top, e.g. with a profiler.
        b: the timings below, e.g. without it.
    """
    ia = a if isinstance(a, Interval) else median_interval(a)
    ib = b if isinstance(b, Interval) else median_interval(b)

    def div(x: float, y: float) -> float:
        return x / y if y > 0 else math.inf

    return Ratio(div(ia.median, ib.median), div(ia.low, ib.high), div(ia.high, ib.low),
                 ia.n, ib.n, max(0.0, ia.confidence + ib.confidence - 1.0))


def fmt_ratio(r: Ratio | None, *, none: str = "no measurable difference",
              above: bool = False) -> str:
    """`1.43× (1.21–1.60)` for a measurable ratio, else `none` with the interval, e.g.
    `no measurable difference (0.91–1.12×)`; `—` without a ratio.

    Args:
        r: the ratio.
        none: the words for a ratio inside the noise.
        above: only a ratio measurably above 1 is a figure (a cost, an overhead): one
            measurably below 1 is `none` too, never a cost below 1×.
    """
    if r is None:
        return "—"
    if r.above or (r.measurable and not above):
        # A measurable interval excludes 1: a bound that would print as 1 gets more digits
        # (up to 5), so that it never reads `(1.00–1.04)`.
        d = 2
        while d < 5 and any(f"{b:.{d}f}" == f"{1:.{d}f}" for b in (r.low, r.high)):
            d += 1
        return f"{r.value:.{d}f}× ({r.low:.{d}f}–{r.high:.{d}f})"
    if min(r.n_a, r.n_b) < MIN_SAMPLES:
        return f"{none} ({min(r.n_a, r.n_b)} sample(s): no spread)"
    return f"{none} ({r.low:.2f}–{r.high:.2f}×)"


def timed_ms(fn: Callable[[], object], sync: Callable[[], None] | None = None
             ) -> Callable[[], float]:
    """A zero-argument function returning one timing of `fn` in milliseconds.

    Args:
        fn: the call to time.
        sync: called before starting and before stopping the clock (a device sync), so
            that queued device work is inside the timing.
    """

    def run() -> float:
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        return (time.perf_counter() - t0) * 1e3

    return run


def repeat_interleaved(
    measures: Sequence[Callable[[], float]],
    *,
    min_repeats: int = 5,
    max_repeats: int = 30,
    budget_s: float = 2.0,
    precision: float = 0.05,
) -> tuple[tuple[float, ...], ...]:
    """Take one sample of each measure per round, alternating their order, until every
    median is known to `precision` (relative interval width), or `max_repeats` rounds, or
    `budget_s` seconds are spent (never fewer than `min_repeats` rounds).

    Alternating the order (a, b, then b, a) keeps a slow drift of the machine, or one
    measure warming a cache for the next, from favouring either.

    Args:
        measures: zero-argument functions each returning one timing (see `timed_ms`).
        min_repeats: rounds always taken.
        max_repeats: rounds at most.
        budget_s: wall time after which no new round starts (once `min_repeats` are done).
        precision: stop once every `Interval.rel_width` is at most this.

    Returns:
        The samples of each measure, in the order of `measures`.
    """
    out: list[list[float]] = [[] for _ in measures]
    start = time.perf_counter()
    rounds = 0
    lo = max(int(min_repeats), 1)
    hi = max(int(max_repeats), lo)
    while rounds < hi:
        order = range(len(measures)) if rounds % 2 == 0 else reversed(range(len(measures)))
        for i in order:
            out[i].append(float(measures[i]()))
        rounds += 1
        if rounds < lo:
            continue
        if time.perf_counter() - start >= budget_s:
            break
        if rounds >= MIN_SAMPLES and all(
                median_interval(s).rel_width <= precision for s in out):
            break
    return tuple(tuple(s) for s in out)


def repeat(measure: Callable[[], float], *, min_repeats: int = 5, max_repeats: int = 30,
           budget_s: float = 2.0, precision: float = 0.05) -> tuple[float, ...]:
    """`repeat_interleaved` of one measure: its samples."""
    return repeat_interleaved([measure], min_repeats=min_repeats, max_repeats=max_repeats,
                              budget_s=budget_s, precision=precision)[0]
