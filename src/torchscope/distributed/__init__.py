"""torchscope under `torchrun`: DDP and FSDP2 models, per-rank records, one joined answer.

Every capability accepts a `DistributedDataParallel`-wrapped model or a model sharded with
`torch.distributed.fsdp.fully_shard`. Hooks go on the modules themselves, with the same names
as on one process; each rank records locally; `gather(result)` (or `result.gather()`) brings
every rank's records to rank 0 as one `Ranked` result. torchscope communicates once per
sampled step at most, never inside a hook, and every collective it runs has a timeout.

    with torchscope.watch_gradients(model, optimizer=opt) as watch:   # model = DDP(net)
        ...
    joined = watch.gathered            # rank 0: Ranked[GradFlow]; None on other ranks

This package reads the job (`world()`, `strategy_of(model)`) and communicates; it imports no
capability. Which rank-aware numbers each capability keeps is its own business.
"""

from torchscope.distributed.comm import (
    DEFAULT_TIMEOUT_S,
    TIMEOUT_ENV,
    DistributedError,
    RankLostError,
    all_gather_tensor,
    all_reduce_sum,
    comm_device,
    gather_objects,
    timeout_s,
)
from torchscope.distributed.ranked import (
    Gatherable,
    Ranked,
    gather,
    merge_findings,
    rank_list,
    ranked_analyzer,
)
from torchscope.distributed.world import (
    STRATEGIES,
    Strategy,
    World,
    is_dtensor,
    local_tensor,
    shard_groups,
    strategy_of,
    world,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "STRATEGIES",
    "TIMEOUT_ENV",
    "DistributedError",
    "Gatherable",
    "RankLostError",
    "Ranked",
    "Strategy",
    "World",
    "all_gather_tensor",
    "all_reduce_sum",
    "comm_device",
    "gather",
    "gather_objects",
    "is_dtensor",
    "local_tensor",
    "merge_findings",
    "rank_list",
    "ranked_analyzer",
    "shard_groups",
    "strategy_of",
    "timeout_s",
    "world",
]
