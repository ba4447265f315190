"""Measured memory (CPU profiler, CUDA allocator), findings, and live tensors."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn

from torchscope.findings import Severity
from torchscope.memory import live_tensors, measure_step, saved_activations
from torchscope.models import DeepMLP


def test_cpu_profiler_measurement_covers_gradients() -> None:
    model = DeepMLP()
    x = torch.randn(32, 64)
    m = measure_step(model, x, loss_fn="sum")
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    assert m.method == "cpu-profiler"
    assert m.step is not None and m.step.loss == "sum of the output"
    # After backward the step still holds every gradient (and the scalar loss).
    assert grads <= m.end_bytes <= grads + 64
    assert m.peak_bytes >= m.end_bytes
    assert all(p.grad is None for p in model.parameters())  # left as it was


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_allocator_measurement() -> None:
    model = DeepMLP().cuda()
    x = torch.randn(32, 64, device="cuda")
    m = measure_step(model, x, loss_fn="sum")
    assert m.method == "cuda-allocator"
    assert m.peak_bytes >= m.baseline_bytes + 73_728
    assert m.reserved_bytes is not None and m.reserved_bytes >= m.end_bytes


def test_relu_finding_names_its_share() -> None:
    saved = saved_activations(DeepMLP(), torch.randn(32, 64), loss_fn="sum")
    finding = next(f for f in saved.findings() if f.code == "memory.saved_by_type")
    assert finding.summary.startswith("ReLU outputs hold 89% of saved activations")
    assert finding.evidence["bytes"] == 8 * 8_192


class _Holder:
    def __init__(self) -> None:
        self.cache = torch.zeros(512, 512)


def test_live_tensors_name_their_holders_and_keep_nothing_alive() -> None:
    holder = _Holder()
    local_big = torch.ones(600, 600)
    view = local_big[:10]  # a view shares the storage; counted once
    model = nn.Linear(300, 300)
    live = live_tensors(50)
    by_bytes = {t.nbytes: t for t in live.tensors}
    big = by_bytes[600 * 600 * 4]
    assert big.views >= 2
    assert any("local 'local_big'" in r for r in big.referrers)
    assert any("attribute 'cache' of _Holder" in r for r in by_bytes[512 * 512 * 4].referrers)
    weight = by_bytes[300 * 300 * 4]
    assert weight.is_parameter and "parameter 'weight' of Linear" in weight.referrers
    assert live.total_bytes >= 600 * 600 * 4 + 512 * 512 * 4
    ref = weakref.ref(holder.cache)
    del holder, view, local_big
    assert ref() is None  # the report holds no tensor
    assert any(f.code == "memory.largest_live" for f in live.findings())
    del model


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_empty_cache_cannot_free_a_referenced_tensor() -> None:
    kept = torch.empty(64 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    freed = torch.empty(32 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    del freed
    live = live_tensors(5, device="cuda")
    assert live.allocated_after is not None and live.reserved_after is not None
    assert live.allocated_after >= kept.numel()
    assert live.reserved_before is not None and live.reserved_after <= live.reserved_before
    finding = next(f for f in live.findings() if f.code == "memory.empty_cache")
    released = live.reserved_before - live.reserved_after
    assert finding.evidence["released"] == released
    assert finding.evidence["still_allocated"] == live.allocated_after >= kept.numel()
    # The kept 64 MiB outweigh what empty_cache() could give back: that is the warning.
    want = Severity.WARNING if live.allocated_after > released else Severity.INFO
    assert finding.severity == want
    del kept


def test_live_tensors_skips_tensors_without_a_data_pointer() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

    # What torch.compile can leave alive in gc: fake and functional tensors.
    with FakeTensorMode():
        fake = torch.empty(1000, 1000)
    with FunctionalTensorMode():
        functional = FunctionalTensor.to_functional(torch.ones(900, 900))
    real = torch.ones(700, 700)
    live = live_tensors(5)
    assert any(t.nbytes == 700 * 700 * 4 for t in live.tensors)
    assert all(t.nbytes != 1000 * 1000 * 4 for t in live.tensors)
    del fake, functional, real
