"""`HookSession.release`: per-step hooks are removed and forgotten, the rest stay owned."""

from __future__ import annotations

import torch
from torch import nn

from torchscope.grads import watch_gradients
from torchscope.hooks import HookSession


def test_release_removes_and_forgets() -> None:
    model = nn.Linear(2, 2)
    fired: list[str] = []
    with HookSession(model) as s:
        keep = s.forward_hook(model, lambda *a: fired.append("keep"))
        x = torch.randn(1, 2, requires_grad=True)
        y = model(x)
        step = s.tensor_hook(y, lambda g: fired.append("step"))
        assert s.handle_count == 2
        s.release([step])
        assert s.handle_count == 1
        y.sum().backward()
        assert fired == ["keep"]  # the released tensor hook did not fire
        s.release([])  # nothing to do
        assert keep in s._handles


def test_eval_forward_in_sampled_step_is_no_micro_batch() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with watch_gradients(model, optimizer=opt) as watch:
        with torch.no_grad():
            model(torch.randn(1, 2))
        model(torch.randn(1, 2)).sum().backward()
        opt.step()
    assert watch.last is not None and watch.last.micro_batches == 1
    assert [r.micro for r in watch.last.modules] == [0]
