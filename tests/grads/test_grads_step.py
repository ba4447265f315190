"""`gradient_flow` on the shared `Step`: what ran is stated (`flow.step`), gradient
accumulation and GradScaler agree with a plain loop, and findings are read one way."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional

from torchscope.errors import TorchscopeError
from torchscope.findings import Analyzed
from torchscope.grads import GradWatch, diagnose, gradient_flow, watch_gradients
from torchscope.grads.analyze import diagnose_history
from torchscope.models import TinyCNN
from torchscope.step import Step


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture
def cnn() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return TinyCNN(), torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))


def test_flow_states_the_step_and_its_loss_value(
    cnn: tuple[nn.Module, torch.Tensor, torch.Tensor],
) -> None:
    model, x, _ = cnn
    flow = gradient_flow(Step(model, x))
    got = _grads(model)
    # auto on (N, C) logits: cross-entropy against seeded class targets, drawn as step.py says.
    seeded = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(0))
    model.zero_grad(set_to_none=True)
    loss = functional.cross_entropy(model(x), seeded)
    loss.backward()
    assert flow.step is not None
    assert flow.step.loss == "auto → cross-entropy vs seeded targets"
    assert flow.step.loss_value == loss.item()  # the same computation, to the bit
    assert flow.step.optimizer is None and flow.step.accumulate == 1
    assert got.keys() == _grads(model).keys()
    assert all(torch.equal(got[n], p.grad) for n, p in model.named_parameters())
    # The same step from keyword arguments: the same numbers.
    model.zero_grad(set_to_none=True)
    again = gradient_flow(model, x)
    assert again.step == flow.step and again.total_norm == flow.total_norm


def test_optimizer_is_recorded_not_stepped(
    cnn: tuple[nn.Module, torch.Tensor, torch.Tensor],
) -> None:
    from torchscope.report.grads import grad_table

    model, x, y = cnn
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    flow = gradient_flow(model, x, loss_fn="cross_entropy", target=y, optimizer=opt)
    assert flow.step is not None
    assert flow.step.loss == "cross-entropy vs given targets" and flow.step.optimizer == "SGD"
    assert flow.step.loss_value == functional.cross_entropy(model(x), y).item()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert flow.step.describe() in str(grad_table(flow).caption)


def test_a_step_with_step_options_is_refused(
    cnn: tuple[nn.Module, torch.Tensor, torch.Tensor],
) -> None:
    model, x, y = cnn
    with pytest.raises(TorchscopeError, match="a Step was given together with target"):
        gradient_flow(Step(model, x), target=y)
    assert all(p.grad is None for p in model.parameters())


def test_accumulate_two_matches_a_plain_accumulating_loop(
    cnn: tuple[nn.Module, torch.Tensor, torch.Tensor],
) -> None:
    model, x, y = cnn
    flow = gradient_flow(Step(model, x, loss_fn="cross_entropy", target=y, accumulate=2))
    got = _grads(model)
    model.zero_grad(set_to_none=True)
    losses = []
    for i in range(2):  # the plain loop: half batches, each loss divided by 2
        loss = functional.cross_entropy(model(x[4 * i:4 * (i + 1)]), y[4 * i:4 * (i + 1)])
        (loss / 2).backward()
        losses.append(loss.detach())
    for n, p in model.named_parameters():
        assert torch.equal(got[n], p.grad)
        norm = flow.param(n).norm
        assert norm is not None and math.isclose(norm, p.grad.norm().item(), rel_tol=1e-6)
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    assert math.isclose(flow.total_norm, total.item(), rel_tol=1e-6)
    assert flow.micro_batches == 2 and flow.backward_calls == 2
    assert {r.micro for r in flow.modules} == {0, 1}
    assert flow.get("fc", micro=1).grad_output[0].shape == (4, 10)
    assert flow.step is not None and flow.step.accumulate == 2
    assert flow.step.loss_value == ((losses[0] + losses[1]) / 2).item()
    assert "accumulate: 2 micro-batches" in flow.step.describe()


def test_the_steps_grad_scaler_is_divided_out(
    cnn: tuple[nn.Module, torch.Tensor, torch.Tensor],
) -> None:
    model, x, y = cnn
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    flow = gradient_flow(Step(model, x, loss_fn="cross_entropy", target=y, scaler=scaler))
    scaled = _grads(model)  # .grad stays scaled, as scaler.scale(loss).backward() leaves it
    model.zero_grad(set_to_none=True)
    functional.cross_entropy(model(x), y).backward()
    assert flow.scale == 2.0**10 and flow.step is not None and flow.step.scaler
    for n, p in model.named_parameters():
        assert torch.equal(scaled[n], p.grad * 2.0**10)
        norm = flow.param(n).norm
        assert norm is not None and math.isclose(norm, p.grad.norm().item(), rel_tol=1e-6)


def test_findings_are_read_one_way_on_flow_and_watch() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with torch.no_grad():
        model[0].bias.fill_(-100.0)  # every ReLU unit off: nothing flows below it
    x = torch.randn(5, 4)
    flow = gradient_flow(model, x, loss_fn="sum")
    assert isinstance(flow, Analyzed)
    assert flow.findings() == diagnose(flow) != []
    assert {f.module for f in flow.findings() if f.code == "grads.dead"} == {"0", "1"}

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with watch_gradients(model, every=1, optimizer=opt) as watch:
        for scale in (1.0, 1e3):
            opt.zero_grad(set_to_none=True)
            (model(x).sum() * scale).backward()
            opt.step()
    assert isinstance(watch, GradWatch) and isinstance(watch, Analyzed)
    assert watch.last is not None and watch.last.step is None  # the user's own step
    found = watch.findings()
    assert found[0].severity >= found[-1].severity
    assert sorted(found, key=repr) == sorted(diagnose(watch.last) + diagnose_history(
        watch.history), key=repr)
    grew = [f for f in found if "grew" in f.summary]
    assert len(grew) == 1 and grew[0].evidence["ratio"] == pytest.approx(1e3, rel=1e-5)
