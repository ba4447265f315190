"""Tensor reads to Python in the profiled steps, and which of them waited for a device.

`.item()`, `bool(t)` and `float(t)` run `aten::_local_scalar_dense`. On an accelerator's
tensor it copies the value back and waits for the stream: the device runtime's calls
(`cudaMemcpyAsync`, `cudaStreamSynchronize`) run inside it, and the profiler nests them
under it. On a host tensor it waits for nothing: torch.optim's Adam and AdamW keep their
step counters on the CPU and read them with `.item()` on every step, on a GPU too. A
synchronising copy without a read (`.cpu()`, `.tolist()`, `torch.nonzero`) shows as a
runtime wait of its own. Reads and waits inside a DataLoader's `__next__` are the
dataset's, not the step's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from torchscope.profiling.attribution import OPTIMIZER_STEP_PREFIX
from torchscope.profiling.loader import LOADER_RANGE_PREFIX
from torchscope.profiling.records import HostReads

__all__ = ["READ_OP", "WAIT_OPS", "host_reads"]

READ_OP = "aten::_local_scalar_dense"
#: GradScaler's ops: the unscale that finds infs, and the scale's update at `update()`.
_UNSCALE_OP = "aten::_amp_foreach_non_finite_check_and_unscale_"
_UPDATE_OP = "aten::_amp_update_scale_"
#: The device runtime's calls that block the host: a stream wait, a blocking copy.
WAIT_OPS = ("cudaStreamSynchronize", "cudaMemcpy", "hipStreamSynchronize", "hipMemcpy")
_RUNTIME = ("cuda", "hip")  # the device runtime's own calls, on the host's thread


def _below(event: Any) -> Iterator[Any]:
    for child in event.cpu_children:
        yield child
        yield from _below(child)


def _inside(event: Any, test: Callable[[str], bool]) -> bool:
    """Whether an event around `event` has a name that passes `test`."""
    parent = event.cpu_parent
    while parent is not None:
        if test(parent.name):
            return True
        parent = parent.cpu_parent
    return False


def _in_loader(event: Any) -> bool:
    return _inside(event, lambda name: name.startswith(LOADER_RANGE_PREFIX))


def _in_torch_optimizer(event: Any) -> bool:
    """Inside the step of one of torch.optim's own optimizers (`Optimizer.step#AdamW.step`),
    whose reads are of its host-side step counters."""
    return _inside(event, lambda name: name.startswith(OPTIMIZER_STEP_PREFIX) and isinstance(
        getattr(torch.optim, name[len(OPTIMIZER_STEP_PREFIX):].partition(".")[0], None), type))


def _scaler_reads(marks: list[tuple[float, str, Any]]) -> set[int]:
    """Of one thread's reads, unscale ops and optimizer steps (`(start, kind, event)`), the
    reads that are a GradScaler's inf check: the last read after an unscale and before the
    next step of a non-fused optimizer or scale update."""
    found: set[int] = set()
    armed, last = False, None
    for _start, kind, event in sorted(marks, key=lambda m: m[0]):
        if kind == "unscale":
            armed, last = True, None
        elif kind == "read":
            last = event if armed else None
        else:  # a step or an update ends the check; a fused step reads nothing to skip
            fused = kind == "step" and any(c.name.startswith("aten::_fused_")
                                           for c in _below(event))
            if armed and last is not None and not fused:
                found.add(id(last))
            armed, last = False, None
    return found


def host_reads(events: Iterable[Any]) -> HostReads:
    """The step's tensor reads and device waits among `events` (`prof.events()`, with
    `cpu_children` populated), outside every DataLoader range."""
    reads = device = waits = optimizer = 0
    linked = False  # the profiler nested runtime calls under ops (so reads can be told)
    marks: dict[Any, list[tuple[float, str, Any]]] = {}  # per thread, for the GradScaler
    counted: list[Any] = []
    for e in events:
        name: str = e.name
        if name.startswith(_RUNTIME) and e.cpu_parent is not None:
            linked = True
        if name == READ_OP and not _in_loader(e):
            reads += 1
            if any(c.name.startswith(_RUNTIME) for c in _below(e)):
                device += 1
            elif _in_torch_optimizer(e):
                optimizer += 1
                continue
            counted.append(e)
            marks.setdefault(e.thread, []).append((e.time_range.start, "read", e))
        elif name in WAIT_OPS and not _in_loader(e) and \
                not _inside(e, lambda n: n == READ_OP):  # not a read's own wait
            waits += 1
        elif name == _UNSCALE_OP:
            marks.setdefault(e.thread, []).append((e.time_range.start, "unscale", e))
        elif name == _UPDATE_OP or name.startswith(OPTIMIZER_STEP_PREFIX):
            kind = "update" if name == _UPDATE_OP else "step"
            marks.setdefault(e.thread, []).append((e.time_range.start, kind, e))
    scaler = set().union(*(_scaler_reads(m) for m in marks.values())) if marks else set()
    return HostReads(reads=reads, device=device, waits=waits, linked=linked,
                     optimizer=optimizer, scaler=sum(1 for e in counted if id(e) in scaler))
