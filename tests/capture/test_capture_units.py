"""Dead units are counted over the dimension that holds them: dim 1 after a convolution,
the last dim after a linear layer on a sequence; each count against torch's own."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchscope.capture import capture_activations
from torchscope.capture.units import unit_candidates, unit_dim

from .._builders import t5_relu


def _torch_dead(out: torch.Tensor, dim: int) -> int:
    dims = [d for d in range(out.dim()) if d != dim % out.dim()]
    return int((out.amax(dim=dims) == 0).sum())


def _outputs(model: nn.Module, name: str, *inputs: object, **kw: object) -> torch.Tensor:
    seen: list[torch.Tensor] = []
    h = model.get_submodule(name).register_forward_hook(
        lambda _m, _i, o: seen.append(o.detach().clone()))
    with torch.no_grad():
        model(*inputs, **kw)
    h.remove()
    return seen[0]


def test_a_t5_feed_forward_s_dead_units_are_its_last_dim(reduction_path: str) -> None:
    # T5's feed-forward runs on (batch, tokens, d_ff); 48 of its 64 units get a zero row of
    # wi (T5 has no bias) and never fire. Counted over dim 1, the 16 token positions, none
    # was dead.
    model = t5_relu().eval()
    broken = "encoder.block.0.layer.1.DenseReluDense.act"
    with torch.no_grad():
        model.get_submodule(broken.replace(".act", ".wi")).weight[:48] = 0.0
    ids = torch.randint(0, 100, (4, 16))
    res = capture_activations(model, {"input_ids": ids, "labels": ids})
    acts = [r for r in res.records if r.module.endswith("DenseReluDense.act")]
    assert len(acts) == 4
    for r in acts:
        s = r.output
        assert s is not None and s.shape == (4, 16, 64) and s.unit_dim == -1
        want = _torch_dead(_outputs(model, r.module, input_ids=ids, labels=ids), -1)
        assert (s.dead_units, s.channels) == (want, 64)
        assert want == (48 if r.module == broken else 0)
    (dead,) = [f for f in res.findings() if f.code == "activations.dead_units"]
    assert dead.module == broken and "48 of 64 units (the last dim; 75%)" in dead.summary


class _Block(nn.Module):
    """A sequence layer whose tokens number as many as its units, beside a convolution whose
    length does too: the size alone cannot say which dim holds the units."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.conv_act = nn.ReLU()
        self.fc = nn.Linear(8, 8)
        self.fc_act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, 8, 8)
        return self.fc_act(self.fc(self.conv_act(self.conv(x))))


def test_a_square_output_takes_the_layout_of_the_layer_beside_it(reduction_path: str
                                                                   ) -> None:
    torch.manual_seed(0)
    block = _Block()
    with torch.no_grad():
        block.conv.bias[:3] = -100.0  # channels 0-2 of the convolution never fire
        block.fc.bias[5:] = -100.0  # units 5-7 of the linear layer never fire
    x = torch.randn(16, 8, 8)
    res = capture_activations(block, x)
    by = {r.module: r.output for r in res.records}
    conv, fc = by["conv_act"], by["fc_act"]
    assert conv is not None and fc is not None
    assert (conv.unit_dim, conv.dead_units) == (1, 3) == (1, _torch_dead(
        _outputs(block, "conv_act", x), 1))
    assert (fc.unit_dim, fc.dead_units) == (-1, 3) == (-1, _torch_dead(
        _outputs(block, "fc_act", x), -1))


def test_the_nearest_layer_that_fits_decides() -> None:
    # T5DenseActDense registers wi, wo, dropout, act: the nearest weighted layer before the
    # activation is wo (64 -> 32); its 32 fits neither dim of the (4, 16, 64) output, wi's
    # 64 fits the last.
    transformers = pytest.importorskip("transformers")
    cfg = transformers.T5Config(d_model=32, d_ff=64, feed_forward_proj="relu")
    ff = transformers.models.t5.modeling_t5.T5DenseActDense(cfg)
    cands = unit_candidates(ff, "act")
    assert cands[:2] == ((32, False), (64, False))
    assert unit_dim((4, 16, 64), cands) == 2
    assert unit_dim((4, 64), cands) == 1  # two dims: one and the same
    seq = nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU(), nn.Flatten(), nn.Linear(16, 10))
    assert unit_dim((2, 16, 10, 10), unit_candidates(seq, "1")) == 1
    assert unit_candidates(seq, "") == ()
    # Nothing beside it fits: dim 1, as for a convolution.
    assert unit_dim((2, 5, 7), unit_candidates(seq, "1")) == 1


class _Shared(nn.Module):
    """One ReLU shared by a ModuleList of linear layers on (batch, tokens, 16): nothing
    weighted sits beside the ReLU itself but the list."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(2)])
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, 16, 16)
        for block in self.blocks:
            x = self.act(block(x))
        return x


class _Wrapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.inner(x)
        return out


def test_layers_in_a_list_beside_it_and_above_a_wrapper_count() -> None:
    torch.manual_seed(0)
    model = _Shared()
    with torch.no_grad():
        model.blocks[0].bias[:4] = -100.0  # 4 of the first layer's 16 units never fire
    x = torch.randn(2, 16, 16)
    res = capture_activations(model, x)
    first = next(r.output for r in res.records if r.module == "act")
    with torch.no_grad():
        want = _torch_dead(model.act(model.blocks[0](x)), -1)
    assert first is not None and (first.unit_dim, first.dead_units) == (-1, want) == (-1, 4)
    seq = nn.Sequential(nn.Linear(8, 12), _Wrapped())
    assert unit_candidates(seq, "1.inner") == ((12, False),)


def test_a_long_sequential_gives_each_activation_its_nearest_layers_only() -> None:
    # A thousand (Linear, ReLU) pairs: each ReLU looks at the four layers before it and
    # the four after it, reading the parent's children once for all of them.
    model = nn.Sequential(*[m for i in range(1000) for m in (nn.Linear(8, 8 + i), nn.ReLU())])
    cache: dict[str, object] = {}
    got = unit_candidates(model, "1001", cache)  # the ReLU after Linear(8, 508)
    assert got == tuple((n, False) for n in (508, 507, 506, 505, 509, 510, 511, 512))
    assert list(cache) == [""]
    assert all(len(unit_candidates(model, str(i), cache)) <= 8 for i in range(1, 2000, 2))
