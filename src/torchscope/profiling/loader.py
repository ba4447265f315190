"""Time a training loop spends waiting for its next batch, from `torch.profiler` events.

`torch.utils.data.DataLoader` opens a `record_function` range around every `__next__`
(`enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__`, or `...Multiprocessing...`
with worker processes): the time inside it is time the model does not compute. With
workers it is the wait for a ready batch; without, the loading itself (the dataset's
`__getitem__`, the transforms and the collation run inside it).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torchscope.profiling.records import InputWait

__all__ = ["LOADER_RANGE_PREFIX", "input_wait"]

LOADER_RANGE_PREFIX = "enumerate(DataLoader)#"


def input_wait(events: Iterable[Any]) -> InputWait | None:
    """The DataLoader's `__next__` ranges among `events` (`prof.events()`), or None when the
    profiled steps took no batch from a DataLoader.

    Args:
        events: `FunctionEvent`s with `cpu_children` populated.
    """
    ranges = [e for e in events if e.name.startswith(LOADER_RANGE_PREFIX)]
    if not ranges:
        return None
    return InputWait(
        ms=sum(float(e.cpu_time_total) for e in ranges) / 1e3,
        calls=len(ranges),
        workers=any("MultiProcessing" in e.name for e in ranges),
    )
