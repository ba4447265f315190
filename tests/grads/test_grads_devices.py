"""Half precision and CUDA: norms reduced on the gradient's device, unscaled under AMP."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from torchscope.grads import gradient_flow, watch_gradients
from torchscope.models import TinyCNN

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_bfloat16_model_norms_in_float32() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(torch.bfloat16)
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    flow = gradient_flow(model, x, loss_fn="sum")
    assert flow.get("0").grad_output[0].dtype == "torch.bfloat16"
    for p in flow.params:
        param = dict(model.named_parameters())[p.name]
        assert math.isclose(p.norm, param.grad.float().norm().item(), rel_tol=1e-6)
        # ‖w‖ is summed in float32 too: the relative gradient is no bfloat16 rounding.
        assert math.isclose(p.weight_norm, param.detach().float().norm().item(), rel_tol=1e-6)


@needs_cuda
def test_cuda_matches_cpu() -> None:
    model = TinyCNN()
    x = torch.randn(4, 3, 16, 16)
    y = torch.randint(0, 10, (4,))
    cpu = gradient_flow(model, x, loss_fn="cross_entropy", target=y)
    gpu = gradient_flow(model.cuda(), x.cuda(), loss_fn="cross_entropy", target=y.cuda())
    assert [r.key for r in gpu.modules] == [r.key for r in cpu.modules]
    for a, b in zip(cpu.params, gpu.params, strict=True):
        assert math.isclose(a.norm, b.norm, rel_tol=1e-2)  # cuDNN may use TF32


@needs_cuda
def test_cuda_amp_scaler_unscaled() -> None:
    model = TinyCNN().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**12)
    x = torch.randn(8, 3, 16, 16, device="cuda")
    y = torch.randint(0, 10, (8,), device="cuda")
    with watch_gradients(model, optimizer=opt, scaler=scaler) as watch:
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        want = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item()
        scaler.step(opt)
        scaler.update()
    flow = watch.last
    assert flow is not None and flow.scale == 2.0**12
    assert math.isclose(flow.total_norm, want, rel_tol=1e-4)
    assert flow.get("conv1").grad_output[0].dtype == "torch.float16"


def test_sparse_embedding_gradient() -> None:
    model = nn.Sequential(nn.Embedding(20, 4, sparse=True), nn.Linear(4, 2))
    ids = torch.tensor([[1, 2, 2, 5]])
    flow = gradient_flow(model, ids, loss_fn="sum")
    grad = model[0].weight.grad
    assert grad is not None and grad.is_sparse
    want = torch.linalg.vector_norm(grad.coalesce().values()).item()
    assert math.isclose(flow.param("0.weight").norm, want, rel_tol=1e-6)
    # clip_grad_norm_ has no sparse kernel; the same total, written out:
    dense = model[1].weight.grad.norm() ** 2 + model[1].bias.grad.norm() ** 2
    assert math.isclose(flow.total_norm, math.sqrt(want**2 + dense.item()), rel_tol=1e-6)


@needs_cuda
def test_cuda_weight_norms_and_update_ratio() -> None:
    model = TinyCNN().cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(8, 3, 16, 16, device="cuda")
    y = torch.randint(0, 10, (8,), device="cuda")
    with watch_gradients(model, optimizer=opt) as watch:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.step()
    flow = watch.last
    assert flow is not None
    for rec in flow.params:
        after = dict(model.named_parameters())[rec.name].detach()
        assert rec.weight_norm == pytest.approx(before[rec.name].norm().item(), rel=1e-6)
        # The update norms are torch's own `_foreach_norm` of the differences, bit for bit
        # (on CUDA its multi-tensor kernel sums in another order than `Tensor.norm`).
        (want,) = torch._foreach_norm([before[rec.name] - after])
        assert rec.update_norm == want.item()
        assert rec.update_norm == pytest.approx((before[rec.name] - after).norm().item(),
                                                rel=1e-6)
        # Adam's first step moves every element by about the learning rate.
        assert rec.update_norm == pytest.approx(1e-3 * math.sqrt(after.numel()), rel=0.05)


def test_the_weight_copy_is_taken_only_where_it_leaves_room() -> None:
    """`copy_fits`: a sampled step copies the weights (its update ratio) only where the copy
    takes at most half of what the device has free, the allocator's unused blocks counted.
    On the CPU every sampled step is copied and measured."""
    from torchscope.grads.collect import copy_fits

    mib = 1 << 20
    assert copy_fits(100 * mib, free=200 * mib, cached=0)
    assert not copy_fits(100 * mib, free=150 * mib, cached=0)
    assert copy_fits(100 * mib, free=150 * mib, cached=50 * mib)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with watch_gradients(model, optimizer=opt, every=1) as watch:
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
    assert watch._collector.snapshot_skipped == 0
    last = watch.last
    assert last is not None and all(p.update_ratio is not None for p in last.params)


@needs_cuda
def test_a_weight_copy_that_would_not_fit_on_the_device_is_not_taken() -> None:
    """With the device nearly full, a sampled step takes no copy of the weights: its update
    goes unmeasured (update ratios None), the step runs, and the gradients are read."""
    torch.cuda.empty_cache()
    model = nn.Linear(4096, 4096).cuda()  # 64 MiB of weights
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4096, device="cuda")
    free, _ = torch.cuda.mem_get_info()
    filler = torch.empty(max(free - (96 << 20), 0), dtype=torch.uint8, device="cuda")
    torch.cuda.empty_cache()
    try:
        with watch_gradients(model, optimizer=opt, every=1) as watch:
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        assert watch._collector.snapshot_skipped == 1
        last = watch.last
        assert last is not None and last.total_norm > 0
        assert all(p.update_ratio is None for p in last.params)
    finally:
        del filler
        torch.cuda.empty_cache()
