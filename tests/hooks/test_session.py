"""HookSession removes exactly its own hooks, restores flags, never keeps the model alive."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from torchscope import HookSession, TorchscopeError, audit_hooks
from torchscope.models import TinyCNN


class Boom(RuntimeError):
    pass


def _raise_at(model: nn.Module, name: str) -> None:
    def bad(_m: nn.Module, _a: object) -> None:
        raise Boom(name)

    # The user's own hook; torchscope must not remove it.
    return dict(model.named_modules())[name].register_forward_pre_hook(bad)


def test_removes_all_hooks_of_every_kind() -> None:
    model = TinyCNN()
    x = torch.randn(2, 3, 12, 12)
    with HookSession(model) as s:
        s.forward_hook(model.conv1, lambda m, i, o: None)
        s.forward_pre_hook(model.conv2, lambda m, i: None)
        s.full_backward_hook(model.fc, lambda m, gi, go: None)
        s.backward_pre_hook(model.fc, lambda m, go: None)
        s.post_accumulate_grad_hook(model.fc.weight, lambda p: None)
        out = model(x)
        s.tensor_hook(out, lambda g: None)
        assert audit_hooks(model).local_total == 5
        out.sum().backward()  # the session stays usable across backward
        assert s.handle_count == 6
    assert audit_hooks(model).local_total == 0
    assert s.closed


@pytest.mark.parametrize("where", ["conv1", "relu", "conv2", "pool", "fc"])
def test_forward_raising_at_any_module_leaves_zero_hooks(where: str) -> None:
    model = TinyCNN()
    user_handle = _raise_at(model, where)
    with pytest.raises(Boom), HookSession(model) as s:
        for _, m in model.named_modules():
            s.forward_hook(m, lambda m, i, o: None)
        s.enable_module_stack()
        model(torch.randn(2, 3, 12, 12))
    audit = audit_hooks(model)
    assert audit.local_total == 1  # only the user's own pre-hook is left
    user_handle.remove()


def test_keyboard_interrupt_still_cleans_up() -> None:
    model = TinyCNN()
    with pytest.raises(KeyboardInterrupt), HookSession(model) as s:
        s.forward_hook(model.conv1, lambda m, i, o: None)
        raise KeyboardInterrupt
    assert audit_hooks(model).local_total == 0


def test_nested_sessions_remove_only_their_own_and_keep_user_hooks() -> None:
    model = TinyCNN()
    fired: list[str] = []
    user = model.conv1.register_forward_hook(lambda m, i, o: fired.append("user"))
    with HookSession(model) as outer:
        outer.forward_hook(model.conv1, lambda m, i, o: fired.append("outer"))
        with HookSession(model) as inner:
            inner.forward_hook(model.conv1, lambda m, i, o: fired.append("inner"))
            model(torch.randn(1, 3, 8, 8))
            assert fired == ["user", "outer", "inner"]
        fired.clear()
        model(torch.randn(1, 3, 8, 8))
        assert fired == ["user", "outer"]
    fired.clear()
    model(torch.randn(1, 3, 8, 8))
    assert fired == ["user"]
    user.remove()


def test_restores_training_flags_per_module() -> None:
    model = TinyCNN().train()
    model.conv2.eval()  # a mixed state must come back exactly
    with HookSession(model) as s:
        s.set_training(False)
        assert not any(m.training for m in model.modules())
    assert model.training and model.conv1.training and not model.conv2.training


def test_session_does_not_keep_model_alive() -> None:
    model = TinyCNN()
    ref = weakref.ref(model)
    s = HookSession(model)
    with s:
        s.forward_hook(model.conv1, lambda m, i, o: None)
        model(torch.randn(1, 3, 8, 8))
    del model
    gc.collect()
    assert ref() is None
    with pytest.raises(ReferenceError):
        _ = s.model


def test_closed_session_refuses_new_hooks_and_close_is_idempotent() -> None:
    model = TinyCNN()
    s = HookSession(model)
    s.close()
    s.close()
    with pytest.raises(TorchscopeError, match="closed"):
        s.forward_hook(model.conv1, lambda m, i, o: None)
    with pytest.raises(TorchscopeError, match="closed"):
        s.set_training(False)  # nothing would restore the flags
    assert all(m.training for m in model.modules())


def test_module_stack_tracks_nesting_and_unwinds_on_error() -> None:
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 2))
    seen: list[list[str]] = []
    with HookSession(model) as s:
        stack = s.enable_module_stack()
        s.forward_pre_hook(model[0][1], lambda m, i: seen.append(list(stack)))
        model(torch.randn(3, 4))
        assert stack == []
        bad = model[1].register_forward_pre_hook(lambda m, i: (_ for _ in ()).throw(Boom()))
        with pytest.raises(Boom):
            model(torch.randn(3, 4))
        bad.remove()
        assert stack == []
    assert seen == [["", "0", "0.1"], ["", "0", "0.1"]]


def test_module_stack_starts_afresh_after_a_keyboard_interrupt() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    seen: list[list[str]] = []
    with HookSession(model) as s:
        stack = s.enable_module_stack()
        stop = model[1].register_forward_pre_hook(lambda m, i: (_ for _ in ()).throw(
            KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt):  # torch runs no always_call hook after it
            model(torch.randn(3, 4))
        stop.remove()
        s.forward_pre_hook(model[0], lambda m, i: seen.append(list(stack)))
        model(torch.randn(3, 4))
        assert stack == []
    assert seen == [["", "0"]]


def test_when_reached_fires_once_for_a_backward_and_never_for_a_dropped_graph() -> None:
    model = nn.Linear(4, 2)
    seen: list[str] = []
    with HookSession(model) as s:
        out = model(torch.randn(3, 4))
        handles = s.when_reached((out, out * 2), lambda: seen.append("trained"))
        assert handles is not None and len(handles) == 2 and s.handle_count == 2
        (out.sum() + (out * 2).sum()).backward()  # reaches both nodes: fires once
        assert seen == ["trained"] and s.handle_count == 0
        dropped = s.when_reached(model(torch.randn(3, 4)), lambda: seen.append("eval"))
        assert dropped is not None and s.handle_count == 1  # its graph is gone already
        with torch.no_grad():
            assert s.when_reached(model(torch.randn(3, 4)), lambda: seen.append("x")) is None
        s.release(dropped)
        assert s.handle_count == 0
    assert seen == ["trained"]


def test_when_reached_waits_for_a_backward_that_updates_the_model() -> None:
    # An adversarial attack's `autograd.grad` with respect to the input, and a backward
    # limited to the input, reach the output but update no parameter: not yet. Then the
    # training backward. A frozen model has nothing to update: any backward counts.
    model = nn.Linear(4, 2)
    x = torch.randn(3, 4, requires_grad=True)
    seen: list[str] = []
    with HookSession(model) as s:
        out = model(x)
        s.when_reached(out, lambda: seen.append("trained"))
        torch.autograd.grad(out.sum(), x, retain_graph=True)
        out.sum().backward(inputs=[x], retain_graph=True)
        assert seen == [] and s.handle_count == 1
        out.sum().backward(inputs=[model.bias], retain_graph=True)
        assert seen == ["trained"] and s.handle_count == 0
    frozen = nn.Linear(4, 2).requires_grad_(False)
    with HookSession(frozen) as s:
        out = frozen(x)
        s.when_reached(out, lambda: seen.append("frozen"))
        torch.autograd.grad(out.sum(), x)
        assert seen == ["trained", "frozen"]


def test_parameters_keep_no_hook_dict_after_a_gradient_flow() -> None:
    """torch makes a parameter's post-accumulate-grad hook dict on the first registration
    and keeps it (with a C++ hook that calls into Python at every accumulation) after the
    hook is removed: the model was not left as found."""
    import torchscope

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    assert all(p._post_accumulate_grad_hooks is None for p in model.parameters())
    torchscope.gradient_flow(model, torch.randn(3, 4), loss_fn="sum")
    assert all(p._post_accumulate_grad_hooks is None for p in model.parameters())
    # A dict the user's own hook holds is left alone, with the hook in it.
    seen: list[int] = []
    handle = model[0].weight.register_post_accumulate_grad_hook(lambda p: seen.append(1))
    torchscope.gradient_flow(model, torch.randn(3, 4), loss_fn="sum")
    assert len(seen) == 1 and len(model[0].weight._post_accumulate_grad_hooks) == 1
    handle.remove()
