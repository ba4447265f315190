"""Capture on the shared `Step` (its autocast), and `capture.findings()`: silent on a healthy
model, the NaN producer on a broken one, on any selection and over several forwards."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from torchscope.capture import (
    ActivationCapture,
    ActivationThresholds,
    capture_activations,
    watch_activations,
)
from torchscope.capture.analyze import leaf_modules
from torchscope.errors import TorchscopeError
from torchscope.findings import Analyzed, Severity
from torchscope.hooks import audit_hooks
from torchscope.models import TinyCNN
from torchscope.step import Step


class _Sqrt(nn.Module):
    """NaN wherever its input is negative."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x)


def _sqrt_net() -> nn.Module:
    return nn.Sequential(nn.Identity(), _Sqrt(), nn.Linear(4, 3))


def test_capture_with_a_step_runs_under_its_autocast() -> None:
    torch.manual_seed(0)
    model, x = TinyCNN(), torch.randn(4, 3, 16, 16)
    cap = capture_activations(Step(model, x, autocast=torch.bfloat16))
    dtypes = {r.module: r.output.dtype for r in cap.records if r.output is not None}
    assert dtypes == {"conv1": "torch.bfloat16", "relu": "torch.bfloat16",
                      "conv2": "torch.bfloat16", "pool": "torch.bfloat16",
                      "fc": "torch.bfloat16"}
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref = model(x)
    fc = cap.get("fc").output
    assert fc is not None and fc.shape == (4, 10)
    assert fc.mean == pytest.approx(ref.float().mean().item(), rel=1e-6, abs=1e-9)
    assert fc.max == ref.float().max().item()
    # Without autocast the same model records float32, from a model and its inputs.
    plain = capture_activations(model, x)
    assert plain.get("fc").output.dtype == "torch.float32"  # type: ignore[union-attr]
    assert audit_hooks(model).local_total == 0


def test_a_step_with_inputs_or_a_model_without_is_refused() -> None:
    model, x = TinyCNN(), torch.randn(1, 3, 8, 8)
    with pytest.raises(TorchscopeError, match="a Step was given together with inputs"):
        capture_activations(Step(model, x), x)
    with pytest.raises(TorchscopeError, match="without inputs"):
        capture_activations(model)
    assert audit_hooks(model).local_total == 0


def test_healthy_tiny_cnn_is_silent() -> None:
    torch.manual_seed(0)
    cap = capture_activations(TinyCNN(), torch.randn(8, 3, 32, 32))
    assert isinstance(cap, ActivationCapture) and isinstance(cap, Analyzed)
    assert cap.findings() == []
    # A few training steps in the user's loop, every module recorded: still silent.
    model = TinyCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with watch_activations(model, select=lambda n, m: True) as watched:
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            model(torch.randn(8, 3, 32, 32)).logsumexp(-1).mean().backward()
            opt.step()
    assert {r.step for r in watched.records} == {0, 1, 2}
    assert watched.findings() == []


def test_nan_producer_is_found() -> None:
    torch.manual_seed(0)
    x = torch.randn(6, 4)
    cap = capture_activations(_sqrt_net(), x)
    (f,) = [f for f in cap.findings() if f.code.startswith("activations.nonfinite")]
    assert f.code == "activations.nonfinite" and f.severity == Severity.ERROR
    assert f.module == "1" and f.evidence["carried_by"] == 1  # the Linear carries it on
    assert f.evidence["nan"] == int((x < 0).sum())
    assert cap.findings()[0] == f  # errors first


def test_nan_over_several_forwards_names_the_first_that_had_one() -> None:
    torch.manual_seed(0)
    model = _sqrt_net()
    with watch_activations(model) as cap:
        model(torch.rand(6, 4))        # forward 0: finite
        model(-torch.rand(6, 4))       # forward 1: every sqrt is NaN
        model(torch.rand(6, 4))        # forward 2: finite again
    (f,) = [f for f in cap.findings() if f.code == "activations.nonfinite"]
    assert f.evidence["step"] == 1 and f.module == "1" and f.evidence["nan"] == 24
    # The input itself non-finite: not a module's fault.
    with watch_activations(model) as bad_input:
        model(torch.full((2, 4), float("nan")))
    codes = [f.code for f in bad_input.findings()]
    assert "activations.nonfinite_input" in codes and "activations.nonfinite" not in codes


class _LogBetween(nn.Module):
    """NaN made by a plain op in the model's own forward, between two of its layers."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.lin2, self.out = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, 4) -> (N, 2)
        h = torch.relu(self.lin(x))
        h = torch.log(h - 10.0)  # every value below 10: NaN, outside any module
        return self.out(self.lin2(h))


def test_nan_made_between_modules_is_not_put_down_to_the_input() -> None:
    """The input is finite and no module made the NaN: it was said to be the input's."""
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    assert torch.isfinite(x).all()
    cap = capture_activations(_LogBetween(), x)
    codes = [f.code for f in cap.findings()]
    assert "activations.nonfinite_input" not in codes
    (f,) = [f for f in cap.findings() if f.code == "activations.nonfinite_between"]
    assert f.severity == Severity.ERROR and f.module == "lin2"
    assert f.evidence["after"] == "lin" and f.evidence["carried_by"] == 2
    assert "after lin and before lin2" in f.summary
    assert all(r.model_inputs_finite is True for r in cap.records)
    # The same model given a NaN input: that is the input's.
    bad = capture_activations(_LogBetween(), torch.full((3, 4), float("nan")))
    (g,) = [f for f in bad.findings() if f.code.startswith("activations.nonfinite")]
    assert g.code == "activations.nonfinite_input" and g.evidence["input_checked"] is True
    assert g.summary.startswith("the model's input already holds NaN/Inf")


def test_any_selection_judges_its_innermost_modules_once() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Tanh(), nn.Linear(8, 8)))
    with torch.no_grad():
        model[1][1].weight.zero_()
        model[1][1].bias.fill_(0.5)  # constant output, which the container "1" returns too
    x = torch.randn(16, 8)
    everything = capture_activations(model, x, select=lambda n, m: True)
    assert [r.module for r in everything.records] == ["0", "1.0", "1.1", "1"]
    assert leaf_modules(everything.records) == {"0", "1.0", "1.1"}
    const = [f for f in everything.findings() if f.code == "activations.constant"]
    assert [f.module for f in const] == ["1.1"] and const[0].evidence["value"] == 0.5
    # A selection of the container alone judges the container.
    only = capture_activations(model, x, select="1")
    assert [f.module for f in only.findings() if f.code == "activations.constant"] == ["1"]
    # Thresholds are the analyzer's, passed through findings().
    big = ActivationThresholds(large_abs=0.25)
    assert "activations.large" in {f.code for f in everything.findings(big)}


def test_dead_units_scale_drift_and_near_overflow() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    with torch.no_grad():
        model[0].bias[:3].fill_(-1e3)  # channels 0, 1 and 2 never fire
    dead = next(f for f in capture_activations(model, torch.randn(4, 3, 8, 8)).findings()
                if f.code == "activations.dead_units")
    assert dead.module == "1" and dead.evidence["dead"] == 3 and dead.evidence["channels"] == 4
    assert dead.evidence["values_per_channel"] == 4 * 6 * 6
    assert dead.severity == Severity.WARNING  # three quarters of the channels
    with torch.no_grad():
        model[0].bias[2].fill_(1.0)
    half = next(f for f in capture_activations(model, torch.randn(4, 3, 8, 8)).findings()
                if f.code == "activations.dead_units")
    # Half the units: what a layer whose input shrank to its biases shows; possible only.
    assert half.evidence["dead"] == 2 and half.severity == Severity.INFO
    assert half.summary.endswith("possibly a loss of capacity")
    # Seven dead of eight, but over 2 values per channel: may be chance, info.
    lin = nn.Sequential(nn.Linear(3, 8), nn.ReLU())
    with torch.no_grad():
        lin[0].bias[:7].fill_(-1e3)
    (few,) = [f for f in capture_activations(lin, torch.randn(2, 3)).findings()
              if f.code == "activations.dead_units"]
    assert few.evidence["dead"] == 7 and few.severity == Severity.INFO
    assert "(only 2 values per channel: may be chance)" in few.summary
    (many,) = [f for f in capture_activations(lin, torch.randn(8, 3)).findings()
               if f.code == "activations.dead_units"]
    assert many.severity == Severity.WARNING

    deep = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    with torch.no_grad():
        deep[2].weight.mul_(1e3)  # the last weighted layer's std grows a lot
    x = torch.randn(16, 8)
    (drift,) = [f for f in capture_activations(deep, x).findings()
                if f.code == "activations.scale_drift"]
    with torch.no_grad():
        ratio = deep(x).std() / deep[0](x).std()
    assert (drift.evidence["first"], drift.evidence["last"]) == ("0", "2")
    assert drift.evidence["ratio"] == pytest.approx(ratio.item(), rel=1e-4)
    assert capture_activations(deep, x).findings(ActivationThresholds(scale_drift=1e9)) == []

    # bfloat16 under the step's autocast: an output near its dtype's max.
    huge = nn.Sequential(nn.Linear(4, 4))
    with torch.no_grad():
        huge[0].weight.fill_(5e37)  # 2e38 out: 59% of bfloat16 max
        huge[0].bias.zero_()
    near = capture_activations(Step(huge, torch.ones(1, 4), autocast=torch.bfloat16))
    (f,) = [f for f in near.findings() if f.code == "activations.near_overflow"]
    assert f.module == "0" and f.evidence["dtype_max"] == torch.finfo(torch.bfloat16).max


def test_a_relu_output_of_mostly_zeros_without_dead_units_is_mostly_zero() -> None:
    """Every unit fires on one sample of 64 and is zero on the others: no dead unit, but
    98% zeros (torch's own count), a warning; random inputs to the same layer are
    silent."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(8))
        model[0].bias.zero_()
    x = torch.full((64, 8), -1.0)  # (64, 8)
    x[torch.arange(8), torch.arange(8)] = 1.0  # unit c fires on sample c only
    with torch.no_grad():
        zeros = float((model[1](model[0](x)) == 0).float().mean())
    found = capture_activations(model, x).findings()
    (f,) = [f for f in found if f.code == "activations.mostly_zero"]
    assert f.module == "1" and f.severity == Severity.WARNING
    assert f.evidence["zero_frac"] == pytest.approx(zeros) and zeros >= 0.95
    assert "activations.dead_units" not in [f.code for f in found]
    assert f.fix == "check the scale of the layer before it and its bias init."
    torch.manual_seed(0)
    healthy = capture_activations(model, torch.randn(64, 8)).findings()
    assert "activations.mostly_zero" not in [f.code for f in healthy]


class _LoRA(nn.Module):
    """A frozen Linear plus a low-rank update whose B starts at zero, as LoRA does."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(16, 16)
        self.lora_a = nn.Linear(16, 4, bias=False)
        self.lora_b = nn.Linear(4, 16, bias=False)
        nn.init.zeros_(self.lora_b.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.base(x) + self.lora_b(self.lora_a(x))  # (B, 16)
        return out


class _Residual(nn.Module):
    """x + BN(conv(x)), the norm's gain at zero (torchvision's `zero_init_residual`)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        nn.init.zeros_(self.bn.weight)  # its bias is zero from the start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.bn(self.conv(x))  # (B, 4, H, W)
        return out


def test_a_zero_initialised_module_is_info_not_a_constant_output_warning() -> None:
    """LoRA's B, a residual branch's last BatchNorm with its gain at zero: both output
    zeros everywhere on purpose; a warning said "a constant output carries no
    information"."""
    torch.manual_seed(0)
    model = nn.Sequential(_LoRA(), nn.Unflatten(1, (4, 2, 2)), _Residual(), nn.Flatten(),
                          nn.Linear(16, 2))
    capture = capture_activations(model, torch.randn(8, 16))
    assert capture.zero_init == frozenset({"0.lora_b", "2.bn"})
    assert capture.result().zero_init == capture.zero_init
    [const] = [f for f in capture.findings() if f.code == "activations.constant"]
    assert str(const.evidence["modules"]).split(", ") == ["0.lora_b", "2.bn"]  # one finding
    assert const.severity == Severity.INFO and const.evidence["zero_init"]
    assert const.evidence["count"] == 2 and const.evidence["value"] == 0.0
    assert not [f for f in capture.findings() if f.severity >= Severity.WARNING]
    # Trained away from zero, the same modules are judged on their outputs again.
    with torch.no_grad():
        model[0].lora_b.weight.fill_(0.1)
        model[2].bn.weight.fill_(1.0)
    again = capture_activations(model, torch.randn(8, 16))
    assert again.zero_init == frozenset()


def test_a_transformers_swin_position_bias_table_is_no_constant_output_warning() -> None:
    """Swin's relative position bias table starts at zero (transformers initialises it so),
    and the module that looks it up takes no input."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.SwinForImageClassification(transformers.SwinConfig(
        image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
        window_size=4, num_labels=10))
    capture = capture_activations(model, {"pixel_values": torch.randn(2, 3, 32, 32)})
    tables = {r.module for r in capture.records if r.module_type == "SwinRelativePositionBias"}
    assert len(tables) == 2 and capture.zero_init == tables
    assert not [f for f in capture.findings() if f.severity >= Severity.WARNING]


def _mobilevit(size: int) -> list:  # type: ignore[type-arg]
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.MobileViTForImageClassification(transformers.MobileViTConfig(
        image_size=size, num_labels=10, hidden_sizes=[32, 48, 64],
        neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 160]))
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0))
    return [f for f in capture_activations(model, {"pixel_values": x}).findings()
            if f.code == "activations.constant"]


def test_uniform_attention_at_init_is_info_and_attention_over_one_position_a_warning() -> None:
    """transformers' MobileViT at init: every attention score of its second stage is equal,
    so the attention probabilities are 1/256 everywhere, which read as a constant output to
    check. It still passes gradient to the
    scores. With a 64-pixel image the last stage attends over one patch: the softmax is 1
    whatever the scores, and the query and key projections never get a gradient."""
    [uniform] = _mobilevit(256)
    assert uniform.severity == Severity.INFO and uniform.evidence["softmax_over"] == 256
    assert "1/256" in uniform.summary and uniform.module.endswith("attention.dropout")
    small = _mobilevit(64)
    one = [f for f in small if f.severity == Severity.WARNING]
    assert len(one) == 3 and all(f.evidence["softmax_over"] == 1 for f in one)
    assert "sequence of length 1" in one[0].fix
    # A sigmoid stuck at 0.5 over a last dimension of 2 is no softmax: still a warning.
    model = nn.Sequential(nn.Linear(4, 2), nn.Sigmoid())
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.zero_()
    [stuck] = [f for f in capture_activations(model, torch.randn(3, 4)).findings()
               if f.code == "activations.constant" and f.module == "1"]
    assert stuck.severity == Severity.WARNING and "softmax_over" not in stuck.evidence
    # ...nor is a module whose name merely holds "att": `flatten` passing it on.
    named = nn.Sequential(OrderedDict(
        [("fc", model[0]), ("sigmoid", nn.Sigmoid()), ("flatten", nn.Flatten())]))
    [flat] = [f for f in capture_activations(named, torch.randn(3, 4)).findings()
              if f.code == "activations.constant" and f.module == "flatten"]
    assert flat.severity == Severity.WARNING and "softmax_over" not in flat.evidence


def _conv_bn_stack(gain: float, depth: int = 6) -> nn.Sequential:
    """`depth` conv (no bias, as before a norm) → BatchNorm → ReLU layers whose BatchNorm
    weights (γ) are all `gain`. Their eps is EfficientNet's, 1e-3: a norm layer whose input
    variance falls below it scales down what it passes on, layer after layer."""
    layers: list[nn.Module] = [nn.Conv2d(3, 8, 3, padding=1, bias=False)]
    for _ in range(depth):
        bn = nn.BatchNorm2d(8, eps=1e-3)
        nn.init.constant_(bn.weight, gain)
        layers += [bn, nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1, bias=False)]
    return nn.Sequential(*layers)


class _ZeroGammaBlock(nn.Module):
    """A residual block whose branch ends in a zero-initialised BatchNorm (Goyal et al.)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        nn.init.zeros_(self.bn.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bn(self.conv(x))  # (N, 8, H, W)


def test_scale_drift_names_the_norm_gains_that_set_it() -> None:
    torch.manual_seed(0)
    x = torch.randn(8, 3, 8, 8)
    # transformers' EfficientNet (5.x) draws its BatchNorm weights like its convs' (normal,
    # std 0.02): each BatchNorm scales the signal to about that.
    small = _conv_bn_stack(0.02)
    (drift,) = [f for f in capture_activations(small, x).findings()
                if f.code == "activations.scale_drift"]
    norms = [n for n, m in small.named_modules() if isinstance(m, nn.BatchNorm2d)]
    assert drift.evidence["ratio"] < 1e-2
    assert drift.evidence["norms_small"] == drift.evidence["norms"] == len(norms)
    assert drift.evidence["norm_onset"] == norms[0] == "1"
    with torch.no_grad():  # what the first BatchNorm outputs: its gain, 0.02
        onset = small[1](small[0](x)).std().item()
    assert f"from 1 ({onset:.2g}) on" in drift.fix and "near zero" in drift.fix
    assert "nn.init.ones_(norm.weight)" in drift.fix
    # Gains far above 1 drift no further: the next norm takes the scale back out.
    assert not [f for f in capture_activations(_conv_bn_stack(30.0), x).findings()
                if f.code == "activations.scale_drift"]
    # Healthy gains hold the scale: no drift.
    assert not [f for f in capture_activations(_conv_bn_stack(1.0), x).findings()
                if f.code == "activations.scale_drift"]
    # A drift no norm layer sets keeps the init advice. The zero-γ norm outputs a constant
    # zero: a deliberate init, not a small gain.
    off_init = nn.Sequential(_conv_bn_stack(1.0, depth=2), _ZeroGammaBlock(),
                             nn.Conv2d(8, 8, 3, padding=1, bias=False))
    with torch.no_grad():
        off_init[-1].weight.mul_(1e-4)
    (init,) = [f for f in capture_activations(off_init, x).findings()
               if f.code == "activations.scale_drift"]
    assert init.evidence["ratio"] < 1e-2 and init.evidence["norms"] == 3
    assert init.evidence["norms_small"] == 0 and init.evidence["norm_onset"] is None
    assert "check weight init" in init.fix


class _Gates(nn.Module):
    """Two squeeze-excitation-like gates, each a sigmoid over a linear layer's output."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
        self.gate = nn.ModuleList([nn.Sigmoid() for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for fc, gate in zip(self.fc, self.gate, strict=True):
            x = x * gate(fc(x))  # (N, 4)
        return x


def test_constants_of_one_kind_and_value_are_one_finding() -> None:
    torch.manual_seed(0)
    x = torch.randn(8, 4)
    model = _Gates()
    with torch.no_grad():
        for fc in model.fc:
            fc.weight.mul_(1e-30)  # gate inputs of ~1e-30: sigmoid rounds them to 0.5
            fc.bias.zero_()
    (const,) = [f for f in capture_activations(model, x).findings()
                if f.code == "activations.constant"]
    with torch.no_grad():
        assert torch.equal(model.gate[0](model.fc[0](x)), torch.full((8, 4), 0.5))
    assert const.evidence["count"] == 2 and const.evidence["value"] == 0.5
    assert const.evidence["modules"] == "gate.0, gate.1" and const.module == "gate.0"
    assert const.summary.startswith("2 Sigmoid modules (gate.0, gate.1) output the same "
                                    "value 0.5 everywhere, their value at 0")
    assert "vanishingly small" in const.fix
    # One gate pinned elsewhere (a huge bias: sigmoid(1e3) = 1) is told on its own, without
    # the value-at-0 reading; the other keeps it.
    with torch.no_grad():
        model.fc[1].bias.fill_(1e3)
    found = {f.module: f for f in capture_activations(model, x).findings()
             if f.code == "activations.constant"}
    assert set(found) == {"gate.0", "gate.1", "fc.1"}  # fc.1 outputs its bias, 1e3
    assert found["gate.0"].summary.endswith("its value at 0")
    assert found["gate.1"].evidence["value"] == 1.0 and "at_zero_input" not in \
        found["gate.1"].evidence


def _pooled_bn(running_stats: bool = True) -> nn.Sequential:
    """A conv stem pooled to 1×1, then a BatchNorm: its channels see one value per sample."""
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.AdaptiveAvgPool2d(1),
                         nn.BatchNorm2d(8, track_running_stats=running_stats),
                         nn.Flatten(), nn.Linear(8, 2))


def test_batch_norm_over_a_few_values_per_channel_is_found() -> None:
    torch.manual_seed(0)
    model = _pooled_bn()
    x = torch.randn(2, 3, 8, 8)
    (f,) = [f for f in capture_activations(model, x).findings()
            if f.code == "activations.batch_stats"]
    assert f.module == "2" and f.severity == Severity.WARNING
    assert (f.evidence["values"], f.evidence["batch"], f.evidence["layers"]) == (2, 2, 1)
    assert "over 2 values (a batch of 2 × 1 positions)" in f.summary
    assert "within ±1 exactly of zero" in f.summary
    # One position per sample (after the pool): only the batch can help.
    assert "larger inputs do not help" in f.fix
    with torch.no_grad():  # torch: over two values, each channel's outputs are ±one value
        out = model[2](model[1](model[0](x)))  # (2, 8, 1, 1), γ = 1, β = 0
    assert torch.allclose(out[0], -out[1], atol=1e-6) and float(out.abs().max()) <= 1
    # One image of 2×2 positions: 4 values, within ±sqrt(3); larger inputs would help.
    conv_bn = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8))
    one = torch.randn(1, 3, 4, 4)
    (f4,) = [f for f in capture_activations(conv_bn, one).findings()
             if f.code == "activations.batch_stats"]
    assert "over 4 values (a batch of 1 × 4 positions)" in f4.summary
    assert "within ±1.7 of zero" in f4.summary and "or larger inputs" in f4.fix
    with torch.no_grad():
        peak = float(conv_bn(one).abs().amax())  # (1, 8, 2, 2), γ = 1, β = 0
    assert 1.0 < peak <= 3 ** 0.5
    # Enough values, or running statistics in eval mode: silent.
    assert not [f for f in capture_activations(model, torch.randn(32, 3, 8, 8)).findings()
                if f.code == "activations.batch_stats"]
    model.eval()
    assert not [f for f in capture_activations(model, x).findings()
                if f.code == "activations.batch_stats"]
    # Without running statistics, a BatchNorm uses the batch's even in eval mode.
    stateless = _pooled_bn(running_stats=False).eval()
    assert [f.module for f in capture_activations(stateless, x).findings()
            if f.code == "activations.batch_stats"] == ["2"]


def test_a_sync_batch_norm_counts_the_values_of_every_rank_it_gathers() -> None:
    """SyncBatchNorm normalises over its process group's batches: 2 values here are 16 over
    8 ranks, the remedy the finding itself names. On one process it normalises locally, as
    torch's forward decides, and is read so (its multi-rank path needs GPUs: torch refuses
    CPU tensors there, so that is judged from the record)."""
    from dataclasses import replace

    from torchscope.capture.analyze import analyze_activations

    torch.manual_seed(0)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(_pooled_bn())
    assert isinstance(model[2], nn.SyncBatchNorm)
    result = capture_activations(model, torch.randn(2, 3, 8, 8)).result()
    (bn,) = [r for r in result.records if r.module == "2"]
    assert bn.batch_stats and bn.batch_ranks == 1  # no process group: local statistics
    assert [f.evidence["values"] for f in analyze_activations(result)
            if f.code == "activations.batch_stats"] == [2]
    gathered = [replace(r, batch_ranks=8) if r.module == "2" else r for r in result.records]
    assert not [f for f in analyze_activations(replace(result, records=tuple(gathered)))
                if f.code == "activations.batch_stats"]
    two = [replace(r, batch_ranks=2) if r.module == "2" else r for r in result.records]
    (f,) = [f for f in analyze_activations(replace(result, records=tuple(two)))
            if f.code == "activations.batch_stats"]
    assert f.evidence["values"] == 4 and "× 2 ranks" in f.summary


def _resnet() -> nn.Module:
    """transformers' ResNet from a small config: 16 BatchNorm layers under `resnet`."""
    from transformers import ResNetConfig, ResNetForImageClassification

    cfg = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1],
                       num_labels=10)
    return ResNetForImageClassification(cfg)


@pytest.mark.parametrize("case", ["frozen-in-training", "frozen-in-eval", "trainable"])
def test_a_backbone_frozen_by_requires_grad_alone_still_changes(case: str) -> None:
    """A ResNet backbone frozen with requires_grad_(False) and left in training mode (as the
    HF Trainer's model.train() at every step leaves it): torch moves its BatchNorm running
    statistics at each forward. In eval mode, or trained as a whole, nothing is said."""
    torch.manual_seed(0)
    model = _resnet().train()
    if case != "trainable":
        model.resnet.requires_grad_(False)
    if case == "frozen-in-eval":
        model.resnet.eval()
    bn = model.resnet.embedder.embedder.normalization
    before = bn.running_mean.clone()
    x = torch.randn(8, 3, 32, 32)
    found = [f for f in capture_activations(model, x).findings()
             if f.code == "activations.frozen_batch_norm"]
    moved = not torch.equal(before, bn.running_mean)  # torch: did the frozen part change?
    assert moved == (case != "frozen-in-eval")
    if case != "frozen-in-training":
        assert not found
        return
    (f,) = found
    assert f.severity == Severity.WARNING and f.module == "resnet"
    assert f.evidence["layers"] == 16 == sum(
        isinstance(m, nn.BatchNorm2d) for m in model.resnet.modules())
    assert "eval" in f.fix and "FrozenBatchNorm2d" in f.fix


class _TwoHeads(nn.Module):
    """Returns one head's output as it is and the other's doubled (a new tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:  # (N, 4) -> 2 x (N, 2)
        h = self.body(x)
        return {"a": self.a(h), "b": 2 * self.b(h)}


def test_the_calls_whose_output_the_model_returns_are_marked() -> None:
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    cap = capture_activations(seq, torch.randn(3, 4))
    assert [r.module for r in cap.records if r.model_output] == ["2"]
    # Through a dict, and only a tensor returned as it is: b's output is doubled after it.
    # With gradients on (a training forward), the graph tells that a feeds nothing else.
    model = _TwoHeads()
    with watch_activations(model) as two:
        model(torch.randn(3, 4))
    assert [r.module for r in two.records if r.model_output] == ["a"]
    # Under no_grad nothing tells whether a feeds b: not marked.
    assert not any(r.model_output for r in capture_activations(model, torch.randn(3, 4)).records)


class _Batch:
    """A batch passed as one object, as some loops do."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x


class _ObjectModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, batch: _Batch) -> torch.Tensor:  # batch.x: (N, 4) -> (N, 2)
        return self.b(self.a(batch.x))


def test_nan_in_an_input_held_by_an_object_is_the_input_s() -> None:
    """The input's finiteness was read from tensors and containers only: an object's NaN
    read as a finite input, and the NaN was put down to the model's own code."""
    x = torch.randn(3, 4)
    x[0, 0] = float("nan")
    cap = capture_activations(_ObjectModel(), (_Batch(x),))
    codes = [f.code for f in cap.findings() if f.code.startswith("activations.nonfinite")]
    assert codes == ["activations.nonfinite_input"]
    assert all(r.model_inputs_finite is False for r in cap.records)


class _Embedder(nn.Module):
    """Returns its logits and the embedding they are computed from, through plain code."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # (N, 4)
        feat = self.embed(x)  # (N, 8), returned and fed on
        return self.head(torch.relu(feat)), feat


def test_a_returned_tensor_that_feeds_the_others_is_not_the_model_s_output() -> None:
    """An embedding returned beside the logits made from it was marked as an output, and a
    drift of it got the fix for a head's scale."""
    torch.manual_seed(0)
    model = _Embedder()
    with watch_activations(model) as cap:
        model(torch.randn(5, 4))
    assert [r.module for r in cap.records if r.model_output] == ["head"]


class _OwnLoss(nn.Module):
    """Returns its own loss beside its logits, as transformers models given labels do."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:  # (N, 4)
        logits = self.head(torch.relu(self.body(x)))  # (N, 3)
        return {"loss": logits.square().mean(), "logits": logits}


def test_a_head_whose_logits_feed_the_model_s_own_loss_is_still_the_output() -> None:
    torch.manual_seed(0)
    model = _OwnLoss()
    with watch_activations(model) as cap:
        model(torch.randn(5, 4))
    assert [r.module for r in cap.records if r.model_output] == ["head"]


def test_forwards_that_record_nothing_keep_nothing() -> None:
    """Each forward notes where its input's finiteness is read until its records are built;
    a forward that recorded no call (its selected module not called) must not leave that
    note behind, or a long loop would grow it without bound."""
    class Unused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.lin, self.spare = nn.Embedding(10, 4), nn.Linear(4, 2), nn.ReLU()

        def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, 2)
            return self.lin(self.emb(ids))

    model = Unused()
    with watch_activations(model, select="spare") as cap:
        for _ in range(3):
            model(torch.randint(0, 10, (2, 3)))  # integer input: no finiteness to read
        assert cap._input_rows == {}
