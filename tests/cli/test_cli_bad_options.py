"""Bad option values of every command fail before any work: one line, exit code 2."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from torchscope.cli import app

runner = CliRunner()


def _assert_one_line_error(argv: list[str], *needles: str) -> None:
    result = runner.invoke(app, argv)
    out = result.output
    assert result.exit_code == 2, out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, out
    assert lines[0].startswith("error:"), out
    assert "Traceback" not in out and "unexpected" not in out, out
    for needle in needles:
        assert needle in lines[0], out


@pytest.mark.parametrize(
    "argv",
    [
        ["capture", "mlp", "--json", "{d}"],
        ["grads", "mlp", "--json", "{d}"],
        ["grads", "mlp", "--plot", "{d}/flow.png"],
        ["memory", "mlp", "--json", "{d}"],
        ["memory", "mlp", "--plot", "{d}"],
        ["profile", "mlp", "--json", "{d}"],
        ["profile", "mlp", "--text", "{d}"],
        ["profile", "mlp", "--trace", "{d}"],
        ["compile", "mlp", "--json", "{d}"],
        ["lint", "--no-config", "--output-file", "{d}", "{d}"],
        ["diff", "{d}/a.json", "{d}/b.json", "--json", "{d}"],
        ["lab", "--skip", "forward,backward,profile,checkpoint,memory,compile", "--json", "{d}"],
    ],
)
def test_output_file_that_is_a_folder(tmp_path: Path, argv: list[str]) -> None:
    (tmp_path / "flow.png").mkdir()
    _assert_one_line_error([a.format(d=tmp_path) for a in argv], "is a folder, not a file")


def test_output_under_a_file(tmp_path: Path) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    _assert_one_line_error(["capture", "mlp", "--json", str(blocker / "acts.json")],
                           "which is a file")
    assert blocker.read_text() == ""


def test_doctor_out_that_is_a_file(tmp_path: Path) -> None:
    existing = tmp_path / "report"
    existing.write_text("keep me")
    _assert_one_line_error(["doctor", "mlp", "--out", str(existing)], "is an existing file")
    assert existing.read_text() == "keep me"


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["profile", "mlp", "--limit", "0"], ["--limit 0"]),
        (["profile", "mlp", "--limit", "-1"], ["--limit -1"]),
        (["profile", "mlp", "--by", "module", "--depth", "-1"], ["--depth -1"]),
        (["profile", "mlp", "--trace-steps", "0"], ["--trace-steps 0"]),
        (["profile", "mlp", "--lr", "-1"], ["--lr -1.0"]),
        (["compile", "mlp", "--timeout", "0"], ["--timeout 0 "]),
        (["compile", "mlp", "--timeout", "-1"], ["--timeout -1 "]),
        (["doctor", "mlp", "--steps", "0"], ["--steps 0"]),
        (["memory", "mlp", "--plot", "memory.txt"], ["must end in .png or .svg"]),
        (["grads", "mlp", "--plot", "flow.jpg"], ["must end in .png or .svg"]),
        (["doctor", "mlp", "--modes", "default,bogus"], ["--modes", "bogus", "reduce-overhead"]),
        # The doctor's old spelling still works, hidden from --help.
        (["doctor", "mlp", "--compile-modes", "bogus"], ["--compile-modes", "bogus"]),
        (["doctor", "mlp", "--modes", ","], ["--modes ','", "lists no mode"]),
        (["grads", "mlp", "--lr", "inf"], ["--lr inf"]),
        (["profile", "mlp", "--lr", "inf"], ["--lr inf"]),
        (["memory", "deep-mlp", "-b", "64KB", "-c", "all"], ["--budget 64KB", "--checkpoint all"]),
        (["memory", "deep-mlp", "-b", "64KB", "-c", "sqrt"], ["--checkpoint sqrt"]),
        (["compile", "mlp", "--warmup", "-1"], ["--warmup -1", "--warmup 0 or more"]),
        (["compile", "mlp", "--iters", "0"], ["--iters 0", "--iters 1 or more"]),
        (["profile", "mlp", "--trace", "t.txt"], ["--trace 't.txt'", ".json.gz"]),
        # Ignored without --by module, even a selection that matched nothing.
        (["profile", "tiny-cnn", "--select", "nomatch*"], ["--select", "add --by module"]),
        (["profile", "tiny-cnn", "--depth", "1"], ["--depth", "add --by module"]),
    ],
)
def test_bad_option_value(argv: list[str], needles: list[str]) -> None:
    _assert_one_line_error(argv, *needles)


@pytest.mark.parametrize(
    ("argv", "option", "least"),
    [
        (["profile", "mlp", "--steps", "0"], "--steps", 1),
        (["profile", "mlp", "--wait", "-1"], "--wait", 0),
        (["profile", "mlp", "--warmup", "-1"], "--warmup", 0),
        (["grads", "mlp", "--steps", "0"], "--steps", 1),
        (["capture", "mlp", "--depth", "-1"], "--depth", 0),
        (["grads", "mlp", "--depth", "-2"], "--depth", 0),
        (["memory", "mlp", "--depth", "-1"], "--depth", 0),
        (["memory", "mlp", "--repeats", "0"], "--repeats", 1),
        (["compile", "mlp", "--timeout", "nan"], "--timeout", None),
    ],
)
def test_a_number_out_of_range_is_named_as_the_option(argv: list[str], option: str,
                                                        least: int | None) -> None:
    """The line names the option as typed, not the Python argument behind it: these said
    `steps=0`, `depth=-1` (with a fix of `depth=None`, which no option can pass) or
    `timeout_s=nan`, and mlp has no known input, so they must fail before loading it."""
    value = argv[-1]
    fix = f"pass {option} {least} or more" if least is not None else f"pass {option} 600"
    _assert_one_line_error(argv, f"{option} {value} ", fix)
    line = runner.invoke(app, argv).output
    assert f"{option.lstrip('-')}=" not in line and "depth=None" not in line, line


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["bogus"], ["No such command 'bogus'", "torchscope --help"]),
        (["memory", "mlp", "--steps", "1"],
         ["No such option: --steps", "torchscope memory --help"]),
        (["memory", "mlp", "--depth", "-1"], ["depth"]),
        (["profile", "--steps", "abc"], ["'--steps'", "torchscope profile --help"]),
        (["grads", "--lr"], ["'--lr' requires an argument"]),
        (["diff", "only-one.json"], ["Missing argument"]),
        (["lint", "--no-config", "--rules", "", "src"], ["--rules lists no rule"]),
        # --select chooses modules in every command; lint's rule codes are --rules.
        (["lint", "--no-config", "--select", "TS001", "src"], ["No such option: --select"]),
        (["compile", "mlp", "--modes", ","], ["--modes ','"]),
    ],
)
def test_usage_error_is_one_line(argv: list[str], needles: list[str]) -> None:
    _assert_one_line_error(argv, *needles)


def test_bare_command_still_shows_the_help() -> None:
    result = runner.invoke(app, [])
    assert result.exit_code == 2
    assert "Usage" in result.output and "capture" in result.output and "error:" not in result.output


def test_a_torchscript_model_is_one_line_before_any_work(tmp_path: Path) -> None:
    """A scripted model calls no Python hook: every section of the doctor failed on it, and
    it said that nothing looked wrong. One line instead, and no report folder."""
    (tmp_path / "scripted.py").write_text(
        "import torch\n"
        "from torch import nn\n\n\n"
        "def build():\n"
        "    return torch.jit.script(nn.Sequential(nn.Linear(8, 8), nn.ReLU()))\n")
    out = tmp_path / "report"
    for command in ("doctor", "grads", "capture"):
        _assert_one_line_error([command, f"{tmp_path / 'scripted.py'}:build", "--input", "4x8",
                                *(["--out", str(out)] if command == "doctor" else [])],
                               "TorchScript module", "pass the eager module")
    assert not out.exists()


def test_the_heatmap_next_to_a_plot_is_checked_before_any_work(tmp_path: Path) -> None:
    """With --steps 2 the grads command also writes FLOW-heatmap.png: a folder there failed
    after the training steps, named the wrong path and left FLOW.png behind."""
    (tmp_path / "flow-heatmap.png").mkdir()
    _assert_one_line_error(["grads", "mlp", "--steps", "2", "--plot",
                            str(tmp_path / "flow.png")], "flow-heatmap.png", "is a folder")
    assert not (tmp_path / "flow.png").exists()


def test_a_factory_that_exits_is_one_line(tmp_path: Path) -> None:
    """A factory reaching a script's sys.exit() ended the CLI with that code and no word."""
    (tmp_path / "script.py").write_text("import sys\n\n\ndef build():\n    sys.exit(3)\n")
    _assert_one_line_error(["capture", f"{tmp_path / 'script.py'}:build", "--input", "4x8"],
                           "called sys.exit(3)", "__main__")
