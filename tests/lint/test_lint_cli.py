"""`torchscope lint` through the Typer app: formats, exit codes, one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from torchscope.cli import app
from torchscope.lint import RULES

from ._fixtures import FIXTURES

runner = CliRunner()


def _lint(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, ["lint", *args])
    assert not isinstance(result.exception, Exception) or isinstance(
        result.exception, SystemExit), result.exception
    return result.exit_code, result.stdout, result.stderr


def test_clean_file_exits_0() -> None:
    code, out, _ = _lint(str(FIXTURES / "ts001_negative.py"), "--no-config")
    assert code == 0
    assert out.startswith(f"All checks passed (1 file, {len(RULES)} rules)")


def test_findings_exit_1_with_ruff_like_lines() -> None:
    path = FIXTURES / "ts001_breaks_hook_in_training_loop.py"
    code, out, _ = _lint(str(path), "--no-fixes")
    assert code == 1
    lines = out.splitlines()
    assert lines[0].startswith(f"{path}:18:23: TS001 `register_forward_hook` runs on every")
    assert lines[-1] == "Found 1 problem (TS001 ×1) in 1 file."


def test_select_and_ignore_on_the_command_line() -> None:
    path = str(FIXTURES / "ts002_positive.py")
    code, out, _ = _lint(path, "--format", "json", "--ignore", "TS002")
    assert (code, json.loads(out)["violations"]) == (0, [])
    code, out, _ = _lint(path, "-f", "json", "--rules", "TS001,TS002")
    assert code == 1
    assert {v["code"] for v in json.loads(out)["violations"]} == {"TS002"}


def test_sarif_to_stdout_and_to_a_file(tmp_path: Path) -> None:
    path = str(FIXTURES / "ts003_positive.py")
    code, out, _ = _lint(path, "--format", "sarif")
    assert code == 1
    log = json.loads(out)
    assert log["version"] == "2.1.0"
    assert [r["ruleId"] for r in log["runs"][0]["results"]] == ["TS003", "TS003"]
    assert _lint(path, "-f", "sarif", "--exit-zero")[0] == 0
    target = tmp_path / "lint.sarif"
    code, out, err = _lint(path, "-f", "sarif", "--output-file", str(target))
    assert code == 1 and out == "" and "wrote" in err
    assert json.loads(target.read_text()) == log


def test_parse_error_exits_2_names_file_and_line_and_keeps_going(tmp_path: Path) -> None:
    (tmp_path / "bad.py").write_text("x = 1\nif x\n")
    (tmp_path / "leak.py").write_text("m.register_forward_hook(f)\n")
    code, out, _ = _lint(str(tmp_path), "--no-config")
    assert code == 2
    assert f"{tmp_path / 'bad.py'}:2:5: error: cannot parse" in out
    assert f"{tmp_path / 'leak.py'}:1:3: TS002" in out


@pytest.mark.parametrize(("args", "needle"), [
    (["--format", "xml"], "unknown --format 'xml'"),
    (["--rules", "TS9"], "--rules/select entry 'TS9' matches no rule"),
    (["does/not/exist.py"], "does not exist"),
    (["--config", "missing.toml"], "cannot read missing.toml"),
    (["--config", "x.toml", "--no-config"], "contradict"),
])
def test_usage_errors_exit_2_with_one_line(args: list[str], needle: str) -> None:
    code, out, err = _lint(*args, str(FIXTURES / "ts003_positive.py")) if args[0] != \
        "does/not/exist.py" else _lint(*args)
    assert code == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert needle in err and "Traceback" not in err


def test_folder_with_no_python_file_exits_2_with_one_line(tmp_path: Path) -> None:
    # A mistyped or empty folder is no pass: "All checks passed (0 files)" would let CI
    # go green having checked nothing.
    empty = tmp_path / "empty"
    empty.mkdir()
    other = tmp_path / "other"
    (other / "sub").mkdir(parents=True)
    (other / "notes.txt").write_text("for x in data:\n    m.compile()\n")
    (other / "stub.pyi").write_text("x: int\n")
    for folder in (empty, other):
        code, out, err = _lint(str(folder), "--no-config")
        assert (code, out) == (2, "")
        assert len(err.strip().splitlines()) == 1, err
        assert f"'{folder}' holds no Python file to lint" in err and "Fix:" in err
        assert "Traceback" not in err
    (other / "sub" / "train.py").write_text("x = 1\n")
    assert _lint(str(other), "--no-config")[0] == 0


def test_default_path_is_the_current_folder(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "train.py").write_text("for b in data:\n    m.compile()\n")
    monkeypatch.chdir(tmp_path)
    code, out, _ = _lint("--no-fixes")
    assert code == 1
    assert out.splitlines()[0].startswith("train.py:2:7: TS004 `m.compile()` runs on every")
