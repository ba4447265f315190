"""Models that tests in several folders build: one definition each."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn


def makemore_mlp(scale: float, act: type[nn.Module] = nn.Tanh) -> nn.Sequential:
    """makemore's MLP: 30 inputs, two hidden layers of 200 behind `act`, 27 classes;
    weights of std scale / sqrt(fan_in), zero biases (Kaiming's tanh gain is 5/3)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(30, 200), act(), nn.Linear(200, 200), act(),
                          nn.Linear(200, 27))
    with torch.no_grad():
        for layer in model:
            if isinstance(layer, nn.Linear):
                nn.init.normal_(layer.weight, std=scale / math.sqrt(layer.in_features))
                layer.bias.zero_()
    return model


def t5_relu(**config: Any) -> nn.Module:
    """transformers' T5 (v1.0: a ReLU feed-forward on (batch, tokens, d_ff)), 2 + 2 layers
    of 32 with 64 feed-forward units, no dropout; skipped without transformers."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.T5Config(**{
        "vocab_size": 100, "d_model": 32, "d_kv": 16, "d_ff": 64, "num_layers": 2,
        "num_heads": 2, "dropout_rate": 0.0, "feed_forward_proj": "relu",
        "decoder_start_token_id": 0, "pad_token_id": 0, **config})
    model: nn.Module = transformers.T5ForConditionalGeneration(cfg)
    return model


def assert_broadcast_told(run: Any, told: bool, shapes: tuple[tuple[int, ...], ...]) -> None:
    """A run's `grads.loss_broadcast`: once, with (output shape, broadcast shape) `shapes`,
    where `told`; else no record and no finding."""
    codes = [f.code for f in run.findings()]
    if not told:
        assert run.loss_broadcast is None and "grads.loss_broadcast" not in codes
        return
    b = run.loss_broadcast
    assert b is not None and (b.output_shape, b.shape) == shapes
    assert codes.count("grads.loss_broadcast") == 1


PAD = 0
LENGTHS = (16, 12, 9, 5)  # real tokens per row; the rest of each row of 16 is padding


def tiny_gpt2() -> nn.Module:
    """transformers' GPT-2 LM head: 2 layers of 32, vocabulary 100, pad token PAD; skipped
    without transformers."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model: nn.Module = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=32, pad_token_id=PAD))
    return model


def padded_lm_batch(masked: bool, lengths: tuple[int, ...] = LENGTHS, left: bool = False
                    ) -> dict[str, torch.Tensor]:
    """Rows of 16 token ids padded with PAD on the right (on the left where `left`), their
    attention mask, and labels copied from the ids, with -100 at the padding where
    `masked`."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 100, (len(lengths), 16), generator=g)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        if left:
            mask[row, 16 - n:] = 1
        else:
            mask[row, :n] = 1
    ids[mask == 0] = PAD
    labels = ids.clone()
    if masked:
        labels[mask == 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
