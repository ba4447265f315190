"""Data-parallel wrappers under torchscope's hooks: `DistributedDataParallel` (and
`DataParallel`) wrap the user's module as `.module`, which renames every submodule
(`conv1` becomes `module.conv1`). Hooks go on the wrapped module instead, so names are the
same as on one process; the wrapper's own forward still runs (and with it DDP's gradient
synchronisation). FSDP2 (`fully_shard`) wraps nothing: it changes the modules in place.

`torch.compile` wrappers around or inside a DDP wrapper are seen through here; running
compiled parts eagerly while hooks are held stays `hooks.compiled`'s job.
"""

from __future__ import annotations

import sys

from torch import nn

__all__ = ["parallel_wrapper", "unwrap_parallel"]


def _parallel_types() -> tuple[type[nn.Module], ...]:
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    return (DistributedDataParallel, DataParallel)


def _compiled_inner(module: nn.Module) -> nn.Module | None:
    dynamo = sys.modules.get("torch._dynamo.eval_frame")  # nothing is compiled without it
    if dynamo is not None and isinstance(module, dynamo.OptimizedModule):
        inner = module._orig_mod
        return inner if isinstance(inner, nn.Module) else None
    return None


def parallel_wrapper(model: nn.Module) -> nn.Module | None:
    """The outermost `DistributedDataParallel` / `DataParallel` wrapper of `model` (looking
    through `torch.compile` wrappers), or None when it has none."""
    parallel = _parallel_types()
    m: nn.Module | None = model
    while m is not None:
        if isinstance(m, parallel):
            return m
        m = _compiled_inner(m)
    return None


def unwrap_parallel(model: nn.Module) -> nn.Module:
    """The module a data-parallel wrapper holds, through any nesting of DDP, DataParallel and
    `torch.compile` wrappers; `model` itself when it has no data-parallel wrapper.

    Example:
        >>> unwrap_parallel(DistributedDataParallel(net)) is net
        True
    """
    if parallel_wrapper(model) is None:
        return model
    parallel = _parallel_types()
    m = model
    while True:
        if isinstance(m, parallel):
            inner = m.module
            assert isinstance(inner, nn.Module)
            m = inner
            continue
        nxt = _compiled_inner(m)
        if nxt is None:
            return m
        m = nxt
