"""Shared timing helpers for the benchmark scripts: interleaved medians, one process."""

from __future__ import annotations

import ctypes
import statistics
import time
from collections.abc import Callable, Mapping

from torchscope._timing import Interval, median_interval


def _rounds(names: list[str], repeats: int) -> list[list[str]]:
    """The order of each round: rotated by one each round, so that no variant always runs
    right after the same one (a variant that frees much memory makes the next one pay the
    page faults of getting it back)."""
    return [names[r % len(names):] + names[:r % len(names)] for r in range(repeats)]


def interleaved_samples(
    runs: Mapping[str, Callable[[], object]], *, repeats: int = 15, warmup: int = 3,
    self_timed: bool = False,
) -> dict[str, list[tuple[float, float]]]:
    """Per function: its (wall, process CPU) seconds in each round, timed round-robin (each
    round's order rotated by one) after `warmup` untimed calls of each; the samples that
    `interleaved_paired` sums up, for a figure of its own per round.

    `self_timed`: each function returns its own (wall, CPU) seconds, for work whose timed
    part lies inside it (a Lightning fit timed from `on_train_start` to `on_train_end`)."""
    for fn in runs.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    for order in _rounds(list(runs), repeats):
        for name in order:
            t0, c0 = time.perf_counter(), time.process_time()
            got = runs[name]()
            if self_timed:
                assert isinstance(got, tuple)
                wall, cpu = got
                samples[name].append((float(wall), float(cpu)))
            else:
                samples[name].append((time.perf_counter() - t0, time.process_time() - c0))
    return samples


def ratios(samples: Mapping[str, list[tuple[float, float]]]
           ) -> dict[str, tuple[Interval, Interval]]:
    """Per function: its per-round ratio to the first function (the baseline), by wall and
    by process CPU time, each as its median with a 95 % interval."""
    base = samples[next(iter(samples))]
    return {name: (median_interval([w / b for (w, _), (b, _) in zip(s, base, strict=True)]),
                   median_interval([c / b for (_, c), (_, b) in zip(s, base, strict=True)]))
            for name, s in samples.items()}


def interleaved_paired(
    runs: Mapping[str, Callable[[], object]], *, repeats: int = 15, warmup: int = 3
) -> dict[str, tuple[tuple[float, float, float], Interval]]:
    """Per function: its median wall, median process CPU and minimum wall seconds per call,
    timed round-robin (each round's order rotated by one), and the paired ratio of its wall
    time to the first function's (the baseline) in the same round: their median with its
    95 % order-statistic interval (`torchscope._timing.median_interval`).

    Process CPU time (every thread of this process) and the minimum are less hit than the
    median wall time by other jobs on a shared machine (their noise only adds); all are
    reported so that a reader can tell load from cost.

    Why paired: a slow spell of the machine (another tenant, a burst of page faults) lasts
    longer than one call, so it moves both calls of a round together; the ratio within
    each round cancels it, where a ratio of two medians taken over all rounds keeps it.
    """
    return paired(interleaved_samples(runs, repeats=repeats, warmup=warmup))


def paired(samples: Mapping[str, list[tuple[float, float]]]
           ) -> dict[str, tuple[tuple[float, float, float], Interval]]:
    """`interleaved_paired` of samples already taken (`interleaved_samples`); the first
    function is the baseline."""
    walls = ratios(samples)
    return {name: ((statistics.median(w for w, _ in s), statistics.median(c for _, c in s),
                    min(w for w, _ in s)), walls[name][0])
            for name, s in samples.items()}


def steady_heap() -> str:
    """Stop glibc's malloc from handing freed memory back to the kernel (for this process).

    By default glibc returns the free top of its heap to the kernel (`brk`) and serves
    blocks of over 128 kB (a threshold it raises as it goes) by `mmap`. A training step
    frees hundreds of MiB of activations, so the next step faults them back in page by
    page: on the CPU machine of the README, 36,000-43,000 page faults and 57-76 ms of
    system time in one 410 ms resnet-mini step, in bursts that land on whichever variant
    happens to free or touch that memory. Timings then differ by several percent from
    round to round, which hides differences of 1 %. Fixed thresholds (32 MiB for `mmap`, no
    trimming), as `MALLOC_MMAP_THRESHOLD_` and `MALLOC_TRIM_THRESHOLD_` set them, keep
    the memory in the process, much as jemalloc or tcmalloc (which return it lazily) do;
    every variant runs under the same allocator. Returns a line saying what was done.
    """
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "malloc left as it is (no glibc mallopt here)"
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's <malloc.h>
    refused = [what for what, option, value in (("mmap threshold", m_mmap_threshold, 32 << 20),
                                                 ("trim threshold", m_trim_threshold, 2**31 - 1))
               if not mallopt(option, value)]
    if refused:  # the other one, if any, is set: say so rather than "left as it is"
        return f"glibc malloc: mallopt refused the {' and the '.join(refused)}"
    return ("glibc malloc: blocks up to 32 MiB from the heap, freed memory kept in the process"
            " (--glibc-default to leave it as it is)")
