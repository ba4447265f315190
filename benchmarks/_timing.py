"""Shared timing helpers for the benchmark scripts: interleaved medians, one process."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping


def interleaved_medians(
    runs: Mapping[str, Callable[[], object]], *, repeats: int = 15, warmup: int = 3
) -> dict[str, float]:
    """Median seconds per call of each function, timed round-robin so drift hits all alike
    (each round's order rotated by one)."""
    for fn in runs.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for order in _rounds(list(runs), repeats):
        for name in order:
            t0 = time.perf_counter()
            runs[name]()
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(s) for name, s in samples.items()}


def _rounds(names: list[str], repeats: int) -> list[list[str]]:
    """The order of each round: rotated by one each round, so that no variant always runs
    right after the same one (a variant that frees much memory makes the next one pay the
    page faults of getting it back)."""
    return [names[r % len(names):] + names[:r % len(names)] for r in range(repeats)]


def interleaved_wall_cpu(
    runs: Mapping[str, Callable[[], object]], *, repeats: int = 15, warmup: int = 3
) -> dict[str, tuple[float, float, float]]:
    """Median wall, median process CPU and minimum wall seconds per call of each function,
    timed round-robin (each round's order rotated by one).

    Process CPU time (every thread of this process) and the minimum are less hit than the
    median wall time by other jobs on a shared machine (their noise only adds); all three
    are reported so that a reader can tell load from cost.
    """
    for fn in runs.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    for order in _rounds(list(runs), repeats):
        for name in order:
            t0, c0 = time.perf_counter(), time.process_time()
            runs[name]()
            samples[name].append((time.perf_counter() - t0, time.process_time() - c0))
    return {name: (statistics.median(w for w, _ in s), statistics.median(c for _, c in s),
                   min(w for w, _ in s))
            for name, s in samples.items()}


def print_ratios(title: str, medians: Mapping[str, float], baseline: str) -> None:
    """One line per variant: median ms and the ratio to `baseline`."""
    base = medians[baseline]
    print(title)
    for name, sec in medians.items():
        print(f"  {name:<38} {sec * 1e3:9.2f} ms   {sec / base:6.3f}x")
