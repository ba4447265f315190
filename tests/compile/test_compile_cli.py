"""`torchscope compile`: one row per mode, JSON, and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import torchscope.compile as tc
from torchscope.cli.app import app
from torchscope.compile.records import (
    CompileReport,
    GraphBreak,
    ModeResult,
    Recompile,
    derive_speed,
)
from torchscope.step import Step, StepInfo

runner = CliRunner()


def _fake_report(model: Any, inputs: Any, **kw: Any) -> CompileReport:
    speedup, break_even = derive_speed(4.0, 1.0, 9.0)
    rec = Recompile("0/1", "forward", "/x/zoo.py", 25,
                    "tensor 'x' size mismatch at index 0. expected 32, actual 16", ("r",))
    rows = (
        ModeResult("default", "ok", cold_compile_s=9.0, warm_compile_s=1.0, eager_ms=4.0,
                   compiled_ms=1.0, speedup=speedup, break_even_calls=break_even,
                   max_abs_diff=1e-7, recompiles=(rec,), iters=kw["iters"]),
        ModeResult("max-autotune", "timeout", error="no result after 5 s"),
    )
    brk = GraphBreak("print() call", "Failed to trace builtin operator", "", "/x/m.py", 12,
                     "forward")
    step = StepInfo("mean squared error vs seeded targets", 0.5) \
        if kw["measure"] == "step" else None
    return CompileReport(kw["name"], inputs.describe(), "cpu", kw["measure"], rows, (brk,), 2,
                         8, torch.__version__, step=step)


def test_table_json_and_options(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: dict[str, Any] = {}

    def fake(step: Step, **kw: Any) -> CompileReport:
        # The CLI hands over one Step: the loss and precision it asked for are on it.
        seen.update(kw, modes=list(kw["modes"]), loss_fn=step.loss_fn, autocast=step.autocast)
        return _fake_report(step.model, step.inputs, **kw)

    monkeypatch.setattr(tc, "compile_report", fake)
    out = tmp_path / "c.json"
    res = runner.invoke(app, ["compile", "tiny-cnn", "--modes", "default,max-autotune",
                              "--measure", "step", "--loss", "mse", "--iters", "7",
                              "--batch-sizes", "16,8", "--dynamic", "off", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert seen["modes"] == ["default", "max-autotune"]
    assert seen["measure"] == "step" and seen["loss_fn"] == "mse" and seen["iters"] == 7
    assert seen["batch_sizes"] == (16, 8) and seen["dynamic"] is False
    assert seen["factory"] == "tiny-cnn" and seen["autocast"] is None
    for text in ("loss: mean squared error vs seeded targets = 0.5",
                 "default", "4.00×", "2", "1/8", "timeout", "m.py:12", "print() call",
                 "expected 32, actual 16", "pays off after 3,000 calls", "3,000"):
        assert text in res.output, text
    data = json.loads(out.read_text())
    assert data["report"]["modes"][0]["break_even_calls"] == 3000
    assert {f["code"] for f in data["findings"]} >= {"compile.pays_off", "compile.timeout",
                                                     "compile.graph_break"}


@pytest.mark.parametrize("args, needle", [
    (["--modes", "fastest"], "unknown torch.compile mode"),
    (["--dynamic", "maybe"], "--dynamic"),
    (["--batch-sizes", "16,x"], "--batch-sizes"),
    (["--iters", "0"], "iters"),
    (["--input", "3xx"], "malformed"),
    (["--measure", "train"], "--measure"),
    (["--loss", "hinge"], "--loss"),
    (["--train"], "--train"),  # the old flag: typer's unknown-option error, in one line
])
def test_bad_input_is_one_line_exit_2(args: list[str], needle: str) -> None:
    res = runner.invoke(app, ["compile", "tiny-cnn", *args])
    assert res.exit_code == 2, res.output
    assert needle in res.output
    assert "Traceback" not in res.output
    assert len([ln for ln in res.output.splitlines() if ln.strip()]) == 1
