"""`torchscope capture`: the table, JSON, and one-line errors with exit code 2 for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from torchscope.cli import app

runner = CliRunner()

FACTORIES = """
import torch
from torch import nn

def good():
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU()), torch.randn(2, 4)

def raises():
    raise ValueError("no weights here")

def not_a_module():
    return {"model": 1}

def conv():
    return nn.Sequential(nn.Conv2d(3, 8, 3))
"""


@pytest.fixture
def factory_file(tmp_path: Path) -> Path:
    path = tmp_path / "factories.py"
    path.write_text(FACTORIES)
    return path


def test_default_target_prints_table_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "acts.json"
    result = runner.invoke(app, ["capture", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "conv1" in result.output and "(32, 8, 30, 30)" in result.output
    data = json.loads(out.read_text())
    assert [r["module"] for r in data["records"]] == ["conv1", "relu", "conv2", "pool", "fc"]
    assert data["records"][2]["outputs"][0]["shape"] == [32, 16, 28, 28]


def test_factory_file_with_inputs(factory_file: Path) -> None:
    result = runner.invoke(app, ["capture", f"{factory_file}:good"])
    assert result.exit_code == 0, result.output
    assert "(2, 3)" in result.output


def test_token_id_spec(tmp_path: Path) -> None:
    path = tmp_path / "emb.py"
    path.write_text(
        "from torch import nn\ndef build():\n    return nn.Sequential(nn.Embedding(1000, 8))\n"
    )
    result = runner.invoke(app, ["capture", f"{path}:build", "--input", "int64[0,1000):4x16"])
    assert result.exit_code == 0, result.output
    assert "(4, 16, 8)" in result.output


def _assert_one_line_error(result: object, *needles: str) -> None:
    out = result.output  # type: ignore[attr-defined]
    assert result.exit_code == 2, out  # type: ignore[attr-defined]
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, out
    assert lines[0].startswith("error:")
    assert "Traceback" not in out
    for needle in needles:
        assert needle in lines[0]


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["missing.py:build"], ["does not exist"]),
        (["{f}:nope"], ["has no attribute 'nope'"]),
        (["{f}:raises"], ["raised ValueError: no weights here"]),
        (["{f}:not_a_module"], ["returned dict, not a torch.nn.Module"]),
        (["--input", "32x3xx32"], ["malformed", "32x3x32x32"]),
        (["--input", "float99:3x4"], ["unknown dtype"]),
        (["--input", "32x4x32x32"], ["conv1 (Conv2d)", "4 channels", "--input"]),
        (["{f}:conv"], ["no example input", "--input"]),
        (["--select", "conv9"], ["matched no module", "conv1"]),
        (["not-a-model"], ["neither a built-in"]),
    ],
)
def test_bad_input_is_one_line_exit_2(
    factory_file: Path, args: list[str], needles: list[str]
) -> None:
    argv = ["capture", *[a.format(f=factory_file) for a in args]]
    _assert_one_line_error(runner.invoke(app, argv), *needles)


def test_debug_shows_traceback() -> None:
    result = runner.invoke(app, ["capture", "--input", "32x4x32x32", "--debug"])
    assert result.exit_code != 0
    assert result.exception is not None
