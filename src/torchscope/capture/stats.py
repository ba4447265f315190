"""Device-side reduction of tensor statistics: no `.item()`, no host sync.

Each tensor becomes one small float64 vector on its own device; the capture stacks those
and copies them to the host once per forward.

Why these ops: on CPU, `var_mean` and bool `isnan(...).sum()` run about 50x slower than the
vectorised `sum`, `vector_norm` and `aminmax` reductions on the same data, so the mean comes
from `sum`, the L2 norm from `vector_norm`, the std from BLAS `dot` of the centred data, and
finiteness comes from
`aminmax` (NaN and ±Inf propagate to the min/max). Exact NaN/Inf counts cost two more passes
and are optional.
"""

from __future__ import annotations

import torch

__all__ = ["N_STATS", "dead_unit_count", "finiteness", "reduce_stats"]

# Layout of the vector `reduce_stats` returns.
MEAN, STD, MIN, MAX, NORM, ZEROS, NANS, INFS, DEAD = range(9)
N_STATS = 9


def reduce_stats(
    x: torch.Tensor, *, dead_units: bool = False, count_nonfinite: bool = True
) -> torch.Tensor:
    """Statistics of `x` as a float64 vector of `N_STATS` on `x.device`.

    Args:
        x: any tensor; integer and half tensors are reduced in float32.
        dead_units: fill slot `DEAD` with the number of all-zero channels (dim 1); else -1.
        count_nonfinite: count NaN and Inf exactly; else slots `NANS`/`INFS` hold -1 and the
            reader derives finiteness from min/max.
    """
    t = x.detach()
    if not t.is_floating_point() or t.dtype in (torch.float16, torch.bfloat16):
        t = t.to(torch.float32)  # half sums lose digits; the copy is worth it
    n = t.numel()
    if n == 0:
        return torch.full((N_STATS,), float("nan"), dtype=torch.float64, device=t.device)
    flat = t.reshape(-1)  # (N,)
    mean32 = flat.sum() / n
    norm = torch.linalg.vector_norm(flat).double()  # the very op behind Tensor.norm()
    mean = mean32.double()
    # Two-pass variance: the centred sum of squares keeps full precision whatever the mean,
    # where E[x^2] - E[x]^2 would cancel; BLAS `dot` keeps ~1e-7 relative error where a
    # float32 `vector_norm` drifts to ~2e-6. Unbiased, as Tensor.std().
    centred = flat - mean32  # (N,)
    ss = torch.dot(centred, centred).double()
    std = (ss / (n - 1)).sqrt() if n > 1 else torch.full_like(mean, float("nan"))
    mn, mx = torch.aminmax(flat)
    zeros = (n - torch.count_nonzero(flat)).double() / n
    if count_nonfinite:
        nans = torch.count_nonzero(torch.isnan(flat)).double()
        infs = torch.count_nonzero(flat.abs() == float("inf")).double()
    else:
        nans = infs = torch.full_like(mean, -1.0)
    dead = dead_unit_count(t) if dead_units and t.dim() >= 2 else torch.full_like(mean, -1.0)
    return torch.stack(
        [mean, std, mn.double(), mx.double(), norm, zeros, nans, infs, dead]
    )  # (N_STATS,)


def finiteness(x: torch.Tensor) -> torch.Tensor:
    """A stats vector whose NANS slot is 0 when `x` is finite and 1 when not, via `aminmax`."""
    t = x.detach()
    out = torch.zeros(N_STATS, dtype=torch.float64, device=t.device)
    if t.numel() and (t.is_floating_point() or t.is_complex()):
        mn, mx = torch.aminmax(t.reshape(-1).real if t.is_complex() else t.reshape(-1))
        out[NANS] = (~torch.isfinite(torch.stack([mn, mx]))).any().double()
    return out


def dead_unit_count(x: torch.Tensor) -> torch.Tensor:
    """Channels (dim 1) of a rank >= 2 tensor that are zero everywhere, as a 0-d device tensor."""
    t = x.detach()
    dims = [d for d in range(t.dim()) if d != 1]
    peak = t.abs().amax(dim=dims) if t.dtype != torch.bool else t.any(dim=dims)  # (C,)
    return (peak == 0).sum().double()
