"""The README and the docs' examples run as written and print what their comments say; the
README stays a five-minute read (issue 47: at most about 250 lines, none over 400
characters, `make demo` and `make test` first), and every link in it resolves.

The README's "In your training run" examples are run by tests/monitor/test_readme_run.py and
the distributed guide's by tests/distributed/test_readme_distributed.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import warnings
from pathlib import Path

import pytest
from typer.testing import CliRunner

from torchscope.cli import app

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def _section(text: str, heading: str) -> str:
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def _exec(code: str, where: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> list[str]:
    monkeypatch.chdir(where)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(code, name, "exec"), {"__name__": "readme"})
    return out.getvalue().splitlines()


def test_the_readme_is_short_and_starts_with_the_two_make_commands() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 250
    assert max(len(line) for line in lines) <= 400
    first = _blocks(README.read_text(), "bash")[0].splitlines()
    assert first[0].startswith("make demo") and first[1].startswith("make test")
    # Terms a newcomer cannot know stay out of the README.
    text = README.read_text().lower()
    for term in (r"\bthe lesson\b", r"\bmilestones?\b", r"\bspecs?\b"):
        assert not re.search(term, text), term


def test_every_relative_link_of_the_readme_resolves() -> None:
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text())
    local = [t for t in targets if not t.startswith(("http://", "https://"))]
    assert local
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing, missing


def test_the_readme_points_at_the_report_screenshot_and_its_script() -> None:
    assert "docs/img/report.png" in README.read_text()
    assert (DOCS / "img" / "report.png").stat().st_size > 10_000
    assert (ROOT / "scripts" / "report_screenshot.py").is_file()


# What the README's `my_model.py` holds: a factory, and the keyword inputs for `--inputs`.
MY_MODEL = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.head = nn.Linear(8 * 30 * 30, 10)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x)).flatten(1))


def build():
    return Net()


def make_inputs():
    return {"x": torch.randn(4, 3, 32, 32)}
'''


def _readme_commands() -> list[str]:
    commands = []
    for block in _blocks(_section(README.read_text(), "Point it at your model"), "bash"):
        commands += [line.split("#")[0].strip() for line in block.splitlines()
                     if line.startswith("torchscope ")]
    return commands


@pytest.mark.slow
def test_the_three_ways_to_point_it_at_a_model_run_as_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's commands, each run in a folder holding the files they name: its own
    transformers factory, and a small my_model.py for `file.py:factory` and `--inputs`.
    `--skip compile` (seconds of cold compile per mode) keeps the test short; the options
    as written are all parsed and used."""
    section = _section(README.read_text(), "Point it at your model")
    factory = _blocks(section, "python")
    assert len(factory) == 1 and "transformers" in factory[0]
    (tmp_path / "llama_factory.py").write_text(factory[0])
    (tmp_path / "my_model.py").write_text(MY_MODEL)
    commands = _readme_commands()
    assert [c.split()[2] for c in commands] == ["my_model.py:build", "my_model.py:build",
                                                "llama_factory.py:build"]
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    for n, command in enumerate(commands):
        argv = shlex.split(command)[1:]
        if "--out" not in argv:
            argv += ["--out", f"report-{n}"]
        result = runner.invoke(app, [*argv, "--skip", "compile"])
        assert result.exit_code == 0, (command, result.output[-3000:])
        out = tmp_path / argv[argv.index("--out") + 1]
        doc = json.loads((out / "report.json").read_text())
        ran = [s for s, v in doc["sections"].items() if v.get("status") == "ok"]
        assert {"activations", "gradients", "memory"} <= set(ran), (command, ran)
    # The config's model trained on its own loss (labels given), not on a seeded target.
    assert "the model's own loss" in json.dumps(doc["step"]), doc["step"]


@pytest.mark.slow
@pytest.mark.xdist_group("compile")
def test_the_getting_started_python_example_runs(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    page = DOCS / "getting-started.md"
    blocks = _blocks(_section(page.read_text(), "The Python API"), "python")
    assert blocks, "the Getting started page has no Python example"
    printed = _exec(blocks[0], tmp_path, monkeypatch, str(page))
    assert printed[0] == "(32, 8, 30, 30)"
    assert printed[1] == "['fc', 'conv2', 'conv1']"
    assert printed[2] == "input does not require grad"
    assert printed[3].startswith("loss: cross-entropy vs given targets = ")
    assert printed[3].endswith(" · optimizer: SGD")
    assert "True" in printed
    assert "[]" in printed
    assert "10" in printed
    assert "73728" in printed


def _your_run_blocks() -> list[str]:
    return _blocks((DOCS / "guides" / "your-run.md").read_text(), "python")


def test_the_your_run_guide_has_one_example_per_entry_point() -> None:
    blocks = _your_run_blocks()
    assert len(blocks) == 3
    assert "torchscope.monitor(" in blocks[0]
    assert "TorchscopeCallback(" in blocks[1]
    assert "TorchscopeTrainerCallback(" in blocks[2] and ".install(trainer)" in blocks[2]


@pytest.mark.slow
@pytest.mark.parametrize(("index", "folder"), [(0, "run-report"), (1, "run-report-pl"),
                                               (2, "run-report-hf")])
def test_the_your_run_guide_examples_write_their_reports(
        index: int, folder: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip(("torch", "pytorch_lightning", "transformers")[index])
    printed = _exec(_your_run_blocks()[index], tmp_path, monkeypatch, "your-run.md")
    doc = json.loads((tmp_path / folder / "report.json").read_text())
    assert doc["kind"] == "run"
    if index == 0:
        assert printed[0] == "60 6"
    if index == 2:  # the callback's total is the norm the Trainer clipped with
        clipped, ours = (float(v) for v in printed[-1].split())
        assert clipped == pytest.approx(ours, rel=1e-6)
