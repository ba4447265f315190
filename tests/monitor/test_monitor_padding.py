"""`run.padding_in_loss`: a transformers model's labels that hold tokens where the attention
mask pads, counted on the device over the sampled steps and checked against the batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchscope

from .._builders import PAD, padded_lm_batch, tiny_gpt2

transformers = pytest.importorskip("transformers")

def _run(model: nn.Module, batch: dict[str, torch.Tensor], steps: int = 4, every: int = 2
         ) -> torchscope.monitoring.RunRecord:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with torchscope.monitor(model, opt, every=every, out=None) as mon:
        for _ in range(steps):
            opt.zero_grad()
            model(**batch).loss.backward()
            opt.step()
    assert mon.result is not None
    return mon.result


def test_labels_on_padding_are_counted_exactly_and_told() -> None:
    batch = padded_lm_batch(masked=False)
    run = _run(tiny_gpt2(), batch)
    padded = int((batch["attention_mask"] == 0).sum())  # 4 + 7 + 11 = 22 a forward
    assert padded == 22
    assert run.samples == 2 and run.padded_labels == (2 * padded, 2 * padded)
    (found,) = [f for f in run.findings() if f.code == "run.padding_in_loss"]
    assert found.severity.label == "warning"
    assert "44 of the 44 label positions" in found.summary
    assert "labels[attention_mask == 0] = -100" in (found.fix or "")


def test_labels_masked_with_minus_100_are_silent() -> None:
    run = _run(tiny_gpt2(), padded_lm_batch(masked=True))
    assert run.padded_labels == (44, 0)
    assert "run.padding_in_loss" not in [f.code for f in run.findings()]


def test_without_a_mask_or_on_an_encoder_decoder_nothing_is_counted() -> None:
    batch = padded_lm_batch(masked=False)
    del batch["attention_mask"]
    assert _run(tiny_gpt2(), batch).padded_labels == (0, 0)
    # T5's labels are the decoder's: its encoder's mask says nothing of them, even where
    # the two have one shape.
    torch.manual_seed(0)
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=100, d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16,
        decoder_start_token_id=PAD, pad_token_id=PAD))
    run = _run(t5, padded_lm_batch(masked=False), steps=2, every=1)
    assert run.padded_labels == (0, 0)
    assert "run.padding_in_loss" not in [f.code for f in run.findings()]


def test_a_causal_lms_first_label_is_never_read_so_a_left_pad_there_is_silent() -> None:
    """GPT-2's loss predicts label t + 1 from position t: the label at position 0 is never
    read (its loss is bitwise the same with -100 there). Rows left-padded by one position
    are silent; longer left padding counts all but each row's first pad."""
    model = tiny_gpt2()
    one = padded_lm_batch(masked=False, lengths=(16, 15, 15, 15), left=True)
    unread = {**one, "labels": one["labels"].clone()}
    unread["labels"][:, 0] = -100
    model.eval()  # no dropout: the two forwards differ in their labels only
    with torch.no_grad():
        assert torch.equal(model(**one).loss, model(**unread).loss)
    model.train()
    run = _run(model, one)
    assert run.padded_labels == (0, 0)
    assert "run.padding_in_loss" not in [f.code for f in run.findings()]
    longer = padded_lm_batch(masked=False, left=True)  # 0, 4, 7 and 11 pads: 3 + 6 + 10 read
    run = _run(tiny_gpt2(), longer)
    assert run.padded_labels == (2 * 19, 2 * 19)
    assert "38 of the 38 label positions" in next(
        f.summary for f in run.findings() if f.code == "run.padding_in_loss")


def test_a_masked_lm_reads_every_label_so_a_pad_at_position_0_counts() -> None:
    """BERT's masked-LM loss reads each label where it stands: no shift."""
    torch.manual_seed(0)
    bert = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32, pad_token_id=PAD))
    run = _run(bert, padded_lm_batch(masked=False, lengths=(16, 15, 15, 15), left=True))
    assert run.padded_labels == (2 * 3, 2 * 3)
    assert "run.padding_in_loss" in [f.code for f in run.findings()]
