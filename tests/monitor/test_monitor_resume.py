"""A run resumed from a checkpoint into the same `out` folder continues its report: one
series, with the resume step marked. A report there that the run does not continue is
replaced with a warning, never silently."""

from __future__ import annotations

import copy
import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import torchscope


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g))
            for _ in range(12)]


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range,
           checkpoint: dict[str, object] | None = None) -> None:
    batches = _batches()
    for step in steps:
        if checkpoint is not None and step == 6:
            checkpoint.update(model=copy.deepcopy(model.state_dict()),
                              opt=copy.deepcopy(opt.state_dict()))
        x, y = batches[step]
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _ours(seen: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in seen if str(w.message).startswith("torchscope")]


def test_a_resumed_loop_continues_its_report_as_one_series(tmp_path: Path) -> None:
    out = tmp_path / "run"
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    checkpoint: dict[str, object] = {}
    with torchscope.monitor(model, opt, every=2, out=out) as first:
        _train(model, opt, range(10), checkpoint)  # on past the checkpoint, to step 9
    a = first.result
    assert a is not None and a.grad_param.steps == (0, 2, 4, 6, 8)

    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.load_state_dict(checkpoint["model"])  # type: ignore[arg-type]
    opt.load_state_dict(checkpoint["opt"])  # type: ignore[arg-type]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with torchscope.monitor(model, opt, every=2, out=out, first_step=6) as second:
            _train(model, opt, range(6, 12))
    assert not _ours(seen)  # it continues that report: nothing is replaced
    b = second.result
    assert b is not None and b.first_step == 6 and b.steps == 6
    assert b.resumed_at == (6,)
    # One series: the first run's samples before step 6, then this run's (its 6 and 8
    # are the first run's again, from the same checkpoint and batches).
    assert b.grad_param.steps == (0, 2, 4, 6, 8, 10)
    assert b.grad_param.layers == a.grad_param.layers
    for layer in a.grad_param.layers:
        for x, y in zip(a.grad_param.series(layer), b.grad_param.series(layer)[:5],
                        strict=True):
            assert math.isclose(x, y, rel_tol=1e-6)
    assert all(math.isclose(x, y, rel_tol=1e-6)
               for x, y in zip(a.total_norms, b.total_norms[:5], strict=True))
    assert [s.first_step for s in b.step_ms][:6] == [0, 1, 2, 3, 4, 5]
    doc = json.loads((out / "report.json").read_text())
    run = doc["sections"]["run"]["data"]
    assert run["resumed_at"] == [6]
    assert doc["sections"]["grad_history"]["data"]["param_norms"]["steps"] == [0, 2, 4, 6, 8,
                                                                                10]
    html = (out / "report.html").read_text()
    assert "at step 6 from a checkpoint" in html and "steps 0–4" in html

    # Resumed again, at step 10: the series goes on, both resumes marked.
    with torchscope.monitor(model, opt, every=2, out=out, first_step=10) as third:
        _train(model, opt, range(10, 12))
    c = third.result
    assert c is not None and c.resumed_at == (6, 10)
    assert c.grad_param.steps == (0, 2, 4, 6, 8, 10)


@pytest.mark.parametrize("other", [False, True])
def test_a_report_the_run_does_not_continue_is_replaced_with_a_warning(
        tmp_path: Path, other: bool) -> None:
    out = tmp_path / "run"
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torchscope.monitor(model, opt, every=2, out=out):
        _train(model, opt, range(4))
    # A new run from step 0, or a resume of another model, into the same folder.
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2)) if other else _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = torchscope.monitor(model, opt, every=2, out=out, first_step=4 if other else 0)
    with pytest.warns(UserWarning) as seen, mon:
        _train(model, opt, range(4, 8) if other else range(4))
    (line,) = _ours(list(seen))
    assert "replaces" in line and "first_step=" in line
    assert ("another model" in line) == other
    assert mon.result is not None and mon.result.grad_param.steps == \
        ((4, 6) if other else (0, 2))
    assert json.loads((out / "report.json").read_text())["sections"]["run"]["data"][
        "resumed_at"] == ([4] if other else [])
