"""audit_hooks lists every hook by kind; the growth guard catches hooks added in a loop."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.modules import module as module_mod

from torchscope import audit_hooks
from torchscope.hooks import HookGrowthGuard, HookGrowthWarning
from torchscope.models import TinyCNN


def test_audit_counts_every_kind() -> None:
    model = TinyCNN()
    hs = [
        model.conv1.register_forward_hook(lambda m, i, o: None),
        model.conv1.register_forward_hook(lambda m, i, o: None),
        model.conv2.register_forward_pre_hook(lambda m, i: None),
        model.fc.register_full_backward_hook(lambda m, gi, go: None),
        model.fc.register_full_backward_pre_hook(lambda m, go: None),
        model.fc.weight.register_hook(lambda g: None),
        model.fc.bias.register_post_accumulate_grad_hook(lambda p: None),
        module_mod.register_module_forward_hook(lambda m, i, o: None),
    ]
    try:
        audit = audit_hooks(model)
        counts = audit.counts()
        assert counts[("conv1", "forward")] == 2
        assert counts[("conv2", "forward_pre")] == 1
        assert counts[("fc", "backward")] == 1
        assert counts[("fc", "backward_pre")] == 1
        assert counts[("fc.weight", "tensor")] == 1
        assert counts[("fc.bias", "post_accumulate_grad")] == 1
        assert counts[("<global>", "global_forward")] >= 1
        assert audit.local_total == 7
    finally:
        for h in hs:
            h.remove()
    assert audit_hooks(model).local_total == 0


def test_audit_marks_deprecated_backward_hook() -> None:
    model = TinyCNN()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        h = model.fc.register_backward_hook(lambda m, gi, go: None)
    try:
        assert audit_hooks(model, include_global=False).by_kind() == {"backward_legacy": 1}
    finally:
        h.remove()


def test_growth_guard_warns_once_naming_module() -> None:
    model = TinyCNN()
    x = torch.randn(1, 3, 8, 8)
    handles = []
    with (
        pytest.warns(HookGrowthWarning, match=r"conv1 forward 1→2") as rec,
        HookGrowthGuard(model) as guard,
    ):
        for _ in range(4):  # the classic bug: a new hook every step
            handles.append(model.conv1.register_forward_hook(lambda m, i, o: None))
            model(x)
    assert len([w for w in rec if issubclass(w.category, HookGrowthWarning)]) == 1
    assert guard.growth == {("conv1", "forward"): (1, 2)}
    for h in handles:
        h.remove()
    assert audit_hooks(model).local_total == 0


def test_growth_guard_silent_for_register_once() -> None:
    model = TinyCNN()
    h = model.conv1.register_forward_hook(lambda m, i, o: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", HookGrowthWarning)
        guard = HookGrowthGuard(model)
        for _ in range(3):
            model(torch.randn(1, 3, 8, 8))
            assert guard.step() == {}
    h.remove()


def test_growth_guard_refuses_a_second_enter_and_cleans_up() -> None:
    from torchscope import TorchscopeError

    model = TinyCNN()
    guard = HookGrowthGuard(model)
    with guard:
        with pytest.raises(TorchscopeError, match="already active"):
            guard.__enter__()
        assert audit_hooks(model, include_global=False).local_total == 1
    assert audit_hooks(model, include_global=False).local_total == 0
