"""Chrome/Perfetto trace export, bounded to the last N profiled steps, optionally gzipped;
one file per rank in a distributed job.

torch.profiler writes `distributedInfo` (backend, rank, world size, process groups) into a
trace when a process group exists; HolisticTraceAnalysis reads a folder of such traces
(`.json` or `.json.gz`), one per rank, told apart by that rank.
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["export_trace", "rank_trace_path"]

_SUFFIXES = (".json.gz", ".json")


def rank_trace_path(path: str | Path, rank: int) -> Path:
    """Where rank `rank` writes its trace when asked for `path`.

    A file name (`traces/step.json.gz`) gets the rank before its suffix
    (`traces/step.rank1.json.gz`); anything else is a folder that receives
    `rank1.json.gz`. Either way every rank's trace lands in one folder.
    """
    p = Path(path)
    for suffix in _SUFFIXES:
        if p.name.endswith(suffix):
            return p.with_name(f"{p.name[: -len(suffix)]}.rank{rank}{suffix}")
    return p / f"rank{rank}.json.gz"


def _bound(trace: dict[str, Any], steps: int) -> dict[str, Any]:
    """Drop events that start before the last `steps` `ProfilerStep#N` ranges.

    Metadata events (`ph == "M"`) are kept: they name processes and threads. Device events
    of an earlier step that start late are kept too; they are few and show the overlap.
    """
    events = trace.get("traceEvents", [])
    step_starts = sorted(
        float(e["ts"]) for e in events
        if isinstance(e, dict) and str(e.get("name", "")).startswith("ProfilerStep#")
        and "ts" in e
    )
    if len(step_starts) <= steps:
        return trace
    start = step_starts[-steps]
    kept = [
        e for e in events
        if not isinstance(e, dict) or e.get("ph") == "M" or "ts" not in e
        or float(e["ts"]) >= start
    ]
    return {**trace, "traceEvents": kept}


def export_trace(prof: Any, path: str | Path, *, steps: int | None = None) -> Path:
    """Write the profiler's last cycle as a Chrome/Perfetto trace.

    Args:
        prof: a finished `torch.profiler.profile`.
        path: destination; a name ending in `.gz` is gzip-compressed.
        steps: keep only the last `steps` profiled steps (None keeps all of them).

    Returns:
        The path written.
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(suffix=".json", dir=out.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        prof.export_chrome_trace(str(tmp))
        trace: dict[str, Any] = json.loads(tmp.read_bytes().decode("utf-8", errors="replace"))
        if steps is not None:
            trace = _bound(trace, max(int(steps), 1))
        payload = json.dumps(trace).encode("utf-8")
        if out.name.endswith(".gz"):
            with gzip.open(out, "wb") as fh:
                fh.write(payload)
        else:
            out.write_bytes(payload)
    finally:
        tmp.unlink(missing_ok=True)
    return out
