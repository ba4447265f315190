"""The run report: report.json against the shipped schema (kind "run", schema 1.4), the HTML
page with the gradient-flow heat map, the doctor's renderers reused, and `diff` between runs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch
from torch import nn

import torchscope
from torchscope.report.diff import diff_documents
from torchscope.report.document import SCHEMA_VERSION, load_document, load_schema

from ._models import batches


def _train(out: Path, **options: object) -> Path:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                          nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with torchscope.monitor(model, opt, every=2, out=out, name="five-layer mlp",
                            **options):  # type: ignore[arg-type]
        for x, y in batches(16):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    return out


@pytest.fixture(scope="module")
def profiled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One run with every section (the profiled window included), shared by the module."""
    return _train(tmp_path_factory.mktemp("run"), profile=2)


def test_report_json_follows_the_schema_and_holds_the_series(profiled: Path) -> None:
    out = profiled
    doc = json.loads((out / "report.json").read_text())
    jsonschema.Draft202012Validator(load_schema()).validate(doc)
    assert doc["kind"] == "run" and doc["schema_version"] == SCHEMA_VERSION == "1.12"
    assert list(doc["sections"]) == ["run", "grad_history", "act_history", "mem_history",
                                     "profile", "last_step"]
    assert all(s["status"] == "ok" for s in doc["sections"].values())
    assert doc["options"]["producer"] == "torchscope.monitor"
    assert doc["options"]["step_by"] == "optimizer"
    assert doc["target"]["name"] == "five-layer mlp" and doc["target"]["inputs"] == "(8x8)"
    grads = doc["sections"]["grad_history"]["data"]["param_norms"]
    assert grads["steps"] == list(range(0, 16, 2))
    assert grads["layers"] == ["0", "2", "4"]  # the model's order, input side first
    assert len(grads["values"]) == 8 and all(len(r) == 3 for r in grads["values"])
    assert doc["sections"]["act_history"]["data"]["dead_frac"]["layers"] == ["1", "3"]
    assert doc["sections"]["run"]["data"]["history"]["rows"] == 8
    assert doc["step"]["text"].startswith("loss: the training loop's own · optimizer: SGD")
    assert "run.step_ms" in doc["metrics"]
    assert load_document(out)["kind"] == "run"
    # The profiled window's findings are the run's (`RunRecord.findings()`), once each, in
    # the profile section.
    codes = [(f["section"], f["code"]) for f in doc["findings"]]
    profile = [c for sec, c in codes if sec == "profile"]
    assert profile and all(c.startswith("profiling.") for c in profile)
    assert len(profile) == len({c for _, c in codes if c.startswith("profiling.")})


def test_the_profiled_windows_findings_are_the_runs() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with torchscope.monitor(model, opt, every=2, profile=2, out=None) as mon:
        for x, y in batches(12):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    run = mon.result
    assert run is not None and run.profile is not None
    assert {f.code for f in run.profile.findings()} <= {f.code for f in run.findings()}


def test_a_doctor_report_without_kind_still_validates() -> None:
    """Reports written before 1.3 have no `kind`: they are doctor reports."""
    schema = load_schema()
    options = {"fast": True, "skip": [], "loss": "auto", "steps": 1, "compile_modes": [],
               "compile_iters": 1, "device": "cpu", "seed": 0}
    doc = {"schema": "torchscope.report", "schema_version": "1.2", "torchscope_version": "0",
           "created": "", "seconds": 0.0,
           "target": {"name": "m", "model_class": "M", "parameters": 1, "trainable": 1,
                      "inputs": "(1)", "device": "cpu"},
           "environment": {"torch": "2", "python": "3", "device": "cpu"},
           "options": options, "sections": {}, "findings": [], "metrics": {}}
    jsonschema.Draft202012Validator(schema).validate(doc)
    bad = {**doc, "kind": "run"}  # doctor options under kind "run" are not run options
    assert not jsonschema.Draft202012Validator(schema).is_valid(bad)


def test_report_html_has_the_heat_map_and_the_doctors_sections(profiled: Path) -> None:
    page = (profiled / "report.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "<title>torchscope run: five-layer mlp" in page
    heat = re.search(r'<figure[^>]*data-plot="run-grad-heatmap"[^>]*><svg.*?</svg>', page,
                     flags=re.S)
    assert heat is not None
    for section in ("run", "grad_history", "act_history", "mem_history", "profile",
                    "last_step"):
        assert f'data-section="{section}" data-status="ok"' in page
    for plot in ("run-total-norm", "run-step-time", "run-act-std", "run-act-dead",
                 "profile-ops", "gradients-flow"):
        assert f'data-plot="{plot}"' in page
    assert "<script" not in page and "http://" not in page.replace(
        'xmlns="http://www.w3.org/2000/svg"', "").replace(
        'xmlns:xlink="http://www.w3.org/1999/xlink"', "")


def test_sections_not_watched_say_so(tmp_path: Path) -> None:
    out = _train(tmp_path / "run", activations=False, memory=False)
    doc = json.loads((out / "report.json").read_text())
    jsonschema.Draft202012Validator(load_schema()).validate(doc)
    assert doc["sections"]["act_history"]["status"] == "skipped"
    assert "activations=False" in doc["sections"]["act_history"]["note"]
    assert doc["sections"]["mem_history"]["status"] == "skipped"
    assert "profile" not in doc["sections"]


def test_diff_compares_two_runs(tmp_path: Path, profiled: Path) -> None:
    a = load_document(profiled)
    b = load_document(_train(tmp_path / "b"))
    diff = diff_documents(a, b)
    names = {c.name for c in diff.changes}
    assert {"run.step_ms", "run.skipped_steps", "act_history.dead_fraction"} <= names
    skipped = next(c for c in diff.changes if c.name == "run.skipped_steps")
    assert skipped.old == skipped.new == 0 and skipped.status == "unchanged"
