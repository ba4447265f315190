"""`torchscope._timing`: medians with distribution-free intervals, ratios that know their noise."""

from __future__ import annotations

import math
import statistics

import pytest

from torchscope._timing import (
    Interval,
    Ratio,
    compare,
    fmt_ratio,
    median_interval,
    repeat,
    repeat_interleaved,
)


def test_median_interval_is_the_order_statistic_interval() -> None:
    # 5 samples: no interval reaches 95 %, so [min, max], which covers 1 - 2/2^5.
    five = median_interval([5.0, 1.0, 4.0, 2.0, 3.0])
    assert (five.median, five.low, five.high, five.n) == (3.0, 1.0, 5.0, 5)
    assert five.confidence == pytest.approx(1 - 2 / 32)
    # 10 samples: [x(2), x(9)] covers 1 - 2 * (1 + 10) / 1024 >= 95 %; [x(3), x(8)] would not.
    ten = median_interval([float(i) for i in range(1, 11)])
    assert (ten.low, ten.high, ten.median) == (2.0, 9.0, 5.5)
    assert ten.confidence == pytest.approx(1 - 2 * 11 / 1024)
    assert 1 - 2 * (1 + 10 + 45) / 1024 < 0.95
    # The coverage is exact: count the binomial tail for 30 samples by hand.
    thirty = median_interval([float(i) for i in range(30)])
    k = int(thirty.low) + 1  # samples 0..29: x(k) == k - 1
    assert thirty.high == 30 - k
    tail = sum(math.comb(30, i) for i in range(k)) / 2**30
    assert thirty.confidence == pytest.approx(1 - 2 * tail) and thirty.confidence >= 0.95
    assert 1 - 2 * (tail + math.comb(30, k) / 2**30) < 0.95  # the next k would fall short
    one = median_interval([2.5])
    assert (one.low, one.high, one.confidence) == (2.5, 2.5, 0.0)
    with pytest.raises(ValueError):
        median_interval([])


def test_a_clear_difference_is_measurable_and_noise_is_not() -> None:
    slow = [10.0, 10.2, 9.9, 10.1, 10.05, 9.95]
    fast = [5.0, 5.1, 4.9, 5.05, 4.95, 5.02]
    r = compare(slow, fast)
    assert r.value == pytest.approx(statistics.median(slow) / statistics.median(fast))
    assert r.low == pytest.approx(min(slow) / max(fast))
    assert r.high == pytest.approx(max(slow) / min(fast))
    assert r.measurable and r.above and not r.below
    assert compare(fast, slow).below
    # Overlapping spreads: the median ratio is 0.55, but the interval includes 1.
    noisy = compare([3.0, 5.5, 9.0, 2.0, 12.0], [10.0, 4.0, 11.0, 6.0, 3.0])
    assert noisy.value == pytest.approx(5.5 / 6.0)
    assert noisy.low < 1 < noisy.high and not noisy.measurable
    # Too few samples: no spread is known, whatever the values.
    assert not compare([10.0, 10.0], [1.0, 1.0]).measurable


def test_fmt_ratio_never_states_noise_as_a_figure() -> None:
    assert fmt_ratio(Ratio(1.43, 1.21, 1.6, 5, 5, 0.875)) == "1.43× (1.21–1.60)"
    assert fmt_ratio(Ratio(0.55, 0.4, 1.2, 5, 5, 0.875)) == \
        "no measurable difference (0.40–1.20×)"
    assert fmt_ratio(Ratio(0.55, 0.55, 0.55, 1, 1, 0.0), none="none") == \
        "none (1 sample(s): no spread)"
    assert fmt_ratio(None) == "—"
    # A measurably faster run is a figure, but never a cost or an overhead below 1×.
    faster = Ratio(0.55, 0.5, 0.6, 9, 9, 0.9)
    assert fmt_ratio(faster) == "0.55× (0.50–0.60)"
    assert fmt_ratio(faster, none="no measurable overhead", above=True) == \
        "no measurable overhead (0.50–0.60×)"
    # A measurable interval never reads as one that holds 1: a bound near it gets a digit.
    assert fmt_ratio(Ratio(1.03, 1.002, 1.04, 9, 9, 0.9)) == "1.030× (1.002–1.040)"
    assert fmt_ratio(Ratio(0.97, 0.95, 0.996, 9, 9, 0.9)) == "0.970× (0.950–0.996)"
    assert fmt_ratio(Ratio(1.02, 1.0003, 1.04, 9, 9, 0.9)) == "1.0200× (1.0003–1.0400)"


def test_compare_accepts_intervals() -> None:
    a = Interval(2.0, 1.5, 2.5, 9, 0.96)
    b = Interval(1.0, 0.9, 1.1, 9, 0.96)
    r = compare(a, b)
    assert (r.value, r.low, r.high) == (2.0, 1.5 / 1.1, 2.5 / 0.9)
    assert r.confidence == pytest.approx(0.92)


def test_repeat_stops_when_precise_and_respects_its_limits() -> None:
    steady = repeat(lambda: 1.0, min_repeats=5, max_repeats=50, budget_s=60)
    assert len(steady) == 5  # precise at once: the minimum is enough
    values = iter([1.0, 3.0] * 100)
    noisy = repeat(lambda: next(values), min_repeats=2, max_repeats=12, budget_s=60)
    assert len(noisy) == 12  # never precise: the maximum ends it
    assert len(repeat(lambda: 1.0, min_repeats=1, max_repeats=1)) == 1


def test_repeat_interleaved_alternates_the_order() -> None:
    calls: list[str] = []

    def a() -> float:
        calls.append("a")
        return 1.0

    def b() -> float:
        calls.append("b")
        return 2.0

    sa, sb = repeat_interleaved([a, b], min_repeats=4, max_repeats=4)
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert sa == (1.0,) * 4 and sb == (2.0,) * 4
