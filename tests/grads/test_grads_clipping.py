"""A loop that clips its gradients: the total norm the update used (`applied_norm`) against
torch's, the advice that follows from it, and `grads.clipped` over a watch's samples."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pytest
import torch
from torch import nn

from torchscope.findings import Finding, Severity
from torchscope.grads import watch_gradients
from torchscope.grads.analyze import diagnose_history
from torchscope.grads.records import GradHistory


def _exploding() -> nn.Module:
    """Ten linear layers at 2.5x std 1/sqrt(fan_in), no activation: the gradient grows 2.5x
    per layer toward the input, a total norm of about 4e4."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(10):
        layer = nn.Linear(64, 64)
        nn.init.normal_(layer.weight, std=2.5 / 64 ** 0.5)
        layers.append(layer)
    return nn.Sequential(*layers, nn.Linear(64, 10))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int,
           clip: Callable[[], object] | None) -> list[float]:
    """Train `steps` SGD steps, clipping with `clip` after each backward; returns per step
    the total norm of the gradients `opt.step()` then used, as torch computes it."""
    g = torch.Generator().manual_seed(1)
    used: list[float] = []
    for _ in range(steps):
        x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if clip is not None:
            clip()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        used.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())
        opt.step()
    return used


def _codes(found: list[Finding]) -> dict[str, Finding]:
    return {f.code: f for f in found}


def test_the_applied_norm_is_the_clipped_total_and_the_advice_follows_it() -> None:
    """clip_grad_norm_ at 1.0 on gradients of total norm ~4e4: the update used a total of
    1.0, which torchscope reads (training bitwise unchanged). The exploding-gradient fix
    said to clip with max_norm 1.0, and the too-small step's to raise the learning rate:
    the loop already clips, and the clipping (40000x) set the step's size."""
    model = _exploding()
    plain = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    returned: list[float] = []

    def clip() -> None:
        returned.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))

    with watch_gradients(model, optimizer=opt) as watch:
        used = _train(model, opt, 4, clip)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=1e-4)
    _train(plain, plain_opt, 4, lambda: torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0))
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)
    applied = watch.applied_norms
    assert sorted(applied) == [0, 1, 2, 3]
    for step in range(4):
        assert applied[step] == pytest.approx(used[step], rel=1e-6)
        assert applied[step] == pytest.approx(1.0, rel=1e-5)
    last = watch.last
    assert last is not None and last.applied_norm == applied[3]
    assert last.total_norm == pytest.approx(returned[3], rel=1e-6)  # before clipping
    assert last.clip_factor == pytest.approx(returned[3] / applied[3], rel=1e-9)
    assert last.clip_factor > 1e4
    found = _codes(watch.findings())
    exploding, small = found["grads.exploding"], found["grads.update_ratio"]
    assert exploding.fix.startswith("the loop already clips") and "clip_grad_norm_" not in \
        exploding.fix
    assert "clipped" in small.summary and "raise the learning rate" not in small.fix
    assert small.evidence["clip_factor"] == last.clip_factor
    clipped = found["grads.clipped"]
    assert clipped.severity == Severity.INFO
    assert clipped.evidence["clipped"] == clipped.evidence["samples"] == 4
    assert clipped.evidence["median_applied_norm"] == pytest.approx(1.0, rel=1e-5)


def test_without_clipping_nothing_is_read_and_the_fix_says_to_clip() -> None:
    model = _exploding()
    opt = torch.optim.SGD(model.parameters(), lr=1e-9)
    with watch_gradients(model, optimizer=opt) as watch:
        _train(model, opt, 3, None)
    assert watch.applied_norms == {}
    assert watch.last is not None and watch.last.applied_norm is None
    assert watch.last.clip_factor == 1.0
    found = _codes(watch.findings())
    assert found["grads.exploding"].fix.startswith("clip with torch.nn.utils.clip_grad_norm_")
    assert "grads.clipped" not in found


@pytest.mark.parametrize("how", ["max_norm above the total", "grad scaler"])
def test_gradients_changed_but_not_shrunk_are_no_clipping(how: str) -> None:
    """clip_grad_norm_ multiplies every gradient in place even when it does not clip (a
    coefficient of 1.0), so the applied norm is read; it equals the total. A GradScaler's
    scale is divided out of both."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if how == "grad scaler" else None
    g = torch.Generator().manual_seed(1)
    with watch_gradients(model, optimizer=opt, scaler=scaler) as watch:
        for _ in range(4):
            x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            if scaler is None:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1e3)
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1e3)
                scaler.step(opt)
                scaler.update()
    history = watch.history
    assert len(history.applied_norms) == 4
    for total, applied in zip(history.total_norms, history.applied_norms, strict=True):
        assert applied == pytest.approx(total, rel=1e-5)
    assert history.clip_factors() == (1.0,) * 4
    assert not [f for f in watch.findings() if "clip" in f.code]


def test_a_closure_that_clips_has_its_clipped_total_read() -> None:
    """`opt.step(closure)`: the gradients are final once the closure has returned (as
    Lightning's closure runs the backward, then clips)."""
    model = _exploding()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        return loss

    with watch_gradients(model, optimizer=opt) as watch:
        for _ in range(2):
            opt.step(closure)
    assert sorted(watch.applied_norms) == [0, 1]
    assert all(v == pytest.approx(0.5, rel=1e-5) for v in watch.applied_norms.values())
    assert watch.last is not None and watch.last.clip_factor > 1e4


def _history(totals: list[float], applied: list[float | None]) -> GradHistory:
    n = len(totals)
    return GradHistory(steps=tuple(range(n)), layers=(), output_norms=((),) * n,
                       param_norms=((),) * n, total_norms=tuple(totals),
                       applied_norms=tuple(applied))


def test_clipping_now_and_then_or_by_a_little_stays_silent() -> None:
    spikes = _history([1.0, 1.2, 9.0, 1.1, 1.0, 1.3], [None, None, 1.0, None, None, None])
    assert _history([2.0, 2.0, 2.0], [None, None, None]).clip_factors() == (1.0,) * 3
    trims = _history([1.5] * 6, [1.0] * 6)
    most = _history([3.0, 3.5, 4.0, 0.5, 3.0, 0.8], [1.0, 1.0, 1.0, 0.5, 1.0, 0.8])
    assert not [f for f in diagnose_history(spikes) if f.code == "grads.clipped"]
    assert not [f for f in diagnose_history(trims) if f.code == "grads.clipped"]
    (f,) = [f for f in diagnose_history(most) if f.code == "grads.clipped"]
    assert f.evidence["clipped"] == 4 and f.evidence["samples"] == 6
    assert math.isclose(float(f.evidence["median_factor"] or 0), 3.25)
    assert f.evidence["first_step"] == 0 and f.evidence["last_step"] == 4


def test_the_table_and_the_json_say_what_the_update_used() -> None:
    from torchscope.doctor.sections import GradientsSection
    from torchscope.report.grads import grad_table

    model = _exploding()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    with watch_gradients(model, optimizer=opt) as watch:
        _train(model, opt, 1, lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    flow = watch.last
    assert flow is not None
    caption = str(grad_table(flow).caption)
    assert "the update used 1" in caption and "clipped" in caption
    assert GradientsSection().to_json(flow)["applied_norm"] == flow.applied_norm
