"""Findings about a run, on real training: silent on a healthy run; the right code at the right
module when a layer's gradient falls away, activations drift, units die, or NaN appears."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import torchscope
from torchscope.findings import Finding, Severity
from torchscope.monitoring import RunRecord

from ._models import Faulty, Gated, batches


def _run(model: nn.Module, opt: torch.optim.Optimizer, steps: int, every: int,
         after_step: Callable[[int], None] | None = None,
         before_step: Callable[[int], None] | None = None) -> RunRecord:
    data = batches(8)
    with torchscope.monitor(model, opt, every=every, out=None, memory=False) as mon:
        for i in range(steps):
            x, y = data[i % len(data)]
            if before_step is not None:
                before_step(i)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            if after_step is not None:
                with torch.no_grad():
                    after_step(i)
    assert mon.result is not None
    return mon.result


def _run_findings(record: RunRecord) -> list[Finding]:
    return [f for f in record.findings() if f.code.startswith("run.")]


def test_a_healthy_run_has_no_run_warnings() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2))
    run = _run(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), 120, 5)
    assert run.samples == 24
    loud = [f for f in _run_findings(run) if f.severity >= Severity.WARNING]
    assert not loud, [f.summary for f in loud]


def test_a_layer_whose_gradient_falls_away_is_named() -> None:
    """fc1's gradient is proportional to a gate that weight decay drives to zero; the other
    layers keep theirs."""
    torch.manual_seed(0)
    model = Gated()
    gate = [model.gate]
    rest = [p for p in model.parameters() if p is not model.gate]
    opt = torch.optim.SGD([{"params": rest}, {"params": gate, "weight_decay": 0.5}], lr=0.1)
    run = _run(model, opt, 150, 5)
    fell = [f for f in _run_findings(run) if f.code == "run.grad_fell"
            and f.severity == Severity.WARNING]
    assert [f.module for f in fell] == ["fc1"], [f.summary for f in _run_findings(run)]
    f = fell[0]
    assert f.summary.startswith("fc1's gradient fell ")
    assert f"between step {f.evidence['first_step']} and step {f.evidence['last_step']}" \
        in f.summary
    assert f.evidence["ratio"] >= 10 and f.evidence["relative_to_median"] >= 10
    assert f.evidence["first_step"] == 0 and f.evidence["last_step"] == 145


def test_activation_drift_is_reported() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    run = _run(model, torch.optim.SGD(model.parameters(), lr=0.01), 60, 4,
               after_step=lambda i: model[2].weight.mul_(1.1))
    drift = [f for f in _run_findings(run) if f.code == "run.activation_drift"
             and f.severity == Severity.WARNING]
    assert [f.module for f in drift] == ["2"]
    assert drift[0].evidence["ratio"] > 100
    assert "2's output std grew" in drift[0].summary


def test_dead_units_that_grow_are_reported() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    run = _run(model, torch.optim.SGD(model.parameters(), lr=0.01), 60, 4,
               after_step=lambda i: model[0].bias.sub_(0.05))
    dead = [f for f in _run_findings(run) if f.code == "run.dead_units"]
    assert [f.module for f in dead] == ["1"]
    assert dead[0].evidence["last_fraction"] >= 0.25
    assert dead[0].evidence["last_fraction"] - dead[0].evidence["first_fraction"] >= 0.1


@pytest.mark.parametrize("every", [1, 5])
def test_nan_onset_names_the_step_and_the_module(every: int) -> None:
    torch.manual_seed(0)
    model = Faulty()

    def shift(i: int) -> None:
        model.shift = 1.0 if i < 12 else -100.0  # log of a negative number from step 12

    run = _run(model, torch.optim.SGD(model.parameters(), lr=0.01), 20, every,
               before_step=shift)
    onset = run.onset
    assert onset.gradient_step == 12  # every step is checked, sampled or not
    assert onset.nonfinite_steps == 8
    nonfinite = [f for f in run.findings() if "nonfinite" in f.code]
    assert [f.code for f in nonfinite] == ["run.nonfinite"]  # the capabilities' give way
    f = nonfinite[0]
    assert f.severity == Severity.ERROR
    if every == 1:
        assert (onset.forward_step, onset.module, onset.module_type) == (12, "bad", "Log")
        assert f.summary == "NaN/Inf first produced by bad (Log) at step 12"
        assert f.module == "bad"
    else:
        # The first sampled forward after it: the NaN weights of fc1 now produce it.
        assert onset.forward_step == 15
        assert "first held NaN/Inf at step 12" in f.summary
        assert "at step 15" in f.summary
