"""The straggler analyzer on two ranks' records: a rank's own work is its mean step time
less its mean wait, so a one-off wait (start-up skew in the first step) cannot hide the
rank that is slow every step.

The records are a real single-process profile with the timing and communication of each
rank set as a two-rank DDP run would report them; the analyzer is a pure function of them.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from torchscope.distributed.ranked import Ranked
from torchscope.distributed.world import World
from torchscope.findings import Finding, Severity
from torchscope.models import TinyCNN
from torchscope.profiling import ProfileResult, profile_steps
from torchscope.profiling.analyze import comm_findings, own_ms, ranked_profile_findings
from torchscope.profiling.records import CommOp, CommTime, StepTiming


@pytest.fixture(scope="module")
def base() -> ProfileResult:
    model = TinyCNN()
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
    return profile_steps(model, x, loss_fn=F.cross_entropy, target=y,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.01), steps=3,
                         baseline_steps=0)


def _rank(base: ProfileResult, steps_ms: list[float], waits_ms: list[float], *,
          per_step: bool = False) -> ProfileResult:
    """`base` as a rank whose steps took `steps_ms`, waiting `waits_ms` in an all-reduce
    (known step by step with `per_step`, as the profiler's step ranges give them)."""
    n = len(steps_ms)
    timing = StepTiming(baseline_ms=None, profiled_ms=sorted(steps_ms)[n // 2],
                        profiled_total_ms=sum(steps_ms), baseline_steps=0, profiled_steps=n,
                        profiled_samples=tuple(steps_ms))
    exposed = sum(waits_ms) / n
    comm = CommTime(compute_ms=sum(steps_ms) / n - exposed, comm_ms=exposed + 0.1,
                    overlap_ms=0.1, exposed_ms=exposed, ops=(CommOp("all_reduce", 1.0,
                                                                      exposed + 0.1),),
                    exposed_per_step=tuple(waits_ms) if per_step else ())
    return dataclasses.replace(base, steps=n, timing=timing, comm=comm)


def _straggler(ranks: list[ProfileResult]) -> list[Finding]:
    joined = Ranked(World(0, len(ranks), "gloo"), tuple(ranks))
    return [f for f in ranked_profile_findings(joined) if f.code == "profiling.straggler"]


def test_startup_wait_does_not_hide_the_slow_rank(base: ProfileResult) -> None:
    # Rank 1 works 10 ms a step; rank 0 works 1 ms and waits 9 ms for it, every step. In
    # the first step rank 1 also waited 40 ms for rank 0 to start.
    fast = _rank(base, [50.0, 10.0, 10.0], [49.0, 9.0, 9.0])
    slow = _rank(base, [50.0, 10.0, 10.0], [40.0, 0.0, 0.0])
    assert own_ms(fast) == pytest.approx(1.0) and own_ms(slow) == pytest.approx(10.0)
    # The median step (10 ms) less the mean wait (13.3 ms) would give rank 1 no own work.
    assert slow.timing.profiled_ms - slow.comm.exposed_ms < 0  # type: ignore[union-attr]
    found = _straggler([fast, slow])
    assert len(found) == 1 and found[0].evidence["rank"] == 1
    assert found[0].evidence["ratio"] == pytest.approx(10.0)
    assert found[0].summary.startswith("rank 1 is a straggler")


def test_balanced_ranks_have_no_straggler(base: ProfileResult) -> None:
    a = _rank(base, [12.0, 10.0, 10.0], [2.0, 0.5, 0.4])
    b = _rank(base, [12.0, 10.0, 10.0], [0.3, 0.6, 0.2])
    assert _straggler([a, b]) == []


def test_a_rank_slower_in_every_step_is_a_straggler_beyond_the_noise(
        base: ProfileResult) -> None:
    fast = _rank(base, [50.0, 10.0, 10.0], [49.0, 9.0, 9.0], per_step=True)
    slow = _rank(base, [50.0, 10.0, 10.0], [40.0, 0.0, 0.0], per_step=True)
    (found,) = _straggler([fast, slow])
    assert found.evidence["rank"] == 1
    # Own work 10 ms against 1 ms in every step: the interval is 10x at both ends.
    assert (found.evidence["ratio_low"], found.evidence["ratio_high"]) == (10.0, 10.0)


def test_a_small_gap_over_three_steps_is_only_a_possible_straggler(
        base: ProfileResult) -> None:
    """Three steps a rank make the interval the samples' range (confidence 0.5): two
    balanced ranks sharing two cores put every step of one above the other's in about a
    run in ten (the doctor's --fast read 1.4-1.7x on identical ranks). A gap under 2x is
    info that says so; over five steps, or 2x in every step, it is a straggler."""
    def pair(n: int, times: float) -> list[Finding]:
        fast = _rank(base, [10.0] * n, [3.0] * n, per_step=True)  # own work 7 ms
        slow = _rank(base, [7.0 * times] * n, [0.0] * n, per_step=True)  # `times`x
        return _straggler([fast, slow])

    (maybe,) = pair(3, 1.5)
    assert maybe.severity == Severity.INFO and "may be a straggler" in maybe.summary
    assert "3 profiled steps" in maybe.summary
    (five,) = pair(5, 1.5)
    assert five.severity == Severity.WARNING and "is a straggler" in five.summary
    (wide,) = pair(3, 2.5)
    assert wide.severity == Severity.WARNING


def test_one_slow_step_is_no_straggler(base: ProfileResult) -> None:
    """Rank 1's mean own work is 1.56x rank 0's, past the 1.3x threshold, but only
    because of one 20 ms step (a pause on that rank); step by step the two overlap."""
    steady = _rank(base, [8.0, 8.0, 8.0], [2.0, 2.0, 2.0], per_step=True)
    paused = _rank(base, [22.0, 8.0, 8.0], [2.0, 4.0, 4.0], per_step=True)
    assert own_ms(paused) / own_ms(steady) > 1.3
    assert _straggler([steady, paused]) == []
    # Without the waits per step, the means alone still name it (the old judgement).
    assert len(_straggler([_rank(base, [8.0, 8.0, 8.0], [2.0, 2.0, 2.0]),
                           _rank(base, [22.0, 8.0, 8.0], [2.0, 4.0, 4.0])])) == 1


def test_exposed_communication_points_to_the_straggler_finding(base: ProfileResult) -> None:
    # Rank 0 waits 9 of its 10 ms a step. The doctor has joined the ranks already, so the
    # fix must not send its user to gather them again: it names the finding that does.
    waiting = _rank(base, [10.0, 10.0, 10.0], [9.0, 9.0, 9.0])
    (found,) = [f for f in comm_findings(waiting) if f.code == "profiling.comm_exposed"]
    assert found.severity is Severity.WARNING
    assert found.fix is not None and "profiling.straggler" in found.fix
    assert "the doctor and watch_time join them" in found.fix


def test_communication_below_the_threshold_is_told_as_info(base: ProfileResult) -> None:
    """A step that waits 1 of its 10 ms for its all-reduce (10%, under 30%): the time it
    takes is told (info), no warning; at 90% it is the warning above."""
    light = _rank(base, [10.0, 10.0, 10.0], [1.0, 1.0, 1.0])
    (found,) = comm_findings(light)
    assert found.code == "profiling.comm" and found.severity is Severity.INFO
    assert found.evidence["exposed_share"] == pytest.approx(0.1)
    assert "the step waits 1 ms of its 10 ms mean" in found.summary
    heavy = _rank(base, [10.0, 10.0, 10.0], [9.0, 9.0, 9.0])
    assert [f.code for f in comm_findings(heavy)] == ["profiling.comm_exposed"]


def test_the_straggler_ranks_before_the_wait_it_causes(base: ProfileResult) -> None:
    """Rank 0 waits 9 of its 10 ms a step for rank 1 (profiling.comm_exposed); rank 1 is
    the straggler. The cause comes first in a report: its entry explains the wait."""
    from torchscope.findings import rank

    fast = _rank(base, [50.0, 10.0, 10.0], [49.0, 9.0, 9.0], per_step=True)
    slow = _rank(base, [50.0, 10.0, 10.0], [40.0, 0.0, 0.0], per_step=True)
    waited = comm_findings(fast)
    assert [f.code for f in waited] == ["profiling.comm_exposed"]
    ranked = rank([*waited, *_straggler([fast, slow])])
    assert [f.code for f in ranked] == ["profiling.straggler", "profiling.comm_exposed"]
