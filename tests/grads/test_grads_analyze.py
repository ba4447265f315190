"""Diagnosis: pure functions over records, with configurable thresholds."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from torchscope.errors import TorchscopeError
from torchscope.findings import Severity
from torchscope.grads import GradThresholds, diagnose, gradient_flow, layer_norms
from torchscope.grads.analyze import (
    diagnose_history,
    find_dead,
    find_exploding,
    find_nonfinite,
    find_vanishing,
)
from torchscope.grads.records import (
    INPUT_NO_GRAD,
    GradFlow,
    GradHistory,
    ModuleGradRecord,
    ParamGradRecord,
    TensorGrad,
)


def _rec(name: str, order: int, out: float, inp: float | None) -> ModuleGradRecord:
    return ModuleGradRecord(name, "Linear", 0, 0, 0, order,
                            (TensorGrad("", (4, 4), "torch.float32", out),),
                            (TensorGrad("[0]", (4, 4), "torch.float32", inp,
                                        None if inp is not None else INPUT_NO_GRAD),),
                            owns_params=True)


def _param(module: str, norm: float | None) -> ParamGradRecord:
    return ParamGradRecord(f"{module}.weight", module, (4, 4), "torch.float32", True, norm)


def _lesson_flow(fc: float = 3.16, conv2: float = 0.4, conv1: float = 0.047) -> GradFlow:
    mods = (_rec("fc", 0, fc, conv2), _rec("conv2", 1, conv2, conv1), _rec("conv1", 2, conv1, None))
    params = (_param("conv1", 0.1), _param("conv2", 0.2), _param("fc", 0.3))
    return GradFlow(0, mods, params, math.sqrt(0.01 + 0.04 + 0.09))


def test_vanishing_lesson_ratio() -> None:
    (f,) = find_vanishing(_lesson_flow())
    assert f.code == "grads.vanishing"
    assert f.summary == "conv1 receives 67× less gradient than fc"
    assert f.module == "conv1" and f.severity == Severity.WARNING
    assert math.isclose(f.evidence["ratio"], 3.16 / 0.047)
    # Configurable: a higher threshold silences it; a lower error threshold escalates it.
    assert find_vanishing(_lesson_flow(), GradThresholds(vanishing_ratio=100)) == []
    (e,) = find_vanishing(_lesson_flow(), GradThresholds(vanishing_error_ratio=50))
    assert e.severity == Severity.ERROR


def test_vanishing_param_metric() -> None:
    (f,) = find_vanishing(_lesson_flow(), GradThresholds(metric="params", vanishing_ratio=2.5))
    assert f.summary == "conv1 receives 3.0× less gradient than fc"


def test_exploding_ratio_and_total() -> None:
    (f,) = find_exploding(_lesson_flow(fc=0.01, conv2=1.0, conv1=5.0))
    assert f.summary == "conv1 receives 500× more gradient than fc"
    big = GradFlow(0, (), (_param("fc", 5e3),), 5e3)
    (g,) = find_exploding(big)
    assert g.severity == Severity.WARNING and g.module == "fc" and "5e+03" in g.summary
    (h,) = find_exploding(big, GradThresholds(exploding_error_norm=1e3))
    assert h.severity == Severity.ERROR
    assert find_exploding(big, GradThresholds(exploding_norm=1e4)) == []


def test_dead_layers() -> None:
    flow = GradFlow(0, (_rec("fc", 0, 1.0, 0.0), _rec("conv1", 1, 0.0, None)),
                    (_param("conv1", 0.0), _param("fc", 1.0)), 1.0)
    blocks, zero = find_dead(flow)
    assert blocks.module == "fc" and blocks.evidence["kind"] == "blocks"
    assert zero.code == "grads.dead" and zero.module == "conv1"
    assert zero.summary == "conv1 receives an all-zero gradient"
    assert find_dead(flow, GradThresholds(dead_norm=-1.0)) == []


def test_nonfinite_first_module_in_backward_order() -> None:
    nan = math.nan
    mods = (_rec("fc", 0, 1.0, 1.0), _rec("conv2", 1, 1.0, nan), _rec("conv1", 2, nan, None))
    flow = GradFlow(0, mods, (_param("conv1", nan), _param("fc", 1.0)), nan)
    (f,) = find_nonfinite(flow)
    assert f.module == "conv2" and f.severity == Severity.ERROR
    assert f.evidence["arrives_from_above"] is False
    assert f.evidence["nonfinite_params"] == 1
    assert diagnose(flow)[0].code == "grads.nonfinite"


def test_nonfinite_end_to_end() -> None:
    class SqrtAtZero(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + (x - x.detach()).sqrt()  # value x, gradient inf at 0

    model = nn.Sequential(nn.Linear(4, 4), SqrtAtZero(), nn.Linear(4, 2))
    flow = gradient_flow(model, torch.randn(3, 4), loss_fn="sum")
    (f,) = find_nonfinite(flow)
    assert f.module == "1"  # the first in backward order to pass NaN/Inf down
    assert f.evidence["arrives_from_above"] is False
    assert not flow.finite and not math.isfinite(flow.total_norm)


def test_history_findings() -> None:
    hist = GradHistory((0, 10, 20), ("fc",), ((1.0,), (10.0,), (math.inf,)),
                       ((1.0,), (2.0,), (3.0,)), (1.0, 500.0, math.nan))
    codes = {f.code: f for f in diagnose_history(hist)}
    assert "step 20" in codes["grads.nonfinite"].summary
    assert codes["grads.exploding"].evidence["ratio"] == 500.0
    assert diagnose_history(hist, GradThresholds(growth_ratio=1000)) == [codes["grads.nonfinite"]]


def test_healthy_flow_has_no_findings() -> None:
    assert diagnose(_lesson_flow(fc=1.0, conv2=0.9, conv1=0.8)) == []


def test_dead_layer_end_to_end() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with torch.no_grad():
        model[0].bias.fill_(-100.0)  # every ReLU unit is off: nothing flows below it
    flow = gradient_flow(model, torch.randn(5, 4), loss_fn="sum")
    dead = {f.module: f for f in find_dead(flow)}
    assert set(dead) == {"1", "0"}  # the ReLU passes zeros down; fc1 gets only zeros
    assert dead["1"].summary == "1 (ReLU) receives gradient but passes an all-zero gradient down"
    assert dead["0"].evidence["zero_params"] == 2
    assert flow.param("0.weight").norm == 0.0 and flow.param("2.bias").norm > 0


def test_unknown_metric_or_series_kind_is_a_clear_error() -> None:
    flow = GradFlow(0, (), (), 0.0)
    with pytest.raises(TorchscopeError, match=r"metric='norm' is not a gradient metric.*Fix"):
        layer_norms(flow, "norm")  # type: ignore[arg-type]
    history = GradHistory((0,), ("fc",), ((1.0,),), ((2.0,),), (2.0,))
    assert history.series("fc") == [1.0] and history.series("fc", "params") == [2.0]
    with pytest.raises(TorchscopeError, match=r"kind='param' is not a series.*Fix"):
        history.series("fc", "param")
