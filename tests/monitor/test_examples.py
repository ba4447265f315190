"""`python -m torchscope.examples.train_monitor` runs and writes a run report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from torchscope.examples.train_monitor import main


def _example(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "torchscope.examples.train_monitor", *args],
                          capture_output=True, text=True, timeout=300, check=False)


def test_train_monitor_writes_a_run_report(tmp_path: Path) -> None:
    done = _example("--steps", "24", "--every", "4", "--profile", "2", "--accumulate", "2",
                    "--model", "mlp", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "24 steps, 6 samples" in done.stdout
    assert "run report:" in done.stdout
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["kind"] == "run" and doc["sections"]["run"]["data"]["steps"] == 24
    assert doc["sections"]["profile"]["status"] == "ok"
    assert doc["step"]["accumulate"] == 2
    assert 'data-plot="run-grad-heatmap"' in (tmp_path / "report.html").read_text()


def test_bad_options_exit_2_in_one_line(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--steps", "0", "--out", str(tmp_path)]) == 2
    out = capsys.readouterr().out
    assert out.strip().count("\n") == 0 and "--steps 0" in out
    assert main(["--out", "/proc/torchscope-example"]) == 2
    out = capsys.readouterr().out
    assert out.strip().count("\n") == 0 and "out='/proc/torchscope-example'" in out
