"""Findings about ranks, from a `GradFlow` of a DDP or FSDP2 step (its `RankGrads`): pure
functions, part of `diagnose` (so `flow.findings()` says them on every rank)."""

from __future__ import annotations

from torchscope.distributed.ranked import rank_list
from torchscope.findings import Finding, Severity
from torchscope.grads.records import GradFlow

__all__ = ["SKEW_RATIO", "find_diverged", "find_rank_skew", "rank_findings"]

#: Largest / smallest per-rank local gradient norm (DDP, before the all-reduce) at or above
#: which the ranks are said to see differently distributed data.
SKEW_RATIO = 4.0


def find_diverged(flow: GradFlow) -> list[Finding]:
    """Synchronised gradients that differ between ranks: each rank's optimizer then moves
    its own copy of the weights, and the replicas drift apart silently."""
    ranks = flow.ranks
    if ranks is None:
        return []
    names = ranks.diverged()
    if not names:
        return []
    i = ranks.names.index(names[0])
    per_rank = ", ".join(f"rank {r}: {'none' if row[i] is None else f'{row[i]:.4g}'}"
                         for r, row in zip(ranks.ranks, ranks.synced, strict=True))
    if ranks.strategy == "ddp":
        fix = ("make every parameter that requires grad take part in every step's loss on "
               "every rank, or pass find_unused_parameters=True to DDP (an unused parameter "
               "stops DDP's all-reduce for the whole step); set requires_grad before "
               "wrapping in DDP (parameters unfrozen later are never synchronised); never "
               "change .grad on one rank only.")
    else:
        fix = ("shard every module that holds parameters with fully_shard (including the "
               "root): FSDP2 reduces only the gradients of parameters it manages.")
    return [Finding(
        code="grads.ranks_diverge",
        severity=Severity.ERROR,
        summary=f"the synchronised gradients differ between ranks for {len(names)} "
        f"parameter(s), first {names[0]} ({per_rank}): each rank steps its own weights and "
        "the replicas drift apart",
        evidence={"params": len(names), "names": ", ".join(names[:10]),
                  "strategy": ranks.strategy, "step": flow.index},
        fix=fix,
        module=next((p.module for p in flow.params if p.name == names[0]), None),
    )]


def find_rank_skew(flow: GradFlow) -> list[Finding]:
    """DDP: one rank's local gradient (before the all-reduce) is far larger than another's,
    which usually means the ranks see differently distributed data."""
    ranks = flow.ranks
    if ranks is None or ranks.strategy != "ddp":
        return []
    totals = [(r, t) for r, t in zip(ranks.ranks, ranks.local_totals(), strict=True)
              if t is not None and t > 0]
    if len(totals) < 2:
        return []
    lo_rank, lo = min(totals, key=lambda x: x[1])
    hi_rank, hi = max(totals, key=lambda x: x[1])
    if hi / lo < SKEW_RATIO:
        return []
    return [Finding(
        code="grads.rank_skew",
        severity=Severity.INFO,
        summary=f"{rank_list([hi_rank])}'s local gradient is {hi / lo:.1f}× "
        f"{rank_list([lo_rank])}'s before the all-reduce: the ranks see differently "
        "distributed data",
        evidence={"high_rank": hi_rank, "high_norm": hi, "low_rank": lo_rank, "low_norm": lo,
                  "ratio": hi / lo, "step": flow.index},
        fix="shuffle with DistributedSampler(shuffle=True) and give every rank the same "
        "batch size; per-rank norms this far apart make averaged gradients noisy.",
    )]


def rank_findings(flow: GradFlow) -> list[Finding]:
    """Every rank finding of one step (empty on one process)."""
    return find_diverged(flow) + find_rank_skew(flow)
