"""`torchscope grads`: output, JSON, plots, and one-line errors with exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from torchscope.cli import app

runner = CliRunner()


# On one reduction path throughout: a kernel that became ready between the two runs would
# change their eager/fused counts.
@pytest.mark.usefixtures("reduction_path")
def test_default_target_tiny_cnn(tmp_path: Path) -> None:
    out = tmp_path / "g.json"
    plot = tmp_path / "g.png"
    res = runner.invoke(app, ["grads", "--input", "4x3x16x16", "--json", str(out),
                              "--plot", str(plot)])
    assert res.exit_code == 0, res.output
    assert "tiny-cnn" in res.output and "input does not require grad" in res.output
    data = json.loads(out.read_text())
    assert [m["module"] for m in data["flow"]["modules"]] == [
        "fc", "pool", "conv2", "relu", "conv1"]
    assert data["flow"]["total_norm"] > 0
    assert plot.read_bytes()[:4] == b"\x89PNG"
    # The step is stated, and it is the step gradient_flow runs on the same model and input.
    assert "loss: auto → cross-entropy vs seeded targets" in res.output
    assert "optimizer: SGD" in res.output
    from torchscope.grads import gradient_flow
    from torchscope.models.target import load_inputs, load_target

    loaded = load_target("tiny-cnn")
    flow = gradient_flow(loaded.model, load_inputs(loaded, ["4x3x16x16"]))
    assert flow.step is not None and flow.step.loss == data["step"]["loss"]
    assert data["step"]["loss_value"] == flow.step.loss_value
    assert data["flow"]["total_norm"] == flow.total_norm
    # Targets come from a seeded generator: a second run gives the same numbers.
    out2 = tmp_path / "g2.json"
    runner.invoke(app, ["grads", "--input", "4x3x16x16", "--json", str(out2)])
    assert json.loads(out2.read_text())["flow"] == data["flow"]


def test_steps_mse_heatmap(tmp_path: Path) -> None:
    plot = tmp_path / "m.svg"
    out = tmp_path / "m.json"
    res = runner.invoke(app, ["grads", "mlp", "--input", "8x128", "--loss", "mse",
                              "--steps", "3", "--plot", str(plot), "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "m-heatmap.svg").exists() and plot.exists()
    assert "loss: mean squared error vs seeded targets" in res.output
    data = json.loads(out.read_text())
    assert data["step"]["loss"] == "mean squared error vs seeded targets"
    assert data["history"]["steps"] == [0, 1, 2]
    assert data["history"]["layers"] == ["fc2", "relu", "fc1"]


@pytest.mark.parametrize("args", [
    ["grads", "--input", "4x5x16x16"],          # wrong channel count
    ["grads", "--input", "4xx3"],               # malformed spec
    ["grads", "--loss", "hinge"],               # unknown loss
    ["grads", "--steps", "0"],                  # nothing to run
    ["grads", "--plot", "out.jpg"],             # unsupported plot format
    ["grads", "no-such-model"],                 # unknown target
])
def test_bad_input_one_line_exit_2(args: list[str]) -> None:
    res = runner.invoke(app, args)
    assert res.exit_code == 2, res.output
    text = res.output.strip()
    assert len(text.splitlines()) == 1, text
    assert text.startswith("error:") and "Traceback" not in text
