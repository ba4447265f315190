"""compile_report in this process leaves the process as it found it: the user's compiled code
(no `torch._dynamo.reset()`), the environment, the random generators, the compiler stance and
`torch.compile` itself."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from torchscope.compile import compile_report, find_graph_breaks, watch_recompiles
from torchscope.compile.records import CompileReport
from torchscope.models import MLP
from torchscope.step import Step

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("compile"),
              pytest.mark.usefixtures("fresh_dynamo")]


def _local_class() -> type[nn.Module]:
    class Local(nn.Module):
        """Defined in a function: it cannot be pickled for a child process, so compile_report
        measures it in this process."""

        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x).relu()

    return Local


def _double_sin(x: torch.Tensor) -> torch.Tensor:
    return (2 * x).sin()


def _process() -> tuple[dict[str, str], torch.Tensor, str, Any]:
    stance = str(torch._dynamo.eval_frame._stance.stance)  # imports Dynamo first
    return dict(os.environ), torch.get_rng_state(), stance, torch.compile


def _assert_same(before: tuple[dict[str, str], torch.Tensor, str, Any]) -> None:
    env, rng, stance, compile_fn = _process()
    assert env == before[0]
    assert torch.equal(rng, before[1])
    assert stance == before[2]
    assert compile_fn is before[3]


def test_in_process_report_keeps_the_users_compiled_code() -> None:
    x = torch.randn(4, 8)
    f = torch.compile(_double_sin)
    f(x)
    local = _local_class()
    # The same class as the measured model, compiled for inference as compile_report
    # measures it: Dynamo's guards would let the copy reuse this graph.
    user = torch.compile(local().eval())
    with torch.no_grad():
        user(x)
    net = local()
    before = _process()
    report = compile_report(net, x, modes=("default",), iters=2, warmup=0, batch_sizes=(2,),
                            dynamic=False)
    _assert_same(before)
    m = report.mode("default")
    assert m.status == "ok", m.error
    assert not m.isolated and any("in this process" in n for n in report.notes)
    # The copy was traced afresh although the user compiled a model of the same class (a
    # reused graph would count none), and its shape recompile counts against its own limit.
    assert m.graphs == 1 and m.cold_compile_s is not None and m.cold_compile_s > 0
    assert [r.guard for r in m.recompiles] == [
        "tensor 'x' size mismatch at index 0. expected 4, actual 2"]
    assert [c.compiled for c in m.shape_calls] == [True]
    assert "forward" not in net.__dict__  # the model's own forward is back
    # What the user compiled before still runs compiled, without compiling anything.
    graphs = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    with watch_recompiles() as w:
        torch.testing.assert_close(f(x), _double_sin(x))
        with torch.no_grad():
            torch.testing.assert_close(user(x), user._orig_mod(x))
    assert w.compiles == 0
    assert int(torch._dynamo.utils.counters["stats"]["unique_graphs"]) == graphs


def test_a_loss_a_child_cannot_get_measures_the_step_here() -> None:
    torch.manual_seed(0)
    model, x = MLP(16, 32, 4), torch.randn(8, 16)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:  # a local function: it cannot be pickled
        return out.square().mean()

    before = _process()
    report = compile_report(model, x, measure="step", loss_fn=loss_fn, modes=("default",),
                            iters=1, warmup=0)
    _assert_same(before)
    m = report.mode("default")
    assert m.status == "ok", m.error
    assert not m.isolated
    assert any("the loss function" in n and "cannot be pickled" in n for n in report.notes)
    assert report.measure == "step" and report.step is not None
    assert report.step.loss == "loss_fn(output)"
    assert report.step.loss_value == float(Step(model, x, loss_fn=loss_fn).forward_backward())
    assert m.grad_max_abs_diff is not None and m.grad_max_abs_diff < 1e-4


def test_graph_break_scan_keeps_the_users_compiled_code() -> None:
    x = torch.randn(4, 8)
    f = torch.compile(_double_sin)
    f(x)
    net = _local_class()()
    before = _process()
    scan = find_graph_breaks(net, x)
    _assert_same(before)
    assert scan.graph_count == 1 and scan.breaks == ()
    assert "forward" not in net.__dict__ and "forward" not in net.fc.__dict__
    with watch_recompiles() as w:
        f(x)
    assert w.compiles == 0


def test_a_torch_module_at_the_root_is_measured_on_its_own_frame() -> None:
    # torch.compile runs torch's own modules (nn.Sequential) through one wrapper frame that
    # every compiled torch module shares; the measured copy must not use (or fill) it.
    x = torch.randn(4, 8)
    user = torch.compile(nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval())
    with torch.no_grad():
        user(x)
    net = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    before = _process()
    report = compile_report(net, x, modes=("default",), iters=2, warmup=0, isolate=False)
    _assert_same(before)
    m = report.mode("default")
    assert m.status == "ok", m.error
    assert m.graphs == 1 and m.recompiles == ()  # traced afresh, nothing recompiled
    assert "forward" not in net.__dict__
    with watch_recompiles() as w, torch.no_grad():
        torch.testing.assert_close(user(x), user._orig_mod(x))
    assert w.compiles == 0


def _passes_through(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A decorator as transformers 5 puts around model forwards (`functools.wraps`)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return wrapper


def _head(y: torch.Tensor) -> torch.Tensor:
    """A helper with a graph break in it, as transformers' loss function has: Dynamo runs
    it as a frame of its own, with cache entries of its own."""
    torch._dynamo.graph_break()
    return y.relu().sum(dim=-1)


def _decorated_class() -> type[nn.Module]:
    class Decorated(nn.Module):
        """A decorated forward with a graph break: local, so measured in this process."""

        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        @_passes_through
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return _head(self.fc(x))

    return Decorated


def _entries(code: Any) -> int:
    return len(torch._dynamo.eval_frame._debug_get_cache_entry_list(code))


def _measured_here(net: nn.Module, x: torch.Tensor) -> CompileReport:
    """compile_report of `net` on `x`, one mode, which must have run in this process and
    left it as it was; the report."""
    before = _process()
    said: list[tuple[str, float | None]] = []
    report = compile_report(net, x, modes=("default",), iters=2, warmup=0,
                            progress=lambda line, limit_s: said.append((line, limit_s)))
    _assert_same(before)
    m = report.mode("default")
    assert m.status == "ok", m.error
    assert not m.isolated
    # Sent to a child first, which could not load it: measured here, where no limit holds.
    assert said[-1] == ("default: measuring in this process", None)
    assert said[:-1] in ([], [("default: measuring in a child process (timeout 600 s)", 600.0)])
    return report


def test_a_decorated_forward_and_its_helpers_are_traced_afresh_and_released() -> None:
    """The scan and both compiles each trace the decorated forward's own code and the
    helper afresh: no compile of theirs is a recompile, and none leaves a cache entry."""
    net = _decorated_class()()
    x = torch.randn(4, 8)
    inner = type(net).forward.__wrapped__.__code__  # type: ignore[attr-defined]
    report = _measured_here(net, x)
    assert [b.function for b in report.graph_breaks] == ["_head"]
    assert report.mode("default").recompiles == ()
    assert (_entries(inner), _entries(_head.__code__), _entries(type(net).forward.__code__)
            ) == (0, 0, 0)
    assert "forward" not in net.__dict__


def test_a_helper_the_user_compiled_keeps_its_code_and_counts_no_recompile() -> None:
    """The user compiled a model of the same class first, so the helper holds the user's
    graph: the measurement's own backend makes Dynamo compile it again (a BACKEND_MATCH
    guard failure), which the user's loop would never see; the user's graph still runs."""
    local = _decorated_class()
    x = torch.randn(4, 8)
    user = torch.compile(local().eval())
    with torch.no_grad():
        user(x)
    assert _entries(_head.__code__) == 1
    report = compile_report(local(), x, modes=("default",), iters=2, warmup=0)
    m = report.mode("default")
    assert m.status == "ok", m.error
    assert m.recompiles == ()
    with watch_recompiles() as w, torch.no_grad():
        torch.testing.assert_close(user(x), user._orig_mod(x))
    assert w.compiles == 0


def test_a_torchscript_submodule_is_measured_in_this_process(
        scripted_part: Callable[[], nn.Module]) -> None:
    """torch.save cannot write a scripted submodule for the child process (RuntimeError,
    not a pickling error): that stopped the report; it measures here instead."""
    report = _measured_here(nn.Sequential(scripted_part(), nn.Linear(8, 2)), torch.randn(4, 8))
    assert any("cannot be pickled (RuntimeError" in n for n in report.notes), report.notes


def test_a_recompile_of_a_decorated_forward_names_that_forward() -> None:
    """The frame Dynamo recompiles is the decorator's wrapper (transformers' `wrapped_func`
    in `deprecation.py`, the same for every forward it wraps): the recompile names the
    decorated forward and its own place instead."""

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        @_passes_through
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x).relu()

    x = torch.randn(4, 8)
    report = compile_report(Wrapped(), x, modes=("default",), iters=2, warmup=0,
                            batch_sizes=(2,), dynamic=False)
    m = report.mode("default")
    assert m.status == "ok", m.error
    assert m.recompiles, "a new batch size with dynamic=False recompiles"
    code = Wrapped.forward.__wrapped__.__code__  # type: ignore[attr-defined]
    for r in m.recompiles:
        assert (r.function, r.file, r.line) == (
            Wrapped.forward.__qualname__, code.co_filename, code.co_firstlineno)
    assert "Wrapped.forward (test_compile_state.py:" in m.recompiles[0].where


def test_a_tensor_passed_twice_stays_one_tensor_at_another_batch_size() -> None:
    """`input_ids=ids, labels=ids`: the batch-size probe made two tensors of the one, and
    Dynamo's guard that they are the same failed: a recompile the user's loop never makes,
    reported as theirs."""

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return (self.fc(a) - b).square().mean()

    x = torch.randn(4, 8)
    report = compile_report(Twice(), {"a": x, "b": x}, modes=("default",), iters=2, warmup=0,
                            batch_sizes=(4,))
    m = report.mode("default")
    assert m.status == "ok", m.error
    assert [c.compiled for c in m.shape_calls] == [False]
    assert m.recompiles == ()
