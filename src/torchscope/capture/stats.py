"""Device-side reduction of tensor statistics: no `.item()`, no host sync.

Each tensor becomes one small float64 vector on its own device (the layout of
`torchscope._kernels`: MEAN, STD, MIN, MAX, NORM, ZEROS, NANS, INFS); the capture joins
those and copies them to the host once per read of its records.

Two paths compute that vector. `tensor_stats` takes the fused kernel whenever it is ready
(`torchscope._kernels`: every statistic in one pass over the tensor, built once per machine
in the background) and otherwise runs `reduce_stats`, the eager ops below; the two agree
exactly on min, max and the counts, and within float32 rounding on the sums.

Why these eager ops: on CPU, `var_mean` and bool `isnan(...).sum()` run about 50x slower
than the vectorised `sum`, `vector_norm` and `aminmax` reductions on the same data, so the
mean comes from `sum`, the L2 norm from `vector_norm`, the std from BLAS `dot` of the
centred data, counts from float sums over small reused buffers (CPU), and finiteness comes
from `aminmax` (NaN and ±Inf propagate to the min/max). Exact NaN/Inf counts cost two more
passes there and are optional.
"""

from __future__ import annotations

import threading

import torch

from torchscope import _kernels
from torchscope._kernels import DEAD, INFS, N_MOMENTS, NANS

__all__ = [
    "dead_unit_count",
    "feature_scale",
    "finiteness",
    "reduce_stats",
    "saturation",
    "stats_vector",
    "tensor_stats",
]


def tensor_stats(
    x: torch.Tensor, *, count_nonfinite: bool = True, dead_units: bool = False,
    nonnegative: bool = False, unit_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """Statistics of `x` as a float64 vector of `N_MOMENTS` on `x.device`, its dead-unit
    count, and whether the fused kernel computed the statistics (else the eager ops of
    `reduce_stats` did).

    The fused kernel always counts NaN and Inf (they cost it almost nothing); the reader
    ignores those slots when `count_nonfinite` is False, as it does for the eager path's -1.

    Args:
        x: the tensor.
        count_nonfinite: count NaN and Inf exactly on the eager path.
        dead_units: also count the units (dim `unit_dim`) that are zero everywhere, in the
            fused pass where the kernel can (units in dim 1), else by `dead_unit_count`;
            None for a tensor of fewer than 2 dims or no elements, or without `dead_units`.
        nonnegative: `x` holds no negative values (see `dead_unit_count`).
        unit_dim: the dimension that holds the units (`torchscope.capture.units`).
    """
    stats, dead, fused = stats_vector(x, count_nonfinite=count_nonfinite,
                                      dead_units=dead_units, nonnegative=nonnegative,
                                      unit_dim=unit_dim)
    if dead is None and stats.shape[0] > N_MOMENTS:  # the count is in the vector
        return stats[:N_MOMENTS], stats[DEAD], fused
    return stats, dead, fused


def stats_vector(
    x: torch.Tensor, *, count_nonfinite: bool = True, dead_units: bool = False,
    nonnegative: bool = False, unit_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """`tensor_stats` as the fused kernel leaves it: where the kernel counted the dead
    units in its pass, the vector is N_MOMENTS + 1 long with the count in slot `DEAD`, and
    the count returned is None (as it is where dead units were not asked for or cannot be
    counted); two views fewer for a caller that copies the vector to the host whole (the
    activation capture's hooks)."""
    want_dead = dead_units and x.dim() >= 2 and x.numel() > 0
    fused = _kernels.run("stats", x, dead_units=want_dead and unit_dim == 1)
    if fused is not None and (not want_dead or fused.shape[0] > N_MOMENTS):
        return fused, None, True
    stats = reduce_stats(x, count_nonfinite=count_nonfinite) if fused is None else fused
    dead = dead_unit_count(x, nonnegative=nonnegative, dim=unit_dim) if want_dead else None
    return stats, dead, fused is not None


def reduce_stats(x: torch.Tensor, *, count_nonfinite: bool = True) -> torch.Tensor:
    """Statistics of `x` as a float64 vector of `N_MOMENTS` on `x.device`, by eager ops.

    Args:
        x: any tensor; integer and half tensors are reduced in float32, complex ones over
            their real and imaginary parts as separate values (`torch.view_as_real`): the
            norm is then the complex norm, and a NaN or Inf in either part is counted.
        count_nonfinite: count NaN and Inf exactly; else slots `NANS`/`INFS` hold -1 and the
            reader derives finiteness from min/max.
    """
    t = x.detach()
    if t.is_complex():
        # A cast to a real dtype would drop the imaginary part (and warn).
        t = torch.view_as_real(t.resolve_conj())  # (..., 2)
    if not t.is_floating_point() or t.dtype in (torch.float16, torch.bfloat16):
        t = t.to(torch.float32)  # half sums lose digits; the copy is worth it
    n = t.numel()
    if n == 0:
        # No elements: the moments are undefined (NaN), but there are exactly no NaN/Inf
        # values.
        out = torch.full((N_MOMENTS,), float("nan"), dtype=torch.float64, device=t.device)
        out[NANS] = out[INFS] = 0.0 if count_nonfinite else -1.0
        return out  # (N_MOMENTS,)
    flat = t.reshape(-1)  # (N,)
    mean32 = flat.sum() / n
    norm = torch.linalg.vector_norm(flat).double()  # the very op behind Tensor.norm()
    mean = mean32.double()
    mn, mx = torch.aminmax(flat)
    if flat.device.type == "cpu" and flat.dtype == torch.float32:
        ss, zero_count, nans, infs = _chunked_passes(flat, mean32, count_nonfinite)
    else:
        ss, zero_count, nans, infs = _direct_passes(flat, mean32, count_nonfinite)
    std = (ss.double() / (n - 1)).sqrt() if n > 1 else torch.full_like(mean, float("nan"))
    zeros = zero_count.double() / n
    if not count_nonfinite:
        nans = infs = torch.full_like(mean, -1.0)
    return torch.stack(
        [mean, std, mn.double(), mx.double(), norm, zeros, nans.double(), infs.double()]
    )  # (N_MOMENTS,)


# Two-pass variance: the centred sum of squares keeps full precision whatever the mean,
# where E[x^2] - E[x]^2 would cancel; BLAS `dot` keeps ~1e-7 relative error where a float32
# `vector_norm` drifts to ~2e-6. Unbiased, as Tensor.std().

_CHUNK = 1 << 20  # elements: 4 MiB of float32, stays in cache between the ops on one chunk
_scratch = threading.local()


def _buffer() -> torch.Tensor:
    buf: torch.Tensor | None = getattr(_scratch, "buf", None)
    if buf is None:
        buf = _scratch.buf = torch.empty(_CHUNK)
    return buf


def _chunked_passes(
    flat: torch.Tensor, mean: torch.Tensor, count_nonfinite: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Centred sum of squares, zero count and NaN/Inf counts on the CPU, chunk by chunk.

    Two things make these passes slow on the CPU: full-size temporaries (fresh memory that
    page-faults) and `count_nonzero` (5x slower than a float `sum`). So each chunk goes
    through one reused float buffer, and counts are sums of 0/1 floats, exact because a
    chunk holds fewer than 2**24 elements; the per-chunk partial sums add up in float64.
    """
    buf = _buffer()
    parts: list[torch.Tensor] = []  # per chunk: ss, zeros[, nans, infs]
    for chunk in flat.split(_CHUNK):  # (<= _CHUNK,) each
        f = buf[: chunk.numel()]
        torch.sub(chunk, mean, out=f)
        parts.append(torch.dot(f, f))
        parts.append(torch.eq(chunk, 0, out=f).sum())
        if count_nonfinite:
            parts.append(torch.ne(chunk, chunk, out=f).sum())  # NaN: the only x != x
            torch.abs(chunk, out=f)
            parts.append(torch.eq(f, float("inf"), out=f).sum())
    width = 4 if count_nonfinite else 2
    totals = torch.stack(parts).double().reshape(-1, width).sum(dim=0)  # (width,)
    zero = totals.new_zeros(())
    if count_nonfinite:
        return totals[0], totals[1], totals[2], totals[3]
    return totals[0], totals[1], zero, zero


def _direct_passes(
    flat: torch.Tensor, mean: torch.Tensor, count_nonfinite: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same reductions with whole-tensor temporaries (cheap with CUDA's caching allocator)."""
    centred = flat - mean  # (N,)
    zero = torch.zeros((), dtype=torch.int64, device=flat.device)
    return (
        torch.dot(centred, centred),
        torch.count_nonzero(flat == 0),
        torch.count_nonzero(torch.isnan(flat)) if count_nonfinite else zero,
        torch.count_nonzero(torch.isinf(flat)) if count_nonfinite else zero,
    )


def finiteness(x: torch.Tensor) -> torch.Tensor:
    """A 0-d float64 tensor on `x`'s device that is finite exactly when every element of
    `x` is.

    From the fused `norm` kernel where it runs (one cheap pass: a NaN or Inf anywhere makes
    the float64 sum of squares NaN or Inf, and squares of float32 or half values cannot
    overflow it), else from `aminmax` (NaN and ±Inf propagate to the min/max; times zero,
    a finite bound gives 0 and a non-finite one NaN).
    """
    t = x.detach()
    if t.dtype in (torch.float32, torch.float16, torch.bfloat16):
        norm = _kernels.run("norm", t)  # () float64
        if norm is not None:
            return norm
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())  # (..., 2): both parts are checked
    if t.numel() and t.is_floating_point():
        mn, mx = torch.aminmax(t.reshape(-1))
        return mn.double() * 0.0 + mx.double() * 0.0  # ()
    return torch.zeros((), dtype=torch.float64, device=t.device)


def dead_unit_count(x: torch.Tensor, *, nonnegative: bool = False, dim: int = 1
                    ) -> torch.Tensor:
    """Units (dim `dim`) of a rank >= 2 tensor that are zero everywhere, as a 0-d device
    tensor.

    Args:
        x: the tensor.
        nonnegative: `x` holds no negative values (a ReLU's output): a unit whose max is 0
            is all zero, one reduction instead of two.
        dim: the dimension that holds the units: 1 for (N, C, ...), the last for (N, ..., C).
    """
    t = x.detach()
    dims = [d for d in range(t.dim()) if d != dim]
    if t.dtype == torch.bool:
        return (~t.any(dim=dims)).sum().double()
    dead = t.amax(dim=dims) == 0  # (C,); NaN is never 0, as in the two-sided test
    if not nonnegative:
        # amax and amin instead of abs().amax(): no full-size temporary.
        dead &= t.amin(dim=dims) == 0
    return dead.sum().double()


def saturation(x: torch.Tensor, low: float, high: float, *, dim: int = 1) -> torch.Tensor:
    """How much of a bounded activation's output sits in its saturated tails, as a float64
    (2,) device tensor: the values at or below `low` or at or above `high`, and the units
    (dim `dim`) whose every value is (-1 for a tensor of fewer than 2 dims).

    NaN is in neither tail. Eager ops, run only on the outputs of saturating activations
    (`torchscope.capture.activations`): a distance past the nearer bound (whose sign is
    exact: a float difference is 0 only between equal values and never changes sign in
    rounding), its minimum per unit, and a float count of where it is >= 0 (bool sums run
    several times slower on CPU).

    Args:
        x: the activation's output.
        low, high: the tails' bounds (where the local gradient has fallen below a share
            of its peak, or to zero).
        dim: the dimension that holds the units.
    """
    t = x.detach()
    # Same shape as x, >= 0 in a tail.
    past = t.abs().sub_(high) if low == -high else \
        torch.maximum(t.sub(high), t.neg().add_(low))
    units = torch.full((), -1.0, dtype=torch.float64, device=t.device)
    if t.dim() >= 2 and t.numel():
        dims = [d for d in range(t.dim()) if d != dim % t.dim()]
        units = (past.amin(dim=dims) >= 0).sum().double()  # () over the (C,) units
    hits = torch.ge(past, 0, out=past)  # 1.0 in a tail, 0.0 elsewhere and at NaN
    # float32 counts whole numbers exactly up to 2**24; past that, sum in float64.
    count = hits.sum(dtype=torch.float64 if t.numel() > 2 ** 24 else None).double()  # ()
    return torch.stack([count, units])


def feature_scale(x: torch.Tensor, *, dim: int) -> torch.Tensor:
    """The mean square of each feature of a model input (dim `dim`: a column of a table
    that a Linear takes, a channel of an image that a convolution takes), as a float64 (3,)
    device tensor: the largest, the median (the lower one for an even count), and the
    index of the largest; -1 each for a tensor of fewer than 2 dims.

    Eager ops, run once per forward on the model's own input only
    (`torchscope.capture.activations`): an input whose overall scale is fine can still
    hold one column a hundred times the others' (an age in years beside standardised
    features), which its first layer's init does not expect.
    """
    t = x.detach()
    if t.dim() < 2 or not t.numel():
        return torch.full((3,), -1.0, dtype=torch.float64, device=t.device)
    dims = [d for d in range(t.dim()) if d != dim % t.dim()]
    ms = t.float().square().mean(dim=dims)  # (F,): the mean square of each feature
    top, at = ms.max(dim=0)
    return torch.stack([top.double(), ms.median().double(), at.double()])
