"""`--autocast`: every command that runs a training step runs it in the precision the user
trains in, through the one `Step.with_autocast`; an unknown precision is one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from torchscope.cli import app

runner = CliRunner()


@pytest.mark.parametrize("command", ["grads", "memory", "profile"])
def test_a_step_command_runs_in_the_precision_asked_for(command: str, tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    result = runner.invoke(app, [command, "mlp", "--autocast", "bf16", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "autocast: torch.bfloat16" in result.output
    doc = json.loads(out.read_text())
    step = {"grads": doc.get("step"), "memory": doc.get("report", {}).get("step"),
            "profile": doc.get("result", {}).get("step")}[command]
    assert step["autocast"] == "torch.bfloat16" and step["scaler"] is False


def test_fp16_comes_with_a_grad_scaler(tmp_path: Path) -> None:
    out = tmp_path / "grads.json"
    result = runner.invoke(app, ["grads", "mlp", "--autocast", "fp16", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "autocast: torch.float16 + GradScaler" in result.output
    step = json.loads(out.read_text())["step"]
    assert step["autocast"] == "torch.float16" and step["scaler"] is True


def test_capture_records_the_activations_in_that_precision(tmp_path: Path) -> None:
    out = tmp_path / "acts.json"
    result = runner.invoke(app, ["capture", "mlp", "--autocast", "bf16", "--json", str(out)])
    assert result.exit_code == 0, result.output
    records = json.loads(out.read_text())["records"]
    linear = [r for r in records if r["module_type"] == "Linear"]
    assert linear and all(r["outputs"][0]["dtype"] == "torch.bfloat16" for r in linear)


def test_the_doctor_runs_its_step_in_that_precision(tmp_path: Path) -> None:
    out = tmp_path / "report"
    result = runner.invoke(app, ["doctor", "mlp", "--fast", "--autocast", "bf16",
                                 "--skip", "compile,profile", "--out", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads((out / "report.json").read_text())
    assert doc["step"]["autocast"] == "torch.bfloat16"


@pytest.mark.parametrize("command", ["doctor", "grads", "memory", "profile", "capture",
                                     "compile"])
def test_an_unknown_precision_is_one_line_before_any_work(command: str, tmp_path: Path
                                                           ) -> None:
    out = tmp_path / "report"
    argv = [command, "mlp", "--autocast", "fp32"] + (["--out", str(out)]
                                                     if command == "doctor" else [])
    result = runner.invoke(app, argv)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0] == "error: --autocast 'fp32' is not one of bf16, fp16. Fix: pick one of " \
        "those."
    assert not out.exists()
