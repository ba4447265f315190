"""One spelling per concept across the commands (issue 47): `--device` with the default
`auto` wherever a model runs, `-o` always `--out` (a folder), `--json` a JSON file, one
name for compile modes, `--select` only for modules, defaults written one way, every
`--help` within 100 columns, and errors in the CLI's own terms."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from torchscope.cli import app

runner = CliRunner()

# The commands that load and run a model (lint reads source; diff reads two reports).
RUNS_A_MODEL = ("capture", "grads", "memory", "profile", "compile", "doctor", "lab")


def _commands() -> dict[str, Any]:
    """Typer's click commands by name (Typer carries its own click: no isinstance)."""
    return dict(typer.main.get_command(app).commands)  # type: ignore[attr-defined]


def _options(command: Any) -> list[Any]:
    return [p for p in command.params if p.param_type_name == "option"]


def _option(command: Any, name: str) -> Any:
    return next((p for p in _options(command) if name in p.opts), None)


def test_every_command_that_takes_inputs_is_listed_as_running_a_model() -> None:
    commands = _commands()
    assert set(RUNS_A_MODEL) <= set(commands)
    for name, command in commands.items():
        if _option(command, "--input") is not None:  # takes a model's inputs: runs it
            assert name in RUNS_A_MODEL, name


@pytest.mark.parametrize("name", RUNS_A_MODEL)
def test_every_model_running_command_takes_device_auto(name: str) -> None:
    option = _option(_commands()[name], "--device")
    assert option is not None, f"{name} has no --device"
    assert option.default == "auto"
    assert "cuda:N" in (option.help or "")


@pytest.mark.parametrize("name", ["lint", "diff"])
def test_commands_that_run_no_model_take_no_device(name: str) -> None:
    assert _option(_commands()[name], "--device") is None


def test_short_options_mean_the_same_everywhere() -> None:
    meaning: dict[str, set[str]] = {}
    for command in _commands().values():
        for param in _options(command):
            longs = tuple(o for o in param.opts if o.startswith("--"))
            for short in (o for o in param.opts if not o.startswith("--")):
                meaning.setdefault(short, set()).update(longs)
    odd = {short: longs for short, longs in meaning.items() if len(longs) != 1}
    assert not odd, f"one short option, several long ones: {odd}"
    assert meaning["-o"] == {"--out"}


def test_out_is_a_folder_and_json_a_json_file() -> None:
    for name, command in _commands().items():
        out = _option(command, "--out")
        if out is not None:
            assert "folder" in (out.help or "").lower(), name
        json_opt = _option(command, "--json")
        if json_opt is not None:
            assert "file" in (json_opt.help or "").lower(), name


def test_compile_modes_have_one_name() -> None:
    for name in ("compile", "doctor"):
        option = _option(_commands()[name], "--modes")
        assert option is not None and option.opts == ["--modes", "-m"], name
    hidden = _option(_commands()["doctor"], "--compile-modes")
    assert hidden is not None and hidden.hidden  # the old spelling, kept out of --help
    assert "--compile-modes" not in runner.invoke(app, ["doctor", "--help"],
                                                  env={"COLUMNS": "100"}).output


def test_select_chooses_modules_only() -> None:
    for name, command in _commands().items():
        option = _option(command, "--select")
        if option is not None:
            assert "module" in (option.help or "").lower(), name
    assert _option(_commands()["lint"], "--select") is None
    assert _option(_commands()["lint"], "--rules") is not None


@pytest.mark.parametrize("name", sorted({*RUNS_A_MODEL, "lint", "diff"}))
def test_help_fits_100_columns_and_writes_defaults_one_way(name: str) -> None:
    result = runner.invoke(app, [name, "--help"], env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert max(len(line) for line in lines) <= 100
    text = " ".join(" ".join(line.strip("│ ") for line in lines).split())
    # Every default reads "[default: ...]": none is written in prose.
    assert not re.search(r"\bDefault:|\(default:|Default [a-z]", text), text
    assert "lesson" not in text.lower() and "milestone" not in text.lower()


def test_a_default_without_a_value_is_still_shown() -> None:
    text = runner.invoke(app, ["capture", "--help"], env={"COLUMNS": "100"}).output
    assert "[default: (tiny-cnn)]" in text


def test_no_blocks_to_checkpoint_is_said_in_cli_terms(tmp_path: Path) -> None:
    path = tmp_path / "flat.py"
    path.write_text("from torch import nn\n\n\ndef build():\n    return nn.Linear(8, 4)\n")
    result = runner.invoke(app, ["memory", f"{path}:build", "--input", "4x8",
                                 "--checkpoint", "all"])
    assert result.exit_code == 2, result.output
    line = " ".join(result.output.split())
    assert "--blocks layer1,layer2" in line
    assert "blocks=[" not in line
    assert "Linear has no nn.Sequential or nn.ModuleList of 2+ blocks" in line
    # Blocks named that match nothing: the selection's own error and fix, not this advice.
    result = runner.invoke(app, ["memory", f"{path}:build", "--input", "4x8",
                                 "--checkpoint", "all", "--blocks", "nothing*"])
    assert result.exit_code == 2, result.output
    line = " ".join(result.output.split())
    assert "'nothing*' matched no module" in line and "--blocks layer1" not in line


def test_device_is_used_by_a_command_that_did_not_take_it_before(tmp_path: Path) -> None:
    out = tmp_path / "acts.json"
    result = runner.invoke(app, ["capture", "mlp", "--device", "cpu", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert out.is_file()
    bad = runner.invoke(app, ["capture", "mlp", "--device", "tpu"])
    assert bad.exit_code == 2 and "--device 'tpu'" in bad.output
