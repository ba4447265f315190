"""`grads.padding_in_loss`: the labels on padding that a transformers model's loss reads,
counted by `gradient_flow` while it runs its step (`GradFlow.padded_labels`,
`StepLossCheck`): from the step's own inputs for a transformers model, and from what a
transformers model inside a wrapper is given, by a pre-hook that comes off when the step
ends, raised or not."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchscope.errors import ModelError
from torchscope.grads import gradient_flow
from torchscope.grads.loss import StepLossCheck, labels_against_mask, padded_label_counts
from torchscope.step import Step

from .._builders import padded_lm_batch, tiny_gpt2


def test_labels_on_padding_are_counted_over_the_steps_micro_batches() -> None:
    """GPT-2's padded label positions that its shifted loss reads and that hold a token,
    summed over micro-batches, against torch's own count; None for a model that is no
    transformers model."""
    batch = padded_lm_batch(masked=False)  # 4 + 7 + 11 padded positions, on the right
    # The shifted loss reads labels from position 1 on: none of them is padding at 0 here.
    pad = batch["attention_mask"][:, 1:] == 0
    assert int(pad.sum()) == 22 and int((pad & (batch["labels"][:, 1:] != -100)).sum()) == 22
    whole = gradient_flow(Step(tiny_gpt2(), batch))
    assert whole.padded_labels == (22, 22)
    assert "grads.padding_in_loss" in [f.code for f in whole.findings()]
    halves = Step(tiny_gpt2(), batch, accumulate=2)  # rows (16, 12) and (9, 5)
    assert [int((m.kwargs["attention_mask"] == 0).sum())
            for m, _ in halves.micro_batches()] == [4, 18]
    assert gradient_flow(halves).padded_labels == (22, 22)
    masked = gradient_flow(Step(tiny_gpt2(), padded_lm_batch(masked=True)))
    assert masked.padded_labels == (22, 0)
    assert "grads.padding_in_loss" not in [f.code for f in masked.findings()]
    assert gradient_flow(Step(nn.Linear(4, 2), torch.randn(3, 4))).padded_labels is None


def test_a_causal_lm_s_loss_reads_labels_from_position_1() -> None:
    """The shift: position 0's label is never read by a causal LM's loss, so a left-padded
    row's first pad is no fault; a model that is no transformers model is not judged."""
    model = tiny_gpt2()
    assert labels_against_mask(model) == 1
    assert labels_against_mask(nn.Linear(2, 2)) is None
    mask = torch.tensor([[0, 0, 1, 1]])
    labels = torch.tensor([[5, 5, 6, 7]])
    counts = padded_label_counts({"attention_mask": mask, "labels": labels}, 1)
    assert counts is not None and counts.tolist() == [1, 1]
    assert padded_label_counts({"labels": labels}, 1) is None


class _Batched(nn.Module):
    """A LightningModule-like wrapper: its forward takes a batch of (ids, mask, labels) and
    gives the transformers model inside it keyword inputs, returning the loss; `fail`
    raises after that model ran."""

    def __init__(self, inner: nn.Module, fail: bool = False) -> None:
        super().__init__()
        self.model = inner
        self.fail = fail

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor
                ) -> torch.Tensor:
        loss: torch.Tensor = self.model(input_ids=ids, attention_mask=mask, labels=labels).loss
        if self.fail:
            raise RuntimeError("after the inner model")
        return loss


@pytest.mark.parametrize("masked", [False, True])
def test_labels_on_padding_are_counted_inside_a_wrapper(masked: bool) -> None:
    """A wrapper that passes its batch to GPT-2 as keyword inputs: the gradient flow counts
    what GPT-2 was given over every micro-batch, through a pre-hook that is gone when the
    step ends, and tells it."""
    b = padded_lm_batch(masked=masked)
    args = (b["input_ids"], b["attention_mask"], b["labels"])
    wrapper = _Batched(tiny_gpt2())
    flow = gradient_flow(Step(wrapper, args, accumulate=2))
    assert flow.padded_labels == (22, 0 if masked else 22)
    assert ("grads.padding_in_loss" in [f.code for f in flow.findings()]) == (not masked)
    assert not wrapper.model._forward_pre_hooks


def test_a_wrapper_that_raises_keeps_no_padding_hook() -> None:
    """The pre-hook comes off when the step raises, and a later step counts again."""
    b = padded_lm_batch(masked=False)
    wrapper = _Batched(tiny_gpt2(), fail=True)
    step = Step(wrapper, (b["input_ids"], b["attention_mask"], b["labels"]))
    check = StepLossCheck(step)
    with pytest.raises(ModelError), check:
        step.forward_backward(before_backward=check.before_backward)
    assert not wrapper.model._forward_pre_hooks
    wrapper.fail = False
    assert gradient_flow(step).padded_labels == (22, 22)
    assert not wrapper.model._forward_pre_hooks
