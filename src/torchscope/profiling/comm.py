"""Communication in a profile: which collectives ran, for how long, and how much of that
time the rank's own computation hid.

torch.profiler records three kinds of events for a collective:

- the c10d op the caller ran on its own thread (`c10d::allreduce_`,
  `c10d::_reduce_scatter_base_`, `c10d::_allgather_base_`, ...), which names the collective
  but on gloo and NCCL only enqueues it;
- the backend's execution range (`gloo:all_reduce` on one of gloo's worker threads,
  `nccl:all_reduce` on the host), which covers the transfer and the wait for the other ranks;
- on a GPU, the NCCL kernels (`ncclDevKernel_...`) on the device.

Gloo runs a reduce-scatter as an all-reduce, so its execution range is named after the wrong
collective: the kind comes from the c10d op, paired in start order with the execution
ranges when both lists are equally long (collectives run in the order they were issued),
else from the execution range's own name.

torchscope's own collectives (a `watch_gradients` sampling the same steps) are issued inside a
`torchscope::collective` range and left out when the pairing identifies them.

Time is split the way HolisticTraceAnalysis does: computation is the union of the compute
intervals (device kernels other than NCCL's on a GPU; `aten::` ops on the ranks' own threads
on a CPU), communication the union of the execution intervals; their intersection is the
overlap, and communication outside it is exposed: the rank waited for it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from typing import Any

from torchscope.distributed.comm import RANGE
from torchscope.profiling.records import CommOp, CommTime

__all__ = ["comm_kind", "comm_time", "is_comm"]

Interval = tuple[float, float]

# Substrings of a collective's name (lower case, underscores dropped), most specific first.
_KINDS: tuple[tuple[str, str], ...] = (
    ("reducescatter", "reduce_scatter"), ("allreduce", "all_reduce"),
    ("allgather", "all_gather"), ("alltoall", "all_to_all"), ("broadcast", "broadcast"),
    ("barrier", "barrier"), ("send", "send/recv"), ("recv", "send/recv"),
    ("reduce", "reduce"), ("gather", "gather"), ("scatter", "scatter"),
)
_EXEC_PREFIXES = ("gloo:", "nccl:")


def comm_kind(name: str) -> str | None:
    """The collective an event name stands for (`all_reduce`, `reduce_scatter`,
    `all_gather`, ...), or None for an event that is no collective."""
    low = name.lower()
    if not (low.startswith(("c10d::", *_EXEC_PREFIXES)) or "nccl" in low):
        return None
    flat = low.replace("_", "")
    return next((kind for key, kind in _KINDS if key in flat), "other")


def is_comm(name: str) -> bool:
    """True for an event of a collective (its c10d op, its execution range or kernel)."""
    return comm_kind(name) is not None or name == "record_param_comms"


def _union(intervals: Iterable[Interval]) -> list[Interval]:
    out: list[Interval] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _length(intervals: Sequence[Interval]) -> float:
    return sum(e - s for s, e in intervals)


def _intersection(a: Sequence[Interval], b: Sequence[Interval]) -> float:
    """Total length of the overlap of two sorted, disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _clip(intervals: Sequence[Interval], window: Interval) -> list[Interval]:
    """The parts of sorted, disjoint intervals inside `window`."""
    lo, hi = window
    return [(max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi]


def _exposed_per_step(events: Sequence[Any], steps: int, comm_u: Sequence[Interval],
                      compute_u: Sequence[Interval]) -> tuple[float, ...]:
    """Each profiled step's exposed communication in ms, cut where the profiler's step
    ranges (`ProfilerStep*`) start; empty when those do not match the steps one to one.

    The cuts tile the whole profile, so the steps' parts add up to the total: a
    collective that a backend's thread finishes after its step's range has ended counts
    for the next step (the first step also takes what came before it).
    """
    starts = sorted(_span(e)[0] for e in events if e.name.startswith("ProfilerStep"))
    if len(starts) != steps:
        return ()
    cuts = [-math.inf, *starts[1:], math.inf]
    out = []
    for window in itertools.pairwise(cuts):
        comm_in = _clip(comm_u, window)
        out.append(max(_length(comm_in) - _intersection(comm_in, _clip(compute_u, window)),
                       0.0) / 1e3)
    return tuple(out)


def _ours(e: Any) -> bool:
    """Whether a c10d op was issued by torchscope (inside its `RANGE`)."""
    parent = getattr(e, "cpu_parent", None)
    while parent is not None:
        if parent.name == RANGE:
            return True
        parent = getattr(parent, "cpu_parent", None)
    return False


def _span(e: Any) -> Interval:
    return float(e.time_range.start), float(e.time_range.end)


def comm_time(events: Sequence[Any], steps: int) -> CommTime | None:
    """Communication and computation per step from `prof.events()`; None when no
    collective ran in the profiled steps.

    Args:
        events: the profiler's `FunctionEvent`s of the profiled steps.
        steps: how many steps they cover (totals are divided by it).
    """
    issued = sorted((e for e in events if e.name.startswith("c10d::") and comm_kind(e.name)),
                    key=lambda e: e.time_range.start)
    # torchscope's own collectives (a watch sampling this step) are no part of the step's.
    own = [_ours(e) for e in issued]
    device = [e for e in events if getattr(e, "device_type", None) is not None
              and str(e.device_type).endswith("CUDA")]
    on_device = [e for e in device if "nccl" in e.name.lower()]
    executed = sorted(on_device or [e for e in events if e.name.startswith(_EXEC_PREFIXES)],
                      key=lambda e: e.time_range.start)
    if not executed:
        executed = issued  # a backend that runs collectives on the caller's thread
    if not executed:
        return None
    if len(executed) == len(issued):
        pairs = [(comm_kind(i.name) or "other", e)
                 for i, e, mine in zip(issued, executed, own, strict=True) if not mine]
    else:
        pairs = [(comm_kind(e.name) or "other", e) for e in executed]
    if not pairs:
        return None
    kinds = [k for k, _ in pairs]
    executed = [e for _, e in pairs]
    comm_threads = {e.thread for e in executed}
    if device:
        compute = [_span(e) for e in device if "nccl" not in e.name.lower()]
    else:
        compute = [_span(e) for e in events if e.name.startswith("aten::")
                   and e.thread not in comm_threads]
    comm_u, compute_u = _union(_span(e) for e in executed), _union(compute)
    per: dict[str, list[float]] = {}
    for kind, e in zip(kinds, executed, strict=True):
        per.setdefault(kind, []).append((e.time_range.end - e.time_range.start) / 1e3)
    n = max(steps, 1)
    comm_ms, overlap = _length(comm_u) / 1e3 / n, _intersection(comm_u, compute_u) / 1e3 / n
    return CommTime(
        compute_ms=_length(compute_u) / 1e3 / n, comm_ms=comm_ms, overlap_ms=overlap,
        exposed_ms=max(comm_ms - overlap, 0.0),
        ops=tuple(CommOp(kind, len(ms) / n, sum(ms) / n)
                  for kind, ms in sorted(per.items(), key=lambda kv: -sum(kv[1]))),
        source="device" if on_device else "host",
        exposed_per_step=_exposed_per_step(events, steps, comm_u, compute_u))
