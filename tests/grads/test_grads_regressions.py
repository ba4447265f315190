"""Defect 1 of issue 12: false gradient alarms on healthy, freshly initialised models.

The old diagnosis compared raw L2 norms of the layer nearest the loss and the farthest one
("conv1 receives 129x less gradient than fc" on the demo's tiny-cnn; "transformer.wte
receives 13x more gradient than lm_head" on GPT-2; 19x on LLaMA; "add normalization" for a
conv already followed by BatchNorm). Each case now stays silent or is worded correctly.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from torchscope.findings import Severity
from torchscope.grads import GradFlow, gradient_flow, layer_norms
from torchscope.models.zoo import BUILTINS
from torchscope.step import Step


def _alarms(flow) -> list[str]:
    return [f"{f.code}: {f.summary}" for f in flow.findings() if f.severity >= Severity.WARNING]


def test_demo_tiny_cnn_is_silent_while_its_raw_ratio_is_still_129x() -> None:
    b = BUILTINS["tiny-cnn"]
    model = b.build()
    flow = gradient_flow(Step(model, b.example_input()))  # the demo's step
    (near, n_near), (far, n_far) = layer_norms(flow)[0], layer_norms(flow)[-1]
    # The measurement the old alarm was made of is unchanged...
    assert (near, far) == ("fc", "conv1") and n_near / n_far > 100
    # ...and is no longer an alarm: three layers hold no trend.
    assert _alarms(flow) == []
    assert not any("less gradient" in f.summary for f in flow.findings())
    model.zero_grad(set_to_none=True)


def test_gpt2_and_llama_are_silent(tiny_gpt2) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    cfg = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    for model in (tiny_gpt2, LlamaForCausalLM(cfg)):
        flow = gradient_flow(model, {"input_ids": ids, "labels": ids})
        assert _alarms(flow) == [], type(model).__name__
        assert not [f for f in flow.findings() if f.code in ("grads.exploding",
                                                               "grads.vanishing")]
        model.zero_grad(set_to_none=True)
    # GPT-2's lm_head is named as tied, not shown without a gradient.
    flow = gradient_flow(tiny_gpt2, {"input_ids": ids, "labels": ids})
    head = flow.param("lm_head.weight")
    assert head.tied_to == "transformer.wte.weight" and head.norm is not None
    tiny_gpt2.zero_grad(set_to_none=True)


def _conv_bn(act: type[nn.Module], gain: float) -> nn.Sequential:
    layers: list[nn.Module] = []
    channels = 3
    for _ in range(8):
        layers += [nn.Conv2d(channels, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), act()]
        channels = 16
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
    with torch.no_grad():
        for m in model:
            if isinstance(m, nn.BatchNorm2d):
                m.weight.fill_(gain)
    return model


def test_conv_bn_is_not_told_to_add_normalization() -> None:
    x = torch.randn(4, 3, 16, 16)
    healthy = _conv_bn(nn.ReLU, 1.0)
    assert _alarms(gradient_flow(healthy, x)) == []
    # BatchNorm gains started at 0.1 in front of sigmoids: gradients do vanish; the fix
    # fits the model (it has normalization and saturating activations).
    broken = _conv_bn(nn.Sigmoid, 0.1)
    (f,) = [f for f in gradient_flow(broken, x).findings() if f.code == "grads.vanishing"]
    assert f.severity == Severity.WARNING and f.module == "0"
    assert "add normalization" not in f.fix
    assert "replace the saturating Sigmoid" in f.fix and "gain" in f.fix
    for m in (healthy, broken):
        m.zero_grad(set_to_none=True)


def _mobilenet_v2(kaiming: bool) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    from transformers import MobileNetV2Config, MobileNetV2ForImageClassification

    torch.manual_seed(0)
    model = MobileNetV2ForImageClassification(MobileNetV2Config(
        image_size=64, depth_multiplier=0.35, num_labels=10))
    if kaiming:  # torchvision's init for its MobileNetV2
        for m in model.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
    g = torch.Generator().manual_seed(0)
    return model, {"pixel_values": torch.randn(4, 3, 64, 64, generator=g),
                   "labels": torch.randint(0, 10, (4,), generator=g)}


def test_a_batch_norm_network_with_a_small_init_is_told_to_raise_it_not_lower_it() -> None:
    """transformers' MobileNetV2 initialises its convolutions with std 0.02, 10x below
    1/sqrt(fan_in). Behind BatchNorm a weight's scale cancels in the forward and its gradient
    grows as it shrinks: the gradients do grow toward the input (the relative gradient 300x
    and more), and the fix said to lower the init scale, which makes it worse."""
    model, inputs = _mobilenet_v2(kaiming=False)
    [f] = [f for f in gradient_flow(model, inputs).findings() if f.code == "grads.exploding"]
    assert f.severity == Severity.WARNING
    assert "raise the init scale, not lower it" in f.fix and "10× below" in f.fix
    assert "kaiming_normal_" in f.fix
    # With torchvision's init the same network is silent.
    model, inputs = _mobilenet_v2(kaiming=True)
    assert _alarms(gradient_flow(model, inputs)) == []


def test_a_large_init_is_told_by_how_much_to_lower_it() -> None:
    """Eight ReLU layers with std-1 weights, fan_in 32: 5.7x std 1/sqrt(fan_in)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(32, 32), nn.ReLU()]
    model = nn.Sequential(*layers)
    with torch.no_grad():
        for m in model:
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=1.0)
    [f] = [f for f in gradient_flow(model, torch.randn(4, 32)).findings()
           if f.code == "grads.exploding"]
    assert "lower the init scale: the layers' weights are 6× std 1/sqrt(fan_in)" in f.fix
    assert "add normalization layers" in f.fix


def test_query_and_key_of_an_attention_over_one_position_are_told_why_they_get_nothing(
        ) -> None:
    """transformers' MobileViT given 64-pixel images attends over one patch in its last
    stage: the softmax is 1 whatever the scores, so the query and key projections of its
    three attention layers get an all-zero gradient. That was six findings, whose fix
    spoke of dead ReLUs, zero branches and masks first; it is one, with that cause."""
    from transformers import MobileViTConfig, MobileViTForImageClassification

    torch.manual_seed(0)
    model = MobileViTForImageClassification(MobileViTConfig(
        image_size=64, num_labels=10, hidden_sizes=[32, 48, 64],
        neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 160]))
    g = torch.Generator().manual_seed(0)
    flow = gradient_flow(model, {"pixel_values": torch.randn(2, 3, 64, 64, generator=g),
                                 "labels": torch.randint(0, 10, (2,), generator=g)})
    [dead] = [f for f in flow.findings() if f.code == "grads.dead"]
    assert dead.evidence["kind"] == "no_score_gradient"
    assert (dead.evidence["modules"], dead.evidence["layers"]) == (6, 3)
    assert "3 attention layers in mobilevit.encoder.layer.4.transformer" in dead.summary
    assert "softmax over one position" in dead.fix and "64-pixel" in dead.fix
    # Exactly what the records say: queries and keys zero, their values not.
    for r in flow.modules:
        leaf = r.module.rsplit(".", 1)[-1]
        if leaf in ("query", "key", "value") and "encoder.layer.4" in r.module:
            assert (r.output_norm == 0) == (leaf != "value"), r.module


def test_an_attention_bias_table_over_one_position_is_not_put_down_to_a_zero_input(
        ) -> None:
    """transformers' LeViT given 64-pixel images ends on a 1×1 map: its last attention's
    softmax runs over one position, so the bias table it adds to the scores (its own
    parameter) gets exactly zero. That read as "their inputs are all zero", which only
    holds for a leaf applying its parameters to its input; its input is not zero."""
    from transformers import LevitConfig, LevitForImageClassification

    torch.manual_seed(0)
    model = LevitForImageClassification(LevitConfig(
        image_size=64, hidden_sizes=[32, 48, 64], num_attention_heads=[1, 2, 2],
        depths=[1, 1, 1], key_dim=[8, 8, 8], num_labels=10))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 64, 64, generator=g)
    name = "levit.encoder.stages.2.layers.0.module"
    seen: list[torch.Tensor] = []
    handle = model.get_submodule(name).register_forward_hook(
        lambda _m, args, _o: seen.append(args[0].detach()))
    flow = gradient_flow(model, {"pixel_values": x,
                                 "labels": torch.randint(0, 10, (4,), generator=g)})
    handle.remove()
    assert seen[0].shape[1] == 1 and seen[0].norm() > 0  # one position, not zero
    [dead] = [f for f in flow.findings() if f.code == "grads.dead"]
    assert dead.module == name and dead.evidence["kind"] == "zero"
    assert dead.evidence["params"] == f"{name}.attention_biases"
    assert "own parameters" in dead.summary and "softmax runs over one element" in dead.fix
    assert "inputs are all zero" not in dead.fix


def test_a_part_of_the_model_that_gets_no_gradient_is_one_finding_at_its_top() -> None:
    """transformers' CvT with a class token in its last stage: the head reads that token
    alone, and in the last layer the convolutional query projection makes only the other
    positions' queries, so it gets exactly zero (a convolution, its BatchNorm and a
    reshape). That was three warnings; it is one, at the projection, whose fix names an
    output the loss reads no element of."""
    from transformers import CvtConfig, CvtForImageClassification

    torch.manual_seed(0)
    model = CvtForImageClassification(CvtConfig(
        embed_dim=[16, 32], num_heads=[1, 2], depth=[1, 2], patch_sizes=[7, 3],
        patch_stride=[4, 2], patch_padding=[2, 1], mlp_ratio=[2.0, 2.0],
        drop_path_rate=[0.0, 0.0], cls_token=[False, True], num_labels=10))
    g = torch.Generator().manual_seed(0)
    batch = {"pixel_values": torch.randn(4, 3, 64, 64, generator=g),
             "labels": torch.randint(0, 10, (4,), generator=g)}
    flow = gradient_flow(model, batch)
    top = "cvt.encoder.stages.1.layers.1.attention.attention.convolution_projection_query"
    [dead] = [f for f in flow.findings() if f.code == "grads.dead"]
    assert dead.module == top and dead.evidence["modules"] == 3
    assert "a head on the class token alone" in dead.fix
    # torch: exactly those parameters get zero; the key and value projections do not.
    model.zero_grad()
    model(**batch).loss.backward()
    at = top.rpartition(".")[0]
    zero = {n for n, p in model.named_parameters() if n.startswith(at) and
            torch.equal(p.grad, torch.zeros_like(p))}
    assert zero == set(dead.evidence["params"].split(", ")) and len(zero) == 3
    assert all(n.startswith(top) for n in zero)


def _attention(seq: int, mask_all_but_one: bool = False) -> GradFlow:
    """A one-head self-attention block on (2, seq, 16) with BERT's projection names."""

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.query, self.key, self.value = (nn.Linear(16, 16) for _ in range(3))
            self.out = nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (2, seq, 16)
            scores = self.query(x) @ self.key(x).transpose(1, 2) / 4.0  # (2, seq, seq)
            if mask_all_but_one:
                keep = torch.zeros(seq, dtype=torch.bool)
                keep[0] = True
                scores = scores.masked_fill(~keep, float("-inf"))
            return self.out(scores.softmax(-1) @ self.value(x)).mean(1)  # (2, 4)

    torch.manual_seed(0)
    return gradient_flow(nn.Sequential(Attention()), torch.randn(2, seq, 16))


def test_an_attention_over_one_position_is_one_finding_and_a_longer_one_is_silent() -> None:
    """Its query and key named together, with the cause, where the value still learns; a
    mask that keeps one position is the same; over six positions nothing is dead."""
    one = [f for f in _attention(1).findings() if f.code == "grads.dead"]
    assert [f.evidence["kind"] for f in one] == ["no_score_gradient"]
    assert one[0].evidence["modules"] == 2 and one[0].module == "0.query"
    masked = [f for f in _attention(6, mask_all_but_one=True).findings()
              if f.code == "grads.dead"]
    assert [f.evidence["kind"] for f in masked] == ["no_score_gradient"]
    assert not [f for f in _attention(6).findings() if f.code == "grads.dead"]


def test_a_small_init_embedding_before_a_norm_is_no_exploding_warning() -> None:
    """transformers' RWKV starts its embedding at std 1e-4 and normalises it at once (its
    small-init embedding): nearly all of a total norm above 1000 is that embedding's, a
    gradient that grows as the weights shrink. It read as a warning to clip at 1.0 and lower
    the init, which would shrink every other gradient 1000x and the embedding further."""
    from transformers import RwkvConfig, RwkvForCausalLM

    torch.manual_seed(0)
    model = RwkvForCausalLM(RwkvConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                                       attention_hidden_size=64, intermediate_size=128,
                                       context_length=32))
    ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    flow = gradient_flow(model, {"input_ids": ids, "labels": ids})
    assert flow.total_norm > 1000
    [f] = [f for f in flow.findings() if f.code == "grads.exploding"]
    assert f.severity == Severity.INFO and f.evidence["param"] == "rwkv.embeddings.weight"
    assert f.evidence["share"] > 0.99 and "Adam" in f.fix
    # A large total from ordinary weights (inputs 300x too large) is still a warning.
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    loud = gradient_flow(plain, torch.randn(8, 16) * 300)
    [g] = [f for f in loud.findings() if f.code == "grads.exploding"]
    assert g.severity == Severity.WARNING and "clip" in g.fix


def test_zero_initialised_tokens_before_a_norm_are_no_exploding_warning() -> None:
    """transformers' AST starts its class, distillation and position embeddings at zero, and
    its first LayerNorm (eps 1e-12) sees them nearly constant: together they hold the whole
    total norm of ~10^4, which read as exploding gradients, one parameter holding only half."""
    from transformers import ASTConfig, ASTForAudioClassification

    torch.manual_seed(0)
    model = ASTForAudioClassification(ASTConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_length=64, num_mel_bins=32, num_labels=10))
    g = torch.Generator().manual_seed(0)
    flow = gradient_flow(model, {"input_values": torch.randn(2, 64, 32, generator=g),
                                 "labels": torch.randint(0, 10, (2,), generator=g)})
    assert flow.total_norm > 1000
    [f] = [f for f in flow.findings() if f.code == "grads.exploding"]
    assert f.severity == Severity.INFO and f.evidence["params"] == 3
    assert f.evidence["weight_rms"] == 0 and "all zero" in f.summary
    assert "cls_token" in f.summary


def test_a_layer_that_layerdrop_skipped_is_one_finding_not_one_per_module() -> None:
    """transformers' HuBERT drops whole encoder layers in training (LayerDrop): a dropped
    layer's six modules were six `grads.unreached` findings (five, then "6 more")."""
    from transformers import HubertConfig, HubertForSequenceClassification

    torch.manual_seed(0)
    model = HubertForSequenceClassification(HubertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, num_labels=3,
        layerdrop=1.0))  # every encoder layer dropped: deterministic
    g = torch.Generator().manual_seed(0)
    flow = gradient_flow(model, {"input_values": torch.randn(2, 2000, generator=g),
                                 "labels": torch.randint(0, 3, (2,), generator=g)})
    unreached = [f for f in flow.findings() if f.code == "grads.unreached"]
    assert [f.module for f in unreached] == ["hubert.encoder.layers.0",
                                             "hubert.encoder.layers.1"]
    assert all(f.evidence["params"] == 16 for f in unreached)
    assert "did not run in the step's forward" in unreached[0].summary
    assert "LayerDrop" in unreached[0].fix


def test_modules_that_no_block_runs_are_one_finding_for_the_stack() -> None:
    """transformers' Longformer holds global-attention projections in every layer, which
    run only with a `global_attention_mask`: without one they were six `grads.unreached`
    findings (five, then "2 more"), one per module. A module that some block runs and
    another does not is still its own finding."""
    from transformers import LongformerConfig, LongformerForMaskedLM

    torch.manual_seed(0)
    model = LongformerForMaskedLM(LongformerConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, attention_window=[8, 8], max_position_embeddings=40))
    ids = torch.randint(3, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    flow = gradient_flow(model, {"input_ids": ids, "labels": ids})
    torch_none = {n for n, p in model.named_parameters() if p.grad is None}
    unreached = [f for f in flow.findings() if f.code == "grads.unreached"]
    [f] = unreached
    assert f.module == "longformer.encoder.layer" and f.evidence["blocks"] == 2
    assert f.evidence["params"] == len(torch_none) == 12
    assert f.summary.startswith("attention.self.query_global, attention.self.key_global, "
                                "attention.self.value_global did not run")
    assert "global_attention_mask" in f.fix
    # Layer 1 alone runs its global projections: nothing common to every block.
    part = replace(flow, params=tuple(
        replace(p, norm=1.0, reason=None) if p.name.startswith(
            "longformer.encoder.layer.1.attention.self.query_global") else p
        for p in flow.params))
    modules = sorted(str(f.module) for f in part.findings() if f.code == "grads.unreached")
    assert "longformer.encoder.layer" in modules
    assert "longformer.encoder.layer.0.attention.self.query_global" in modules


@pytest.mark.parametrize("drop", [None, 0.1])
def test_a_dropout_that_drops_everything_is_one_cause_and_one_effect(drop: float | None
                                                                     ) -> None:
    """transformers' MobileNetV1Config defaults classifier_dropout_prob to 0.999: almost
    every feature is dropped, and with a small batch all of them. That read as 83
    `grads.dead` warnings (the dropout, then one per module below it), each with the fix to
    look for dead ReLUs. It is now the dropout's finding, whose fix names its p, and one for
    the 82 modules it starves. A usual p is silent."""
    from transformers import MobileNetV1Config, MobileNetV1ForImageClassification

    options = {} if drop is None else {"classifier_dropout_prob": drop}
    torch.manual_seed(0)
    model = MobileNetV1ForImageClassification(MobileNetV1Config(
        image_size=32, depth_multiplier=0.25, num_labels=5, **options))
    g = torch.Generator().manual_seed(0)
    flow = gradient_flow(model, {"pixel_values": torch.randn(2, 3, 32, 32, generator=g),
                                 "labels": torch.randint(0, 5, (2,), generator=g)})
    dead = [f for f in flow.findings() if f.code == "grads.dead"]
    if drop is not None:
        assert not dead
        return
    starved = {n for n, p in model.named_parameters()
               if p.grad is not None and not p.grad.any()}
    # torch agrees: every gradient is zero but the classifier's bias (its weight meets
    # only dropped, zero features).
    assert starved == {n for n, _ in model.named_parameters()} - {"classifier.bias"}
    cause, effect = dead
    assert cause.module == "dropout" and cause.evidence["kind"] == "blocks"
    assert "classifier_dropout_prob=0.999" in cause.fix and "dead ReLUs" not in cause.fix
    assert effect.module == "mobilenet_v1.pooler" and effect.evidence["cause"] == "dropout"
    assert effect.evidence["last"] == "mobilenet_v1.conv_stem.convolution"
    owners = {n.rsplit(".", 1)[0] for n in starved} - {"classifier"}
    assert int(effect.evidence["modules"] or 0) > len(owners)  # activations too
