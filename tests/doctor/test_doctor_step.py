"""One step for the whole doctor: every section that runs one measures the same computation,
the report states it once, and the model comes back exactly as it was."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

from torchscope.doctor import DoctorOptions, run_doctor
from torchscope.models import TinyCNN
from torchscope.profiling import profile_steps
from torchscope.report.document import build_document
from torchscope.report.html import render_report
from torchscope.step import Step

STEP_SECTIONS = ("gradients", "memory", "profile")


def _plain_loss(model: nn.Module, inputs: object, seed: int = 0) -> float:
    """The loss of a plain `Step(...).forward_backward()` on a copy, seeded as the doctor
    seeds each section."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return float(Step(copy.deepcopy(model), inputs).forward_backward())


def _assert_one_step(model: nn.Module, inputs: object) -> None:
    report = run_doctor(model, inputs, options=DoctorOptions(
        fast=True, steps=1, skip=frozenset({"activations", "compile"})))
    infos = [report.outcome(name).record.step for name in STEP_SECTIONS]
    assert all(o.status == "ok" for o in report.outcomes if o.name in STEP_SECTIONS)
    assert len({i.loss for i in infos}) == 1
    assert len({i.loss_value for i in infos}) == 1  # exact float equality
    assert infos[0].loss_value == _plain_loss(model, inputs)
    assert report.step == infos[0]
    # Stated once, in the JSON and in the page.
    text = report.step.describe()
    assert text.startswith("loss: auto → cross-entropy vs seeded targets = ")
    assert text.endswith(" · optimizer: SGD")
    assert build_document(report)["step"]["text"] == text
    assert render_report(report).count(text) == 1


def test_sections_measure_the_same_step_on_tinycnn() -> None:
    _assert_one_step(TinyCNN(), torch.randn(8, 3, 32, 32))


def test_sections_measure_the_same_step_on_gpt2_with_dropout(tiny_gpt2: nn.Module) -> None:
    model = tiny_gpt2.train()  # dropout on: each section's first step draws the same masks
    assert any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules())
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    _assert_one_step(model, {"input_ids": ids})


def test_a_users_step_is_the_one_measured() -> None:
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), torch.randn(8, 8)
    target = torch.randn(8, 4)
    step = Step(model, x, loss_fn="mse", target=target, accumulate=2)
    report = run_doctor(step, options=DoctorOptions(fast=True, steps=1,
                                                    skip=frozenset({"compile"})))
    infos = {report.outcome(n).record.step for n in STEP_SECTIONS}
    assert len(infos) == 1
    (info,) = infos
    assert info.loss == "mean squared error vs given targets" and info.accumulate == 2
    assert info.optimizer is None  # the user's step has none; the doctor adds none
    with torch.no_grad():
        out = model(x)
    want = (nn.functional.mse_loss(out[:4], target[:4]) +
            nn.functional.mse_loss(out[4:], target[4:])) / 2
    assert info.loss_value == pytest.approx(float(want), rel=1e-6)
    assert report.step == info and "accumulate: 2 micro-batches" in report.step.describe()


class _Stateful(nn.Module):
    """BatchNorm in train mode, a dropout left in eval mode, a frozen bias, and two
    non-persistent buffers: one updated in place, one replaced by a new tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(4 * 6 * 6, 10)
        self.register_buffer("seen", torch.zeros(()), persistent=False)
        self.register_buffer("calls", torch.zeros(()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += x.shape[0]
        self.calls = self.calls + 1
        h = self.drop(torch.relu(self.bn(self.conv(x))))  # (N, 4, 6, 6)
        return self.fc(h.flatten(1))


def _state(model: nn.Module) -> dict[str, object]:
    return {
        "tensors": [(n, t, t.detach().clone()) for n, t in
                    [*model.named_parameters(), *model.named_buffers()]],
        "grads": [(n, p.grad, None if p.grad is None else p.grad.clone())
                  for n, p in model.named_parameters()],
        "requires_grad": [p.requires_grad for p in model.parameters()],
        "training": [m.training for m in model.modules()],
    }


def test_the_model_comes_back_exactly() -> None:
    torch.manual_seed(0)
    model, x = _Stateful(), torch.randn(4, 3, 8, 8)
    model.conv.bias.requires_grad_(False)
    model.drop.eval()
    model(x).sum().backward()  # existing .grad values the doctor must not touch
    before = _state(model)
    assert "seen" not in model.state_dict()  # what a state_dict restore would miss

    # What the sections do to a model left to them: BN statistics, buffers and weights move.
    loose = copy.deepcopy(model)
    profile_steps(Step(loose, x, optimizer=torch.optim.SGD(
        [p for p in loose.parameters() if p.requires_grad], lr=0.1)), steps=1)
    assert not torch.equal(loose.bn.running_mean, model.bn.running_mean)
    assert not torch.equal(loose.seen, model.seen) and not torch.equal(loose.fc.weight,
                                                                        model.fc.weight)

    report = run_doctor(model, x, options=DoctorOptions(steps=1, skip=frozenset({"compile"})))
    assert [o.status for o in report.outcomes] == ["ok", "ok", "ok", "ok", "skipped", "skipped"]
    after = _state(model)
    for (name, t0, v0), (_, t1, v1) in zip(before["tensors"], after["tensors"], strict=True):
        assert t1 is t0 and torch.equal(v1, v0), name  # the same tensor, the same values
    for (name, g0, v0), (_, g1, v1) in zip(before["grads"], after["grads"], strict=True):
        assert g1 is g0 and (v0 is None or torch.equal(v1, v0)), name
    assert after["requires_grad"] == before["requires_grad"]
    assert after["training"] == before["training"]


def test_process_state_is_left_alone() -> None:
    model, x = TinyCNN(), torch.randn(2, 3, 32, 32)
    fn = torch.compile(lambda t: torch.sin(t) * 2, backend="eager")
    fn(torch.randn(4))
    from torch._dynamo import eval_frame
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    env, rng, stance, compile_fn = dict(os.environ), torch.get_rng_state(), \
        eval_frame._stance, torch.compile
    run_doctor(model, x, options=DoctorOptions(fast=True, steps=1))
    assert dict(os.environ) == env
    assert torch.equal(torch.get_rng_state(), rng)
    assert eval_frame._stance == stance and torch.compile is compile_fn
    fn(torch.randn(4))  # the user's compiled function is still compiled: no new graph
    assert counters["stats"]["unique_graphs"] == graphs
