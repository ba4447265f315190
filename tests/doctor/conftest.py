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
    """Shaped like `torchscope.grads.GradFlow`: modules in backward order, params, total."""
    rows: list[SimpleNamespace] = []
    with HookSession(model) as s:
        for name, m in model.named_modules():
            if name and next(m.children(), None) is None and any(True for _ in m.parameters()):
                def hook(mod: nn.Module, gi: Any, go: Any, _n: str = name) -> None:
                    ins = [float(g.norm()) for g in gi if g is not None]
                    rows.append(SimpleNamespace(
                        module=_n, order=len(rows), output_norm=float(go[0].norm()),
                        input_norm=ins[0] if ins else None))
                s.full_backward_hook(m, hook)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # inputs needing no grad: expected
            _loss(call_model(model, ModelInputs.of(inputs))).backward()
    params = [SimpleNamespace(module=n.rpartition(".")[0], norm=float(p.grad.norm()))
              for n, p in model.named_parameters() if p.grad is not None]
    total = torch.linalg.vector_norm(torch.stack(
        [p.grad.norm() for p in model.parameters() if p.grad is not None]))
    return SimpleNamespace(modules=rows, params=params, total_norm=float(total))


def fake_analyze_memory(model: nn.Module, inputs: Any, **_: Any) -> Any:
    """Shaped like `torchscope.memory.MemoryReport`, without its own findings."""
    mods = [SimpleNamespace(module=n, module_type=type(m).__name__, bytes=4096 * (i + 1),
                            storages=1) for i, (n, m) in enumerate(model.named_children())]
    saved = sum(m.bytes for m in mods)
    names = tuple(m.module for m in mods)
    plans = [SimpleNamespace(name="none", blocks=names, segments=(), saved_bytes=saved,
                             recompute_ms=0.0),
             SimpleNamespace(name="sqrt", blocks=names, segments=((0, 1),),
                             saved_bytes=saved // 2, recompute_ms=1.0)]
    measured = [SimpleNamespace(plan=p.name, step_ms=10.0, recompute_ms=p.recompute_ms * 1.5,
                                verification=SimpleNamespace(ok=True)) for p in plans]
    return SimpleNamespace(
        saved=SimpleNamespace(modules=mods, total_bytes=saved),
        totals=SimpleNamespace(parameters=4 * sum(p.numel() for p in model.parameters()),
                               gradients=0, optimizer_state=None, peak_estimate=2 * saved),
        measured=None, plans=SimpleNamespace(plans=plans, measurements=measured),
        findings=None)


def fake_profile_steps(model: nn.Module, inputs: Any, steps: int = 5, **_: Any) -> Any:
    """Shaped like `torchscope.profiling.ProfileResult`, from a real torch.profiler run."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            _loss(call_model(model, ModelInputs.of(inputs))).backward()
    ops = [SimpleNamespace(name=e.key, calls=e.count, self_cpu_ms=e.self_cpu_time_total / 1e3,
                           cpu_total_ms=e.cpu_time_total / 1e3, self_device_ms=0.0)
           for e in prof.key_averages()]
    mods = [SimpleNamespace(module=n, calls=steps, forward_ms=1.0 + i, backward_ms=2.0 + i)
            for i, (n, _) in enumerate(model.named_children())]
    phases = {"forward": 4.0 * steps, "backward": 8.0 * steps, "optimizer": 0.5 * steps}
    return SimpleNamespace(
        ops=ops, modules=mods, steps=steps, timing=SimpleNamespace(profiled_ms=12.5),
        phase=lambda name: SimpleNamespace(cpu_ms=phases[name]) if name in phases else None)


def fake_compile_report(model: nn.Module, inputs: Any, modes: Any = ("default",),
                        **_: Any) -> Any:
    """Shaped like `torchscope.compile.CompileReport`; no compile runs."""
    return SimpleNamespace(graph_breaks=("print",), modes=[
        SimpleNamespace(mode=m, status="ok", error=None, cold_compile_s=8.0, warm_compile_s=1.5,
                        eager_ms=2.0, compiled_ms=1.0 + i, speedup=2.0 / (1.0 + i),
                        break_even_calls=8000 if i == 0 else None, recompiles=(),
                        max_abs_diff=1e-6) for i, m in enumerate(modes)])


@pytest.fixture
def fake_capabilities(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Install the stand-ins under the names the adapters import."""
    monkeypatch.setattr(torchscope.grads, "gradient_flow", fake_gradient_flow, raising=False)
    monkeypatch.setattr(torchscope.memory, "analyze_memory", fake_analyze_memory, raising=False)
    monkeypatch.setattr(torchscope.profiling, "profile_steps", fake_profile_steps, raising=False)
    monkeypatch.setattr(torchscope.compile, "compile_report", fake_compile_report, raising=False)
    # The stand-ins' records are not the real ones: their analyzers must not read them.
    for module, name in ((torchscope.grads, "diagnose"),
                         (torchscope.profiling, "profile_findings"),
                         (torchscope.compile, "compile_findings")):
        monkeypatch.delattr(module, name, raising=False)
    yield
