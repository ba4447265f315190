"""What the gradient tools let go of: per-step hooks (`HookSession.release`), the hooks of an
`open()` that failed, an unfinished step on an exception, and the model's weights on exit."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from torchscope.grads import watch_gradients
from torchscope.grads.collect import GradCollector
from torchscope.hooks import HookSession, audit_hooks


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


@pytest.mark.parametrize("with_optimizer", [True, False])
def test_watch_kept_for_its_results_does_not_keep_the_weights_alive(
    with_optimizer: bool,
) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
    # The last layer is in no optimizer: the watch follows it (`unoptimized`) until close.
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1) if with_optimizer else None
    with watch_gradients(model, optimizer=opt) as watch:
        model(torch.randn(1, 2)).sum().backward()
        if opt is not None:
            opt.step()
    weight = weakref.ref(model[0].weight)
    layer = weakref.ref(model[0])
    other = weakref.ref(model[2].weight)
    del model, opt
    gc.collect()
    assert weight() is None and layer() is None and other() is None
    assert watch.last is not None and watch.last.param("0.weight").norm is not None
    assert watch.history.series("0") and len(watch.history) == 1
    assert watch.unoptimized == (("2.weight", "2.bias") if with_optimizer else ())


def test_watch_left_by_an_exception_drops_the_unfinished_step() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(KeyboardInterrupt), watch_gradients(model, optimizer=opt) as watch:
        model(torch.randn(1, 2)).sum().backward()
        opt.step()  # step 0 is sampled here
        model(torch.randn(1, 2)).sum().backward()  # step 1 never reaches its optimizer step
        raise KeyboardInterrupt
    assert watch.samples == 1 and watch.last is not None and watch.last.index == 0
    assert audit_hooks(model).local_total == 0


def test_collector_whose_open_fails_removes_the_hooks_it_added() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[1].weight.register_post_accumulate_grad_hook = None  # type: ignore[method-assign]
    with pytest.raises(TypeError), GradCollector(model):
        pass
    del model[1].weight.register_post_accumulate_grad_hook
    assert audit_hooks(model).local_total == 0


def test_forward_interrupted_by_keyboard_interrupt_leaves_nothing_behind() -> None:
    class Stop(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise KeyboardInterrupt

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with watch_gradients(model) as watch:
        x = torch.randn(1, 2, requires_grad=True)
        stop = model[1].register_forward_pre_hook(lambda m, a: Stop()(a[0]))
        with pytest.raises(KeyboardInterrupt):  # torch runs no forward hook after it
            model(x)
        stop.remove()
        ref = weakref.ref(x)
        del x
        model(torch.randn(1, 2)).sum().backward()
        gc.collect()
        assert ref() is None  # no input alias of the interrupted call is kept
    assert watch.last is not None
    # The interrupted forward, which no backward reached, is no micro-batch of the step.
    assert [(r.module, r.micro, r.order) for r in watch.last.modules] == [
        ("1", 0, 0), ("0", 0, 1)]
    assert watch.last.micro_batches == 1
