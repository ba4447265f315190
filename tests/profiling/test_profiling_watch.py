"""watch_time in the user's own training loop: the same analysis as profile_steps, no trace
left on the model, and training that goes exactly as without it."""

from __future__ import annotations

import copy
import os
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchscope.findings import Severity
from torchscope.models import TinyCNN
from torchscope.profiling import ProfilingError, phase, watch_time


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))


def _train(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
           steps: int, *, labelled: bool = True) -> None:
    for _ in range(steps):
        if labelled:
            with phase("forward"):
                loss = F.cross_entropy(model(x), y)
            with phase("backward"):
                loss.backward()
            with phase("optimizer"):
                opt.step()
                opt.zero_grad()
        else:
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()


def _hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_watch_time_on_a_real_loop_trains_identically() -> None:
    torch.manual_seed(0)
    model = TinyCNN()
    twin = copy.deepcopy(model)
    x, y = _batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    opt_hooks = len(opt._optimizer_step_post_hooks)
    with watch_time(model, optimizer=opt, steps=3, wait=1, warmup=1) as watch:
        _train(model, opt, x, y, 7)
    _train(twin, twin_opt, x, y, 7)

    # The model trained exactly as the plain loop did, and nothing of the watch is left.
    for got, ref in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(got, ref)
    assert _hooks(model) == 0 and len(opt._optimizer_step_post_hooks) == opt_hooks
    assert not torch.autograd._profiler_enabled()

    result = watch.result
    assert result is not None and watch.boundaries == 7
    assert result.steps == 3 and result.timing.profiled_steps == 3
    assert result.step is None  # torchscope did not run the step
    # Per-module rows: one forward per step each, and backward reaches every layer.
    for name in ("conv1", "conv2", "fc"):
        m = result.module(name)
        assert m is not None and m.calls == 3, name
        assert m.backward_ms > 0 and m.backward_nodes > 0, name
    assert result.module("conv1").backward_nodes == 3  # one ConvolutionBackward0 per step
    # The phases the loop labelled, each closed once per profiled step.
    assert [(p.name, p.calls) for p in result.phases] == [
        ("forward", 3), ("backward", 3), ("optimizer", 3)]
    assert result.calls("aten::convolution") == 2 * 3  # 2 convs × 3 profiled steps
    codes = {f.code for f in result.findings()}
    assert "profiling.top_op" in codes and "profiling.no_phases" not in codes


def test_unlabelled_loop_has_modules_but_no_phases() -> None:
    model = TinyCNN()
    x, y = _batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with watch_time(model, optimizer=opt, steps=2, wait=0, warmup=1, select="Conv2d") as w:
        _train(model, opt, x, y, 3, labelled=False)
    result = w.result
    assert result is not None
    assert [m.module for m in result.modules] == ["conv1", "conv2"]
    # The root is not timed: no forward; backward and optimizer from torch's own ranges.
    assert [(p.name, p.derived) for p in result.phases] == [
        ("backward", True), ("optimizer", True)]
    assert "profiling.no_phases" in {f.code for f in result.findings()}


def test_an_unlabelled_loop_gets_the_phases_a_labelled_one_gets() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.ReLU()) for _ in range(4)])
    x, y = torch.randn(64, 128), torch.randn(64, 128)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    results = []
    for labelled in (False, True):
        with watch_time(model, optimizer=opt, steps=4) as w:
            for _ in range(6):
                if labelled:
                    with phase("forward"):
                        out = model(x)
                    with phase("backward"):
                        F.mse_loss(out, y).backward()
                    with phase("optimizer"):
                        opt.step()
                else:
                    F.mse_loss(model(x), y).backward()
                    opt.step()
                opt.zero_grad()
        results.append(w.result)
    auto, labelled_result = results
    assert [(p.name, p.derived) for p in auto.phases] == [
        ("forward", True), ("backward", True), ("optimizer", True)]
    assert [p.name for p in labelled_result.phases] == ["forward", "backward", "optimizer"]
    assert not any(p.derived for p in labelled_result.phases)
    fwd, bwd, opt_phase = (auto.phase(n) for n in ("forward", "backward", "optimizer"))
    assert fwd is not None and bwd is not None and opt_phase is not None
    # Read from the ranges torch opens: the model's own forward calls, one per step ...
    root = auto.module("")
    assert root is not None and fwd.calls == root.calls == 4
    assert fwd.cpu_ms == pytest.approx(root.forward_ms)
    # ... torch.optim's step ranges ...
    step_range = auto.op("Optimizer.step#Adam.step")
    assert step_range is not None and opt_phase.calls == step_range.calls == 4
    assert opt_phase.cpu_ms == pytest.approx(step_range.cpu_total_ms, rel=1e-3)
    # ... and the autograd nodes, which the module attribution splits with nothing left.
    rec = auto.reconciliation
    assert rec.backward_ms == pytest.approx(rec.backward_modules_ms + rec.backward_outside_ms
                                            + rec.backward_accumulate_ms)
    # Derived phases are shown, not judged: their forward leaves out a loss computed
    # outside the model, their backward does not (no profiling.backward_ratio).
    codes = {f.code for f in auto.findings()}
    assert "profiling.no_phases" not in codes and "profiling.backward_ratio" not in codes
    assert any("labelled no phase" in n for n in auto.notes)


def test_explicit_steps_without_a_model() -> None:
    x = torch.randn(16, 16)
    w = torch.randn(16, 16, requires_grad=True)
    with watch_time(steps=2, wait=0, warmup=1) as watch:
        for _ in range(5):
            (x @ w).sum().backward()
            watch.step()
    result = watch.result
    assert result is not None and result.steps == 2 and result.modules == ()
    assert result.calls("aten::mm") == 2 * 2  # forward + the gradient of w, per profiled step
    assert not result.by_module


def test_a_short_loop_is_said_and_the_process_is_left_alone() -> None:
    model = TinyCNN()
    x, y = _batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    env = dict(os.environ)
    with pytest.raises(ProfilingError, match="saw 1 step"), \
            watch_time(model, optimizer=opt, steps=3, wait=1, warmup=1):
        _train(model, opt, x, y, 1)
    assert dict(os.environ) == env
    assert _hooks(model) == 0 and not torch.autograd._profiler_enabled()


def test_loop_that_raises_leaves_no_hook() -> None:
    model = TinyCNN()
    x, y = _batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(RuntimeError, match="boom"), \
            watch_time(model, optimizer=opt, steps=2, wait=0, warmup=1) as watch:
        _train(model, opt, x, y, 1)
        raise RuntimeError("boom")
    assert watch.result is None
    assert _hooks(model) == 0 and not opt._optimizer_step_post_hooks
    assert not torch.autograd._profiler_enabled()


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"steps": 0}, "steps=0"),
    ({"wait": -1}, "wait=-1"),
    ({"trace_steps": 0}, "trace_steps=0"),
])
def test_bad_arguments(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ProfilingError, match=match):
        watch_time(TinyCNN(), **kwargs)


class _SlowDecode(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """Each sample takes a millisecond to make and reads its label with `.item()`."""

    def __len__(self) -> int:
        return 1024

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        time.sleep(0.001)
        return torch.randn(16), int(torch.tensor(i % 4).item())


def _loader_loop(model: nn.Module, loader: torch.utils.data.DataLoader[Any], steps: int
                 ) -> list[Any]:
    """`steps` steps of a loop over `loader` under `watch_time`: its result, then its
    findings."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with watch_time(model, optimizer=opt, steps=3) as watch:
        for i, (x, y) in enumerate(loader):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            if i == steps:
                break
    assert watch.result is not None
    return [watch.result, *watch.result.findings()]


def test_a_loop_that_waits_for_its_dataloader_is_told_to_use_workers() -> None:
    result, *found = _loader_loop(nn.Linear(16, 4),
                                  torch.utils.data.DataLoader(_SlowDecode(), batch_size=8), 6)
    wait = result.input_wait
    assert wait is not None and wait.calls == 3 and not wait.workers
    # The dataset's own .item(), one per sample, is no read of the step.
    assert result.host_reads is not None and result.host_reads.reads == 0
    assert wait.ms >= 3 * 8 * 1.0  # at least the sleeps
    codes = {f.code: f for f in found}
    f = codes["profiling.input_wait"]
    assert f.severity == Severity.WARNING and "num_workers" in f.fix
    assert f.evidence["share"] > 0.5
    assert "profiling.host_read" not in codes  # the dataset's reads are no part of the step
    assert not codes["profiling.top_op"].summary.startswith("enumerate(DataLoader)")


def test_a_loop_fed_ready_batches_has_no_input_warning() -> None:
    torch.manual_seed(0)
    # A step of tens of milliseconds; taking a ready batch costs a fraction of one.
    model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 4))
    batches = [(torch.randn(256, 512), torch.randint(0, 4, (256,))) for _ in range(8)]
    loader = torch.utils.data.DataLoader(batches, batch_size=None)  # already batched
    result, *found = _loader_loop(model, loader, 6)
    assert result.input_wait is not None and result.input_wait.calls == 3
    # No warning. (An info, a wait of 5-20 % of the steps, came once on a loaded 2-core
    # machine, when the scheduler took the process away inside one batch's fetch.)
    assert not [f for f in found if f.code == "profiling.input_wait"
                and f.severity >= Severity.WARNING]
    assert result.input_wait.ms < 0.2 * result.timing.profiled_total_ms
