"""The doctor on a tiny transformers GPT-2 given through a factory file (no download)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
from typer.testing import CliRunner

from torchscope.cli import app
from torchscope.report.document import load_schema

FACTORY = '''
import torch
from transformers import GPT2Config, GPT2LMHeadModel


def build():
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=32)
    model = GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids}
'''


def test_doctor_on_tiny_gpt2_factory(tmp_path: Path) -> None:
    factory = tmp_path / "gpt2_factory.py"
    factory.write_text(FACTORY)
    out = tmp_path / "report"
    res = CliRunner().invoke(app, ["doctor", f"{factory}:build", "--fast", "--out", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads((out / "report.json").read_text())
    jsonschema.Draft202012Validator(load_schema()).validate(doc)
    assert doc["target"]["model_class"] == "GPT2LMHeadModel"
    assert doc["target"]["inputs"] == "(input_ids=2x16)"
    acts = doc["sections"]["activations"]
    assert acts["status"] == "ok", acts["note"]
    mods = {m["module"]: m for m in acts["data"]["modules"]}
    # The LM head's logits: (batch, seq, vocab); the blocks are captured as containers too.
    assert mods["lm_head"]["outputs"][0]["shape"] == [2, 16, 100]
    assert mods["lm_head"]["leaf"] and not mods["transformer.h.0"]["leaf"]
    assert acts["data"]["nonfinite"]["producer"] is None
    html = (out / "report.html").read_text()
    assert 'data-plot="activations-stats"' in html and "transformer.h.1.mlp.c_fc" in html
