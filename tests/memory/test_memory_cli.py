"""`torchscope memory` through typer's CliRunner."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from torchscope.cli import app

runner = CliRunner()


def test_memory_deep_mlp_with_budget_writes_json_and_plot(tmp_path: Path) -> None:
    out, png = tmp_path / "m.json", tmp_path / "m.png"
    res = runner.invoke(app, ["memory", "deep-mlp", "--budget", "64KB", "--repeats", "1",
                              "--json", str(out), "--plot", str(png)])
    assert res.exit_code == 0, res.output
    assert "73,728 B in 9 storages" in res.output
    assert "bitwise equal" in res.output
    data = json.loads(out.read_text())
    assert data["report"]["saved"]["total_bytes"] == 73_728
    assert data["report"]["chosen"] == "budget"
    plans = {p["name"]: p for p in data["report"]["plans"]["plans"]}
    assert plans["budget"]["saved_bytes"] <= 65_536
    assert png.stat().st_size > 1000


def _one_line_error(res) -> str:  # type: ignore[no-untyped-def]
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1, res.output
    assert "Traceback" not in res.output
    return lines[0]


def test_unmeetable_budget_is_one_line_exit_2() -> None:
    line = _one_line_error(runner.invoke(app, ["memory", "deep-mlp", "--budget", "100B"]))
    assert "at least 8,192 B" in line


def test_bad_inputs_are_one_line_exit_2() -> None:
    assert "malformed" in _one_line_error(
        runner.invoke(app, ["memory", "deep-mlp", "--input", "32xx64"]))
    assert "raised" in _one_line_error(
        runner.invoke(app, ["memory", "deep-mlp", "--input", "32x65"]))
    assert "not a size" in _one_line_error(
        runner.invoke(app, ["memory", "deep-mlp", "--budget", "lots"]))
    assert "not a plan" in _one_line_error(
        runner.invoke(app, ["memory", "deep-mlp", "--checkpoint", "half"]))
    assert "no nn.Sequential" in _one_line_error(
        runner.invoke(app, ["memory", "tiny-cnn", "--checkpoint", "sqrt"]))
