"""`torchscope lab`: every claim it checks carries a verdict and the measured value."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from torchscope.cli import app
from torchscope.models import TinyCNN


def test_lab_checks_lesson_claims_with_measured_values(tmp_path: Path) -> None:
    out = tmp_path / "lab.json"
    # compile is measured by `torchscope lab` itself (tens of seconds on 2 cores); not here.
    res = CliRunner().invoke(app, ["lab", "--skip", "compile", "--json", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    claims = doc["claims"]
    assert len(claims) >= 20
    for c in claims:
        if c["held"] is None:  # not checked here: the reason is given instead
            assert c["note"] and c["milestone"] == "memory" and not torch.cuda.is_available()
        else:
            assert c["measured"] is not None, c
    by = {c["claim"]: c for c in claims}
    # The lesson's figures, measured against torch here.
    torch.manual_seed(0)
    m = TinyCNN()
    x = torch.randn(32, 3, 32, 32)
    with torch.no_grad():
        conv1 = m.conv1(x)
        conv2 = m.conv2(m.relu(conv1))
    assert by["conv1 activation shape is (32, 8, 30, 30)"]["measured"] == list(conv1.shape)
    assert by["conv2 activation shape is (32, 16, 28, 28)"]["measured"] == list(conv2.shape)
    for op, n in (("aten::addmm", 10), ("aten::mm", 15), ("aten::nll_loss_backward", 5),
                  ("aten::_log_softmax", 5)):
        c = by[f"{op} is called {n} times in 5 steps"]
        assert c["measured"] == n and c["held"] is True
    assert by["conv1's grad_input is (None,): its input needs no grad"]["measured"] == [None]
    grads = by["gradient norms are identical with and without checkpointing"]
    assert grads["held"] is True
    assert by["storing all keeps one 8 KB activation per block plus the input"]["measured"] \
        == 9 * 8192
    ck = by["checkpointing at 2 segments stores less than storing all"]
    assert ck["held"] is True and ck["measured"] < 9 * 8192
    assert by["backward re-runs the forward of each checkpointed segment"]["measured"] == \
        [0, 1, 2, 3]
    # The terminal shows the lesson's tables and the verdicts.
    assert "Milestone 1" in res.output and "Lesson claims" in res.output
    assert "held" in res.output


def test_lab_bad_milestone_exit_2() -> None:
    res = CliRunner().invoke(app, ["lab", "--skip", "nope"])
    assert res.exit_code == 2
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "unknown milestone" in lines[0]


@pytest.mark.slow
def test_lab_compile_cost_column_is_measured() -> None:
    from torch._dynamo import eval_frame
    from torch._dynamo.utils import counters

    from torchscope.lab import run_lab

    # A function the user compiled before: the lab must leave it compiled (no reset).
    fn = torch.compile(lambda t: torch.cos(t) + 1, backend="eager")
    fn(torch.randn(4))
    graphs = counters["stats"]["unique_graphs"]
    env, rng, stance, compile_fn = dict(os.environ), torch.get_rng_state(), \
        eval_frame._stance, torch.compile
    result = run_lab(fast=True, skip=("forward", "backward", "profile", "checkpoint", "memory"))
    assert dict(os.environ) == env and torch.equal(torch.get_rng_state(), rng)
    assert eval_frame._stance == stance and torch.compile is compile_fn
    assert counters["stats"]["unique_graphs"] == graphs  # the lab compiled nothing here
    fn(torch.randn(4))
    assert counters["stats"]["unique_graphs"] == graphs  # ...and fn did not recompile
    (table,) = result.milestones
    mode, cost_s, compiled_ms, eager_ms, speedup, error = table.rows[0]
    assert mode == "default" and error == ""
    assert cost_s > 0 and compiled_ms > 0 and eager_ms > 0
    assert speedup == pytest.approx(eager_ms / compiled_ms)
    by = {c.claim: c for c in result.claims}
    first = by["the first call pays the compile cost"]
    assert first.measured == round(cost_s * 1e3 / compiled_ms)
    assert first.held == (cost_s * 1e3 > 10 * compiled_ms)
    wrappers = by["torch.compile returns a new wrapper object on every call"]
    assert wrappers.measured == 3 and wrappers.held
    loop = by["calling torch.compile in the loop recompiles on every iteration"]
    assert isinstance(loop.measured, int) and loop.held == (loop.measured == 3)
    for c in result.claims:
        assert (c.held is None) == (c.measured is None), c


def test_lab_leaves_the_callers_rng_state_alone() -> None:
    from torchscope.lab import run_lab

    torch.manual_seed(4321)
    before = torch.get_rng_state()
    result = run_lab(skip=("backward", "profile", "checkpoint", "memory", "compile"))
    assert result.claims
    assert torch.equal(torch.get_rng_state(), before)


def test_claims_that_failed_or_were_not_checked_are_findings_held_ones_are_not() -> None:
    from torchscope.findings import Severity, Subject
    from torchscope.lab.records import LabClaim, LabResult

    result = LabResult((), (
        LabClaim("checkpoint", "checkpointing stores less", 8192, 4096, True),
        LabClaim("checkpoint", "each activation is 8 KB", 8192, 4096, False, "saved bytes"),
        LabClaim("memory", "empty_cache() releases the cache", True, None, None,
                 "needs a CUDA device")))
    found = result.findings()
    assert [(f.code, f.severity, f.subject) for f in found] == [
        ("lab.claim_failed", Severity.WARNING, Subject.ENVIRONMENT),
        ("lab.claim_unchecked", Severity.INFO, Subject.ENVIRONMENT)]
    assert "measured 4096, expected 8192" in found[0].summary
    assert found[1].fix == "needs a CUDA device"
