"""Small number formatters shared by the renderers."""

from __future__ import annotations

import math

__all__ = ["fmt_bytes", "fmt_num", "fmt_pct", "fmt_shape"]


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
