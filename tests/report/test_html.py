"""report.html's own formatting: long tables fold, and a tied parameter is named in the
gradient table (GPT-2's `lm_head.weight` is `transformer.wte.weight`)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from torchscope.grads import gradient_flow
from torchscope.grads.records import ParamGradRecord
from torchscope.report.html import SHOW_ROWS, gradients_fragment, table


def test_a_long_table_shows_a_screenful_and_folds_the_rest() -> None:
    rows = [(f"layer.{i}", i) for i in range(SHOW_ROWS + 30)]
    html = table(("module", "n"), rows, numeric=(1,))
    shown, folded = html.split("<details>")
    assert shown.count("<tr>") == SHOW_ROWS + 1  # and the header row
    assert "<summary>30 more rows</summary>" in folded and folded.count("<tr>") == 30 + 1
    assert all(f"<td>layer.{i}</td>" in html for i in range(SHOW_ROWS + 30))
    short = table(("module", "n"), rows[:SHOW_ROWS + 5])
    assert "<details>" not in short
    whole = table(("module", "n"), rows[:3], folded="All 3 modules")
    assert whole.startswith("<details><summary>All 3 modules</summary><table>")


@pytest.mark.skipif("tied_to" not in {f.name for f in dataclasses.fields(ParamGradRecord)},
                    reason="the gradient records do not name tied parameters yet")
def test_gpt2_tied_weights_are_named_in_the_gradient_table(tiny_gpt2: torch.nn.Module) -> None:
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    html = gradients_fragment(gradient_flow(tiny_gpt2, {"input_ids": ids}), {})
    head = re.search(r"<tr><td>lm_head</td>.*?</tr>", html)
    wte = re.search(r"<tr><td>transformer\.wte</td>.*?</tr>", html)
    assert head and "weight tied to transformer.wte.weight" in head.group(0)
    assert wte and "weight tied to lm_head.weight" in wte.group(0)
