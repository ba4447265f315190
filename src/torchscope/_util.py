"""Neutral helpers every layer may use: number formatting for messages and tables,
turning records into JSON-ready data, and the line fit that trend findings share.

This module imports nothing from torchscope, so analyzers (which word their findings with
`fmt_bytes`) and renderers (which print tables) share one formatter without an analyzer
depending on a renderer.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__version__ = "0.1.0"

__all__ = [
    "__version__", "fit_line", "fmt_bytes", "fmt_num", "fmt_pct", "fmt_shape", "to_jsonable",
    "write_json",
]


def fmt_num(x: float | None, digits: int = 4) -> str:
    """Compact number: `0.0021`, `2.8e+02`, `nan`, `inf`, or `—` for None."""
    if x is None:
        return "—"
    if not math.isfinite(x):
        return str(x)
    if x == 0:
        return "0"
    if 1e-3 <= abs(x) < 1e4:
        return f"{x:.{digits}g}"
    return f"{x:.{max(digits - 2, 1)}e}"


def fmt_pct(frac: float | None) -> str:
    """A fraction as a percentage: `41.2%`."""
    return "—" if frac is None or not math.isfinite(frac) else f"{100 * frac:.1f}%"


def fmt_bytes(n: float | None) -> str:
    """Bytes in binary units: `8.0 KiB`, `1.5 MiB`."""
    if n is None:
        return "—"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def fmt_shape(shape: tuple[int, ...]) -> str:
    """`(32, 8, 30, 30)`."""
    return "(" + ", ".join(map(str, shape)) + ")"


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares line through the points: (slope, R²).

    R² is the share of the variance of `ys` the line explains: 1 when the points lie on it,
    0 when they scatter around a flat line (and for flat or fewer than two points, whose
    slope is 0 too).
    """
    n = len(xs)
    if n < 2:
        return 0.0, 0.0
    mx, my = math.fsum(xs) / n, math.fsum(ys) / n
    sxx = math.fsum((x - mx) ** 2 for x in xs)
    sxy = math.fsum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    syy = math.fsum((y - my) ** 2 for y in ys)
    if sxx == 0:
        return 0.0, 0.0
    return sxy / sxx, (sxy * sxy / (sxx * syy) if syy > 0 else 0.0)


def to_jsonable(obj: Any) -> Any:
    """A JSON-ready copy of `obj`.

    Dataclasses become dicts (fields starting with `_` are left out), NaN/Inf become None,
    enums their value, tuples and sets lists, paths strings, and anything else unknown
    `str(obj)`.
    """
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
