"""`torchscope profile` through Typer's CliRunner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from torchscope.cli.app import app

runner = CliRunner()

_FAST = ["--input", "4x3x12x12", "--steps", "2", "--wait", "0", "--warmup", "1"]


def test_profile_default_target_by_module(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    trace = tmp_path / "t.json"
    res = runner.invoke(app, ["profile", *_FAST, "--by", "module", "--json", str(out),
                              "--trace", str(trace)])
    assert res.exit_code == 0, res.output
    assert "conv1" in res.output and "phase total" in res.output
    assert "loss: auto → cross-entropy vs seeded targets = " in res.output
    assert "optimizer: SGD" in res.output
    assert "profiler_start" not in res.output
    data = json.loads(out.read_text())
    assert data["target"] == "tiny-cnn"
    assert data["result"]["step"]["loss"] == "auto → cross-entropy vs seeded targets"
    assert data["result"]["step"]["optimizer"] == "SGD"
    assert {m["module"] for m in data["result"]["modules"]} >= {"conv1", "conv2", "fc"}
    assert "traceEvents" in json.loads(trace.read_text())


def test_profile_mlp_ops_sorted_by_total(tmp_path: Path) -> None:
    text = tmp_path / "p.txt"
    res = runner.invoke(app, ["profile", "mlp", "--steps", "2", "--sort", "total",
                              "--limit", "5", "--text", str(text)])
    assert res.exit_code == 0, res.output
    assert "Top ops by total" in res.output and "aten::" in res.output
    assert "aten::" in text.read_text()


def test_profile_loss_option_is_the_shared_steps() -> None:
    res = runner.invoke(app, ["profile", "mlp", *_FAST[2:], "--loss", "mse"])
    assert res.exit_code == 0, res.output
    assert "loss: mean squared error vs seeded targets = " in res.output


@pytest.mark.parametrize("args", [
    ["profile", "--input", "4x3x"],
    ["profile", "--input", "4x5x12x12", "--steps", "1"],
    ["profile", "--sort", "bogus"],
    ["profile", "--by", "layer"],
    ["profile", "--steps", "0"],
    ["profile", "no-such-model"],
    ["profile", "--select", "nothing*", "--by", "module", "--steps", "1"],
    ["profile", "--device", "tpu"],
    ["profile", "--loss", "hinge"],
])
def test_bad_input_is_one_line_exit_2(args: list[str]) -> None:
    res = runner.invoke(app, args)
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1, res.output
    assert lines[0].startswith("error:")
    assert "Traceback" not in res.output


def test_kineto_lines_stay_out_of_cli_output() -> None:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2] / "src")
    proc = subprocess.run(
        [sys.executable, "-m", "torchscope", "profile", "mlp", "--steps", "1", "--wait", "0",
         "--warmup", "0", "--limit", "3"],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "aten::" in proc.stdout
    assert "profiler_start" not in proc.stderr + proc.stdout
    assert "profiler_stop" not in proc.stderr + proc.stdout
