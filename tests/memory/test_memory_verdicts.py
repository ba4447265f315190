"""The memory section's verdicts agree with each other (issue 44): a plan the user did not ask
for gives no warning, a plan that lowers nothing is never recommended, and no recompute time
is negative, in the findings, the tables, the chart or report.json."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from torchscope._timing import compare, median_interval
from torchscope.findings import Severity
from torchscope.memory import analyze_memory
from torchscope.memory.planner import recompute_cost
from torchscope.memory.records import MemoryReport, PlanReport


def _cbr(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU())


class BNCNN(nn.Module):
    """The issue's small BatchNorm CNN: 3 conv+BN+ReLU, one conv block, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(_cbr(3, 8), _cbr(8, 8), _cbr(8, 8))
        self.block = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.block(self.stem(x)))  # (B, 10)
        return out


@pytest.fixture(scope="module")
def bn_report() -> MemoryReport:
    """The doctor's memory analysis of the BatchNorm CNN: a plan it offers, unasked."""
    torch.manual_seed(0)
    return analyze_memory(BNCNN(), torch.randn(8, 3, 16, 16), checkpoint="auto",
                          proposed=True, repeats=3)


def _codes(findings: list, severity: Severity) -> list[str]:  # type: ignore[type-arg]
    return [f.code for f in findings if f.severity >= severity]


def test_a_plan_nobody_asked_for_gives_notes_not_warnings(bn_report: MemoryReport) -> None:
    # torch.utils.checkpoint runs BatchNorm's forward again in backward: its running
    # statistics are updated twice, so the verification sees the buffers differ.
    assert bn_report.verification is not None and not bn_report.verification.buffers_equal
    found = bn_report.findings()
    assert [f.severity for f in found if f.code == "memory.buffers_recomputed"] == [
        Severity.INFO]
    assert _codes(found, Severity.WARNING) == []
    # Asked for (torchscope memory --checkpoint auto), the same caveat is a warning.
    asked = replace(bn_report, proposed=False).findings()
    assert [f.severity for f in asked if f.code == "memory.buffers_recomputed"] == [
        Severity.WARNING]
    # The plan's recommendation says its caveat.
    dominate = [f for f in found if f.code == "memory.activations_dominate"]
    assert dominate and "twice" in dominate[0].fix


def test_a_healthy_model_s_offered_plan_is_silent_at_warning_level() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)])
    report = analyze_memory(model, torch.randn(16, 32), checkpoint="auto", proposed=True,
                            repeats=3)
    assert report.plans is not None and report.chosen is not None
    assert _codes(report.findings(), Severity.WARNING) == []


def _with_peak(report: MemoryReport, peak: int) -> MemoryReport:
    """`report` with its chosen plan's measured peak set to `peak`."""
    assert report.plans is not None and report.chosen is not None
    m = report.plans.measurement(report.chosen)
    plans = replace(report.plans, measurements=tuple(
        replace(x, peak_bytes=peak) if x is m else x for x in report.plans.measurements))
    return replace(report, plans=plans)


def test_a_plan_that_lowers_nothing_is_never_recommended(bn_report: MemoryReport) -> None:
    assert bn_report.plans is not None
    none = bn_report.plans.measurement("none")
    assert none is not None and none.peak_bytes > 0
    for peak, lowers in ((none.peak_bytes + 4096, False), (none.peak_bytes // 2, True)):
        found = _with_peak(bn_report, peak).findings()
        [plan] = [f for f in found if f.code == "memory.checkpoint_plan"]
        recommended = [f for f in found if "apply" in f.fix]
        assert ("lowers it by nothing" in plan.summary) == (not lowers)
        if lowers:
            assert plan.fix.startswith("torchscope.memory.apply(")
            assert any("apply the verified plan" in f.fix for f in recommended)
        else:
            # One report never says "apply the plan" beside "it lowers nothing".
            assert plan.fix == "" and recommended == []


# Step times (ms) of a plan and of no checkpointing, 5 interleaved steps each as the
# planner takes them: measured faster with the plan (noise: recompute adds work), and a
# median 20 % slower whose interval includes no difference.
_FASTER = ([9.3, 9.2, 9.4, 9.3, 9.35], [10.0, 10.1, 9.9, 10.0, 10.2])
_NOISY = ([12.0, 3.0, 25.0, 11.0, 4.0], [10.0, 20.0, 2.0, 9.0, 5.0])


def _timed(plans: PlanReport, name: str, plan_ms: list[float], none_ms: list[float]
           ) -> PlanReport:
    """`plans` with plan `name` timed as `plan_ms` against `none_ms`."""
    slowdown = compare(plan_ms, none_ms)
    cost, low, high = recompute_cost(slowdown, median_interval(none_ms).median)
    m = plans.measurement(name)
    assert m is not None
    timed = replace(m, step_ms=9.3, recompute_ms=cost, slowdown=slowdown, repeats=5,
                    recompute_low_ms=low, recompute_high_ms=high)
    return replace(plans, measurements=tuple(timed if x is m else x
                                             for x in plans.measurements))


def test_no_recompute_time_is_negative_anywhere(bn_report: MemoryReport) -> None:
    from torchscope.doctor.sections import MemorySection
    from torchscope.report.charts import label_texts
    from torchscope.report.html import memory_fragment
    from torchscope.report.plots_memory import plot_plans

    name = bn_report.chosen
    assert bn_report.plans is not None and name is not None
    for measured in bn_report.plans.measurements:  # as measured
        assert 0 <= measured.recompute_low_ms <= measured.recompute_high_ms
        assert measured.recompute_ms >= 0
    faster = replace(bn_report, plans=_timed(bn_report.plans, name, *_FASTER))
    assert faster.plans is not None
    fast = faster.plans.measurement(name)
    assert fast is not None and fast.slowdown is not None and fast.slowdown.high < 1
    assert (fast.recompute_ms, fast.recompute_low_ms, fast.recompute_high_ms) == (0, 0, 0)
    assert "no measurable cost (0.90–0.95× the step time)" in memory_fragment(faster, {})
    report = replace(bn_report, plans=_timed(bn_report.plans, name, *_NOISY))
    assert report.plans is not None
    m = report.plans.measurement(name)
    assert m is not None and m.slowdown is not None and m.slowdown.value > 1
    assert not m.recompute_measurable and m.recompute_ms > 0
    assert m.recompute_low_ms == 0.0 and m.recompute_high_ms > m.recompute_ms
    # report.json: no figure for a cost inside the noise, and its interval.
    [row] = [p for p in MemorySection().to_json(report)["plans"] if p["name"] == name]
    assert row["recompute_ms"] is None
    assert row["recompute_low_ms"] == 0.0 and row["recompute_high_ms"] == m.recompute_high_ms
    # The finding, the HTML table and the chart say the same.
    [plan] = [f for f in report.findings() if f.code == "memory.checkpoint_plan"]
    assert "no measurable cost" in plan.summary and plan.evidence["recompute_ms"] is None
    html = memory_fragment(report, {})
    assert f"no measurable cost (0–{m.recompute_high_ms:.3g} ms)" in html  # under 1 s
    legend = [t.get_text() for t in label_texts(plot_plans(report.plans))]
    chosen = [t for t in legend if t.startswith(name)]
    assert chosen and "no measurable cost" in chosen[0]
    assert not any(" -" in t or "−" in t for t in legend)
    # Each point's cost is the tables' (`recompute_cost`): hollow where it has no figure.
    from torchscope.report.memory import recompute_cost
    from torchscope.report.plots_memory import _plan_points

    hollow = []
    for pt in _plan_points(report.plans):
        for plan in (p for p in report.plans.plans if p.name in pt.names):
            ms, low, high = recompute_cost(plan, report.plans.measurement(plan.name))
            assert pt.measurable == (ms is not None), plan.name
            assert low is None or (pt.low, pt.high) == (low, high), plan.name
        if not pt.measurable:
            hollow += pt.names
    assert name in hollow


def test_a_plan_s_other_caveat_follows_the_same_policy(bn_report: MemoryReport) -> None:
    """Gradients within tolerance but not bitwise equal (nondeterministic kernels on a GPU):
    a note on an offered plan, a warning on one the user asked for."""
    assert bn_report.plans is not None and bn_report.chosen is not None
    m = bn_report.plans.measurement(bn_report.chosen)
    assert m is not None and m.verification is not None
    loose = replace(m, verification=replace(m.verification, bitwise_equal=False,
                                            max_abs_diff=2.4e-7))
    plans = replace(bn_report.plans, measurements=tuple(
        loose if x is m else x for x in bn_report.plans.measurements))
    offered = replace(bn_report, plans=plans)
    for report, severity in ((offered, Severity.INFO),
                             (replace(offered, proposed=False), Severity.WARNING)):
        found = [f for f in report.findings() if f.code == "memory.not_bitwise"]
        assert [f.severity for f in found] == [severity]
        assert "2.4e-07" in found[0].summary


def test_optimizer_state_and_live_tensors_are_notes_on_the_loop() -> None:
    from torchscope.findings import Subject
    from torchscope.memory import live_tensors

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters())
    report = analyze_memory(model, torch.randn(4, 16), optimizer=opt, measure=False)
    [state] = [f for f in report.findings() if f.code == "memory.optimizer_state"]
    assert (state.severity, state.subject) == (Severity.INFO, Subject.LOOP)
    assert "2.0× the parameters" in state.summary  # Adam's two moments
    held = torch.zeros(1 << 20)  # the largest tensor alive here  # noqa: F841
    live = live_tensors(5, device="cpu")
    [largest] = [f for f in live.findings() if f.code == "memory.largest_live"]
    assert "(1048576,) float32 (4.0 MiB)" in largest.summary
    # On CUDA, empty_cache() cannot free what live tensors hold: a warning when they hold
    # more than it released (the allocator's figures, as live_tensors reads them there).
    cuda = replace(live, reserved_before=64 << 20, reserved_after=60 << 20,
                   allocated_before=32 << 20, allocated_after=32 << 20)
    [cache] = [f for f in cuda.findings() if f.code == "memory.empty_cache"]
    assert cache.severity == Severity.WARNING and "released 4.0 MiB" in cache.summary
