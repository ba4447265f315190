"""Op records from `torch.profiler`'s `key_averages()`, and their sort orders."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from torchscope.profiling.records import OpRecord, ProfilingError, SortKey

__all__ = ["SORT_KEYS", "op_records", "sort_ops"]

#: Sort keys accepted by `sort_ops` and the CLI's `--sort`.
SORT_KEYS: tuple[str, ...] = ("self_cpu", "total", "self_cuda", "cuda_total", "calls")

MODULE_RANGE_PREFIX = "nn.Module: "
# Ranges torchscope or the schedule opened (phases, modules, steps): no op rows.
_INTERNAL_NAMES = frozenset({"forward", "backward", "optimizer", "ProfilerStep*"})
_INTERNAL_PREFIXES = (MODULE_RANGE_PREFIX, "ProfilerStep#")


def _shapes(raw: Any) -> tuple[tuple[int, ...], ...] | None:
    if not raw:
        return None
    out: list[tuple[int, ...]] = []
    for item in raw:
        # A TensorList input arrives as a list of lists; keep only plain shapes.
        if isinstance(item, (list, tuple)) and all(isinstance(d, int) for d in item):
            out.append(tuple(int(d) for d in item))
        else:
            out.append(())
    return tuple(out)


def op_records(averages: Iterable[Any]) -> tuple[OpRecord, ...]:
    """Turn `prof.key_averages()` rows into `OpRecord`s, largest self CPU time first; the
    phase, module and `ProfilerStep` ranges are no rows.

    Shares are computed against the self time of every row (torchscope's own ranges
    included, as `torch.profiler`'s table does), so they add up to 100% of profiled time.
    """
    rows = list(averages)
    self_cpu = sum(float(a.self_cpu_time_total) for a in rows) or 1.0
    self_dev = sum(float(getattr(a, "self_device_time_total", 0.0)) for a in rows) or 1.0
    records: list[OpRecord] = []
    for a in rows:
        name = str(a.key)
        if name in _INTERNAL_NAMES or name.startswith(_INTERNAL_PREFIXES):
            continue
        sd = float(getattr(a, "self_device_time_total", 0.0))
        records.append(
            OpRecord(
                name=name,
                calls=int(a.count),
                self_cpu_ms=float(a.self_cpu_time_total) / 1e3,
                cpu_total_ms=float(a.cpu_time_total) / 1e3,
                self_device_ms=sd / 1e3,
                device_total_ms=float(getattr(a, "device_time_total", 0.0)) / 1e3,
                self_cpu_frac=float(a.self_cpu_time_total) / self_cpu,
                self_device_frac=sd / self_dev,
                input_shapes=_shapes(getattr(a, "input_shapes", None)),
            )
        )
    # Largest self CPU time first (then by name, for a stable order): `ops[0]` is the top op.
    records.sort(key=lambda r: (-r.self_cpu_ms, r.name))
    return tuple(records)


# Sort key -> the `OpRecord` field it orders by (`self_device`/`device_total`: aliases).
_SORT_FIELDS = {
    "self_cpu": "self_cpu_ms", "total": "cpu_total_ms", "self_cuda": "self_device_ms",
    "self_device": "self_device_ms", "cuda_total": "device_total_ms",
    "device_total": "device_total_ms", "calls": "calls",
}


def sort_ops(
    records: Sequence[OpRecord], by: SortKey | str = "self_cpu", limit: int | None = None
) -> list[OpRecord]:
    """Records sorted by `by`, largest first, ties broken by name; at most `limit` of them.

    Args:
        records: op records.
        by: `self_cpu`, `total` (CPU total), `self_cuda`, `cuda_total` or `calls`.
        limit: keep only the first rows.

    Raises:
        ProfilingError: `by` is not a known key.
    """
    field = _SORT_FIELDS.get(by)
    if field is None:
        raise ProfilingError(f"sort key {by!r} is not known.",
                             fix=f"use one of {', '.join(SORT_KEYS)}.")
    ordered = sorted(records, key=lambda r: (-getattr(r, field), r.name))
    return ordered if limit is None else ordered[: max(limit, 0)]
