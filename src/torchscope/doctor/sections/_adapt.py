"""Small helpers the adapter sections share to read a capability's records defensively."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["first_attr", "num", "opt_int", "seq"]

_MISSING = object()


def first_attr(obj: Any, *names: str, default: Any = None) -> Any:
    """The first of `names` that `obj` has (attribute or mapping key), else `default`."""
    for name in names:
        if isinstance(obj, Mapping) and name in obj:
            return obj[name]
        value = getattr(obj, name, _MISSING)
        if value is not _MISSING:
            return value() if callable(value) and name.startswith("get_") else value
    return default


def num(value: Any) -> float | None:
    """A finite float, or None for None/NaN/non-numbers."""
    if value is None or isinstance(value, bool):
        return None
    try:
        f = float(value)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def opt_int(value: Any) -> int | None:
    """An int, or None."""
    f = num(value)
    return None if f is None else int(f)


def seq(value: Any) -> tuple[Any, ...]:
    """A tuple of the items of `value` (a mapping gives its values); empty for None."""
    if value is None:
        return ()
    if isinstance(value, Mapping):
        return tuple(value.values())
    if isinstance(value, (str, bytes)):
        return (value,)
    if isinstance(value, Iterable):
        return tuple(value)
    return (value,)
