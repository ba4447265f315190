"""Turn records (frozen dataclasses, tuples, enums, tensors' metadata) into JSON-ready data."""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["to_jsonable", "write_json"]


def to_jsonable(obj: Any) -> Any:
    """A JSON-ready copy of `obj`: dataclasses become dicts, NaN/Inf become None (with the
    original kept as a string under the same key's `_repr` only where it matters is up to
    the caller), tuples become lists, and anything else unknown becomes `str(obj)`."""
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, enum.Enum):
        return obj.value
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {
            f.name: to_jsonable(getattr(obj, f.name))
            for f in dataclasses.fields(obj)
            if not f.name.startswith("_")
        }
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return str(obj)


def write_json(path: str | Path, payload: Any) -> Path:
    """Write `payload` as indented JSON (after `to_jsonable`), creating parent folders."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(to_jsonable(payload), indent=2, allow_nan=False) + "\n")
    return out
