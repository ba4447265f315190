"""Results with a rank dimension: every rank's record of one measurement, joined on rank 0.

Each rank measures locally (hooks fill its own records); `gather(result)` (or
`result.gather()` on the records that mix in `Gatherable`) brings every rank's record to
rank 0 as one `Ranked` result, in rank order. Its `findings()` are those of the capability's
ranked analyzer (registered with `@ranked_analyzer(RecordType)`: a straggler, gradients
that differ between ranks, ...) followed by the ranks' own findings, merged: a finding every
rank made is said once, one made on some ranks only says which.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar

from torchscope.distributed.comm import gather_objects, rank_list
from torchscope.distributed.world import World, world
from torchscope.findings import Analyzed, Finding, rank

__all__ = [
    "Gatherable",
    "Ranked",
    "gather",
    "merge_findings",
    "rank_list",
    "ranked_analyzer",
]

T = TypeVar("T")
RankedAnalyzer = Callable[..., list[Finding]]
_RANKED_ANALYZERS: dict[type, RankedAnalyzer] = {}
_F = TypeVar("_F", bound=RankedAnalyzer)


def ranked_analyzer(record_type: type) -> Callable[[_F], _F]:
    """Register `fn(ranked, thresholds=None) -> list[Finding]` for `Ranked` results whose
    ranks hold `record_type` records (or subclasses)."""

    def register(fn: _F) -> _F:
        _RANKED_ANALYZERS[record_type] = fn
        return fn

    return register


def merge_findings(per_rank: Sequence[Sequence[Finding]]) -> list[Finding]:
    """One list from every rank's findings.

    Findings are matched by `(code, module)`. One that every rank made is kept once (rank
    0's wording, whose numbers are rank 0's) with `evidence["ranks"] = "all"`; one made on
    some ranks only is kept once, its summary prefixed with the ranks that made it (`on
    rank 1: ...`), with `evidence["ranks"]` listing them.
    """
    seen: dict[tuple[str, str | None], tuple[Finding, list[int]]] = {}
    for r, found in enumerate(per_rank):
        for f in found:
            key = (f.code, f.module)
            if key in seen:
                if r not in seen[key][1]:
                    seen[key][1].append(r)
            else:
                seen[key] = (f, [r])
    out = []
    for f, ranks in seen.values():
        if len(ranks) == len(per_rank):
            out.append(replace(f, evidence={**f.evidence, "ranks": "all"}))
        else:
            out.append(replace(f, summary=f"on {rank_list(ranks)}: {f.summary}",
                               evidence={**f.evidence,
                                         "ranks": ", ".join(str(x) for x in ranks)}))
    return out


@dataclass(frozen=True)
class Ranked(Analyzed, Generic[T]):
    """Every rank's record of one measurement, in rank order (index = rank).

    Attributes:
        world: the job, as the gathering rank saw it.
        results: one record per rank.
    """

    world: World
    results: tuple[T, ...]

    def __len__(self) -> int:
        return len(self.results)

    def __iter__(self) -> Iterator[T]:
        return iter(self.results)

    def __getitem__(self, rank: int) -> T:
        return self.results[rank]

    def findings(self, thresholds: Any = None) -> list[Finding]:
        """The ranked analyzer's findings, then the ranks' own findings merged (see
        `merge_findings`), most severe first.

        Args:
            thresholds: passed to the ranked analyzer and to every rank's `findings()`.
        """
        out: list[Finding] = []
        first = self.results[0] if self.results else None
        for cls in type(first).__mro__:
            fn = _RANKED_ANALYZERS.get(cls)
            if fn is not None:
                out.extend(fn(self, thresholds))
                break
        if all(isinstance(r, Analyzed) for r in self.results):
            out.extend(merge_findings([r.findings(thresholds)  # type: ignore[attr-defined]
                                       for r in self.results]))
        return rank(out)


def gather(result: T, *, timeout: float | None = None) -> Ranked[T] | None:
    """Bring every rank's `result` to rank 0 as one `Ranked` result.

    Call it on every rank, in the same order as the other collectives. Without a process
    group (or with one rank) it returns `Ranked` of this one result, so code written for
    torchrun runs unchanged on one process.

    Args:
        result: this rank's record (picklable: torchscope's records are).
        timeout: seconds to wait for the other ranks (default: `TORCHSCOPE_TIMEOUT_S`,
            else 120).

    Returns:
        The `Ranked` result on rank 0; None on every other rank.

    Raises:
        DistributedError: a rank did not join within the timeout.
    """
    w = world()
    if not w.distributed:
        return Ranked(w, (result,))
    results = gather_objects(result, timeout=timeout, what=f"gather of a "
                             f"{type(result).__name__}")
    return None if results is None else Ranked(w, tuple(results))


class Gatherable:
    """Mixin of records that can be gathered: `record.gather()` is `gather(record)`."""

    __slots__ = ()

    def gather(self, *, timeout: float | None = None) -> Ranked[Any] | None:
        """Every rank's record of this measurement on rank 0 (None on the other ranks);
        call it on every rank. See `torchscope.distributed.gather`."""
        return gather(self, timeout=timeout)
