"""Per-module ranges wrap each forward instead of hooking it: what that must never change."""

from __future__ import annotations

import copy
import inspect
import io

import torch
from torch import nn
from torch.profiler import profile

from torchscope.findings import Subject
from torchscope.models import MLP, DeepMLP
from torchscope.profiling.module_ranges import ModuleRanges, range_label


def _range_names(prof: profile) -> list[str]:
    return [e.name for e in prof.events() if e.name.startswith("nn.Module: ")]


def test_every_module_gets_one_range_per_call_and_nothing_stays() -> None:
    model = DeepMLP(width=8, blocks=3)
    x = torch.randn(4, 8)
    ref = model(x)
    with ModuleRanges(model) as ranges, profile() as prof:
        out = model(x)
    assert torch.equal(out, ref)
    names = _range_names(prof)
    for name, module in model.named_modules():
        assert names.count(range_label(name, type(module).__name__)) == 1
    assert set(ranges.labels) == set(names)
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert ranges.session.closed


def test_copies_made_inside_run_their_own_weights() -> None:
    model = MLP(4, 8, 2)
    x = torch.randn(3, 4)
    with ModuleRanges(model), profile():
        twin = copy.deepcopy(model)
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        with torch.no_grad():
            for p in twin.parameters():
                p.add_(1.0)
    plain = MLP(4, 8, 2)
    plain.load_state_dict(twin.state_dict())
    # The copy's wrapper reaches the forward through the copy, never the original.
    assert torch.equal(twin(x), plain(x))
    assert not torch.equal(twin(x), model(x))
    assert torch.equal(loaded(x), model(x))
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_signature_and_errors_are_the_modules_own() -> None:
    model = MLP(4, 8, 2)
    before = inspect.signature(model.fc1.forward)
    with ModuleRanges(model), profile() as prof:
        assert inspect.signature(model.fc1.forward) == before
        try:
            model(torch.randn(3, 5))  # wrong width: fc1 raises inside its range
        except RuntimeError as e:
            assert "mat1 and mat2" in str(e)
        else:
            raise AssertionError("the shape error was swallowed")
    # The ranges the failing forward opened were closed: each is a complete event.
    events = [e for e in prof.events() if e.name.startswith("nn.Module: ")]
    assert {e.name for e in events} >= {range_label("", "MLP"), range_label("fc1", "Linear")}
    assert all(e.time_range.end >= e.time_range.start for e in events)


def test_a_forward_replaced_on_the_instance_is_hooked_and_kept() -> None:
    model = MLP(4, 8, 2)
    model.fc2.forward = model.fc2.forward  # type: ignore[method-assign]  # the user's own
    own_forward = model.fc2.forward
    with ModuleRanges(model), profile() as prof:
        model(torch.randn(2, 4))
        hooked = len(model.fc2._forward_pre_hooks)
    names = _range_names(prof)
    assert range_label("fc2", "Linear") in names and range_label("", "MLP") in names
    assert hooked == 1 and not model.fc2._forward_pre_hooks
    assert model.fc2.forward is own_forward and "forward" not in model.__dict__


def test_no_ranges_while_no_profiler_records() -> None:
    model = MLP(4, 8, 2)
    with ModuleRanges(model):
        model(torch.randn(2, 4))  # no profiler: the wrappers only call through
        with profile() as prof:
            model(torch.randn(2, 4))
    assert len(_range_names(prof)) == len(list(model.modules()))


def test_a_compiled_model_is_timed_eagerly_and_left_compiled() -> None:
    from torchscope.hooks.compiled import CompileCounter

    model = MLP(4, 8, 2)
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(3, 4)
    compiled(x)  # compiled once, before the ranges
    try:
        with CompileCounter() as counter:
            with ModuleRanges(compiled), profile() as prof:
                compiled(x)  # force_eager while the ranges are open: every range fires
            compiled(x)  # compiled again afterwards, from the cache
        assert counter.compiles == 0
        names = _range_names(prof)
        # Named as the user's own model names them: the compile wrapper adds no prefix.
        assert range_label("fc1", "Linear") in names
        assert range_label("<root>", "MLP") in names
        assert not any("_orig_mod" in n for n in names)
        assert all("forward" not in m.__dict__ for m in model.modules())
    finally:
        torch._dynamo.reset()


def test_a_compiled_model_profiled_per_module_is_said_to_be_the_eager_one() -> None:
    """Per-module ranges need hooks, which fire only in eager code: profile_steps times a
    compiled model eagerly, and says so (the op table is aten's, not the compiled
    kernels'): a caveat about what was measured, info, never a warning about the model;
    by_module=False profiles the compiled code and says nothing."""
    import torchscope

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(4, 8)
    eager = torchscope.profile_steps(compiled, x, loss_fn="sum", steps=2)
    assert eager.compiled == ("",)
    found = [f for f in eager.findings() if f.code == "profiling.compiled_eager"]
    assert [f.severity.label for f in found] == ["info"]
    assert found[0].subject is Subject.MEASUREMENT
    assert "by_module=False" in (found[0].fix or "")
    as_compiled = torchscope.profile_steps(compiled, x, loss_fn="sum", steps=2,
                                           by_module=False)
    assert as_compiled.compiled == () and not as_compiled.modules
    assert not [f for f in as_compiled.findings() if f.code == "profiling.compiled_eager"]
    plain = torchscope.profile_steps(model, x, loss_fn="sum", steps=2)
    assert plain.compiled == ()
