"""The terminal on a real model with long module names (defect 9): flags show no value in
`--help`, every table fits `COLUMNS=80`, module names are shortened from the middle (block
index and leaf kept), never cut at their end, and tied parameters are named as tied."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from torchscope.cli import app
from torchscope.grads.records import ParamGradRecord

runner = CliRunner()

BERT = '''
import torch
from transformers import BertConfig, BertForSequenceClassification


def build():
    torch.manual_seed(0)
    cfg = BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                     intermediate_size=64, vocab_size=100, max_position_embeddings=32)
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    return BertForSequenceClassification(cfg), {"input_ids": ids}
'''

GPT2 = '''
import torch
from transformers import GPT2Config, GPT2LMHeadModel


def build():
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=32)
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    return GPT2LMHeadModel(cfg), {"input_ids": ids}
'''

# A word that ends in an ellipsis right before a cell border or space: cut at its end.
CUT = re.compile(r"\w…(?=\s*[│┃])")


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[str]]:
    from transformers import BertConfig, BertForSequenceClassification

    path = tmp_path_factory.mktemp("bert") / "bert_factory.py"
    path.write_text(BERT)
    cfg = BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                     intermediate_size=64, vocab_size=100, max_position_embeddings=32)
    names = [n for n, _ in BertForSequenceClassification(cfg).named_modules() if n]
    return f"{path}:build", names


def _commands() -> list[str]:
    return [c.name or "" for c in typer.main.get_command(app).commands.values()]  # type: ignore[attr-defined]


@pytest.mark.parametrize("command", ["capture", "grads", "memory", "profile", "compile", "lint",
                                     "doctor", "diff", "lab"])
def test_flags_show_no_value_in_help(command: str) -> None:
    assert command in _commands()
    result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    assert "<bool>" not in result.output
    flags = {"doctor": "--fast", "memory": "--live", "lint": "--no-config", "lab": "--strict",
             "profile": "--group-by-shape"}
    if command in flags:  # the flag is listed, followed by its help, not by a value
        line = next(ln for ln in result.output.splitlines() if flags[command] in ln)
        assert re.search(re.escape(flags[command]) + r"\s+(-\w\s+)?[A-Z]", line), line
    assert "--debug" in result.output


def _matches(cell: str, names: list[str]) -> bool:
    """`cell` shows a module name whole, or shortened from the middle: its leaf whole at the
    end, its block indices all there, and nothing but the name's own parts, in order."""
    if cell in names or cell == "<root>":
        return True
    kept = [p for chunk in cell.split("…") for p in chunk.split(".") if p]
    for name in names:
        parts = name.split(".")
        indices = [p for p in parts[:-1] if p.isdigit()]
        it = iter(parts)
        if cell.endswith(parts[-1]) and all(p in it for p in kept) and \
                [p for p in kept[:-1] if p.isdigit()] == indices:
            return True
    return False


def _column(output: str, index: int) -> list[str]:
    return [ln.split("│")[index].strip() for ln in output.splitlines()
            if ln.startswith("│") and ln.split("│")[index].strip()]


@pytest.mark.parametrize(("argv", "column"), [
    (["capture"], 1),
    (["grads"], 2),  # the first column holds the backward order
    (["memory"], 1),
    (["profile", "--by", "module", "--steps", "1", "--wait", "0"], 1),
])
def test_tables_fit_80_columns_and_names_shorten_from_the_middle(
        bert: tuple[str, list[str]], argv: list[str], column: int) -> None:
    target, names = bert
    result = runner.invoke(app, [argv[0], target, *argv[1:]], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert max(map(len, lines)) <= 80, max(lines, key=len)
    assert not CUT.search(result.output), CUT.findall(result.output)
    cells = _column(result.output, column)
    # Long names had to be shortened at 80 columns, and each one still names its module.
    shortened = [c for c in cells if "…" in c and not re.match(r"… \d+ more", c)]
    assert shortened, cells
    assert all(_matches(c, names) for c in shortened), [
        c for c in shortened if not _matches(c, names)]


def test_wide_console_shows_whole_names(bert: tuple[str, list[str]]) -> None:
    target, _ = bert
    result = runner.invoke(app, ["capture", target], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "bert.encoder.layer.1.intermediate.intermediate_act_fn" in result.output
    assert "…" not in result.output


def test_doctor_fits_80_columns(bert: tuple[str, list[str]], tmp_path: Path) -> None:
    target, _ = bert
    result = runner.invoke(app, ["doctor", target, "--fast", "--out", str(tmp_path / "r")],
                           env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    assert max(map(len, result.output.splitlines())) <= 80
    assert not CUT.search(result.output), CUT.findall(result.output)
    assert "Findings" in result.output and "verdict: " in result.output


@pytest.mark.skipif("tied_to" not in {f.name for f in dataclasses.fields(ParamGradRecord)},
                    reason="the gradient records do not name tied parameters yet")
def test_gpt2_tied_lm_head_is_named_as_tied(tmp_path: Path) -> None:
    factory = tmp_path / "gpt2_factory.py"
    factory.write_text(GPT2)
    result = runner.invoke(app, ["grads", f"{factory}:build"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    row = next(ln for ln in result.output.splitlines() if "│ lm_head " in ln)
    assert "tied to transformer.wte.weight" in row, result.output
