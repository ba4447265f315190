"""Sections: activation analysis on models built to fail, adapters, registry, failure isolation."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from torchscope.doctor import (
    DoctorOptions,
    Section,
    get_section,
    register_section,
    run_doctor,
    section_names,
)
from torchscope.doctor.sections import _REGISTRY
from torchscope.doctor.sections.activations import ActivationsSection, analyze_activations
from torchscope.findings import Finding, Severity
from torchscope.models import TinyCNN


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
    result = ActivationsSection().run(_LogNet(), torch.randn(4, 8), DoctorOptions())
    findings = analyze_activations(result)
    nan = [f for f in findings if f.code == "activations.nonfinite"]
    assert len(nan) == 1 and nan[0].severity == Severity.ERROR
    assert nan[0].module == "head" and nan[0].evidence["nan"] == 32  # (4, 8) all NaN
    assert nan[0].evidence["carried_by"] == 1  # fc2 only carries it
    assert result.trace.producer is not None and result.trace.producer.module == "head"


def test_constant_and_scale_drift_findings() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 8))
    with torch.no_grad():
        model[2].weight.zero_()
        model[2].bias.fill_(0.5)  # constant output
        model[3].weight.mul_(1000.0)  # std grows a lot after
    x = torch.randn(16, 8)
    res = ActivationsSection().run(model, x, DoctorOptions())
    findings = analyze_activations(res)
    const = [f for f in findings if f.code == "activations.constant"]
    assert [f.module for f in const] == ["2"] and const[0].evidence["value"] == 0.5
    with torch.no_grad():
        out0, out3 = model[0](x), model(x)
    first, last = res.leaf_records[0].output, res.leaf_records[-1].output
    assert first is not None and last is not None
    assert first.std == pytest.approx(float(out0.std()), rel=1e-5)
    drift = [f for f in findings if f.code == "activations.scale_drift"]
    assert len(drift) == 1 and drift[0].evidence["first"] == "0"
    assert drift[0].evidence["ratio"] == pytest.approx(float(out3.std() / out0.std()), rel=1e-4)


def test_adapters_not_available_are_reported_not_fatal(monkeypatch: pytest.MonkeyPatch) -> None:
    import torchscope.grads
    import torchscope.memory
    import torchscope.profiling

    # As on a branch where those capabilities are not merged (or an install without them).
    monkeypatch.delattr(torchscope.grads, "gradient_flow", raising=False)
    monkeypatch.delattr(torchscope.memory, "analyze_memory", raising=False)
    monkeypatch.delattr(torchscope.profiling, "profile_steps", raising=False)
    report = run_doctor(TinyCNN(), torch.randn(2, 3, 32, 32),
                        options=DoctorOptions(skip=frozenset({"compile"})))
    status = {o.name: o.status for o in report.outcomes}
    assert status == {"activations": "ok", "gradients": "unavailable", "memory": "unavailable",
                      "profile": "unavailable", "compile": "skipped"}
    for name, dotted in (("gradients", "torchscope.grads.gradient_flow"),
                         ("memory", "torchscope.memory.analyze_memory"),
                         ("profile", "torchscope.profiling.profile_steps")):
        o = report.outcome(name)
        assert o.note == f"not available: this install has no {dotted}"
        assert o.result is None and not o.findings and not o.metrics
    assert report.outcome("compile").note == "skipped by --skip"


def test_adapters_with_capabilities_fill_records_findings_and_metrics(
        fake_capabilities: None) -> None:
    report = run_doctor(TinyCNN(), torch.randn(4, 3, 32, 32),
                        options=DoctorOptions(compile_modes=("default", "max-autotune")))
    assert {o.name: o.status for o in report.outcomes} == dict.fromkeys(section_names(), "ok")
    grads = report.outcome("gradients").result
    assert [ly.module for ly in grads.layers] == ["fc", "conv2", "conv1"]
    assert grads.layers[-1].grad_input_norm is None  # conv1's input needs no grad
    assert grads.total_norm is not None and grads.total_norm > 0
    codes = [f.code for _, f in report.findings]
    assert "grads.vanishing" in codes  # fc vs conv1 over 10x on tiny-cnn
    assert "memory.checkpoint_plan" in codes and "compile.break_even" in codes
    assert "compile.graph_breaks" in codes  # the stand-in reports one break
    m = report.metrics
    assert m["gradients.vanishing_ratio"].value == pytest.approx(
        grads.layers[0].grad_output_norm / grads.layers[-1].grad_output_norm)
    assert m["compile.speedup:default"].value == pytest.approx(2.0)
    assert m["compile.speedup:default"].better == "higher"
    mem = report.outcome("memory").result
    assert [(p.name, p.blocks, p.verified) for p in mem.plans] == [
        ("none", (), True), ("sqrt", ("conv1",), True)]
    prof = report.outcome("profile").result
    assert prof.ops[0].self_cpu_us == max(o.self_cpu_us for o in prof.ops)


class _Boom(Section[None]):
    name = "boom"
    title = "Boom"

    def run(self, model: nn.Module, inputs: Any, options: DoctorOptions) -> None:
        model.fc.weight.data.add_(1.0)  # a section that trains must not leak into the next
        raise RuntimeError("section bug\nsecond line")

    def analyze(self, result: None) -> list[Finding]:
        return []

    def to_json(self, result: None) -> dict[str, Any]:
        return {}


def test_failing_section_is_isolated_and_model_restored() -> None:
    model = TinyCNN()
    w = model.fc.weight.detach().clone()
    report = run_doctor(model, torch.randn(2, 3, 32, 32),
                        sections=[_Boom(), get_section("activations")])
    boom, acts = report.outcomes
    assert boom.status == "failed" and boom.note == "RuntimeError: section bug"
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
