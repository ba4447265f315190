"""Memory stays bounded over long runs: the monitor's history, watch_activations(keep_last=)
and its growth warning, and a 10,000-step soak of the whole monitor."""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

import torchscope
from torchscope.capture import activations as capture_activations_module
from torchscope.capture import watch_activations
from torchscope.monitoring import SampleHistory, StepBuckets
from torchscope.monitoring.history import METRICS
from torchscope.monitoring.run import KEEP_FORWARDS


def test_sample_history_keeps_the_whole_run_in_a_fixed_budget() -> None:
    h = SampleHistory(capacity=16, recent=4)
    for i in range(1000):
        h.add(i * 10, {"a": [float(i)] * len(METRICS)}, total_norm=float(i))
    rows = h.rows()
    assert len(rows) <= 16 + 4
    assert rows[0].step == 0 and rows[-1].step == 9990  # the whole run, first to last
    assert h.stride == 64
    spread = [r.sample for r in rows[:-4]]
    assert all(s % h.stride == 0 for s in spread)  # evenly spaced
    assert [r.sample for r in rows[-4:]] == [996, 997, 998, 999]  # the newest in full
    assert h.budget_bytes() == (16 + 4) * (len(METRICS) * 8 + 120)


def test_step_buckets_merge_in_pairs() -> None:
    b = StepBuckets(capacity=8)
    for i in range(1000):
        b.add(i, float(i))
    buckets = b.buckets()
    assert len(buckets) <= 8 and len(b) == 1000
    assert sum(x.count for x in buckets) == 1000
    assert buckets[0].first_step == 0 and buckets[0].low == 0.0
    assert buckets[-1].high == 999.0
    assert sum(x.total for x in buckets) == sum(range(1000))  # means stay exact


def test_keep_last_bounds_watch_activations() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(2, 4)
    with watch_activations(model, keep_last=3) as acts:
        for i in range(50):
            model(x)
            if i == 20:
                assert {r.step for r in acts.records} == {18, 19, 20}
    assert len(acts.records) == 3 * 3
    assert {r.step for r in acts.records} == {47, 48, 49}
    assert acts.last()[0].step == 49
    with pytest.raises(Exception, match="keep_last=0"):
        watch_activations(model, keep_last=0)


def test_an_unbounded_capture_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(capture_activations_module, "GROWTH_WARNING_RECORDS", 30)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(2, 4)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with watch_activations(model):
            for _ in range(40):  # 3 records a forward: past 30 at the 10th
                model(x)
        with watch_activations(model, keep_last=2):
            for _ in range(40):
                model(x)
    grew = [w for w in seen if "keep_last=N" in str(w.message)]
    assert len(grew) == 1 and issubclass(grew[0].category, RuntimeWarning)


def _objects() -> tuple[int, int]:
    gc.collect()
    objs = gc.get_objects()
    return len(objs), sum(1 for o in objs if isinstance(o, torch.Tensor))


def _tiny_loop(*, evaluate: bool) -> tuple[nn.Module, torch.optim.Optimizer,
                                          Callable[[int], None]]:
    """A small model, its optimizer, and a function that trains it `n` steps (each after a
    forward whose output is dropped, with `evaluate`)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(4, 4), torch.randn(4, 2)

    def steps(n: int) -> None:
        for _ in range(n):
            if evaluate:
                model(x)  # gradients on, output dropped
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()

    return model, opt, steps


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_ten_thousand_steps_hold_no_more_than_the_configured_history() -> None:
    """The whole monitor over 10,000 steps (1,000 samples): what it holds after 4,000 steps
    (its newest 32 loss-scale reads full by then: one in 16 samples after the first 8) is
    what it holds after 10,000, within the configured history."""
    model, opt, steps = _tiny_loop(evaluate=False)

    with torchscope.monitor(model, opt, every=10, out=None, history=64, recent=16) as mon:
        steps(4000)
        grads = mon.grads
        assert grads is not None
        handles = grads.session.handle_count
        objects, tensors = _objects()
        steps(6000)
        objects_after, tensors_after = _objects()
        assert grads.session.handle_count == handles
        assert mon._history.samples == 1000
        assert len(mon._history.rows()) <= 64 + 16
        assert len(mon._times.buckets()) <= 64
        assert mon._acts is not None
        held = len(mon._acts.records)  # also copies what is pending to the host
        assert held <= KEEP_FORWARDS * 3
    # Nothing accumulates per step or per sample: a few objects either way (the bounded
    # structures swap rows; other tests' garbage may be collected meanwhile).
    assert objects_after - objects < 200, (objects, objects_after)
    assert tensors_after <= tensors + 2
    run = mon.result
    assert run is not None and run.steps == 10000 and run.samples == 1000
    assert run.grad_param.steps[0] == 0 and run.grad_param.steps[-1] == 9990
    assert run.budget.rows <= 80 and run.budget.stride == 16
    assert run.budget.bytes == (64 + 16) * (len(METRICS) * 3 * 8 + 120)  # 3 layers: 0, 1, 2


def test_evaluation_passes_with_gradients_on_leave_no_hooks_piling_up() -> None:
    """A forward whose graph is dropped never reaches the pre-hooks that wait for its
    backward (the monitor's and the memory watch's): they are released, not kept."""
    model, opt, steps = _tiny_loop(evaluate=True)

    with torchscope.monitor(model, opt, every=1, out=None) as mon:
        steps(50)
        assert mon._session is not None and mon._mem is not None
        counts = (mon._session.handle_count, mon._mem.session.handle_count)
        steps(200)
        assert (mon._session.handle_count, mon._mem.session.handle_count) == counts
    run = mon.result
    assert run is not None and run.samples == 250 and run.last is not None
    assert run.last.idle_forwards == 1
