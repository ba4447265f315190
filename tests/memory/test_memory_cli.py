"""`torchscope memory` through typer's CliRunner."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from torchscope.cli import app

runner = CliRunner()


def test_memory_deep_mlp_with_budget_writes_json_and_plot(tmp_path: Path) -> None:
    out, png = tmp_path / "m.json", tmp_path / "m.png"
    res = runner.invoke(app, ["memory", "deep-mlp", "--loss", "sum", "--budget", "64KB",
                              "--repeats", "1", "--json", str(out), "--plot", str(png)])
    assert res.exit_code == 0, res.output
    assert "73,728 B in 9 storages" in res.output
    assert "loss: sum of the output = " in res.output
    assert "bitwise equal" in res.output
    data = json.loads(out.read_text())
    assert data["report"]["saved"]["total_bytes"] == 73_728
    assert data["report"]["chosen"] == "budget"
    plans = {p["name"]: p for p in data["report"]["plans"]["plans"]}
    assert plans["budget"]["saved_bytes"] <= 65_536
    assert png.stat().st_size > 1000
    assert data["report"]["step"]["loss"] == "sum of the output"
    assert "memory.checkpoint_plan" in [f["code"] for f in data["findings"]]


def test_memory_default_loss_is_auto_and_states_its_value(tmp_path: Path) -> None:
    from torchscope.models.target import load_inputs, load_target
    from torchscope.step import Step

    out = tmp_path / "m.json"
    res = runner.invoke(app, ["memory", "deep-mlp", "--json", str(out)])
    assert res.exit_code == 0, res.output
    step = json.loads(out.read_text())["report"]["step"]
    assert step["loss"] == "auto → cross-entropy vs seeded targets"
    assert f"loss: auto → cross-entropy vs seeded targets = {step['loss_value']:.4g}" \
        in res.output
    assert step["optimizer"] is None
    # The same step in Python: the built-in model and its inputs are built seeded.
    loaded = load_target("deep-mlp")
    inputs = load_inputs(loaded, (), None)
    want = Step(loaded.model.train(), inputs).forward_backward()
    assert step["loss_value"] == float(want)


def _one_line_error(res) -> str:  # type: ignore[no-untyped-def]
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1, res.output
    assert "Traceback" not in res.output
    return lines[0]


def test_unmeetable_budget_is_one_line_exit_2() -> None:
    line = _one_line_error(runner.invoke(app, ["memory", "deep-mlp", "--loss", "sum",
                                               "--budget", "100B"]))
    assert "at least 8,192 B" in line


def test_bad_inputs_are_one_line_exit_2() -> None:
    assert "malformed" in _one_line_error(
        runner.invoke(app, ["memory", "deep-mlp", "--input", "32xx64"]))
    assert "raised" in _one_line_error(
        runner.invoke(app, ["memory", "deep-mlp", "--input", "32x65"]))
    assert "not a size" in _one_line_error(
        runner.invoke(app, ["memory", "deep-mlp", "--budget", "lots"]))
    assert "not a known loss" in _one_line_error(
        runner.invoke(app, ["memory", "deep-mlp", "--loss", "l1"]))
    assert "not a plan" in _one_line_error(
        runner.invoke(app, ["memory", "deep-mlp", "--checkpoint", "half"]))
    assert "no nn.Sequential" in _one_line_error(
        runner.invoke(app, ["memory", "tiny-cnn", "--checkpoint", "sqrt"]))
