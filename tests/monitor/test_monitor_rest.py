"""Steps the monitor does not sample run the submodules without torchscope's hooks (torch's
fast path; the cost is measured in benchmarks/monitor_overhead.py), the sampled ones with
all of them, in their places among the user's hooks; training stays bitwise the same."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

import torchscope
from torchscope.hooks import audit_hooks


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 2))


def _submodule_hooks(model: nn.Module) -> int:
    """Forward hooks on the submodules, but the first layer's pre-hooks: the monitor keeps
    one there at every step (the autocast state a framework enters inside the model)."""
    return sum(len(m._forward_hooks) + (len(m._forward_pre_hooks) if m is not model[0] else 0)
               for m in model.modules() if m is not model)


def test_unsampled_steps_run_the_submodules_unhooked_and_sampled_ones_fully() -> None:
    model, plain = _net(), _net()
    seen: list[int] = []

    def user_hook(_m: nn.Module, _a: Any, _o: Any) -> None:
        seen.append(1)

    mine = model[0].register_forward_hook(user_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g))
               for _ in range(12)]
    hooked: list[int] = []  # submodule hooks during each step's forward
    orders: dict[int, list[int]] = {}  # model[0]'s forward hooks' keys, sampled steps
    reference: dict[int, float] = {}  # model[2]'s weight-gradient norm, by torch
    with torchscope.monitor(model, opt, every=5, out=None) as mon:
        for step, (x, y) in enumerate(batches):
            opt.zero_grad()
            out = model(x)
            hooked.append(_submodule_hooks(model))
            if step % 5 == 0:
                orders[step] = [*model[0]._forward_hooks, *model[2]._forward_pre_hooks]
            nn.functional.mse_loss(out, y).backward()
            reference[step] = torch.linalg.vector_norm(
                torch.cat([model[2].weight.grad.flatten(), model[2].bias.grad.flatten()])
            ).item()
            opt.step()
    for x, y in batches:
        plain_opt.zero_grad()
        nn.functional.mse_loss(plain(x), y).backward()
        plain_opt.step()
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)
    # Sampled steps (0, 5, 10) carry the watches' hooks; the others only the user's own.
    assert [step for step, n in enumerate(hooked) if n > 1] == [0, 5, 10]
    assert all(n == 1 for step, n in enumerate(hooked) if step % 5)
    assert len(seen) == 12  # the user's hook fired at every step
    # The user's hook stays first among model[0]'s hooks, as it was registered.
    assert all(keys[0] == mine.id and len(keys) > 2 for keys in orders.values())
    assert orders[0] == orders[5] == orders[10]  # every hook back in its place
    run = mon.result
    assert run is not None and run.grad_param.steps == (0, 5, 10)
    for step, value in zip(run.grad_param.steps, run.grad_param.series("2"), strict=True):
        assert math.isclose(value, reference[step], rel_tol=1e-6)
    mine.remove()
    assert audit_hooks(model, include_global=False).local_total == 0


def test_a_monitor_closed_between_samples_leaves_the_users_hooks_alone() -> None:
    """Closed while its hooks are off the submodules: nothing of it comes back, the
    user's hooks stay."""
    model = _net()
    kept = model[2].register_forward_pre_hook(lambda _m, _a: None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    with torchscope.monitor(model, opt, every=10, out=None):
        for _ in range(3):  # step 0 sampled, then resting
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        assert _submodule_hooks(model) == 1  # the user's
    assert list(model[2]._forward_pre_hooks) == [kept.id]
    assert _submodule_hooks(model) == 1 and not model[0]._forward_pre_hooks
    kept.remove()
    assert audit_hooks(model, include_global=False).local_total == 0


def test_the_every_step_check_finds_the_first_nonfinite_element_on_unsampled_steps() -> None:
    """The check at every step (one native norms call over a CPU model's gradients, where
    the library is loaded): a finite gradient of 6e31 per element is no NaN/Inf (a float32
    sum of its squares would overflow), a NaN element at unsampled step 7 is found there."""
    from torchscope import _kernels

    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 8)
    with torchscope.monitor(model, opt, every=5, out=None, activations=False,
                            memory=False) as mon:
        for step in range(10):
            opt.zero_grad()
            model(x).sum().backward()
            if step in (2, 3):
                model[2].weight.grad.fill_(6e31)  # finite, beyond float32's squares
            if step == 7:
                model[0].bias.grad[3] = float("nan")
            opt.step()
        grads = [p.grad for p in model.parameters()]
    assert mon.grads is not None
    # Steps 7, 8 and 9: the NaN's update made the weights NaN.
    assert mon.grads.first_nonfinite_step == 7 and mon.grads.nonfinite_steps == 3
    loaded = _kernels.norm_vector(grads)  # the native path ran when this is not None
    if loaded is not None:
        assert not bool(torch.isfinite(loaded).all())  # the NaN is in it


def test_the_flight_recorder_holds_every_steps_gradient_norms_as_torch_computes_them() -> None:
    """The every-step check writes each gradient's norm into the flight recorder's row of
    its step (on the CPU, the native call writes the row itself): every step's row, the
    unsampled ones included, equals torch's float64 norm of each gradient, as the loop
    saw it just before the update."""
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(4, 8)
    want: dict[int, torch.Tensor] = {}
    with torchscope.monitor(model, opt, every=5, out=None, activations=False,
                            memory=False) as mon:
        for step in range(12):
            opt.zero_grad()
            model(x).pow(2).sum().backward()
            want[step] = torch.stack([torch.linalg.vector_norm(p.grad.double())
                                      for p in model.parameters()])  # (n,)
            opt.step()
        flight = mon._flight
        assert flight is not None and flight._grads is not None
        rows = {flight._grad_step[r]: flight._grads[r].clone() for r in range(flight.capacity)
                if flight._grad_step[r] >= 0}
    assert sorted(rows) == list(range(12))
    for step, norms in want.items():
        assert rows[step].dtype == torch.float64
        torch.testing.assert_close(rows[step], norms, rtol=1e-6, atol=0)


def test_memory_is_measured_where_the_input_changes_and_one_sampled_step_in_eight() -> None:
    """What a forward saves is set by the input's shapes: after the first three sampled
    steps the memory watch measures where they change and at the samples whose index is a
    multiple of eight (which the history's thinning keeps), and its hooks are off the
    submodules at the others. What it measures is what `saved_activations` finds for the
    same input."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    rows = [4 if step < 14 else 6 for step in range(24)]  # the batch grows at step 14
    hooks: list[int] = []  # submodule hooks during each step's forward
    orders: list[list[int]] = []  # model[0]'s forward hooks' and model[2]'s pre-hooks' keys
    with torchscope.monitor(model, opt, every=1, out=None) as mon:
        for n in rows:
            opt.zero_grad()
            out = model(torch.randn(n, 8, generator=g))
            hooks.append(_submodule_hooks(model))
            orders.append([*model[0]._forward_hooks, *model[2]._forward_pre_hooks])
            out.square().mean().backward()
            opt.step()
    run = mon.result
    assert run is not None and run.samples == 24
    measured = [step for step, b in enumerate(run.saved_bytes) if b is not None]
    assert measured == [0, 1, 2, 8, 14, 16]
    for step in measured:
        want = torchscope.memory.saved_activations(
            _net(), torch.randn(rows[step], 8), loss_fn="sum").total_bytes
        assert run.saved_bytes[step] == want
    assert len({hooks[s] for s in measured}) == 1
    assert all(hooks[s] < hooks[0] for s in range(24) if s not in measured)
    # Every hook in its place: the same order at each measured step, and the same order
    # without the memory watch's at the others.
    assert all(orders[s] == orders[0] for s in measured)
    assert all(orders[s] == [k for k in orders[0] if k in orders[s]] and orders[s]
               for s in range(24))
    assert audit_hooks(model, include_global=False).local_total == 0
