"""Planner: none / all / √L / budget plans on deep-mlp, exact vs DP, budget errors."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import torchscope.memory as ckpt
from torchscope.errors import BudgetError, TorchscopeError
from torchscope.memory import analyze_memory, parse_bytes, plan_checkpointing
from torchscope.memory.planner import _costs, _search_dp, _search_exact
from torchscope.models import DeepMLP
from torchscope.step import Step


@pytest.fixture(scope="module")
def deep_report():
    torch.manual_seed(0)
    model = DeepMLP()
    x = torch.randn(32, 64)
    # The budget plan is the least measured recompute: with one timed forward per block,
    # one slow forward (a background build on the other core) made a 2-block segment
    # look cheaper than the last block alone. A median of five does not.
    return model, x, plan_checkpointing(model, x, loss_fn="sum", budget="64KB", repeats=5)


def test_sqrt_and_budget_plans_reduce_saved_bytes(deep_report) -> None:
    _, _, report = deep_report
    assert report.baseline_saved_bytes == 73_728
    none, every, sqrt, budget = (report.plan(n) for n in ("none", "all", "sqrt", "budget"))
    assert none.saved_bytes == 73_728 and none.segments == ()
    assert every.segments == tuple((i, i + 1) for i in range(8))  # the last block too
    assert every.saved_bytes == 65_536
    assert sqrt.segments == ((0, 3), (3, 6), (6, 8))  # ⌈√8⌉ = 3 blocks per segment
    assert sqrt.saved_bytes == 3 * 8_192
    assert budget.saved_bytes <= 65_536 < 73_728
    assert budget.segments == ((7, 8),)  # the cheapest way: checkpoint only the last block
    assert budget.recompute_ms < sqrt.recompute_ms
    assert report.min_feasible_bytes == 8_192


def test_every_plan_is_measured_and_verified_bitwise(deep_report) -> None:
    _, _, report = deep_report
    for plan in report.plans:
        m = report.measurement(plan.name)
        assert m is not None
        assert m.saved_bytes == plan.saved_bytes  # prediction = count with the plan applied
        if plan.segments:
            assert m.verification is not None and m.verification.bitwise_equal
    assert report.measurement("none").verification is None


def test_model_untouched_by_planning(deep_report) -> None:
    model, _, _ = deep_report
    assert not any("forward" in vars(m) for m in model.modules())
    assert all(p.grad is None for p in model.parameters())


def test_dp_matches_exhaustive_search() -> None:
    model = DeepMLP()
    x = torch.randn(32, 64)
    blocks = ckpt.resolve_blocks(model)
    costs, _, _, _ = _costs(Step(model, x, loss_fn="sum"), blocks, 1)
    for budget in (8_192, 30_000, 50_000, 65_536, 73_728):
        exact, least_e = _search_exact(costs, True, budget)
        dp, least_d = _search_dp(costs, True, budget)
        assert exact is not None and dp is not None
        e_saved, _, e_rec = costs.evaluate(exact)
        d_saved, _, d_rec = costs.evaluate(dp)
        assert e_saved <= budget and d_saved <= budget
        assert d_rec == pytest.approx(e_rec), budget
        assert least_e == least_d == 8_192


def test_unmeetable_budget_names_the_smallest_feasible_one() -> None:
    model = DeepMLP()
    with pytest.raises(BudgetError, match=r"at least 8,192 B"):
        plan_checkpointing(model, torch.randn(32, 64), loss_fn="sum", budget="1KB",
                           measure=False)


def test_parse_bytes() -> None:
    assert parse_bytes("64KB") == parse_bytes("64 KiB") == 65_536
    assert parse_bytes("2GB") == 2 * 1024**3
    assert parse_bytes("1.5MiB") == 1_572_864
    assert parse_bytes("73728") == parse_bytes(73_728) == 73_728
    for bad in ("", "12 parsecs", "-1KB", "KB"):
        with pytest.raises(BudgetError):
            parse_bytes(bad)


def test_apply_plan_is_always_verified_and_dropout_passes() -> None:
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.2), nn.ReLU())
                            for _ in range(4)]).train()
    x = torch.randn(8, 16)
    report = plan_checkpointing(model, x, measure=False, repeats=1)
    with ckpt.apply_plan(model, report.plan("sqrt"), x) as handle:
        assert handle.segments == ((0, 2), (2, 4))
        assert handle.verification is not None and handle.verification.bitwise_equal


def test_analyze_memory_auto_defaults_to_sqrt_memory(tiny_gpt2: nn.Module) -> None:
    inputs = {"input_ids": torch.randint(0, 100, (2, 16)), "use_cache": False}
    report = analyze_memory(tiny_gpt2, inputs, checkpoint="auto", repeats=1)
    assert report.plans is not None and report.chosen == "budget"
    chosen = report.plans.plan("budget")
    assert chosen.saved_bytes <= report.plans.plan("sqrt").saved_bytes
    assert chosen.saved_bytes < report.saved.total_bytes
    m = report.plans.measurement("budget")
    assert m is not None and m.verification is not None and m.verification.ok
    assert any(f.code == "memory.checkpoint_plan" for f in report.findings())
    assert report.verification is m.verification
    assert not report.plans.groupable  # GPT-2's blocks live in a ModuleList


def test_analyze_memory_verifies_the_chosen_plan_without_measuring() -> None:
    model = DeepMLP()
    report = analyze_memory(model, torch.randn(32, 64), checkpoint="sqrt", measure=False,
                            repeats=1)
    assert report.measured is None and report.plans is not None
    assert report.plans.measurements == ()
    assert report.verification is not None and report.verification.bitwise_equal
    assert len(report.verification.grads) == 16


def test_bad_plan_name_or_repeats_is_a_clear_error() -> None:
    model, x = DeepMLP(), torch.randn(2, 64)
    with pytest.raises(TorchscopeError, match=r"checkpoint='half' is not a plan.*Fix"):
        analyze_memory(model, x, checkpoint="half", measure=False)  # type: ignore[arg-type]
    with pytest.raises(TorchscopeError, match=r"repeats=0 times nothing.*Fix"):
        plan_checkpointing(model, x, repeats=0)


def _timed(report, name: str, plan_ms: list[float], none_ms: list[float]):  # type: ignore[no-untyped-def]
    """`report` with plan `name` timed as `plan_ms` against `none_ms` (interleaved steps)."""
    from dataclasses import replace

    from torchscope._timing import compare, median_interval
    from torchscope.memory.planner import recompute_cost

    m = report.measurement(name)
    slowdown = compare(plan_ms, none_ms)
    cost, low, high = recompute_cost(slowdown, median_interval(none_ms).median)
    timed = replace(m, step_ms=sorted(plan_ms)[2], recompute_ms=cost, slowdown=slowdown,
                    repeats=5, recompute_low_ms=low, recompute_high_ms=high)
    return replace(report, measurements=tuple(timed if x is m else x
                                              for x in report.measurements))


def test_a_negative_or_noisy_recompute_cost_is_no_measurable_cost(deep_report) -> None:
    from rich.console import Console

    from torchscope.report.memory import plans_table

    _, _, report = deep_report

    def summary(r) -> str:  # type: ignore[no-untyped-def]
        return next(f.summary for f in r.findings() if f.code == "memory.checkpoint_plan"
                    and f.evidence["plan"] == "sqrt")

    def table(r) -> str:  # type: ignore[no-untyped-def]
        console = Console(width=250, record=True)
        console.print(plans_table(r))
        return console.export_text()

    # The "saves 37.6 MiB at -7% step time": faster with the plan than without.
    faster = _timed(report, "sqrt", [9.3, 9.2, 9.4, 9.3, 9.35], [10.0, 10.1, 9.9, 10.0, 10.2])
    timed = faster.measurement("sqrt")
    # No negative time: a step measured faster with recompute is noise, costing nothing.
    assert (timed.recompute_ms, timed.recompute_low_ms) == (0.0, 0.0)
    assert not timed.recompute_measurable
    text = summary(faster)
    assert "at no measurable cost in step time" in text and "-7%" not in text
    assert "no measurable cost" in table(faster) and "-0." not in table(faster)
    # Slower by a median of 20 %, but inside the noise: no cost is claimed either.
    noisy = _timed(report, "sqrt", [12.0, 3.0, 25.0, 11.0, 4.0], [10.0, 20.0, 2.0, 9.0, 5.0])
    assert "at no measurable cost in step time" in summary(noisy)
    # A clear cost is stated with its interval.
    slower = _timed(report, "sqrt", [12.0, 12.1, 11.9, 12.0, 12.2], [10.0, 10.1, 9.9, 10.0, 10.2])
    assert "at +20% step time (1.17–1.23×)" in summary(slower)
    assert "+20% (1.17–1.23×)" in table(slower)


def test_a_plan_says_what_it_did_to_the_measured_peak(deep_report) -> None:
    """Saved activations given back are not always the step's peak: where the measured
    peak did not fall (it comes later, in backward), the plan says it lowers it by
    nothing; where it fell, the two peaks are given."""
    from dataclasses import replace

    _, _, report = deep_report
    none = report.measurement("none")
    assert none is not None and none.peak_bytes > 0  # measured on the CPU too

    def with_peak(peak: int) -> str:
        m = report.measurement("sqrt")
        r = replace(report, measurements=tuple(replace(x, peak_bytes=peak) if x is m else x
                                               for x in report.measurements))
        return next(f.summary for f in r.findings() if f.code == "memory.checkpoint_plan"
                    and f.evidence["plan"] == "sqrt")

    higher = with_peak(none.peak_bytes + 5_000)
    assert "measured peak" in higher and "lowers it by nothing" in higher
    lower = with_peak(none.peak_bytes // 2)
    assert "measured peak" in lower and "lowers it by nothing" not in lower


def test_measured_plans_carry_their_slowdown(deep_report) -> None:
    _, _, report = deep_report
    assert report.measurement("none").slowdown is None
    for name in ("all", "sqrt", "budget"):
        m = report.measurement(name)
        assert m is not None and m.slowdown is not None and m.repeats >= 1
        assert m.slowdown.low <= m.slowdown.value <= m.slowdown.high
        assert m.slowdown.n_a == m.slowdown.n_b == m.repeats
    for f in report.findings():
        if f.code == "memory.checkpoint_plan":
            assert " at -" not in f.summary  # a cost is never negative


def test_a_torchscript_block_is_no_block_to_plan(
        scripted_part: Callable[[int], nn.Module]) -> None:
    """A scripted child takes no hook: as a block, the planner's input hooks raised
    `register_forward_pre_hook is not supported on ScriptModules`."""
    model = nn.Sequential(scripted_part(16),
                          *(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3)))
    assert ckpt.resolve_blocks(model).names == ("1", "2", "3")
    assert not ckpt.resolve_blocks(model).groupable  # "0" sits between them and the loop
    report = analyze_memory(model, torch.randn(8, 16, requires_grad=True), loss_fn="sum",
                            checkpoint="auto")
    assert report.saved.total_bytes > 0
    assert report.chosen_plan is not None
