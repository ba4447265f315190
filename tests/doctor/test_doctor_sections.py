"""Sections: activation analysis on models built to fail, the capabilities composed on one
step, registry, failure isolation."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from torchscope.capture import trace_nonfinite
from torchscope.doctor import (
    DoctorOptions,
    Section,
    get_section,
    register_section,
    run_doctor,
    section_names,
)
from torchscope.doctor.sections import _REGISTRY, ActivationsSection
from torchscope.findings import Analyzed, Finding, Severity
from torchscope.models import TinyCNN
from torchscope.report.html import leaf_records
from torchscope.step import Step


class _LogNet(nn.Module):
    """fc2 takes the log of a negative number: the first NaN comes from `log`, inside `head`."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.head = _LogHead()
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.head(self.fc1(x)))


class _LogHead(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x - 100.0)  # every element negative -> NaN


def _codes(findings: list[Finding]) -> list[str]:
    return [f.code for f in findings]


def test_nonfinite_producer_found_and_carriers_counted() -> None:
    capture = ActivationsSection().run(Step(_LogNet(), torch.randn(4, 8)), DoctorOptions())
    findings = capture.findings()
    nan = [f for f in findings if f.code == "activations.nonfinite"]
    assert len(nan) == 1 and nan[0].severity == Severity.ERROR
    assert nan[0].module == "head" and nan[0].evidence["nan"] == 32  # (4, 8) all NaN
    assert nan[0].evidence["carried_by"] == 1  # fc2 only carries it
    trace = trace_nonfinite(capture.records)
    assert trace.producer is not None and trace.producer.module == "head"


def test_constant_and_scale_drift_findings() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 8))
    with torch.no_grad():
        model[2].weight.zero_()
        model[2].bias.fill_(0.5)  # constant output
        model[3].weight.mul_(1000.0)  # std grows a lot after
    x = torch.randn(16, 8)
    capture = ActivationsSection().run(Step(model, x), DoctorOptions())
    findings = capture.findings()
    const = [f for f in findings if f.code == "activations.constant"]
    assert [f.module for f in const] == ["2"] and const[0].evidence["value"] == 0.5
    with torch.no_grad():
        out0, out3 = model[0](x), model(x)
    leaves = leaf_records(capture)
    assert [r.module for r in leaves] == ["0", "1", "2", "3"]  # the container is not a leaf
    first, last = leaves[0].output, leaves[-1].output
    assert first is not None and last is not None
    assert first.std == pytest.approx(float(out0.std()), rel=1e-5)
    drift = [f for f in findings if f.code == "activations.scale_drift"]
    assert len(drift) == 1 and drift[0].evidence["first"] == "0"
    assert drift[0].evidence["ratio"] == pytest.approx(float(out3.std() / out0.std()), rel=1e-4)


def test_sections_run_the_real_capabilities_and_their_analyzers() -> None:
    from torchscope.grads import gradient_flow, layer_norms

    torch.manual_seed(0)
    model, x = TinyCNN(), torch.randn(4, 3, 32, 32)
    report = run_doctor(model, x, options=DoctorOptions(loss_fn="sum", steps=2,
                                                        skip=frozenset({"compile"})))
    assert {o.name: o.status for o in report.outcomes} == {
        "activations": "ok", "gradients": "ok", "memory": "ok", "profile": "ok",
        "compile": "skipped", "lint": "skipped"}  # a model object: no source file to lint

    # Gradients against torch: the same loss, backward by hand.
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    want_total = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()
                                                       if p.grad is not None]))
    grads = report.outcome("gradients")
    layers = grads.data["layers"]
    assert [ly["module"] for ly in layers] == ["fc", "pool", "conv2", "relu", "conv1"]
    assert layers[-1]["grad_input_norm"] is None  # the input needs no grad
    assert grads.record.total_norm == pytest.approx(float(want_total), rel=1e-5)
    conv1 = next(ly for ly in layers if ly["module"] == "conv1")
    want_conv1 = torch.linalg.vector_norm(torch.stack(
        [model.conv1.weight.grad.norm(), model.conv1.bias.grad.norm()]))
    assert conv1["param_grad_norm"] == pytest.approx(float(want_conv1), rel=1e-5)
    model.zero_grad(set_to_none=True)
    # The findings are the capability's own, on the same step.
    flow = gradient_flow(model, x, loss_fn="sum")
    model.zero_grad(set_to_none=True)
    assert [f.code for f in grads.findings] == [f.code for f in flow.findings()]
    near, far = layer_norms(flow)[0], layer_norms(flow)[-1]
    assert report.metrics["gradients.vanishing_ratio"].value == pytest.approx(
        near[1] / far[1], rel=1e-5)
    assert report.metrics["gradients.vanishing_ratio"].label == f"{near[0]} / {far[0]} grad norm"

    # Memory: conv1 saves its input, relu its output (float32), as autograd does.
    mem = report.outcome("memory")
    saved = {m.module: m.bytes for m in mem.record.saved.modules}
    assert saved["conv1"] == x.numel() * 4
    assert saved["relu"] == 4 * 8 * 30 * 30 * 4
    assert mem.record.saved.total_bytes == sum(saved.values())
    assert mem.record.totals.parameters == 4 * sum(p.numel() for p in model.parameters())
    # TinyCNN has no block sequence to checkpoint: the step's memory stands without a plan,
    # the record says why, and no finding advises a checkpoint command that would fail.
    assert mem.record.plans is None and mem.data["plans"] == []
    assert mem.record.no_plan.startswith("TinyCNN has no nn.Sequential")
    no_plan = [f for f in mem.findings if f.code == "memory.no_plan"]
    assert len(no_plan) == 1 and no_plan[0].severity == Severity.INFO
    assert not any("--checkpoint" in f.fix for f in mem.findings)
    mem_codes = [f.code for f in mem.findings]
    assert "memory.saved_by_type" in mem_codes and all(c.startswith("memory.")
                                                       for c in mem_codes)

    # Profile: torch.profiler's counts over the steps; self times sorted; its findings.
    prof = report.outcome("profile")
    assert prof.record.steps == 2 and prof.data["steps"] == 2
    ops = {o["name"]: o for o in prof.data["ops"]}
    assert ops["aten::convolution_backward"]["calls"] == 2 * 2  # conv1, conv2
    assert ops["aten::addmm"]["calls"] == 2  # fc
    assert prof.data["ops"][0]["self_cpu_us"] == max(o["self_cpu_us"] for o in ops.values())
    mods = {m["module"]: m for m in prof.data["modules"]}
    assert mods["conv1"]["calls"] == 1 and mods["conv1"]["forward_ms"] > 0
    assert prof.data["step_ms"] is not None and prof.data["forward_ms"]
    assert prof.data["backward_ms"]
    codes = [f.code for f in prof.findings]
    assert "profiling.top_op" in codes and all(c.startswith("profiling.") for c in codes)

    # The report's findings are read like any result's: every section's, most severe first.
    assert isinstance(report, Analyzed)
    found = report.findings()
    assert sorted(found, key=repr) == sorted((f for o in report.outcomes for f in o.findings),
                                             key=repr)
    assert [int(f.severity) for f in found] == sorted((int(f.severity) for f in found),
                                                      reverse=True)
    assert [f for _, f in report.section_findings()] == found


class _Counting(nn.Module):
    """Mutates state in forward: a checkpoint's recompute sees another scale."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.relu(self.lin(x)) * self.calls


def test_memory_keeps_its_analysis_when_the_checkpoint_plan_fails_verification() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[_Counting() for _ in range(4)])
    report = run_doctor(model, torch.randn(4, 8), options=DoctorOptions(
        steps=1, skip=frozenset({"compile", "profile"})))
    mem = report.outcome("memory")
    assert mem.status == "ok" and mem.note == "" and mem.error is None
    # The chosen plan is in the record, marked failed with the reason; it is not offered.
    plans, chosen = mem.record.plans, mem.record.chosen_plan
    assert plans is not None and chosen is not None and chosen.status == "unverified"
    assert chosen.failed is not None and "checkpointing changed the result" in chosen.failed
    assert mem.record.verification is None
    assert all(p.failed is not None for p in plans.plans if p.segments)
    failed = [f for f in mem.findings if f.code == "memory.checkpoint_failed"]
    # The doctor offers the plan unasked: its failure is a note, not a warning (issue 44).
    assert len(failed) == 1 and failed[0].severity == Severity.INFO and failed[0].fix
    assert "memory.checkpoint_plan" not in [f.code for f in mem.findings]
    assert "memory.saved_by_type" in [f.code for f in mem.findings]  # the rest still stands
    assert [p["verified"] for p in mem.data["plans"] if p["blocks"]] == [False] * sum(
        1 for p in plans.plans if p.segments)


class _Boom(Section[None]):
    name = "boom"
    title = "Boom"

    def run(self, step: Step, options: DoctorOptions) -> None:
        step.model.fc.weight.data.add_(1.0)  # a section that trains must not leak
        raise RuntimeError("section bug\nsecond line")

    def to_json(self, record: None) -> dict[str, Any]:
        return {}


def test_failing_section_is_isolated_and_model_restored() -> None:
    model = TinyCNN()
    w = model.fc.weight.detach().clone()
    report = run_doctor(model, torch.randn(2, 3, 32, 32),
                        sections=[_Boom(), get_section("activations")])
    boom, acts = report.outcomes
    assert boom.status == "failed" and boom.note == "RuntimeError: section bug"
    assert isinstance(boom.error, RuntimeError) and boom.error.__traceback__ is not None
    assert acts.status == "ok"
    assert torch.equal(model.fc.weight, w)


def test_register_section_places_and_replaces() -> None:
    saved = list(_REGISTRY)
    try:
        register_section(_Boom(), before="gradients")
        assert section_names()[:2] == ["activations", "boom"]
        register_section(_Boom())  # same name: replaced in place
        assert section_names().count("boom") == 1
        with pytest.raises(KeyError):
            register_section(type("X", (_Boom,), {"name": "x"})(), before="nope")
    finally:
        _REGISTRY[:] = saved


def test_sections_are_seeded_but_the_callers_rng_state_is_restored() -> None:
    torch.manual_seed(1234)
    model, x = TinyCNN(), torch.randn(2, 3, 32, 32)
    before = torch.get_rng_state()
    report = run_doctor(model, x, sections=[get_section("activations")])
    assert report.outcomes[0].status == "ok"
    # The plain forward that checks the inputs draws nothing (TinyCNN has no dropout).
    assert torch.equal(torch.get_rng_state(), before)


def test_existing_gradients_come_back_unchanged() -> None:
    model, x = TinyCNN(), torch.randn(2, 3, 32, 32)
    model(x).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    values = {n: g.clone() for n, g in grads.items() if g is not None}
    report = run_doctor(model, x, options=DoctorOptions(fast=True),
                        sections=[get_section("profile"), get_section("gradients")])
    assert [o.status for o in report.outcomes] == ["ok", "ok"]
    for n, p in model.named_parameters():
        assert p.grad is grads[n]  # the same tensor object...
        assert torch.equal(p.grad, values[n])  # ...holding the same values
