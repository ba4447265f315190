"""Parse input SPECs such as `32x3x32x32`, `float16:8x3x32x32` or `int64[0,1000):4x128`."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

import torch

from torchscope._util import fmt_bytes
from torchscope.errors import InputSpecError

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float": torch.float32, "f32": torch.float32,
    "float64": torch.float64, "double": torch.float64, "f64": torch.float64,
    "float16": torch.float16, "half": torch.float16, "f16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "int64": torch.int64, "long": torch.int64, "int32": torch.int32, "int": torch.int32,
    "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}  # fmt: skip

_SPEC = re.compile(
    r"^(?:(?P<dtype>[a-z0-9]+)"
    r"(?:\[(?P<low>-?[0-9.eE+-]+),(?P<high>-?[0-9.eE+-]+)\))?:)?"
    r"(?P<shape>[0-9]+(?:x[0-9]+)*)$"
)

_HELP = "write a shape like 32x3x32x32, optionally with a dtype and range: int64[0,1000):4x128"


@dataclass(frozen=True)
class InputSpec:
    """One input tensor to synthesise: shape, dtype and an optional [low, high) range."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    low: float | None = None
    high: float | None = None

    def make(self, generator: torch.Generator | None = None) -> torch.Tensor:
        """A random tensor of this spec: normal floats, uniform in [low, high) when given.

        Raises:
            InputSpecError: the tensor needs more memory than this machine has, or than it
                could allocate.
        """
        numel = math.prod(self.shape)
        nbytes = numel * self.dtype.itemsize
        # What the draw holds at its peak: bools are drawn as int64, other floats than
        # float32 are drawn in float32 and cast.
        peak = numel * (8 if self.dtype == torch.bool else 0 if not self.dtype.is_floating_point
                        or self.dtype == torch.float32 else 4) + nbytes
        what = f"input {'x'.join(map(str, self.shape))} ({str(self.dtype).removeprefix('torch.')})"
        fix = "pass a smaller shape, e.g. a smaller batch."
        ram = _physical_memory()
        # Linux overcommits: an allocation above the RAM can succeed and the process then be
        # killed while it is filled, with no message at all.
        if ram is not None and peak > ram:
            raise InputSpecError(f"{what} needs {fmt_bytes(nbytes)}, more than this machine's "
                                 f"{fmt_bytes(ram)} of memory.", fix=fix)
        try:
            return self._draw(generator)
        except RuntimeError as exc:  # torch.OutOfMemoryError derives from it
            if "alloc" not in str(exc).lower():
                raise
            raise InputSpecError(f"{what} needs {fmt_bytes(nbytes)}, which could not be "
                                 "allocated.", fix=fix) from exc

    def _draw(self, generator: torch.Generator | None) -> torch.Tensor:
        g = generator if generator is not None else torch.Generator().manual_seed(0)
        if self.dtype == torch.bool:
            return torch.randint(0, 2, self.shape, generator=g).bool()
        if not self.dtype.is_floating_point:
            low = int(self.low) if self.low is not None else 0
            high = int(self.high) if self.high is not None else 2
            return torch.randint(low, high, self.shape, generator=g, dtype=self.dtype)
        if self.low is not None and self.high is not None:
            t = torch.rand(self.shape, generator=g) * (self.high - self.low) + self.low
        else:
            t = torch.randn(self.shape, generator=g)
        return t.to(self.dtype)


def _physical_memory() -> int | None:
    """This machine's RAM in bytes, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # Windows has no sysconf
        return None


def parse_spec(text: str) -> InputSpec:
    """Parse one SPEC string.

    Raises:
        InputSpecError: the text is not a valid SPEC; the message shows the accepted forms.
    """
    cleaned = text.strip().lower().replace("×", "x").replace(" ", "")
    m = _SPEC.match(cleaned)
    if m is None:
        raise InputSpecError(f"input spec {text!r} is malformed.", fix=_HELP + ".")
    shape = tuple(int(d) for d in m["shape"].split("x"))
    if any(d == 0 for d in shape):
        raise InputSpecError(f"input spec {text!r} has a zero dimension.", fix=_HELP + ".")
    dtype = torch.float32
    if m["dtype"]:
        if m["dtype"] not in _DTYPES:
            raise InputSpecError(
                f"input spec {text!r} names an unknown dtype {m['dtype']!r}.",
                fix=f"use one of {', '.join(sorted(_DTYPES))}.",
            )
        dtype = _DTYPES[m["dtype"]]
    low = high = None
    if m["low"] is not None:
        try:
            low, high = float(m["low"]), float(m["high"])
        except ValueError:
            raise InputSpecError(f"input spec {text!r} has a bad range.", fix=_HELP + ".") from None
        if not high > low:
            raise InputSpecError(
                f"input spec {text!r} has an empty range [{m['low']},{m['high']}).",
                fix="give a range whose high is above its low.",
            )
        if not dtype.is_floating_point and dtype != torch.bool and int(high) <= int(low):
            raise InputSpecError(f"input spec {text!r} has an empty integer range.", fix=_HELP)
    return InputSpec(shape, dtype, low, high)
