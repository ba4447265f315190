"""Findings about ranks, from a `GradFlow` of a DDP or FSDP2 step (its `RankGrads`): pure
functions, part of `diagnose` (so `flow.findings()` says them on every rank)."""

from __future__ import annotations

import math

from torchscope.catalogue import entry
from torchscope.distributed.ranked import rank_list
from torchscope.findings import Finding, Severity
from torchscope.grads.records import GradFlow, RankGrads, disagree

__all__ = ["SKEW_RATIO", "WEIGHT_REL", "diverged_weights", "find_diverged", "find_rank_skew",
           "rank_findings"]

#: Largest / smallest per-rank local gradient norm (DDP, before the all-reduce) at or above
#: which the ranks are said to see differently distributed data.
SKEW_RATIO = 4.0
#: Relative difference of one parameter's weight norm between DDP replicas above which they
#: differ. Replicas that stepped on the same gradients are bitwise equal, but a rank may
#: read its norms with another kernel than its peer for a while (float32 `vector_norm`
#: until torchscope's native one has loaded, float64 sums after): those differ at float32's
#: rounding (5e-8 measured on an MLP), as the gradients' `RankGrads.diverged` allows for.
WEIGHT_REL = 1e-6

_RANKS_DIVERGE = entry("grads.ranks_diverge")
_RANK_SKEW = entry("grads.rank_skew")


def diverged_weights(ranks: RankGrads, rel: float = WEIGHT_REL) -> tuple[str, ...]:
    """DDP: names of the parameters whose weights differ between the replicas. Each rank's
    weight norms are in every exchange already (read at the step's end, before a watched
    loop's update), so this costs nothing more; a gradient changed on one rank after the
    all-reduce shows at the next sampled step, once the optimizer has stepped on it. Where
    the ranks were joined at the watch's end, each parameter's norm and weighted sum as it
    was then (`RankGrads.end_norms`, `end_sums`) show a change at the last step too, and
    one that keeps the norm."""
    if ranks.strategy != "ddp" or not ranks.weights:
        return ()
    out = []
    for i, name in enumerate(ranks.names):
        if disagree([row[i] for row in ranks.weights], rel, partial=False) or \
                _end_differ(ranks, i, rel):
            out.append(name)
    return tuple(out)


def _end_differ(ranks: RankGrads, i: int, rel: float) -> bool:
    if not ranks.end_norms:
        return False
    norms = [row[i] for row in ranks.end_norms]
    # A sum's terms may cancel: its rounding is judged against the norm's scale.
    scale = max((abs(v) for v in norms if v is not None and math.isfinite(v)), default=0.0)
    return disagree(norms, rel, partial=False) or \
        disagree([row[i] for row in ranks.end_sums], rel, partial=False, scale=scale)


def _per_rank(ranks: RankGrads, column: tuple[tuple[float | None, ...], ...], i: int) -> str:
    return ", ".join(f"rank {r}: {'none' if row[i] is None else f'{row[i]:.6g}'}"
                     for r, row in zip(ranks.ranks, column, strict=True))


def find_diverged(flow: GradFlow) -> list[Finding]:
    """Synchronised gradients that differ between ranks, or (DDP) weights that differ
    between the replicas: each rank's optimizer then moves its own copy of the weights, and
    the replicas drift apart silently."""
    ranks = flow.ranks
    if ranks is None:
        return []
    names = ranks.diverged()
    weights = diverged_weights(ranks) if not names else ()
    if not names and not weights:
        return []
    first = (names or weights)[0]
    i = ranks.names.index(first)
    module = next((p.module for p in flow.params if p.name == first), None)
    evidence: dict[str, float | int | str | bool | None] = {
        "params": len(names or weights), "names": ", ".join((names or weights)[:10]),
        "strategy": ranks.strategy, "step": flow.index}
    if names:
        if ranks.strategy == "ddp":
            fix = ("make every parameter that requires grad take part in every step's loss "
                   "on every rank, or pass find_unused_parameters=True to DDP (an unused "
                   "parameter stops DDP's all-reduce for the whole step); set requires_grad "
                   "before wrapping in DDP (parameters unfrozen later are never "
                   "synchronised); never change .grad on one rank only.")
        else:
            fix = ("shard every module that holds parameters with fully_shard (including the "
                   "root): FSDP2 reduces only the gradients of parameters it manages.")
        return [_RANKS_DIVERGE.finding(
            Severity.ERROR,
            f"the synchronised gradients differ between ranks for {len(names)} "
            f"parameter(s), first {first} ({_per_rank(ranks, ranks.synced, i)}): each rank "
            "steps its own weights and the replicas drift apart",
            {**evidence, "seen_in": "gradients"}, fix=fix, module=module)]
    if disagree([row[i] for row in ranks.weights], WEIGHT_REL, partial=False):
        seen = f"weight norm {_per_rank(ranks, ranks.weights, i)}"
    else:  # only as the watch ended: after the last update, or in the weighted sums
        seen = (f"at the watch's end, weight norm {_per_rank(ranks, ranks.end_norms, i)}; "
                f"weighted sum {_per_rank(ranks, ranks.end_sums, i)}")
    return [_RANKS_DIVERGE.finding(
        Severity.ERROR,
        f"the weights differ between the DDP replicas for {len(weights)} parameter(s), "
        f"first {first} ({seen}) though their "
        "synchronised gradients agree: an earlier update differed between ranks, as when "
        ".grad is changed on one rank after the all-reduce, and the replicas have drifted "
        "apart",
        {**evidence, "seen_in": "weights"},
        fix="change gradients (scale, clip, zero) the same way on every rank, between "
        "backward and optimizer.step(); and start every rank from the same weights "
        "(DDP broadcasts rank 0's when it wraps the model, not later).",
        module=module)]


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
    return [_RANK_SKEW.finding(
        Severity.INFO,
        f"{rank_list([hi_rank])}'s local gradient is {hi / lo:.1f}× "
        f"{rank_list([lo_rank])}'s before the all-reduce: the ranks see differently "
        "distributed data",
        {"high_rank": hi_rank, "high_norm": hi, "low_rank": lo_rank, "low_norm": lo,
         "ratio": hi / lo, "step": flow.index},
    )]


def rank_findings(flow: GradFlow) -> list[Finding]:
    """Every rank finding of one step (empty on one process)."""
    return find_diverged(flow) + find_rank_skew(flow)
