"""tiny-cnn: backward order, None grad_input with its reason, and equality with a hand-written
`register_full_backward_hook` reference and with `p.grad.norm()`."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from torchscope.grads import gradient_flow
from torchscope.grads.records import INPUT_NO_GRAD
from torchscope.models import TinyCNN

# Every test here runs twice: norms by eager `vector_norm`, and by the fused kernel.
pytestmark = pytest.mark.usefixtures("reduction_path")

SELECT = ["conv1", "conv2", "fc"]


def _close(a: float | None, b: float | None) -> bool:
    assert a is not None and b is not None
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=0.0)


@pytest.fixture
def setup() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = TinyCNN()
    x = torch.randn(8, 3, 16, 16)
    y = torch.randint(0, 10, (8,))
    return model, x, y


def _reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, dict]:
    """The lesson's way: full backward hooks on conv1, conv2, fc."""
    ref: dict[str, dict] = {}
    order: list[str] = []
    handles = []
    for name in SELECT:
        def hook(_m, grad_input, grad_output, _n=name):
            order.append(_n)
            ref[_n] = {
                "out": [g.norm().item() for g in grad_output],
                "in": [None if g is None else g.norm().item() for g in grad_input],
            }
        handles.append(getattr(model, name).register_full_backward_hook(hook))
    try:
        model.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
    finally:
        for h in handles:
            h.remove()
    ref["_order"] = {"names": order}
    ref["_grads"] = {n: p.grad.norm().item() for n, p in model.named_parameters()}
    return ref


def test_backward_order_and_none_input(setup) -> None:
    model, x, y = setup
    flow = gradient_flow(model, x, loss_fn="cross_entropy", target=y, select=SELECT)
    assert [r.module for r in flow.modules] == ["fc", "conv2", "conv1"]
    assert [r.order for r in flow.modules] == [0, 1, 2]
    conv1 = flow.get("conv1")
    assert len(conv1.grad_input) == 1
    assert conv1.grad_input[0].norm is None
    assert conv1.grad_input[0].reason == INPUT_NO_GRAD == "input does not require grad"
    assert conv1.grad_input[0].shape == (8, 3, 16, 16)
    assert flow.get("conv2").grad_input[0].norm is not None


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_norms_equal_full_backward_hook_and_param_grads(setup) -> None:
    model, x, y = setup
    ref = _reference(model, x, y)
    assert ref["_order"]["names"] == ["fc", "conv2", "conv1"]
    flow = gradient_flow(model, x, loss_fn="cross_entropy", target=y, select=SELECT)
    for name in SELECT:
        rec = flow.get(name)
        assert len(rec.grad_output) == len(ref[name]["out"])
        for got, want in zip(rec.grad_output, ref[name]["out"], strict=True):
            assert _close(got.norm, want), (name, got.norm, want)
        assert len(rec.grad_input) == len(ref[name]["in"])
        for got, want in zip(rec.grad_input, ref[name]["in"], strict=True):
            if want is None:
                assert got.norm is None
            else:
                assert _close(got.norm, want), (name, got.norm, want)
    # Parameter norms against the .grad the step left behind, and against the reference run.
    for p_rec in flow.params:
        p = dict(model.named_parameters())[p_rec.name]
        assert _close(p_rec.norm, p.grad.norm().item())
        assert _close(p_rec.norm, ref["_grads"][p_rec.name])
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=float("inf"))
    assert _close(flow.total_norm, total.item())


def test_default_selection_covers_leaves_and_removes_hooks(setup) -> None:
    from torchscope.hooks import audit_hooks

    model, x, y = setup
    flow = gradient_flow(model, x, loss_fn="cross_entropy", target=y)
    assert [r.module for r in flow.modules] == ["fc", "pool", "conv2", "relu", "conv1"]
    # Gradient passed down by one layer is what the layer below receives.
    assert _close(flow.get("relu").grad_input[0].norm, flow.get("conv1").grad_output[0].norm)
    assert audit_hooks(model, include_global=False).local_total == 0


def test_loss_errors_are_torchscope_errors(setup) -> None:
    from torchscope.errors import TorchscopeError

    model, x, _ = setup
    with pytest.raises(TorchscopeError, match="not a scalar"):
        gradient_flow(model, x, loss_fn=lambda out: out)  # (8, 10) logits: no loss
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(TorchscopeError, match="does not require grad"):
        gradient_flow(model, x, loss_fn="sum")


def test_without_grad_input(setup) -> None:
    model, x, y = setup
    flow = gradient_flow(model, x, loss_fn="cross_entropy", target=y, select=SELECT,
                         inputs_grad=False)
    assert [r.module for r in flow.modules] == ["fc", "conv2", "conv1"]
    assert all(r.grad_input == () for r in flow.modules)
    assert flow.get("fc").grad_output[0].norm is not None
