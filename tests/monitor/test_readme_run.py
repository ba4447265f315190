"""README's "In your training run" examples run as written: a plain loop, Lightning, the
Hugging Face Trainer; each writes its run report."""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
import warnings
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def _blocks() -> list[str]:
    section = README.read_text().split("\n## In your training run\n", 1)[1]
    section = section.split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def _run(code: str, where: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    monkeypatch.chdir(where)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(code, str(README), "exec"), {"__name__": "readme"})
    return out.getvalue().splitlines()


def test_the_section_has_one_example_per_entry_point() -> None:
    blocks = _blocks()
    assert len(blocks) == 3
    assert "torchscope.monitor(" in blocks[0]
    assert "TorchscopeCallback(" in blocks[1]
    assert "TorchscopeTrainerCallback(" in blocks[2]
    assert (README.parent / "docs" / "run-heatmap.png").is_file()


def test_plain_loop_example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    printed = _run(_blocks()[0], tmp_path, monkeypatch)
    assert printed[0] == "60 6"
    assert json.loads((tmp_path / "run-report" / "report.json").read_text())["kind"] == "run"


def test_lightning_example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("pytorch_lightning")
    _run(_blocks()[1], tmp_path, monkeypatch)
    doc = json.loads((tmp_path / "run-report-pl" / "report.json").read_text())
    assert doc["sections"]["run"]["data"]["steps"] == 50
    assert doc["sections"]["run"]["data"]["samples"] == 5


def test_hf_example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    printed = _run(_blocks()[2], tmp_path, monkeypatch)
    clipped, ours = (float(v) for v in printed[-1].split())
    assert math.isclose(clipped, ours, rel_tol=1e-6)
    assert (tmp_path / "run-report-hf" / "report.html").is_file()
