"""watch_gradients in a training loop: sampling on optimizer steps, bounded memory, no hooks
left, gradient accumulation and GradScaler."""

from __future__ import annotations

import gc
import math
import tracemalloc

import pytest
import torch
from torch import nn

from torchscope.errors import TorchscopeError
from torchscope.grads import watch_gradients
from torchscope.hooks import audit_hooks


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _live_tensors() -> int:
    gc.collect()  # torch.distributed's deprecated alias warns when gc walks past it
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_thousand_steps_bounded_memory_and_no_hooks_left() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(4, 4), torch.randn(4, 2)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    with watch_gradients(model, every=10, optimizer=opt, max_samples=20) as watch:
        for _ in range(800):
            step()
        handles = watch.session.handle_count
        tensors = _live_tensors()
        tracemalloc.start(8)
        try:
            gc.collect()  # count what is kept, not garbage waiting for the cycle collector
            snap_before = tracemalloc.take_snapshot()
            for _ in range(200):
                step()
            gc.collect()
            snap_after = tracemalloc.take_snapshot()
        finally:
            tracemalloc.stop()
        # Count what torchscope's own code (and anything it calls) allocated and kept; torch's
        # internal caches grow by a few bytes per step with or without it.
        ours = [tracemalloc.Filter(True, "*torchscope*", all_frames=True)]
        growth = sum(s.size_diff for s in snap_after.filter_traces(ours).compare_to(
            snap_before.filter_traces(ours), "filename"))
        assert watch.session.handle_count == handles  # step hooks are released each step
        # No gradients or norms kept: the count cannot grow (other tests' garbage may shrink it).
        assert _live_tensors() <= tensors
    assert growth < 16 * 1024, f"memory grew by {growth} bytes over 200 steps"
    assert watch.steps == 1000
    assert watch.samples == 100
    assert len(watch.history) == 20  # bounded by max_samples
    assert watch.history.steps[-1] == 990 and watch.history.steps[0] == 800
    assert audit_hooks(model, include_global=False).local_total == 0
    assert not opt._optimizer_step_pre_hooks  # the optimizer hook is gone too


def test_history_length_follows_every() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(4, 4)
    with watch_gradients(model, every=10, optimizer=opt) as watch:
        for _ in range(100):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
    h = watch.history
    assert len(h) == 10 and h.steps == tuple(range(0, 100, 10))
    assert h.layers[0] == "2"  # nearest the loss first
    assert all(math.isfinite(v) for v in h.series("0"))


@pytest.mark.parametrize("every,expected", [(1, 5), (2, 3)])
def test_accumulation_samples_follow_optimizer_steps(every: int, expected: int) -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    batches = [torch.randn(4, 4) for _ in range(20)]
    final_grads: list[dict[str, float]] = []
    with watch_gradients(model, every=every, optimizer=opt) as watch:
        for i, xb in enumerate(batches):
            (model(xb).sum() / 4).backward()
            if i % 4 == 3:
                final_grads.append({n: p.grad.norm().item()
                                    for n, p in model.named_parameters()})
                opt.step()
                opt.zero_grad()
    assert watch.steps == 5
    assert watch.samples == expected
    last = watch.last
    assert last is not None and last.index == 4
    assert last.micro_batches == 4 and last.backward_calls == 4
    assert sorted({r.micro for r in last.modules}) == [0, 1, 2, 3]
    assert len([r for r in last.modules if r.module == "0"]) == 4
    for p in last.params:  # the accumulated gradient the optimizer used
        assert math.isclose(p.norm, final_grads[-1][p.name], rel_tol=1e-6)


def test_without_optimizer_every_backward_is_a_step() -> None:
    model = _mlp()
    seen = []
    with watch_gradients(model, every=3, on_sample=seen.append) as watch:
        for _ in range(7):
            model(torch.randn(2, 4)).sum().backward()
    assert watch.steps == 7
    assert [f.index for f in seen] == [0, 3, 6]
    assert watch.samples == 3


def test_grad_scaler_norms_are_unscaled() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    unscaled: dict[str, float] = {}
    with watch_gradients(model, optimizer=opt, scaler=scaler) as watch:
        opt.zero_grad()
        scaler.scale(model(torch.randn(4, 4)).sum()).backward()
        scaler.unscale_(opt)
        unscaled = {n: p.grad.norm().item() for n, p in model.named_parameters()}
        clip = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item()
        scaler.step(opt)
        scaler.update()
    flow = watch.last
    assert flow is not None and flow.scale == 2.0**10
    for p in flow.params:
        assert math.isclose(p.norm, unscaled[p.name], rel_tol=1e-6)
    assert math.isclose(flow.total_norm, clip, rel_tol=1e-6)


def test_exception_in_loop_removes_hooks() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with pytest.raises(KeyError), watch_gradients(model, optimizer=opt):
        model(torch.randn(2, 4)).sum().backward()
        raise KeyError("boom")
    assert audit_hooks(model, include_global=False).local_total == 0
    assert not opt._optimizer_step_pre_hooks


def test_bad_arguments() -> None:
    with pytest.raises(TorchscopeError, match="every=0"), watch_gradients(_mlp(), every=0):
        pass
