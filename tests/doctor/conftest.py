"""Fixtures for the doctor tests: stand-in capabilities for sections not merged on this branch.

The stand-ins measure for real with torch (backward hooks, torch.profiler) where that is
cheap, and return records shaped the way the adapters read them.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import torchscope.compile
import torchscope.grads
import torchscope.memory
import torchscope.profiling
from torchscope.hooks import HookSession
from torchscope.models import ModelInputs, call_model


def _loss(out: Any) -> torch.Tensor:
    t = out if isinstance(out, torch.Tensor) else out[0] if isinstance(out, tuple) else out.logits
    return t.float().pow(2).mean()


def fake_gradient_flow(model: nn.Module, inputs: Any, loss_fn: Any = None) -> Any:
    rows: list[SimpleNamespace] = []
    with HookSession(model) as s:
        for name, m in model.named_modules():
            if name and next(m.children(), None) is None and any(True for _ in m.parameters()):
                def hook(mod: nn.Module, gi: Any, go: Any, _n: str = name) -> None:
                    rows.append(SimpleNamespace(
                        module=_n, grad_output_norm=float(go[0].norm()),
                        grad_input_norms=[None if g is None else float(g.norm()) for g in gi],
                        param_norms=[]))
                s.full_backward_hook(m, hook)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # inputs needing no grad: expected
            _loss(call_model(model, ModelInputs.of(inputs))).backward()
    total = torch.linalg.vector_norm(torch.stack(
        [p.grad.norm() for p in model.parameters() if p.grad is not None]))
    return SimpleNamespace(records=rows, total_norm=float(total))


def fake_memory_report(model: nn.Module, inputs: Any, loss_fn: Any = None) -> Any:
    mods = [SimpleNamespace(module=n, module_type=type(m).__name__, saved_bytes=4096 * (i + 1),
                            tensors=1) for i, (n, m) in enumerate(model.named_children())]
    saved = sum(m.saved_bytes for m in mods)
    return SimpleNamespace(
        modules=mods, saved_bytes=saved, param_bytes=4 * sum(p.numel() for p in model.parameters()),
        grad_bytes=None, optimizer_bytes=None, peak_estimate_bytes=2 * saved,
        measured_peak_bytes=None, step_ms=10.0,
        plans=[SimpleNamespace(name="none", blocks=(), saved_bytes=saved, recompute_ms=0.0,
                               verified=True),
               SimpleNamespace(name="sqrt", blocks=(mods[0].module,), saved_bytes=saved // 2,
                               recompute_ms=1.5, verified=True)])


def fake_profile_steps(model: nn.Module, inputs: Any, loss_fn: Any = None, steps: int = 5) -> Any:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            _loss(call_model(model, ModelInputs.of(inputs))).backward()
    ops = [SimpleNamespace(name=e.key, calls=e.count, self_cpu_us=e.self_cpu_time_total,
                           total_cpu_us=e.cpu_time_total) for e in prof.key_averages()]
    mods = [SimpleNamespace(module=n, calls=steps, forward_ms=1.0 + i, backward_ms=2.0 + i)
            for i, (n, _) in enumerate(model.named_children())]
    return SimpleNamespace(ops=ops, modules=mods, steps=steps, step_ms=12.5, forward_ms=4.0,
                           backward_ms=8.0, optimizer_ms=0.5)


def fake_compile_report(model: nn.Module, inputs: Any, modes: Any = ("default",),
                        iters: int = 20) -> Any:
    return SimpleNamespace(modes=[
        SimpleNamespace(mode=m, cold_s=8.0, warm_s=1.5, eager_ms=2.0, compiled_ms=1.0 + i,
                        break_even_calls=8000.0 if i == 0 else None, graph_breaks=i,
                        recompiles=0, max_abs_diff=1e-6) for i, m in enumerate(modes)])


@pytest.fixture
def fake_capabilities(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Install the stand-ins under the names the adapters import."""
    monkeypatch.setattr(torchscope.grads, "gradient_flow", fake_gradient_flow, raising=False)
    monkeypatch.setattr(torchscope.memory, "memory_report", fake_memory_report, raising=False)
    monkeypatch.setattr(torchscope.profiling, "profile_steps", fake_profile_steps, raising=False)
    monkeypatch.setattr(torchscope.compile, "compile_report", fake_compile_report, raising=False)
    yield
