"""The labelled zoo: healthy initialisations of real architectures and deliberately broken
models, each with the findings an expert expects of it.

Healthy entries expect nothing at warning or above. Broken entries name the finding code
and the module it must point at (`expected`); `allowed` lists codes that are true
consequences of the same fault (a model whose activations explode also has large
activations). Everything is tiny and runs one step on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn

from torchscope.capture import capture_activations
from torchscope.findings import Finding, Severity
from torchscope.grads import gradient_flow
from torchscope.models.zoo import BUILTINS
from torchscope.step import Step

from .._builders import makemore_mlp


@dataclass(frozen=True)
class Expect:
    """A finding the entry must get: `code` at `module`, at least `severity`."""

    code: str
    module: str | None
    severity: Severity = Severity.WARNING


@dataclass(frozen=True)
class Entry:
    """One zoo model: a factory returning (model, inputs) and what it must be diagnosed with.

    `loss_fn` is the step's (the default "auto" uses a Hugging Face model's own loss).
    """

    name: str
    build: Callable[[], tuple[nn.Module, Any]]
    expected: tuple[Expect, ...] = ()
    allowed: frozenset[str] = field(default_factory=frozenset)
    loss_fn: str = "auto"

    @property
    def healthy(self) -> bool:
        return not self.expected


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _tokens(vocab: int = 100, shape: tuple[int, int] = (4, 16)) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=_gen())


def _labels(n: int, classes: int = 10) -> torch.Tensor:
    return torch.randint(0, classes, (n,), generator=_gen(1))


def _lm_batch(model: nn.Module) -> tuple[nn.Module, Any]:
    """`model` with a batch of tokens that are also its labels (its own loss)."""
    ids = _tokens()
    return model, {"input_ids": ids, "labels": ids.clone()}


# ---------------------------------------------------------------- healthy: transformers
def hf_resnet() -> tuple[nn.Module, Any]:
    """A ResNet at 64 pixels, batches of 8: its last stage's 2×2 map gives each BatchNorm
    channel 32 values. (At 32 pixels and 4 images, 4 values: `activations.batch_stats`.)"""
    from transformers import ResNetConfig, ResNetForImageClassification

    cfg = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[2, 2, 2, 2],
                       layer_type="basic", num_labels=10)
    return ResNetForImageClassification(cfg), {
        "pixel_values": torch.randn(8, 3, 64, 64, generator=_gen()), "labels": _labels(8)}


def hf_vit() -> tuple[nn.Module, Any]:
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=4,
                    num_attention_heads=2, intermediate_size=64, num_labels=10)
    return ViTForImageClassification(cfg), {
        "pixel_values": torch.randn(4, 3, 32, 32, generator=_gen()), "labels": _labels(4)}


def hf_bert() -> tuple[nn.Module, Any]:
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=32)
    return _lm_batch(BertForMaskedLM(cfg))


def hf_bert_classifier() -> tuple[nn.Module, Any]:
    """BERT for sequence classification, 2 layers: its pooler and classifier, nearer the loss
    than any encoder layer, get about 100x the encoder's relative gradient at init."""
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=32, num_labels=3)
    return BertForSequenceClassification(cfg), {"input_ids": _tokens(),
                                                "labels": _labels(4, classes=3)}


def hf_bert_regression() -> tuple[nn.Module, Any]:
    """BERT with one regression output against (N,) float labels: its own loss squeezes
    the (N, 1) logits before mean squared error."""
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=32, num_labels=1,
                     problem_type="regression")
    return BertForSequenceClassification(cfg), {
        "input_ids": _tokens(), "labels": torch.randn(4, generator=_gen(1))}


def hf_gpt2() -> tuple[nn.Module, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=4, n_head=2, n_embd=32, vocab_size=100, n_positions=32)
    return _lm_batch(GPT2LMHeadModel(cfg))


def hf_t5() -> tuple[nn.Module, Any]:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=100, d_model=32, d_kv=16, d_ff=64, num_layers=2,
                   num_decoder_layers=2, num_heads=2, decoder_start_token_id=0)
    return T5ForConditionalGeneration(cfg), {
        "input_ids": _tokens(), "labels": torch.randint(0, 100, (4, 8), generator=_gen(1))}


def hf_bart() -> tuple[nn.Module, Any]:
    """An encoder-decoder whose encoder gets its gradient through cross-attention: level
    within each stack, far lower in the encoder than in the decoder at initialisation."""
    from transformers import BartConfig, BartForConditionalGeneration

    cfg = BartConfig(vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2,
                     encoder_attention_heads=4, decoder_attention_heads=4,
                     encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32)
    return _lm_batch(BartForConditionalGeneration(cfg))


def hf_swin() -> tuple[nn.Module, Any]:
    """Windowed attention with a relative position bias table that starts at zero."""
    from transformers import SwinConfig, SwinForImageClassification

    cfg = SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1],
                     num_heads=[2, 2], window_size=4, num_labels=10)
    return SwinForImageClassification(cfg), {
        "pixel_values": torch.randn(4, 3, 32, 32, generator=_gen()),
        "labels": _labels(4, classes=10)}


def hf_efficientnet(bn_weight: Callable[[torch.Tensor], object] = nn.init.ones_
                    ) -> Callable[[], tuple[nn.Module, Any]]:
    """A small EfficientNet (BatchNorm eps 1e-3, squeeze-excitation) whose BatchNorm
    weights are set by `bn_weight`: to 1 by default, torch's own init."""
    def build() -> tuple[nn.Module, Any]:
        from transformers import EfficientNetConfig, EfficientNetForImageClassification

        cfg = EfficientNetConfig(width_coefficient=0.2, depth_coefficient=0.2, image_size=64,
                                 hidden_dim=256, num_labels=10)
        model = EfficientNetForImageClassification(cfg)
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                bn_weight(m.weight)
        return model, {"pixel_values": torch.randn(4, 3, 64, 64, generator=_gen()),
                       "labels": _labels(4)}
    return build


def _like_its_convs(weight: torch.Tensor) -> object:
    """transformers 5's EfficientNet init draws BatchNorm weights as it draws its convs',
    normal with std 0.02: each norm layer then scales the signal to about 0.02 of unit
    std, and below eps 1e-3 the next ones shrink it further, to ~1e-34 by the classifier."""
    return nn.init.normal_(weight, 0.0, 0.02)


def hf_vitmae(sincos: bool) -> Callable[[], tuple[nn.Module, Any]]:
    """ViT-MAE for pre-training. transformers 5's init leaves its fixed (frozen) position
    tables all zero, the encoder's and the decoder's: every masked token then enters the
    decoder as the same zero vector, and the decoder's attention query and key get no
    gradient. With `sincos`, both hold the 2-D sin-cos table the model is meant to have."""
    def build() -> tuple[nn.Module, Any]:
        from transformers import ViTMAEConfig, ViTMAEForPreTraining
        from transformers.models.vit_mae import modeling_vit_mae

        cfg = ViTMAEConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                           num_attention_heads=2, intermediate_size=64, decoder_hidden_size=32,
                           decoder_num_hidden_layers=1, decoder_num_attention_heads=2,
                           decoder_intermediate_size=64)
        model = ViTMAEForPreTraining(cfg)
        tables = (model.vit.embeddings.position_embeddings, model.decoder.decoder_pos_embed)
        with torch.no_grad():
            for t in tables:  # (1, 17, 32): the class token's row, then 4 x 4 patches
                t.copy_(modeling_vit_mae.build_2d_sinusoidal_position_embedding(
                    height=4, width=4, embed_dim=32, cls_token=True).reshape(t.shape)
                    if sincos else torch.zeros_like(t))
        return model, {"pixel_values": torch.randn(4, 3, 32, 32, generator=_gen())}
    return build


def hf_resnet_small_batch() -> tuple[nn.Module, Any]:
    """The same ResNet on 32-pixel images in batches of 4: its last stage is 1×1, and each
    of its BatchNorm channels is normalised over 4 values."""
    model, _ = hf_resnet()
    return model, {"pixel_values": torch.randn(4, 3, 32, 32, generator=_gen()),
                   "labels": _labels(4)}


def hf_llama() -> tuple[nn.Module, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    return _lm_batch(LlamaForCausalLM(cfg))


def hf_mistral() -> tuple[nn.Module, Any]:
    """Grouped-query attention (4 query heads over 2 key/value heads), sliding window."""
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=100, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=64, sliding_window=8)
    return _lm_batch(MistralForCausalLM(cfg))


def hf_phi() -> tuple[nn.Module, Any]:
    """Parallel attention and MLP off one LayerNorm, partial rotary embeddings."""
    from transformers import PhiConfig, PhiForCausalLM

    cfg = PhiConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                    num_attention_heads=4, max_position_embeddings=64)
    return _lm_batch(PhiForCausalLM(cfg))


def hf_mamba() -> tuple[nn.Module, Any]:
    """A selective state-space model: no attention (transformers' slow path on CPU)."""
    from transformers import MambaConfig, MambaForCausalLM

    cfg = MambaConfig(vocab_size=100, hidden_size=32, state_size=8, num_hidden_layers=4)
    return _lm_batch(MambaForCausalLM(cfg))


def hf_deberta() -> tuple[nn.Module, Any]:
    """DeBERTa-v2 as a masked LM: disentangled relative-position attention."""
    from transformers import DebertaV2Config, DebertaV2ForMaskedLM

    cfg = DebertaV2Config(vocab_size=100, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=4, num_attention_heads=4,
                          max_position_embeddings=64)
    return _lm_batch(DebertaV2ForMaskedLM(cfg))


def hf_regnet() -> tuple[nn.Module, Any]:
    """RegNet's Y blocks (grouped convolutions, squeeze-excitation, BatchNorm) at 64 pixels
    in batches of 8: its last stage's 2×2 map gives each BatchNorm 32 values per channel."""
    from transformers import RegNetConfig, RegNetForImageClassification

    cfg = RegNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1],
                       groups_width=8, num_labels=10)
    return RegNetForImageClassification(cfg), {
        "pixel_values": torch.randn(8, 3, 64, 64, generator=_gen()), "labels": _labels(8)}


def hf_convnext() -> tuple[nn.Module, Any]:
    """ConvNeXt: depthwise 7×7 convolutions, LayerNorm, layer scale 1e-6."""
    from transformers import ConvNextConfig, ConvNextForImageClassification

    cfg = ConvNextConfig(hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 2, 1], num_labels=10)
    return ConvNextForImageClassification(cfg), {
        "pixel_values": torch.randn(4, 3, 64, 64, generator=_gen()), "labels": _labels(4)}


def builtin(name: str, shape: tuple[int, ...] | None = None) -> Callable[[], tuple[nn.Module, Any]]:
    def build() -> tuple[nn.Module, Any]:
        b = BUILTINS[name]
        return b.build(), torch.randn(shape or b.input_shape, generator=_gen())

    return build


def conv_bn() -> tuple[nn.Module, Any]:
    """A conv followed directly by BatchNorm (defect 1 told it to "add normalization")."""
    layers: list[nn.Module] = []
    channels = 3
    for _ in range(4):
        layers += [nn.Conv2d(channels, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16),
                   nn.ReLU()]
        channels = 16
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)]
    return nn.Sequential(*layers), torch.randn(4, 3, 16, 16, generator=_gen())


# ---------------------------------------------------------------- broken
def _stack(act: type[nn.Module], depth: int, width: int = 32) -> nn.Sequential:
    """depth × [Linear(width, width), act], then Linear(width, 10): Linear layers at even
    indices 0, 2, ..., 2 * depth."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), act()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def deep_sigmoid() -> tuple[nn.Module, Any]:
    """Ten sigmoid layers, default init: each layer multiplies the backward signal by at
    most 1/4, and the inputs (around 0.5) do not make up for it."""
    return _stack(nn.Sigmoid, 10), torch.randn(4, 32, generator=_gen())


class _PooledSigmoid(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Sigmoid())
                                      for _ in range(10)])
        self.pooler = nn.Linear(32, 32)
        self.classifier = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.classifier(torch.tanh(self.pooler(self.blocks(x))))  # (B, 10)
        return out


def pooled_sigmoid() -> tuple[nn.Module, Any]:
    """Ten sigmoid blocks under a pooler and a classifier, as BERT's head sits on its
    encoder: the head is left out of the depth trend, the vanishing blocks are not."""
    return _PooledSigmoid(), torch.randn(4, 32, generator=_gen())


def deep_tanh_small() -> tuple[nn.Module, Any]:
    """Ten tanh layers with half the default init: the signal shrinks both ways."""
    model = _stack(nn.Tanh, 10)
    with torch.no_grad():
        for m in model:
            if isinstance(m, nn.Linear):
                m.weight.mul_(0.5)
    return model, torch.randn(4, 32, generator=_gen())


def tanh_too_wide() -> tuple[nn.Module, Any]:
    """makemore's MLP (30 -> 200 -> 200 tanh -> 27) with weights of std 5 / sqrt(fan_in),
    three times Kaiming's tanh gain: about two thirds of each tanh's values sit in its
    flat tails."""
    return makemore_mlp(5.0), torch.randn(32, 30, generator=_gen())


def hf_t5_dead_ffn() -> tuple[nn.Module, Any]:
    """The healthy T5 with 48 of the 64 units of its first feed-forward held at zero (zero
    rows of wi; T5 has no biases): dead units along the last dim of (batch, tokens, d_ff)."""
    model, inputs = hf_t5()
    with torch.no_grad():
        model.get_submodule("encoder.block.0.layer.1.DenseReluDense.wi").weight[:48] = 0.0
    return model, inputs


def large_init() -> tuple[nn.Module, Any]:
    """Eight ReLU layers initialised with std 1 (4x Kaiming's sqrt(2 / fan_in) for fan_in 32)
    and no normalisation: activations and the backward signal grow about 4x per layer."""
    model = _stack(nn.ReLU, 8)
    with torch.no_grad():
        for m in model:
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=1.0)
    return model, torch.randn(4, 32, generator=_gen())


class _ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 16, 3)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.conv2(self.relu(self.conv1(x))))  # (B, 16, 1, 1)
        out: torch.Tensor = self.fc(torch.flatten(x, 1))  # (B, 10)
        return out


def dead_bias() -> tuple[nn.Module, Any]:
    """Seven of conv1's eight channels sit behind a bias of -100: their ReLU never fires."""
    model = _ConvNet()
    with torch.no_grad():
        model.conv1.bias[:7].fill_(-100.0)
    return model, torch.randn(4, 3, 16, 16, generator=_gen())


def dead_layer() -> tuple[nn.Module, Any]:
    """Every conv1 channel behind a bias of -100: nothing flows below the ReLU."""
    model = _ConvNet()
    with torch.no_grad():
        model.conv1.bias.fill_(-100.0)
    return model, torch.randn(4, 3, 16, 16, generator=_gen())


class _Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.log()  # NaN for the negative entries


class _NaNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 16)
        self.log = _Log()
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(self.log(self.fc1(x)))  # (B, 10)
        return out


def nan_module() -> tuple[nn.Module, Any]:
    """`log` takes the log of a linear layer's output: NaN wherever it is negative."""
    return _NaNNet(), torch.randn(4, 16, generator=_gen())


class _AuxNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 10)
        self.aux = nn.Linear(16, 4)  # an auxiliary head the loss forgot

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.body(x))  # (B, 16)
        self.aux_out = self.aux(h)  # computed, never part of the loss
        out: torch.Tensor = self.head(h)  # (B, 10)
        return out


def unreached() -> tuple[nn.Module, Any]:
    return _AuxNet(), torch.randn(4, 16, generator=_gen())


class _FineTune(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.backbone(x))  # (B, 10)
        return out


class _BroadcastRegressor(nn.Module):
    """A regressor that computes its own loss against (N,) labels from its (N, 1) output
    without a squeeze: every output is compared with every label."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.net(x)  # (N, 1)
        diff = out - labels  # (N, 1) - (N,) -> (N, N)
        return {"logits": out, "loss": diff.square().mean()}


def broadcast_regressor() -> tuple[nn.Module, Any]:
    return _BroadcastRegressor(), {"x": torch.randn(16, 16, generator=_gen()),
                                   "labels": torch.randn(16, generator=_gen(1))}


def softmax_classifier() -> tuple[nn.Module, Any]:
    """A classifier whose last layer is nn.Softmax: cross-entropy takes its probabilities
    as logits."""
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10), nn.Softmax(dim=1))
    return model, torch.randn(16, 16, generator=_gen())


def hf_resnet_frozen_bn() -> tuple[nn.Module, Any]:
    """The healthy ResNet with its backbone frozen by requires_grad_(False) alone and left
    in training mode: its 20 BatchNorm layers' running statistics still move."""
    model, inputs = hf_resnet()
    model.resnet.requires_grad_(False)
    return model, inputs


def frozen_backbone() -> tuple[nn.Module, Any]:
    """A frozen backbone under a trainable head: frozen is not dead."""
    model = _FineTune()
    model.backbone.requires_grad_(False)
    return model, torch.randn(4, 16, generator=_gen())


ZOO: tuple[Entry, ...] = (
    Entry("hf-resnet", hf_resnet),
    Entry("hf-vit", hf_vit),
    Entry("hf-swin", hf_swin),
    Entry("hf-bert", hf_bert),
    Entry("hf-bert-classifier", hf_bert_classifier),
    Entry("hf-bert-regression", hf_bert_regression),
    Entry("hf-gpt2", hf_gpt2),
    Entry("hf-t5", hf_t5),
    Entry("hf-bart", hf_bart),
    Entry("hf-llama", hf_llama),
    Entry("hf-mistral", hf_mistral),
    Entry("hf-phi", hf_phi),
    Entry("hf-mamba", hf_mamba),
    Entry("hf-deberta-v2", hf_deberta),
    Entry("hf-regnet", hf_regnet),
    Entry("hf-convnext", hf_convnext),
    Entry("hf-efficientnet", hf_efficientnet()),
    Entry("hf-vitmae", hf_vitmae(sincos=True)),
    Entry("tiny-cnn", builtin("tiny-cnn", (4, 3, 32, 32))),
    Entry("mlp", builtin("mlp", (4, 128))),
    Entry("deep-mlp", builtin("deep-mlp")),
    Entry("resnet-mini", builtin("resnet-mini", (4, 3, 16, 16))),
    Entry("conv-bn", conv_bn),
    Entry("deep-sigmoid", deep_sigmoid, (Expect("grads.vanishing", "0"),)),
    Entry("pooled-sigmoid", pooled_sigmoid, (Expect("grads.vanishing", "blocks.0.0"),)),
    Entry("deep-tanh-small-init", deep_tanh_small, (Expect("grads.vanishing", "0"),)),
    Entry("large-init", large_init, (Expect("grads.exploding", "0"),),
          allowed=frozenset({"activations.large", "activations.scale_drift"})),
    Entry("dead-bias", dead_bias, (Expect("activations.dead_units", "relu"),)),
    Entry("hf-t5-dead-ffn", hf_t5_dead_ffn, (
        Expect("activations.dead_units", "encoder.block.0.layer.1.DenseReluDense.act"),)),
    Entry("hf-efficientnet-bn-init", hf_efficientnet(_like_its_convs),
          (Expect("activations.scale_drift", "classifier"),),
          # what a signal at 1e-34 leaves: weight gradients that underflow to zero, and
          # squeeze-excitation gates at sigmoid(0) = 0.5
          allowed=frozenset({"grads.dead", "activations.constant"})),
    Entry("hf-vitmae-zero-positions", hf_vitmae(sincos=False),
          (Expect("grads.frozen_zero", "vit.embeddings"),),
          # what identical masked tokens leave: a decoder key projection with no gradient
          allowed=frozenset({"grads.dead"})),
    Entry("hf-resnet-small-batch", hf_resnet_small_batch, (Expect(
        "activations.batch_stats", "resnet.encoder.stages.3.layers.0.layer.0.normalization"),)),
    Entry("tanh-too-wide", tanh_too_wide, (Expect("activations.saturated", "1"),
                                           Expect("activations.saturated", "3"))),
    Entry("dead-layer", dead_layer, (
        Expect("activations.dead_units", "relu"),
        Expect("grads.dead", "relu"),  # receives gradient, passes zeros down
        Expect("grads.dead", "conv1"),  # receives only zeros
    )),
    Entry("nan-module", nan_module, (Expect("activations.nonfinite", "log", Severity.ERROR),),
          allowed=frozenset({"grads.nonfinite"})),
    Entry("unreached", unreached, (Expect("grads.unreached", "aux", Severity.INFO),)),
    Entry("frozen-backbone", frozen_backbone, (Expect("grads.frozen", "backbone", Severity.INFO),)),
    Entry("broadcast-regressor", broadcast_regressor,
          (Expect("grads.loss_broadcast", None, Severity.ERROR),)),
    Entry("softmax-classifier", softmax_classifier,
          (Expect("grads.loss_on_probabilities", None),)),
    Entry("hf-resnet-frozen-bn", hf_resnet_frozen_bn, (
        Expect("activations.frozen_batch_norm", "resnet"),
        Expect("grads.frozen", "resnet", Severity.INFO),
    )),
)


# ---------------------------------------------------------------- running the zoo
@dataclass(frozen=True)
class Diagnosis:
    """What torchscope concluded on one zoo entry: its gradient and activation findings."""

    entry: Entry
    findings: tuple[Finding, ...]

    def flagged(self) -> set[tuple[str, str | None]]:
        """(code, module) of every warning-or-worse finding, and of every finding the entry
        expects at a lower severity."""
        low = {(e.code, e.module) for e in self.entry.expected}
        return {(f.code, f.module) for f in self.findings
                if f.severity >= Severity.WARNING or (f.code, f.module) in low}

    def found(self, e: Expect) -> bool:
        return any(f.code == e.code and f.module == e.module and f.severity >= e.severity
                   for f in self.findings)

    def false_positives(self) -> set[tuple[str, str | None]]:
        """Flagged (code, module) pairs that are neither expected nor an allowed consequence."""
        ok = {(e.code, e.module) for e in self.entry.expected}
        return {(c, m) for c, m in self.flagged() if (c, m) not in ok
                and c not in self.entry.allowed}


def diagnose_entry(entry: Entry) -> Diagnosis:
    """One training step of the entry: gradient flow and activations, their findings."""
    torch.manual_seed(0)
    model, inputs = entry.build()
    step = Step(model, inputs, loss_fn=entry.loss_fn)
    flow = gradient_flow(step)
    capture = capture_activations(step)
    return Diagnosis(entry, tuple(flow.findings() + capture.findings()))


_CACHE: dict[str, Diagnosis] = {}


def _cached(entry: Entry) -> Diagnosis:
    if entry.name not in _CACHE:
        _CACHE[entry.name] = diagnose_entry(entry)
    return _CACHE[entry.name]


@pytest.fixture
def diagnosis(entry: Entry) -> Diagnosis:
    """The entry's diagnosis, computed once per test session."""
    return _cached(entry)


@pytest.fixture
def zoo_diagnoses() -> list[Diagnosis]:
    """Every entry's diagnosis, in zoo order."""
    return [_cached(e) for e in ZOO]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "entry" in metafunc.fixturenames:
        metafunc.parametrize("entry", ZOO, ids=[e.name for e in ZOO])
