"""Capture and gradient flow on torch.compile'd models: they record everything, or refuse."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchscope
from torchscope import audit_hooks
from torchscope.errors import CompileError
from torchscope.hooks import HookSession
from torchscope.models import TinyCNN

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("compile")]


@pytest.fixture(scope="module")
def compiled_cnn() -> tuple[nn.Module, nn.Module, torch.Tensor]:
    torch._dynamo.reset()
    model = TinyCNN().eval()
    compiled = torch.compile(model)
    x = torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        compiled(x)  # the first call compiles: later hooks would never fire without care
    return model, compiled, x


def test_capture_on_compiled_model_records_every_module(
    compiled_cnn: tuple[nn.Module, nn.Module, torch.Tensor],
) -> None:
    model, compiled, x = compiled_cnn
    cap = torchscope.capture_activations(compiled, x)
    assert [r.module for r in cap.records] == ["conv1", "relu", "conv2", "pool", "fc"]
    with torch.no_grad():
        ref = model.conv1(x)
    conv1 = cap.get("conv1").output
    assert conv1 is not None and abs(conv1.mean - ref.mean().item()) <= 1e-6 * abs(
        ref.mean().item()) + 1e-9
    check = cap.session.compiled_check
    assert check is not None and check.compiled == ("",) and check.compiles == 0
    assert audit_hooks(model).local_total == 0
    # The compiled wrapper still runs compiled code afterwards, with no recompile.
    with torch.no_grad():
        assert torch.allclose(compiled(x), model(x), atol=1e-5)


def test_gradient_flow_on_compiled_model(
    compiled_cnn: tuple[nn.Module, nn.Module, torch.Tensor],
) -> None:
    model, compiled, x = compiled_cnn
    flow = torchscope.gradient_flow(compiled, x, loss_fn="sum",
                                    select=["conv1", "conv2", "fc"])
    assert [r.module for r in flow.modules] == ["fc", "conv2", "conv1"]
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.equal(p.grad, grads[n])
    model.zero_grad(set_to_none=True)
    assert audit_hooks(model).local_total == 0


def test_refuse_policy_raises_clear_error(
    compiled_cnn: tuple[nn.Module, nn.Module, torch.Tensor],
) -> None:
    _, compiled, _ = compiled_cnn
    with pytest.raises(CompileError, match="compiled"):
        HookSession(compiled, compiled="refuse")


def test_watches_on_a_compiled_model_say_it_ran_eagerly() -> None:
    """The gradient watch and the activation capture keep a compiled model eager while
    open (as the monitor does, which says so): each says so too, as info, and a plain
    model gets no such finding."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(4, 8)
    for net, parts in ((compiled, ("",)), (model, ())):
        with torchscope.watch_gradients(net) as grads, \
                torchscope.watch_activations(net) as acts:
            for _ in range(2):
                net.zero_grad(set_to_none=True)
                net(x).square().sum().backward()
        assert grads.compiled == parts and acts.compiled == parts
        for found, code in ((grads.findings(), "grads.compiled_eager"),
                            (acts.findings(), "activations.compiled_eager")):
            hits = [f for f in found if f.code == code]
            if parts:
                assert [f.severity.label for f in hits] == ["info"]
                assert "(<root>) ran eagerly while the" in hits[0].summary
                assert "eager numerics" in hits[0].summary
            else:
                assert hits == []
    assert audit_hooks(model, include_global=False).local_total == 0


def test_a_compiled_wrapper_made_before_the_watch_is_a_warning_not_a_clean_record() -> None:
    """The loop calls a `torch.compile` wrapper that ran before the watch opened: the hooks
    added later never fire, and an empty capture said nothing, as a healthy one does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(4, 4)
    compiled(x).sum().backward()  # compiled before the watch
    with torchscope.watch_activations(model) as watch:
        compiled(x).sum().backward()
    assert watch.forwards == 0 and not watch.records
    [f] = watch.findings()
    assert (f.code, f.severity.name) == ("activations.unseen_forward", "WARNING")
    assert "compile" in f.fix
    # Given the wrapper the loop calls, the watch runs it eagerly and records every layer.
    with torchscope.watch_activations(compiled) as watch:
        compiled(x).sum().backward()
    assert {r.module for r in watch.records} == {"0", "1", "2"}
    assert "activations.unseen_forward" not in {f.code for f in watch.findings()}
    assert audit_hooks(model, include_global=False).local_total == 0
