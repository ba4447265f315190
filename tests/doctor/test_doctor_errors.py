"""Errors keep their story: a section that fails keeps its exception; `--debug` prints its
traceback, without it one line; nothing runs the model again after an error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from torchscope.cli import app
from torchscope.doctor import DoctorOptions, run_doctor
from torchscope.errors import ModelError, TorchscopeError
from torchscope.step import Step

# The model's forward works; its backward raises. Every forward appends whether grad was on,
# so the test can count the forwards of the gradients section (the doctor's input check runs
# under no_grad).
FACTORY = '''
from pathlib import Path

import torch
from torch import nn

CALLS = Path(__file__).with_suffix(".calls")


class _NoBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("custom op: backward is not implemented here")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        with CALLS.open("a") as f:
            f.write("grad\\n" if torch.is_grad_enabled() else "nograd\\n")
        return _NoBackward.apply(self.fc(x))


def build():
    return Net(), torch.randn(16, 8)
'''

ONLY_GRADIENTS = ["--skip", "activations,memory,profile,compile"]


def _factory(tmp_path: Path) -> tuple[Path, Path]:
    path = tmp_path / "failing_backward.py"
    path.write_text(FACTORY)
    return path, path.with_suffix(".calls")


@pytest.mark.parametrize("debug", [False, True])
def test_a_section_that_raises_in_backward_is_reported_once(tmp_path: Path, debug: bool
                                                            ) -> None:
    factory, calls = _factory(tmp_path)
    out = tmp_path / "report"
    res = CliRunner().invoke(app, ["doctor", f"{factory}:build", *ONLY_GRADIENTS, "--out",
                                   str(out), *(["--debug"] if debug else [])])
    assert res.exit_code == 0, res.output  # the report is still written
    # The gradients section ran the model's forward exactly once: no retry with another loss.
    assert calls.read_text().splitlines().count("grad") == 1
    doc = json.loads((out / "report.json").read_text())
    section = doc["sections"]["gradients"]
    assert section["status"] == "failed" and section["data"] is None
    note = section["note"]
    assert "\n" not in note and "backward raised RuntimeError: custom op: backward is not " \
        "implemented here" in note
    if debug:
        # The section's own traceback, down to the factory's backward, on stderr.
        assert "section gradients failed:" in res.stderr
        assert "Traceback (most recent call last)" in res.stderr
        assert f'File "{factory}"' in res.stderr and "in backward" in res.stderr
        assert "RuntimeError: custom op: backward is not implemented here" in res.stderr
    else:
        assert "Traceback" not in res.output and "section gradients failed" not in res.output
        # One line for the section as it finishes, with the whole note.
        (line,) = [ln for ln in res.stdout.splitlines() if "Gradient flow: failed" in ln]
        assert line.startswith("[2/6] Gradient flow: failed (") and line.endswith(f" - {note}")


def test_the_outcome_keeps_the_exception_and_its_cause(tmp_path: Path) -> None:
    factory, calls = _factory(tmp_path)
    import importlib.util

    spec = importlib.util.spec_from_file_location("failing_backward", factory)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model, x = mod.build()
    report = run_doctor(model, x, options=DoctorOptions(skip=frozenset(
        {"activations", "memory", "profile", "compile"})))
    o = report.outcome("gradients")
    assert o.status == "failed" and isinstance(o.error, ModelError)
    assert isinstance(o.error.__cause__, RuntimeError)  # torch's own error, traceback intact
    assert o.error.__cause__.__traceback__ is not None
    assert o.note == o.error.one_line()
    assert calls.read_text().splitlines() == ["nograd", "grad"]


def test_a_step_with_inputs_or_a_loss_is_refused() -> None:
    model, x = torch.nn.Linear(4, 2), torch.randn(3, 4)
    with pytest.raises(TorchscopeError, match="a Step was given together with inputs"):
        run_doctor(Step(model, x), x)
    with pytest.raises(TorchscopeError, match=r"options\.loss_fn='mse' was given with a Step"):
        run_doctor(Step(model, x), options=DoctorOptions(loss_fn="mse"))
    with pytest.raises(TorchscopeError, match=r"options\.autocast='bf16' was given with a "
                       r"Step\. Fix: set it on the Step: Step\(model, x\)\.with_autocast"):
        run_doctor(Step(model, x), options=DoctorOptions(autocast="bf16"))
