"""`torchscope doctor` end to end: files written, schema-valid JSON, findings printed, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch
from typer.testing import CliRunner

from torchscope.cli import app
from torchscope.report.document import SCHEMA_VERSION, load_schema

runner = CliRunner()


def _validate(doc: dict) -> None:
    schema = load_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.Draft202012Validator(schema).validate(doc)


def test_demo_equivalent_run_writes_valid_report(tmp_path: Path) -> None:
    # What `make demo` runs, with --fast: the default target is tiny-cnn.
    res = runner.invoke(app, ["doctor", "--fast", "--out", str(tmp_path), "--verbose"])
    assert res.exit_code == 0, res.output
    html = (tmp_path / "report.html").read_text()
    doc = json.loads((tmp_path / "report.json").read_text())
    _validate(doc)
    assert doc["schema_version"] == SCHEMA_VERSION
    assert doc["target"]["name"] == "tiny-cnn"
    assert doc["options"]["fast"] is True
    sections = doc["sections"]
    assert list(sections) == ["activations", "gradients", "memory", "profile", "compile",
                              "lint"]
    assert sections["lint"]["status"] == "skipped"  # a built-in model has no source file
    assert "no source file" in sections["lint"]["note"]
    assert sections["activations"]["status"] == "ok"
    assert sections["compile"]["status"] == "skipped"
    assert "--fast" in sections["compile"]["note"]
    # Every section that is not ok says why, in the page and in the terminal.
    for name, sec in sections.items():
        if sec["status"] != "ok":
            assert sec["note"] and sec["data"] is None
        assert f'data-section="{name}"' in html
    # The activation records match torch: conv1 of tiny-cnn is (32, 8, 30, 30).
    mods = {m["module"]: m for m in sections["activations"]["data"]["modules"]}
    assert mods["conv1"]["outputs"][0]["shape"] == [32, 8, 30, 30]
    assert mods["relu"]["outputs"][0]["dead_units"] is not None
    assert "wrote" in res.output and "report.html" in res.output
    assert "Activations" in res.output
    # After the sections' progress lines, the verdict comes first, as report.json has it.
    lines = [line for line in res.output.splitlines() if line.strip()]
    first = next(i for i, line in enumerate(lines) if not line.startswith("["))
    assert lines[first].startswith("verdict: "), res.output
    assert f"verdict: {doc['verdict']}" in " ".join(res.output.split())
    # The step every section measured, stated once in each of terminal (--verbose), JSON
    # and page.
    step = doc["step"]["text"]
    assert step.startswith("loss: auto → cross-entropy vs seeded targets = ")
    assert step.endswith(" · optimizer: SGD")
    assert res.output.count(step) == 1 and html.count(step) == 1


def test_doctor_prints_ranked_findings_with_evidence_and_fix(tmp_path: Path) -> None:
    factory = tmp_path / "deadnet.py"
    factory.write_text(
        "import torch\nfrom torch import nn\n"
        "def build():\n"
        "    torch.manual_seed(0)\n"
        "    lin = nn.Linear(16, 8)\n"
        "    with torch.no_grad():\n"
        "        lin.bias[:6] = -100.0  # 6 of 8 units can never fire\n"
        "    m = nn.Sequential(lin, nn.ReLU(), nn.Linear(8, 4))\n"
        "    return m, torch.randn(32, 16)\n")
    res = runner.invoke(app, ["doctor", f"{factory}:build", "--skip", "compile,profile,memory,"
                              "gradients", "--out", str(tmp_path / "r"), "--fail-on", "warning"])
    assert res.exit_code == 1, res.output  # --fail-on warning with a warning present
    doc = json.loads((tmp_path / "r" / "report.json").read_text())
    _validate(doc)
    dead = [f for f in doc["findings"] if f["code"] == "activations.dead_units"]
    assert dead and dead[0]["evidence"]["dead"] == 6 and dead[0]["evidence"]["channels"] == 8
    assert dead[0]["severity"] == "warning" and dead[0]["fix"]
    # Report order: the user's model, loop and data before caveats, then the most severe.
    order = {"error": 0, "warning": 1, "info": 2}
    group = {"model": 0, "loop": 0, "data": 0, "environment": 1, "measurement": 2}
    keys = [(group[f["subject"]], order[f["severity"]]) for f in doc["findings"]]
    assert keys == sorted(keys)
    assert "6 of 8 channels" in res.output and dead[0]["fix"][:30] in " ".join(
        res.output.split())
    # The evidence stays in the JSON and the page unless --verbose asks for it.
    assert "dead=6" not in res.output
    warnings = sum(f["severity"] == "warning" for f in doc["findings"])
    assert doc["verdict"].startswith(f"{warnings} warning") and "6 of 8 channels" in \
        doc["verdict"] and f"verdict: {warnings} warning" in res.output


def test_doctor_tells_a_models_own_loss_that_broadcasts_its_output(tmp_path: Path) -> None:
    # A regressor that computes its own loss, as a transformers head does, against (N,)
    # labels: the step's loss compares every output with every label.
    factory = tmp_path / "regressor.py"
    factory.write_text(
        "import warnings\nimport torch\nfrom torch import nn\n"
        "class Regressor(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))\n"
        "    def forward(self, x, labels):\n"
        "        out = self.net(x)\n"
        "        with warnings.catch_warnings():\n"
        "            warnings.simplefilter('ignore')\n"
        "            return {'logits': out, 'loss': nn.functional.mse_loss(out, labels)}\n"
        "def build():\n"
        "    torch.manual_seed(0)\n"
        "    return Regressor(), {'x': torch.randn(32, 8), 'labels': torch.randn(32)}\n")
    res = runner.invoke(app, ["doctor", f"{factory}:build", "--skip", "compile,profile,memory,"
                              "activations,lint", "--out", str(tmp_path / "r")])
    assert res.exit_code == 0, res.output
    doc = json.loads((tmp_path / "r" / "report.json").read_text())
    _validate(doc)
    assert doc["sections"]["gradients"]["data"]["loss_broadcast"] == {
        "output": "['logits']", "output_shape": [32, 1], "shape": [32, 32],
        "op": "ExpandBackward0", "target_shape": None}
    # Readers of report.json 1.9-1.11 still find it under `step`.
    assert doc["step"]["loss_broadcast"] == doc["sections"]["gradients"]["data"]["loss_broadcast"]
    (told,) = [f for f in doc["findings"] if f["code"] == "grads.loss_broadcast"]
    assert told["section"] == "gradients" and told["severity"] == "error"


@pytest.mark.parametrize("masked", [False, True])
def test_doctor_tells_labels_on_padding_in_its_inputs(tmp_path: Path, masked: bool) -> None:
    """GPT-2 given right-padded rows with `labels = input_ids.clone()`: the doctor's step
    counts the padded label positions its loss reads (from position 1: the shift) and
    tells them in the gradients section; with -100 there it counts them and is silent."""
    pytest.importorskip("transformers")
    factory = tmp_path / "lm.py"
    factory.write_text(
        "from tests._builders import padded_lm_batch, tiny_gpt2\n"
        "def build():\n"
        f"    return tiny_gpt2(), padded_lm_batch(masked={masked})\n")
    res = runner.invoke(app, ["doctor", f"{factory}:build", "--skip", "compile,profile,memory,"
                              "activations,lint", "--out", str(tmp_path / "r")])
    assert res.exit_code == 0, res.output
    doc = json.loads((tmp_path / "r" / "report.json").read_text())
    _validate(doc)
    # 4 + 7 + 11 padded positions, none at position 0 (right padding)
    assert doc["sections"]["gradients"]["data"]["padded_labels"] == [22, 0 if masked else 22]
    told = [f for f in doc["findings"] if f["code"] == "grads.padding_in_loss"]
    if masked:
        assert not told
    else:
        (found,) = told
        assert found["section"] == "gradients" and found["severity"] == "warning"
        assert "22 of the 22 label positions" in found["summary"]


def test_doctor_lints_the_file_the_model_comes_from(tmp_path: Path) -> None:
    """The factory's file trains with softmax into cross-entropy and never zeroes its
    gradients: both are findings of the report, with their lines, next to the measured ones;
    `--skip lint` leaves the section out."""
    factory = tmp_path / "trainer.py"
    factory.write_text(
        "import torch\nfrom torch import nn\n"
        "def build():\n"
        "    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))\n"
        "def train(model, loader, opt):\n"
        "    for x, y in loader:\n"
        "        probs = torch.softmax(model(x), 1)\n"
        "        nn.functional.cross_entropy(probs, y).backward()\n"
        "        opt.step()\n")
    res = runner.invoke(app, ["doctor", f"{factory}:build", "--input", "4x8", "--fast",
                              "--skip", "profile,memory", "--out", str(tmp_path / "r")])
    assert res.exit_code == 0, res.output
    doc = json.loads((tmp_path / "r" / "report.json").read_text())
    _validate(doc)
    lint = doc["sections"]["lint"]
    assert lint["status"] == "ok" and doc["options"]["sources"] == [str(factory)]
    assert [(v["code"], v["line"]) for v in lint["data"]["violations"]] == [
        ("TS014", 8), ("TS012", 9)]
    codes = {f["code"]: f for f in doc["findings"]}
    assert codes["lint.TS014"]["severity"] == "error"
    assert codes["lint.TS014"]["evidence"]["line"] == 8
    assert {"lint.TS012", "grads.frozen"} & set(codes) == {"lint.TS012"}
    assert doc["metrics"]["lint.problems"]["value"] == 2
    assert "softmax" in res.output and "│ lint" in res.output  # in the findings table
    html = (tmp_path / "r" / "report.html").read_text()
    assert 'data-section="lint"' in html and "TS012" in html
    skipped = runner.invoke(app, ["doctor", f"{factory}:build", "--input", "4x8", "--fast",
                                  "--skip", "profile,memory,lint", "--out",
                                  str(tmp_path / "s")])
    assert skipped.exit_code == 0, skipped.output
    doc = json.loads((tmp_path / "s" / "report.json").read_text())
    assert doc["sections"]["lint"]["status"] == "skipped"
    assert not [f for f in doc["findings"] if f["code"].startswith("lint.")]


@pytest.mark.parametrize(("args", "needle"), [
    (["--input", "32xbad"], "malformed"),
    (["--skip", "nonsense"], "unknown section"),
    (["no-such-model"], "neither a built-in"),
    (["--input", "32x4x32x32"], "raised in conv1"),
    (["--loss", "hinge"], "--loss"),
])
def test_doctor_bad_input_is_one_line_exit_2(tmp_path: Path, args: list[str], needle: str
                                             ) -> None:
    res = runner.invoke(app, ["doctor", *args, "--out", str(tmp_path)])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], res.output
    assert "Traceback" not in res.output
    assert not (tmp_path / "report.json").exists()


def test_doctor_leaves_model_untouched() -> None:
    from torchscope.doctor import DoctorOptions, run_doctor
    from torchscope.models import TinyCNN

    model = TinyCNN()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    flags = [m.training for m in model.modules()]
    # compile never calls the model in this process; the full run in test_doctor_browser.py
    # checks the same with it.
    report = run_doctor(model, torch.randn(4, 3, 32, 32),
                        options=DoctorOptions(steps=2, skip=frozenset({"compile"})))
    # The gradients section ran backward, the profile section SGD steps on this very model.
    assert report.outcome("gradients").status == "ok"
    assert report.outcome("profile").status == "ok"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert [m.training for m in model.modules()] == flags


def test_failed_sections_are_not_reported_as_nothing_wrong(tmp_path: Path) -> None:
    """Every parameter frozen: the training step has no loss to differentiate, so the
    sections that run it fail. The terminal said 'nothing looked wrong', and --fail-on error
    exited 0."""
    factory = tmp_path / "frozen.py"
    factory.write_text(
        "import torch\nfrom torch import nn\n\n\n"
        "def build():\n"
        "    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))\n"
        "    model.requires_grad_(False)\n"
        "    return model, torch.randn(4, 8)\n")
    argv = ["doctor", f"{factory}:build", "--fast", "--skip", "compile,lint",
            "--out", str(tmp_path / "r")]
    res = runner.invoke(app, argv)
    doc = json.loads((tmp_path / "r" / "report.json").read_text())
    failed = [name for name, s in doc["sections"].items() if s["status"] == "failed"]
    assert res.exit_code == 0 and failed, res.output
    assert "nothing looked wrong" not in res.output
    assert doc["verdict"].startswith(f"failed: {len(failed)} section")
    assert f"verdict: failed: {len(failed)} section" in res.output
    # The HTML's summary counts said "0 error 0 warning" beside them.
    html = (tmp_path / "r" / "report.html").read_text()
    assert f"{len(failed)} sections failed" in html
    res = runner.invoke(app, [*argv, "--fail-on", "error"])
    assert res.exit_code == 1, res.output
