"""A plain accelerate loop (`Accelerator.prepare`, `accelerator.backward`, gradient
accumulation, `accelerator.clip_grad_norm_`) under `torchscope.monitor` and
`watch_gradients`, given the prepared optimizer as the loop has it."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import torchscope
from torchscope.grads import GradWatch, watch_gradients
from torchscope.hooks import audit_hooks
from torchscope.monitoring import RunRecord

accelerate = pytest.importorskip("accelerate")


def _loop(watched: str | None, clip: float = 0.01) -> tuple[nn.Module, list[float], object]:
    """Eight batches, two per optimizer step, clipped: the model, what clipping returned
    at each step (the norm before clipping), and the watch or the monitor's run."""
    from accelerate import Accelerator
    from accelerate.utils import GradientAccumulationPlugin

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        acc = Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=2, sync_with_dataloader=False))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g),
                                          torch.randn(32, 2, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    model, opt, loader = acc.prepare(model, opt, loader)
    assert type(opt).__name__ == "AcceleratedOptimizer"
    returned: list[float] = []

    def train() -> None:
        for x, y in loader:
            with acc.accumulate(model):
                acc.backward(nn.functional.mse_loss(model(x), y))
                if acc.sync_gradients:
                    returned.append(float(acc.clip_grad_norm_(model.parameters(), clip)))
                opt.step()
                opt.zero_grad()

    if watched is None:
        train()
        return model, returned, None
    if watched == "monitor":
        with torchscope.monitor(model, opt, every=1, out=None) as mon:
            train()
        return model, returned, mon.result
    with watch_gradients(model, every=1, optimizer=opt) as watch:
        train()
    return model, returned, watch


@pytest.mark.parametrize("watched", ["monitor", "watch"])
def test_an_accelerate_loop_is_watched_through_its_prepared_optimizer(watched: str) -> None:
    """Registering a step hook on accelerate's `AcceleratedOptimizer` raised AttributeError
    (it has no hooks of its own): the hooks go on the optimizer it wraps, whose `step()` runs
    once per accumulated step."""
    plain, _, _ = _loop(None)
    model, returned, got = _loop(watched)
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)
    assert audit_hooks(model, include_global=False).local_total == 0
    assert len(returned) == 4
    if watched == "monitor":
        run = got
        assert isinstance(run, RunRecord)
        assert run.steps == 4 and run.optimizer == "SGD"
        assert run.last is not None and run.last.backward_calls == 2
        totals, applied = run.total_norms, run.applied_norms
        assert any(f.code == "grads.clipped" for f in run.findings())
    else:
        assert isinstance(got, GradWatch)
        assert got.steps == 4 and got.optimizer_name == "SGD"
        totals, applied = got.history.total_norms, got.history.applied_norms
    for total, before in zip(totals, returned, strict=True):
        assert math.isclose(total, before, rel_tol=1e-6)  # read before clipping
    assert all(a is not None and math.isclose(a, 0.01, rel_tol=1e-4) for a in applied)


def test_an_object_that_is_no_optimizer_is_one_line_before_any_hook() -> None:
    from torchscope.errors import TorchscopeError

    model = nn.Linear(4, 2)

    class Stepper:  # steps by hand, with no torch optimizer inside
        def step(self) -> None:
            pass

    for make in (lambda: torchscope.monitor(model, Stepper(), out=None),  # type: ignore[arg-type]
                 lambda: watch_gradients(model, optimizer=Stepper())):  # type: ignore[arg-type]
        with pytest.raises(TorchscopeError, match=r"no torch\.optim\.Optimizer"), make():
            pass
        assert audit_hooks(model, include_global=False).local_total == 0
