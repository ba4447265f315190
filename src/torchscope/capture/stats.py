"""Device-side reduction of tensor statistics: no `.item()`, no host sync.

Each tensor becomes one small float64 vector on its own device; the capture stacks those
and copies them to the host once per forward.
"""

from __future__ import annotations

import torch

__all__ = ["N_STATS", "dead_unit_count", "reduce_stats"]

# Layout of the vector `reduce_stats` returns.
MEAN, STD, MIN, MAX, NORM, ZEROS, NANS, INFS, DEAD = range(9)
N_STATS = 9


def reduce_stats(x: torch.Tensor, *, dead_units: bool = False) -> torch.Tensor:
    """Statistics of `x` as a float64 vector of `N_STATS` on `x.device`.

    With `dead_units`, slot `DEAD` counts dead channels (see `dead_unit_count`); else -1.

    Fused reductions where torch has them (`var_mean`, `aminmax`), so the data is read a
    handful of times and nothing leaves the device.
    """
    t = x.detach()
    if not t.is_floating_point():
        t = t.to(torch.float32)
    elif t.dtype in (torch.float16, torch.bfloat16):
        t = t.to(torch.float32)  # half-precision sums lose digits; the copy is worth it
    n = t.numel()
    if n == 0:
        return torch.full((N_STATS,), float("nan"), dtype=torch.float64, device=t.device)
    flat = t.reshape(-1)  # (N,)
    var, mean = torch.var_mean(flat)  # unbiased, as Tensor.std()
    mn, mx = torch.aminmax(flat)
    sumsq = torch.linalg.vector_norm(flat)
    zeros = n - torch.count_nonzero(flat)
    nans = torch.isnan(flat).sum()
    infs = torch.isinf(flat).sum()
    return torch.stack(
        [
            mean.double(),
            var.double().sqrt(),
            mn.double(),
            mx.double(),
            sumsq.double(),
            zeros.double() / n,
            nans.double(),
            infs.double(),
            dead_unit_count(t) if dead_units and t.dim() >= 2 else mean.new_full((), -1.0).double(),
        ]
    )  # (N_STATS,)


def dead_unit_count(x: torch.Tensor) -> torch.Tensor:
    """Channels (dim 1) of a rank >= 2 tensor that are zero everywhere, as a 0-d device tensor."""
    t = x.detach()
    per_channel = t.transpose(0, 1).reshape(t.shape[1], -1)  # (C, B*spatial)
    return (per_channel.abs().amax(dim=1) == 0).sum().double()
