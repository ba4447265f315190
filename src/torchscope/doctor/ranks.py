"""The doctor's "ranks" section: every rank's records joined on rank 0, one row per rank.

In the distributed mode (`torchscope doctor --nproc N`, or under torchrun) every rank runs
the doctor's sections on its own rows of the batch; each then sends rank 0 a `RankRecords`
(its profile, gradient flow, memory report and bytes of model state). This section sets
them side by side: step time split into own work, computation and communication by kind,
gradient norms (the synchronised or global one, and the rank's own before synchronisation),
bytes per rank against the same model under DDP. Its findings: the straggler
(`torchscope.profiling`'s ranked analysis), what the sharding saves or DDP's buckets cost, and
findings that only other ranks than rank 0 made.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torchscope._util import fmt_bytes
from torchscope.catalogue import entry
from torchscope.distributed.ranked import Ranked, merge_findings
from torchscope.distributed.world import World
from torchscope.doctor.section import DoctorOptions, Section
from torchscope.errors import TorchscopeError
from torchscope.findings import Analyzed, Finding, Severity, analyzer, rank
from torchscope.grads import GradFlow
from torchscope.memory import MemoryReport, RankBytes
from torchscope.profiling import ProfileResult
from torchscope.profiling.analyze import mean_step_ms, own_ms, ranked_profile_findings
from torchscope.report.document import Metric, SectionOutcome
from torchscope.report.ranks import Column, ranks_fragment

if TYPE_CHECKING:
    from torchscope.step import Step

__all__ = ["RankRecords", "RanksRecord", "RanksSection", "ranks_findings", "ranks_outcome",
           "uneven_split"]

_KINDS = ("all_reduce", "reduce_scatter", "all_gather")
_SHARDING = entry("memory.sharding")
_DDP_BUCKETS = entry("memory.ddp_buckets")
_UNEVEN = entry("ranks.uneven_split")


@dataclass(frozen=True)
class RankRecords:
    """What one rank measured, sent to rank 0.

    Attributes:
        rank: the rank.
        profile: its profile section's record (None when that section did not run).
        grads: its gradients section's record.
        memory: its memory section's record.
        bytes: the model state it holds, against DDP's (`torchscope.memory.rank_bytes`).
        loss: the loss of its first step, on its own rows.
        findings: every finding its sections made.
        rows: the rows of the example batch it took (None: not known).
    """

    rank: int
    profile: ProfileResult | None
    grads: GradFlow | None
    memory: MemoryReport | None
    bytes: RankBytes
    loss: float | None
    findings: tuple[Finding, ...] = ()
    rows: int | None = None


@dataclass(frozen=True)
class RanksRecord(Analyzed):
    """Every rank's `RankRecords`, in rank order; `findings()` is `ranks_findings`.

    Attributes:
        world_size: ranks in the job.
        strategy: `ddp` or `fsdp2`.
        backend: the process group's backend.
        ranks: one entry per rank.
        batch_rows: rows of the whole example batch the ranks shared (None: not known).
    """

    world_size: int
    strategy: str
    backend: str
    ranks: tuple[RankRecords, ...]
    batch_rows: int | None = None

    def profiles(self) -> Ranked[ProfileResult] | None:
        """Every rank's profile, when every rank has one."""
        found = [r.profile for r in self.ranks]
        if not found or any(p is None for p in found):
            return None
        return Ranked(World(0, self.world_size, self.backend),
                      tuple(p for p in found if p is not None))


def _state_finding(record: RanksRecord) -> Finding | None:
    b = record.ranks[0].bytes
    if record.strategy == "fsdp2" and b.total:
        return _SHARDING.finding(
            Severity.INFO,
            f"FSDP2 holds {fmt_bytes(b.total)} of model state per rank (parameters, "
            f"gradients{', optimizer state' if b.optimizer_state else ''}) against "
            f"{fmt_bytes(b.replicated_total)} under DDP: {b.saving:.2f}× less",
            {"bytes": b.total, "ddp_bytes": b.replicated_total, "saving": b.saving,
             "world_size": record.world_size})
    if record.strategy == "ddp" and b.buckets:
        return _DDP_BUCKETS.finding(
            Severity.INFO,
            f"DDP keeps {fmt_bytes(b.buckets)} of gradient buckets per rank, a second copy of "
            f"the gradients ({fmt_bytes(b.total)} of model state per rank in all)",
            {"bucket_bytes": b.buckets, "bytes": b.total},
            fix="DistributedDataParallel(..., gradient_as_bucket_view=True) makes the "
            "gradients views of the buckets; FSDP2 (fully_shard) also shards the state.")
    return None


def uneven_split(record: RanksRecord) -> Finding | None:
    """A note where the ranks took different numbers of rows: DDP and FSDP2 average the
    ranks' gradients of their own mean losses, so each row on rank r weighs
    1 / (world size × rows of rank r), not 1 / rows as on one process."""
    rows = [r.rows for r in record.ranks]
    if any(n is None or n <= 0 for n in rows) or len(set(rows)) < 2:
        return None
    counts = [int(n) for n in rows if n is not None]
    n = record.world_size
    groups: dict[int, list[int]] = {}
    for r, c in enumerate(counts):
        groups.setdefault(c, []).append(r)

    def names(ranks: list[int]) -> str:
        said = [f"rank {r}'s" for r in ranks]
        return said[0] if len(said) == 1 else ", ".join(said[:-1]) + f" and {said[-1]}"

    weights = ", ".join(f"each of {names(ranks)} rows weighs 1/{n * c}"
                        for c, ranks in sorted(groups.items(), reverse=True))
    total = record.batch_rows or sum(counts)
    return _UNEVEN.finding(
        Severity.INFO,
        f"the batch of {total} rows splits {'/'.join(str(c) for c in counts)} over {n} "
        f"ranks: the ranks' gradients are averaged, so {weights} of the step, where one "
        f"process weighs every row 1/{total}",
        {"rows": "/".join(str(c) for c in counts), "batch_rows": total, "world_size": n,
         **{f"rank{r}_row_weight": 1.0 / (n * c) for r, c in enumerate(counts)}})


@analyzer(RanksRecord)
def ranks_findings(record: RanksRecord, thresholds: Any = None) -> list[Finding]:
    """Findings across ranks: the straggler, model state per rank, an uneven split of the
    batch, and what ranks other than rank 0 found that rank 0 did not (rank 0's own
    findings are in its sections)."""
    del thresholds
    out: list[Finding] = []
    profiles = record.profiles()
    if profiles is not None:
        out.extend(ranked_profile_findings(profiles))
    for extra in (_state_finding(record), uneven_split(record)):
        if extra is not None:
            out.append(extra)
    merged = merge_findings([r.findings for r in record.ranks])
    out.extend(f for f in merged
               if "0" not in str(f.evidence.get("ranks", "")).split(", ")
               and f.evidence.get("ranks") != "all")
    return rank(out)


def _row(r: RankRecords) -> dict[str, Any]:
    p, g, m, b = r.profile, r.grads, r.memory, r.bytes
    comm = p.comm if p is not None else None
    local = None
    if g is not None and g.ranks is not None and g.ranks.strategy == "ddp":
        local = g.ranks.local_totals()[g.ranks.ranks.index(r.rank)]
    ops = {o.kind: o.ms for o in comm.ops} if comm is not None else {}
    return {
        "rank": r.rank, "rows": r.rows, "loss": r.loss,
        # Means over the profiled steps, as the communication times are: step = own + waited.
        "step_ms": None if p is None else mean_step_ms(p),
        "own_ms": None if p is None else own_ms(p),
        "compute_ms": None if comm is None else comm.compute_ms,
        "comm_ms": None if comm is None else comm.comm_ms,
        "exposed_ms": None if comm is None else comm.exposed_ms,
        "comm": ops,
        "grad_norm": None if g is None else g.total_norm, "local_grad_norm": local,
        "param_bytes": b.parameters, "grad_bytes": b.gradients, "bucket_bytes": b.buckets,
        "saved_bytes": None if m is None else m.saved.total_bytes,
        "state_bytes": b.total, "ddp_state_bytes": b.replicated_total,
    }


class RanksSection(Section[RanksRecord]):
    """Every rank side by side (see the module docstring); built by the distributed runner
    from the gathered records, not run on a step."""

    name = "ranks"
    title = "Ranks"
    capability = "torchscope.distributed.gather"

    def run(self, step: Step, options: DoctorOptions) -> RanksRecord:
        raise TorchscopeError("the ranks section is built from every rank's gathered "
                              "records, not run on one step.",
                              fix="run the doctor with --nproc N, or under torchrun.")

    def metrics(self, record: RanksRecord) -> dict[str, Metric]:
        rows = [_row(r) for r in record.ranks]
        out = {"ranks.state_bytes": Metric(float(max(r["state_bytes"] for r in rows)),
                                           "lower", "bytes", "model state on the fullest rank")}
        own = [r["own_ms"] for r in rows if r["own_ms"] is not None]
        if len(own) > 1 and statistics.median(own) > 0:
            out["ranks.imbalance"] = Metric(max(own) / statistics.median(own), "lower", "x",
                                            "slowest rank's own work / median")
        waited = [r["exposed_ms"] for r in rows if r["exposed_ms"] is not None]
        if waited:
            out["ranks.waited_ms"] = Metric(max(waited), "lower", "ms",
                                            "most time a rank waited for communication")
        return out

    def to_json(self, record: RanksRecord) -> dict[str, Any]:
        return {"world_size": record.world_size, "strategy": record.strategy,
                "backend": record.backend, "ranks": [_row(r) for r in record.ranks]}

    def tables(self, record: RanksRecord) -> list[tuple[str, tuple[Column, ...],
                                                        list[list[Any]]]]:
        """The per-rank tables as (title, columns, rows): time per step, then gradients and
        memory. Columns that no rank fills (a collective that never ran; local gradient
        norms and DDP's buckets under FSDP2) are left out."""
        rows = [_row(r) for r in record.ranks]
        kinds = [k for k in _KINDS if any(k in r["comm"] for r in rows)]
        time_cols: list[tuple[Column, Any]] = [
            (("rank", "text"), "rank"), (("loss", "norm"), "loss"), (("step", "ms"), "step_ms"),
            (("own work", "ms"), "own_ms"), (("compute", "ms"), "compute_ms"),
            (("communication", "ms"), "comm_ms"), (("waited", "ms"), "exposed_ms"),
            *(((k, "ms"), ("comm", k)) for k in kinds)]
        ddp = record.strategy == "ddp"
        state_cols: list[tuple[Column, Any]] = [
            (("rank", "text"), "rank"), (("grad norm", "norm"), "grad_norm"),
            *([(("local grad norm", "norm"), "local_grad_norm")] if ddp else []),
            (("parameters", "bytes"), "param_bytes"), (("gradients", "bytes"), "grad_bytes"),
            *([(("DDP buckets", "bytes"), "bucket_bytes")] if ddp else []),
            (("saved activations", "bytes"), "saved_bytes"),
            (("model state", "bytes"), "state_bytes"),
            (("under DDP", "bytes"), "ddp_state_bytes")]

        def cell(row: dict[str, Any], key: Any) -> Any:
            return row["comm"].get(key[1]) if isinstance(key, tuple) else row[key]

        return [(title, tuple(c for c, _ in cols), [[cell(r, k) for _, k in cols] for r in rows])
                for title, cols in (("Per rank: time per step", time_cols),
                                     ("Per rank: gradients and memory", state_cols))]

    def html(self, record: RanksRecord, plots: Mapping[str, str]) -> str:
        straggler = next((f.evidence.get("rank") for f in record.findings()
                          if f.code == "profiling.straggler"), None)
        bad = [int(straggler)] if isinstance(straggler, int) else []
        caption = (f"{record.world_size} ranks, {record.strategy} over {record.backend}. Own "
                   "work is the step less the time the rank waited for communication; the "
                   "grad norm is the synchronised (DDP) or global (FSDP2) one, the local one "
                   "the rank's own before the all-reduce; under DDP is the model state every "
                   "rank would hold with DDP.")
        parts = [ranks_fragment(cols, rows, caption=caption if i == 0 else "",
                                bad_rows=bad if i == 0 else [])
                 for i, (_, cols, rows) in enumerate(self.tables(record))]
        return "".join(parts)


def ranks_outcome(record: RanksRecord, seconds: float) -> SectionOutcome:
    """The "ranks" section's outcome for a report."""
    section = RanksSection()
    return SectionOutcome(
        name=section.name, title=section.title, status="ok", seconds=seconds,
        capability=section.capability, record=record, data=section.to_json(record),
        findings=tuple(record.findings()), metrics=section.metrics(record), renderer=section)
