"""Zero-initialised layers on real adapters: peft's LoRA on a transformers Llama, and a
residual block whose last norm gain starts at zero. Their first step passes no gradient
below them by design: one info finding, not a dead-layer warning per module. A layer that
grows from zero is left out of the update ratio's median. Broken models still warn."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from torchscope.findings import Severity
from torchscope.grads import gradient_flow, watch_gradients

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


def _lora_llama(dora: bool = False) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    base = transformers.LlamaForCausalLM(cfg)
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                           target_modules=["q_proj", "v_proj"], use_dora=dora)
    return peft.get_peft_model(base, lora)


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def test_lora_first_step_is_one_info_and_exact() -> None:
    model = _lora_llama()
    batch = _batch()
    bare = copy.deepcopy(model)
    bare(**batch).loss.backward()
    flow = gradient_flow(model, batch)
    for (name, p), (_, q) in zip(model.named_parameters(), bare.named_parameters(),
                                 strict=True):
        assert (p.grad is None) == (q.grad is None), name
        assert p.grad is None or torch.equal(p.grad, q.grad), name
    found = flow.findings()
    assert not [f for f in found if f.code == "grads.dead"]
    [info] = [f for f in found if f.code == "grads.zero_init"]
    assert info.severity is Severity.INFO
    b_modules = {n for n, m in model.named_modules()
                 if n.endswith("lora_B.default") and isinstance(m, nn.Linear)}
    assert len(b_modules) == 4
    assert set(str(info.evidence["modules"]).split(", ")) == b_modules
    starved = set(str(info.evidence["starved_modules"]).split(", "))
    # Every A, and nothing outside the adapters: the base layers get gradient.
    assert {n.replace("lora_B", "lora_A") for n in b_modules} <= starved
    assert all(".lora_" in n for n in starved)


def test_dora_s_magnitude_passing_no_gradient_at_the_first_step_is_part_of_it() -> None:
    """DoRA scales the base output by magnitude / ‖W‖ - 1, which is 0 at the start, and the
    zero LoRA update by the magnitude: its magnitude module passes no gradient down. That was
    one `grads.dead` warning per adapted projection."""
    model = _lora_llama(dora=True)
    found = gradient_flow(model, _batch()).findings()
    assert not [f for f in found if f.severity >= Severity.WARNING], [f.summary for f in found]
    [info] = [f for f in found if f.code == "grads.zero_init"]
    starved = str(info.evidence["starved_modules"])
    assert starved.count("lora_magnitude_vector") >= 2 and starved.count("lora_A") == 4


def test_lora_update_ratio_leaves_out_layers_grown_from_zero(train_own_loss: Any) -> None:
    model = _lora_llama()
    batch = _batch()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    with watch_gradients(model, every=1, optimizer=opt) as watch:
        train_own_loss(model, batch, opt, 3)
    last = watch.last
    assert last is not None and last.index == 2
    b_weights = {n for n, _ in model.named_parameters() if ".lora_B." in n}
    assert set(last.from_zero) == b_weights
    # B has grown from zero for two updates: it moves by about half its norm each step.
    b_ratio = [lg.update_ratio for lg in last.layer_grads() if "lora_B" in lg.module]
    assert b_ratio and all(r is not None and r > 0.3 for r in b_ratio)
    ratios = [f for f in watch.findings() if f.code == "grads.update_ratio"]
    for f in ratios:  # judged on the A layers only
        assert f.evidence["from_zero"] == 4 and f.evidence["layers"] == 4
        assert "lora_A" in str(f.evidence["largest_module"])
        assert f.severity is Severity.INFO


def test_lora_b_read_zero_when_the_watch_opened_counts_before_the_first_sample(
        train_own_loss: Any) -> None:
    """A callback samples every 10th step: by the first sample B has had several updates and
    is no longer zero. The watch reads which parameters are zero when it opens."""
    model = _lora_llama()
    batch = _batch()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    with watch_gradients(model, every=4, start=3, optimizer=opt) as watch:
        train_own_loss(model, batch, opt, 4)
    last = watch.last
    assert last is not None and last.index == 3
    assert all(p.weight_norm for p in last.params if ".lora_B." in p.name)  # moved by now
    assert set(last.from_zero) == {n for n, _ in model.named_parameters() if ".lora_B." in n}
    assert not [f for f in watch.findings()
                if f.code == "grads.update_ratio" and "lora_B" in str(f.module)]


class _Block(nn.Module):
    """A residual block whose last norm gain starts at zero (torchvision's
    `zero_init_residual`, Goyal et al. 2017)."""

    def __init__(self, c: int = 8, zero: bool = True) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        if zero:
            nn.init.zeros_(self.bn2.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, C, H, W) -> (N, C, H, W)
        return torch.relu(x + self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x))))))


def _resnet(zero: bool) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), _Block(zero=zero), _Block(zero=zero),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


def test_zero_init_residual_is_info_and_names_the_branches() -> None:
    x = torch.randn(4, 3, 8, 8)
    flow = gradient_flow(_resnet(zero=True), x)
    found = flow.findings()
    assert not [f for f in found if f.severity >= Severity.WARNING]
    [info] = [f for f in found if f.code == "grads.zero_init"]
    assert set(str(info.evidence["modules"]).split(", ")) == {"1.bn2", "2.bn2"}
    assert set(str(info.evidence["starved_modules"]).split(", ")) == {
        f"{b}.{m}" for b in (1, 2) for m in ("conv1", "bn1", "relu", "conv2")}
    assert not [f for f in gradient_flow(_resnet(zero=False), x).findings()
                if f.code == "grads.zero_init"]


def test_a_dead_relu_after_the_residual_sum_of_a_zero_init_block_still_warns() -> None:
    """The block's own module that receives gradient and passes none down is no part of the
    zero init's explanation: only an adapter's (a named wrapper's) modules are."""
    model = _resnet(zero=True)

    class Off(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:  # every unit off
            return torch.relu(x - 1e6)

    model[1].out = Off()
    block = model[1]
    inner = block.forward
    block.forward = lambda x: block.out(inner(x))  # type: ignore[method-assign]
    found = gradient_flow(model, torch.randn(4, 3, 8, 8)).findings()
    # Block 1 gets none at all, 1.out with it: one finding for the block's six modules.
    (block,) = [f for f in found if f.code == "grads.dead" and f.module == "1"]
    assert block.evidence["modules"] == 6 and "1.out" in block.summary


def test_a_dead_layer_beside_a_zero_init_still_warns() -> None:
    model = _resnet(zero=True)
    with torch.no_grad():
        model[5].weight.zero_()  # the head passes nothing down; its bias is not zero
    found = gradient_flow(model, torch.randn(4, 3, 8, 8)).findings()
    dead = {f.module for f in found if f.code == "grads.dead"}
    assert "5" in dead and found[0].severity is Severity.WARNING
    assert not [f for f in found if f.code == "grads.zero_init"]  # nothing reaches them
