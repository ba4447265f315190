"""Exactness of gradient-flow norms on both paths (eager `vector_norm`, the fused `norm`
kernel) and of parameter norms (one native call for large float32 CPU weights, else one
`torch._foreach_norm`); gradients bitwise untouched.

Tolerances: the fused kernel sums squares in float64, so it must match the float64 norm of
the very gradient autograd produced to 1e-9. Eager `vector_norm` is torch's float32
reduction itself; against float64 it drifts by float32 accumulation error (below 1e-4 for
these sizes, see tests/capture/test_capture_fused.py), and it equals `vector_norm` of the
same tensor exactly.
"""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch
from torch import nn
from torch.nn import functional

from torchscope import _kernels
from torchscope.grads import gradient_flow, watch_gradients
from torchscope.step import Step


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    )


def _reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor
               ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Each leaf's output gradient (tensor hooks on a twin) and each parameter's `.grad`."""
    twin = copy.deepcopy(model)
    outs: dict[str, torch.Tensor] = {}

    def keep(name: str):  # type: ignore[no-untyped-def]
        def hook(_m: nn.Module, _i: object, o: torch.Tensor) -> None:
            o.register_hook(lambda g: outs.__setitem__(name, g.detach().clone()))
        return hook

    handles = [m.register_forward_hook(keep(n)) for n, m in twin.named_modules()
               if not list(m.children()) and not getattr(m, "inplace", False)]
    try:
        functional.cross_entropy(twin(x), y).backward()
    finally:
        for h in handles:
            h.remove()
    return outs, {n: p.grad.detach().clone() for n, p in twin.named_parameters()
                  if p.grad is not None}


@pytest.mark.parametrize("path", ["fused", "eager"])
def test_norms_equal_the_gradients_autograd_computed(path: str) -> None:
    tol = 0.0
    if path == "fused":
        status = _kernels.prepare("norm", wait=None)
        if status.state != "ready":
            pytest.skip(status.reason)
        tol = 1e-6 if status.backend == "native" else 1e-9
    model = _net()
    x, y = torch.randn(8, 3, 24, 24), torch.randint(0, 10, (8,))
    grads, params = _reference(model, x, y)
    with _kernels.disabled() if path == "eager" else contextlib.nullcontext():
        flow = gradient_flow(model, x, loss_fn="cross_entropy", target=y)
    if path == "fused":
        assert flow.fused_norms > 0 and flow.eager_norms == 0
    else:
        assert flow.fused_norms == 0 and flow.eager_norms > 0
    for name, g in grads.items():
        got = flow.get(name).grad_output[0].norm
        assert got is not None, name
        truth = float(g.double().norm())
        if path == "fused":
            # float64 sums (AOTInductor), or float32 lanes summed in float64 every 1024
            # elements (the native CPU float32 kernel: ~1e-7 at worst).
            assert math.isclose(got, truth, rel_tol=tol), (name, got, truth)
        else:
            assert got == float(torch.linalg.vector_norm(g)), name
            assert math.isclose(got, truth, rel_tol=1e-4), name
    # Parameter norms: one foreach call, equal to vector_norm of each .grad.
    for rec in flow.params:
        want = float(torch.linalg.vector_norm(params[rec.name]))
        assert rec.norm is not None and math.isclose(rec.norm, want, rel_tol=1e-6), rec.name
    total = math.sqrt(sum(float(p.double().norm()) ** 2 for p in params.values()))
    assert math.isclose(flow.total_norm, total, rel_tol=1e-6)


@pytest.mark.parametrize("path", ["fused", "eager"])
def test_large_parameters_are_measured_by_one_native_call(
        path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights of 64 kB and more on average: their gradients' and their own norms come from
    the native list kernel (float64 sums) in one call each, and equal float64 truth; with
    fused kernels off, from foreach, equal to float32 `vector_norm`."""
    if path == "fused" and _kernels.prepare("norm", wait=None).backend != "native":
        pytest.skip("no native kernel here")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 96))  # 23k on average
    x, y = torch.randn(32, 256), torch.randint(0, 96, (32,))
    _, grads = _reference(model, x, y)
    calls: list[int] = []
    native = _kernels.norms

    def counted(xs: list[torch.Tensor]) -> list[torch.Tensor] | None:
        got = native(xs)
        if got is not None:
            calls.append(len(xs))
        return got

    monkeypatch.setattr(_kernels, "norms", counted)
    with _kernels.disabled() if path == "eager" else contextlib.nullcontext():
        flow = gradient_flow(model, x, loss_fn="cross_entropy", target=y)
    assert calls == ([4, 4] if path == "fused" else [])  # the gradients, then the weights
    weights = dict(model.named_parameters())
    for rec in flow.params:
        g, w = grads[rec.name], weights[rec.name].detach()
        assert rec.norm is not None and rec.weight_norm is not None
        if path == "fused":
            assert math.isclose(rec.norm, float(g.double().norm()), rel_tol=1e-7), rec.name
            assert math.isclose(rec.weight_norm, float(w.double().norm()), rel_tol=1e-7)
        else:
            assert rec.norm == float(torch.linalg.vector_norm(g)), rec.name
            assert rec.weight_norm == float(torch.linalg.vector_norm(w)), rec.name


@pytest.mark.parametrize("path", ["fused", "eager"])
def test_gradients_and_training_are_bitwise_untouched(path: str) -> None:
    if path == "fused" and _kernels.prepare("norm", wait=None).state != "ready":
        pytest.skip("no fused kernel here")
    model = _net()
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
    with _kernels.disabled() if path == "eager" else contextlib.nullcontext(), \
            watch_gradients(model, every=1, optimizer=opt) as watch:
        for _ in range(3):
            opt.zero_grad()
            functional.cross_entropy(model(x), y).backward()
            opt.step()
    for _ in range(3):
        twin_opt.zero_grad()
        functional.cross_entropy(twin(x), y).backward()
        twin_opt.step()
    assert len(watch.history) == 3
    for (name, a), b in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b), name
        assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad), name


def test_half_precision_gradients_and_accumulation() -> None:
    status = _kernels.prepare("norm", torch.bfloat16, wait=None)
    if status.state != "ready":
        pytest.skip(status.reason)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 8)).to(torch.bfloat16)
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    seen: list[torch.Tensor] = []

    def keep(_m: nn.Module, _i: object, o: torch.Tensor) -> None:
        o.register_hook(lambda g: seen.append(g.detach().clone()))

    handle = model[1].register_forward_hook(keep)
    try:
        flow = gradient_flow(Step(model, x, loss_fn="sum", accumulate=2))
    finally:
        handle.remove()
    assert flow.micro_batches == 2 and flow.fused_norms > 0
    recs = [r for r in flow.modules if r.module == "1"]
    assert len(recs) == 2 == len(seen)
    for rec, g in zip(sorted(recs, key=lambda r: r.micro), seen, strict=True):
        got = rec.grad_output[0].norm
        assert got is not None and math.isclose(got, float(g.double().norm()), rel_tol=1e-9)
    # After two micro-batches the parameter norms are those of the accumulated .grad.
    for rec in flow.params:
        p = dict(model.named_parameters())[rec.name]
        want = float(torch.linalg.vector_norm(p.grad, dtype=torch.float32))  # type: ignore[arg-type]
        assert rec.norm is not None and math.isclose(rec.norm, want, rel_tol=1e-6), rec.name


def _backward_adds(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[int, int]:
    """(out-of-place, in-place) adds in one backward, counted by the profiler."""
    from torch.profiler import profile

    loss = functional.cross_entropy(model(x), y)
    with profile() as prof:
        loss.backward()
    counts = {e.key: e.count for e in prof.key_averages()}
    return counts.get("aten::add", 0), counts.get("aten::add_", 0)


def test_watching_leaves_autograd_accumulating_in_place() -> None:
    """Where two branches of a residual block meet, autograd adds their gradients in place
    when nothing else holds either one. The hooks' reuse of a norm (the gradient a layer
    passes down is the one the layer below receives) must not hold one: a weak reference to
    the gradient's storage did, and made every merge an out-of-place add."""
    from torchscope.models import ResNetMini

    torch.manual_seed(0)
    x, y = torch.randn(2, 3, 16, 16), torch.randint(0, 10, (2,))
    model = ResNetMini(channels=8, blocks=6).train()
    bare = _backward_adds(model, x, y)
    model.zero_grad(set_to_none=True)
    with watch_gradients(model, every=1) as watch:
        watched = _backward_adds(model, x, y)
    assert watch.last is not None and watch.last.get("blocks.5.conv").grad_input[0].norm
    assert watched == bare, (watched, bare)
