"""Where this process stands in a `torch.distributed` job, and how a model is parallelised.

Everything here reads state and changes none: no process group is created, no collective
runs. `torch.distributed` is imported only when a function needs it, so a process that never
trains distributed pays nothing for it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from torchscope.hooks.parallel import parallel_wrapper

__all__ = [
    "STRATEGIES",
    "Strategy",
    "World",
    "fsdp1_module",
    "is_dtensor",
    "local_tensor",
    "shard_groups",
    "strategy_of",
    "world",
]

Strategy = Literal["none", "ddp", "fsdp2"]
STRATEGIES: tuple[Strategy, ...] = ("none", "ddp", "fsdp2")


@dataclass(frozen=True)
class World:
    """This process's place in the job.

    Attributes:
        rank: global rank (0 without a process group).
        world_size: number of ranks (1 without a process group).
        backend: the default process group's backend (`gloo`, `nccl`), None without one.
        local_rank: rank on this machine (`LOCAL_RANK`, as torchrun sets it), else `rank`.
    """

    rank: int = 0
    world_size: int = 1
    backend: str | None = None
    local_rank: int = 0

    @property
    def distributed(self) -> bool:
        """True when a process group of more than one rank is initialised."""
        return self.world_size > 1

    def describe(self) -> str:
        """`rank 1 of 2 (gloo)`, or `one process`."""
        if self.backend is None:
            return "one process"
        return f"rank {self.rank} of {self.world_size} ({self.backend})"


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def world() -> World:
    """The `World` of this process, read from the default process group (if any)."""
    if not torch.distributed.is_available():
        return World()
    dist = _dist()
    if not dist.is_initialized():
        return World()
    rank = dist.get_rank()
    local = os.environ.get("LOCAL_RANK")
    return World(rank=rank, world_size=dist.get_world_size(), backend=str(dist.get_backend()),
                 local_rank=int(local) if local and local.isdigit() else rank)


def is_dtensor(t: Any) -> bool:
    """True for a `torch.distributed.tensor.DTensor` (FSDP2's parameters and gradients)."""
    if type(t) is torch.Tensor or type(t) is nn.Parameter:
        return False  # the common case, at every step: no import
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` this rank holds: a DTensor's local shard, any other tensor itself."""
    if is_dtensor(t):
        local: torch.Tensor = t.to_local()  # type: ignore[attr-defined]
        return local
    return t


def shard_groups(t: torch.Tensor) -> tuple[Any, ...]:
    """The process groups a DTensor is sharded over (one per sharded mesh dimension).

    A plain 1-D FSDP2 mesh gives the one group of all its ranks; HSDP's 2-D mesh
    (replicate, shard) gives only the shard group, so a sum over these groups counts each
    element once. An unsharded tensor gives none.
    """
    if not is_dtensor(t):
        return ()
    mesh = t.device_mesh  # type: ignore[attr-defined]
    return tuple(mesh.get_group(dim) for dim, p in enumerate(t.placements)  # type: ignore[attr-defined]
                 if p.is_shard() and mesh.size(dim) > 1)


def fsdp1_module(model: nn.Module) -> str | None:
    """The name of the first `FullyShardedDataParallel` (FSDP1) wrapper in `model`'s tree
    (`""` for the root), or None. FSDP1 trains flattened, sharded copies of the parameters
    (`FlatParameter`): autograd accumulates into them, not into the parameters the layers
    own, whose gradients FSDP1 sets to views of this rank's shard after backward."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.fsdp import FullyShardedDataParallel

    return next((name for name, m in model.named_modules()
                 if isinstance(m, FullyShardedDataParallel)), None)


def strategy_of(model: nn.Module) -> Strategy:
    """How `model` is parallelised: `ddp` (a `DistributedDataParallel` wrapper, possibly
    inside `torch.compile`), `fsdp2` (a module sharded with `fully_shard`, anywhere in the
    tree), else `none`."""
    if not torch.distributed.is_available():
        return "none"
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(parallel_wrapper(model), DistributedDataParallel):
        return "ddp"
    from torch.distributed.fsdp import FSDPModule

    return "fsdp2" if any(isinstance(m, FSDPModule) for m in model.modules()) else "none"
