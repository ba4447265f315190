"""Saturated tanh and sigmoid units: the values counted in the tails are those whose local
gradient torch's autograd gives as below 5 % of its peak (or zero); `activations.saturated`
on a tanh MLP initialised too wide, silence under Kaiming's tanh gain and at the model's
last activation."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from torchscope.capture import capture_activations
from torchscope.findings import Severity

from .._builders import makemore_mlp


def _local_grads(act: nn.Module, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(act(z), d act(z) / dz elementwise) from torch's autograd."""
    z = z.detach().requires_grad_(True)
    y = act(z)
    (g,) = torch.autograd.grad(y.sum(), z)
    return y.detach(), g


@pytest.mark.parametrize(("act", "peak"), [
    (nn.Tanh(), 1.0), (nn.Sigmoid(), 0.25), (nn.Softsign(), 1.0),
    (nn.Hardtanh(), 1.0), (nn.Hardtanh(-2.0, 0.5), 1.0), (nn.Hardsigmoid(), 1 / 6)])
def test_the_tails_are_where_autograd_s_local_gradient_is_small(
        act: nn.Module, peak: float, reduction_path: str) -> None:
    torch.manual_seed(0)
    z = torch.randn(64, 32) * 4  # (64, 32): many values past every bound
    z[:, 5] = z[:, 5].abs() + 8  # unit 5 saturated (or clipped) on every sample
    y, g = _local_grads(act, z)
    tail = g <= 0.05 * peak  # (64, 32)
    model = nn.Sequential(nn.Identity(), act, nn.Linear(32, 2))
    res = capture_activations(model, z)
    s = res.records[1].output
    assert s is not None and torch.equal(model[1](z), y) and s.shape == (64, 32)
    assert s.saturated_frac == pytest.approx(float(tail.float().mean()), abs=0.0)
    assert s.saturated_units == int(tail.all(dim=0).sum()) >= 1
    assert (s.channels, s.unit_dim) == (32, 1)


def test_a_tanh_mlp_initialised_too_wide_is_saturated_at_both_layers(reduction_path: str
                                                                     ) -> None:
    x = torch.randn(32, 30)
    res = capture_activations(makemore_mlp(5.0), x)
    found = {f.module: f for f in res.findings() if f.code == "activations.saturated"}
    assert set(found) == {"1", "3"}
    for name, f in found.items():
        assert f.severity == Severity.WARNING
        s = next(r.output for r in res.records if r.module == name)
        assert s is not None and f.evidence["saturated_frac"] == s.saturated_frac > 0.5
        assert "gain=nn.init.calculate_gain('tanh')" in f.fix


@pytest.mark.parametrize("act", [nn.Tanh, nn.Sigmoid])
def test_kaiming_s_gain_is_silent(act: type[nn.Module]) -> None:
    gain = nn.init.calculate_gain("tanh" if act is nn.Tanh else "sigmoid")
    res = capture_activations(makemore_mlp(gain, act), torch.randn(32, 30))
    assert not [f for f in res.findings() if f.code == "activations.saturated"]
    fracs = [r.output.saturated_frac for r in res.records if r.output is not None and
             r.output.saturated_frac is not None]
    assert len(fracs) == 2 and max(fracs) < 0.25


def test_the_model_s_last_activation_is_not_judged() -> None:
    # A classifier's sigmoid saturates as its predictions grow sure; a GAN generator's tanh
    # is its image. No weighted layer follows either.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Sigmoid())
    with torch.no_grad():
        model[0].weight.mul_(50)
    res = capture_activations(model, torch.randn(32, 8))
    s = res.records[-1].output
    assert s is not None and s.saturated_frac is not None and s.saturated_frac > 0.8
    assert not [f for f in res.findings() if f.code == "activations.saturated"]


def test_units_of_a_sequence_are_its_last_dim() -> None:
    # A tanh on (batch, tokens, 16) after a linear layer: a unit is saturated when it is at
    # every token of every sequence.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    with torch.no_grad():
        model[0].bias[:3] = 20.0
    x = torch.randn(4, 16, 8)  # (4, 16, 8): 16 tokens, as many as the units
    res = capture_activations(model, x)
    s = res.records[1].output
    with torch.no_grad():
        y = model[1](model[0](x))  # (4, 16, 16)
    assert s is not None and (s.unit_dim, s.channels) == (-1, 16)
    assert s.saturated_units == int((y.abs() >= math.sqrt(0.95)).all(dim=(0, 1)).sum()) == 3


@pytest.mark.parametrize("recurrent_scale", [1.0, 8.0])
def test_a_tanh_rnn_s_outputs_are_its_tanh_s(recurrent_scale: float) -> None:
    # An nn.RNN's sequence output and final state are tanh(...) themselves. With its
    # recurrent weight 8x torch's default init (an eigenvalue above 4) most hidden states
    # pin at +-1 (58 %; 22 % at 4x); at the default none do. Units are the last dim of
    # (batch, time, 64).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 32), nn.RNN(32, 64, batch_first=True))
    head = nn.Linear(64, 50)
    with torch.no_grad():
        model[1].weight_hh_l0.mul_(recurrent_scale)

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.head = model, head

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T) token ids
            out, _ = self.body(x)  # (B, T, 64)
            return self.head(out)  # (B, T, 50)

    lm = LM()
    x = torch.randint(0, 50, (8, 100))
    res = capture_activations(lm, x)
    rec = next(r for r in res.records if r.module == "body.1")
    seq, final = rec.outputs
    with torch.no_grad():
        out, h = model[1](model[0](x))  # (8, 100, 64), (1, 8, 64)
    c = math.sqrt(0.95)
    assert seq.saturated_frac == int((out.abs() >= c).sum()) / out.numel()
    assert final.saturated_frac == int((h.abs() >= c).sum()) / h.numel()
    assert (seq.unit_dim, seq.channels) == (-1, 64)
    found = [f for f in res.findings() if f.code == "activations.saturated"]
    if recurrent_scale == 1.0:
        assert seq.saturated_frac < 0.25 and not found
    else:
        (f,) = found
        assert seq.saturated_frac > 0.5 and f.severity == Severity.WARNING
        assert "nn.init.orthogonal_" in f.fix and f.module == "body.1"
