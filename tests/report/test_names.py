"""Module names shortened from the middle (`_util.shorten_name`), and which block a module
belongs to (`_util.module_block`): checked on the names of a real 12-layer BERT."""

from __future__ import annotations

import pytest

from torchscope._util import module_block, shorten_name


@pytest.fixture(scope="module")
def bert_names() -> list[str]:
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(num_hidden_layers=12, hidden_size=32, num_attention_heads=2,
                     intermediate_size=64, vocab_size=100, max_position_embeddings=32)
    return [n for n, _ in BertForSequenceClassification(cfg).named_modules() if n]


@pytest.mark.parametrize(("width", "short"), [
    (39, "encoder.layer.11.attention.output.dense"),
    (33, "encoder…11.attention.output.dense"),
    (30, "encoder.layer.11…output.dense"),
    (16, "encoder…11…dense"),
    (9, "…11…dense"),
    (6, "…dense"),
    (5, "…ense"),
    (1, "…"),
])
def test_the_issues_example(width: int, short: str) -> None:
    assert shorten_name("encoder.layer.11.attention.output.dense", width) == short


def test_short_names_stay_whole() -> None:
    assert shorten_name("fc", 2) == "fc"
    assert shorten_name("", 5) == ""
    assert shorten_name("conv1", 80) == "conv1"


@pytest.mark.parametrize("width", [12, 16, 20, 24, 30, 40])
def test_every_bert_name_keeps_its_leaf_and_block_index(bert_names: list[str],
                                                        width: int) -> None:
    for name in bert_names:
        short = shorten_name(name, width)
        assert len(short) <= width, (name, short)
        parts = name.split(".")
        leaf, indices = parts[-1], [p for p in parts[:-1] if p.isdigit()]
        essential = sum(map(len, indices)) + len(indices) + len(leaf) + 1
        if len(name) <= width:
            assert short == name
        elif essential <= width:
            # The leaf whole at the end, every block index kept, in order, and the kept
            # parts are the name's own: dropping the ellipses' gaps gives the name back.
            assert short.endswith(leaf), (name, short)
            kept = [p for chunk in short.split("…") for p in chunk.split(".") if p]
            assert [p for p in kept[:-1] if p.isdigit()] == indices, (name, short)
            it = iter(parts)
            assert all(p in it for p in kept), (name, short)
        else:
            assert short.startswith("…") and leaf.endswith(short[1:]), (name, short)


def test_module_block_groups_what_repeats(bert_names: list[str]) -> None:
    assert module_block("bert.encoder.layer.3.attention.self.query") == "bert.encoder.layer.3"
    assert module_block("bert.encoder.layer.3") == "bert.encoder.layer.3"
    assert module_block("bert.embeddings.word_embeddings") == "bert.embeddings"
    assert module_block("classifier") == "classifier"
    assert module_block("") == ""
    blocks = {module_block(n) for n in bert_names}
    # The 12 layers; the model, its embeddings, encoder and pooler; the dropout and head.
    assert blocks == {f"bert.encoder.layer.{i}" for i in range(12)} | {
        "bert", "bert.embeddings", "bert.encoder", "bert.pooler", "dropout", "classifier"}
