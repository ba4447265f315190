"""watch_gradients in a training loop: sampling on optimizer steps, bounded memory, no hooks
left, gradient accumulation and GradScaler."""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import tracemalloc

import pytest
import torch
from torch import nn

from torchscope.errors import TorchscopeError
from torchscope.grads import GradFlow, watch_gradients
from torchscope.grads.records import PASSES_UNSUMMED
from torchscope.hooks import audit_hooks


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _live_tensors() -> int:
    gc.collect()  # torch.distributed's deprecated alias warns when gc walks past it
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_thousand_steps_bounded_memory_and_no_hooks_left() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(4, 4), torch.randn(4, 2)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    with watch_gradients(model, every=10, optimizer=opt, max_samples=20) as watch:
        for _ in range(600):
            step()
        handles = watch.session.handle_count
        tensors = _live_tensors()
        tracemalloc.start(8)
        try:
            # Traced from here: first 200 steps, so that what a step keeps until a later
            # one (the sample whose records are built when the next sample comes, the
            # history's rows) is traced in both snapshots, and only growth differs.
            for _ in range(200):
                step()
            gc.collect()  # count what is kept, not garbage waiting for the cycle collector
            snap_before = tracemalloc.take_snapshot()
            for _ in range(200):
                step()
            gc.collect()
            snap_after = tracemalloc.take_snapshot()
        finally:
            tracemalloc.stop()
        # Count what torchscope's own code (and anything it calls) allocated and kept; torch's
        # internal caches grow by a few bytes per step with or without it.
        ours = [tracemalloc.Filter(True, "*torchscope*", all_frames=True)]
        growth = sum(s.size_diff for s in snap_after.filter_traces(ours).compare_to(
            snap_before.filter_traces(ours), "filename"))
        assert watch.session.handle_count == handles  # step hooks are released each step
        # No gradients or norms kept: the count cannot grow (other tests' garbage may shrink it).
        assert _live_tensors() <= tensors
    assert growth < 16 * 1024, f"memory grew by {growth} bytes over 200 steps"
    assert watch.steps == 1000
    assert watch.samples == 100
    assert len(watch.history) == 20  # bounded by max_samples
    assert watch.history.steps[-1] == 990 and watch.history.steps[0] == 800
    assert audit_hooks(model, include_global=False).local_total == 0
    assert not opt._optimizer_step_pre_hooks  # the optimizer hook is gone too


def test_history_length_follows_every() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(4, 4)
    with watch_gradients(model, every=10, optimizer=opt) as watch:
        for _ in range(100):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
    h = watch.history
    assert len(h) == 10 and h.steps == tuple(range(0, 100, 10))
    assert h.layers[0] == "2"  # nearest the loss first
    assert all(math.isfinite(v) for v in h.series("0"))


@pytest.mark.parametrize("every,expected", [(1, 5), (2, 3)])
def test_accumulation_samples_follow_optimizer_steps(every: int, expected: int) -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    batches = [torch.randn(4, 4) for _ in range(20)]
    final_grads: list[dict[str, float]] = []
    with watch_gradients(model, every=every, optimizer=opt) as watch:
        for i, xb in enumerate(batches):
            (model(xb).sum() / 4).backward()
            if i % 4 == 3:
                final_grads.append({n: p.grad.norm().item()
                                    for n, p in model.named_parameters()})
                opt.step()
                opt.zero_grad()
    assert watch.steps == 5
    assert watch.samples == expected
    last = watch.last
    assert last is not None and last.index == 4
    assert last.micro_batches == 4 and last.backward_calls == 4
    assert sorted({r.micro for r in last.modules}) == [0, 1, 2, 3]
    assert len([r for r in last.modules if r.module == "0"]) == 4
    for p in last.params:  # the accumulated gradient the optimizer used
        assert math.isclose(p.norm, final_grads[-1][p.name], rel_tol=1e-6)


def test_without_optimizer_a_backward_into_zeroed_gradients_is_a_step() -> None:
    model = _mlp()
    seen = []
    with watch_gradients(model, every=3, on_sample=seen.append) as watch:
        for _ in range(7):
            model.zero_grad()
            model(torch.randn(2, 4)).sum().backward()
    assert watch.step_by == "inferred"
    assert watch.steps == 7
    assert [f.index for f in seen] == [0, 3, 6]
    assert watch.samples == 3


@pytest.mark.parametrize("given", [True, False], ids=["given", "found"])
def test_grad_scaler_norms_are_unscaled(given: bool) -> None:
    """Not given, the GradScaler is found stepping the optimizer (`scaler.step(opt)`): the
    norms were 2^10 times too large, which reads as exploding gradients."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    unscaled: dict[str, float] = {}
    with watch_gradients(model, optimizer=opt, scaler=scaler if given else None) as watch:
        opt.zero_grad()
        scaler.scale(model(torch.randn(4, 4)).sum()).backward()
        scaler.unscale_(opt)
        unscaled = {n: p.grad.norm().item() for n, p in model.named_parameters()}
        clip = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item()
        scaler.step(opt)
        scaler.update()
    flow = watch.last
    assert flow is not None and flow.scale == 2.0**10 and watch.scaler is scaler
    for p in flow.params:
        assert math.isclose(p.norm, unscaled[p.name], rel_tol=1e-6)
    assert math.isclose(flow.total_norm, clip, rel_tol=1e-6)


def test_a_sample_built_after_the_update_keeps_its_steps_numbers() -> None:
    """A sampled step's records are built when read (or at the next sample), after the
    optimizer and the GradScaler have moved on: they hold that step's scale and norms."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    x = torch.randn(4, 4)
    with watch_gradients(model, optimizer=opt, scaler=scaler) as watch:
        for k in range(3):
            opt.zero_grad()
            scaler.scale(model(x).sum()).backward()
            scaler.step(opt)  # unscales .grad in place
            grads = {n: p.grad.norm().item() for n, p in model.named_parameters()}
            scaler.update()  # the scale doubles after each finite step
            assert scaler.get_scale() == 2.0 ** (11 + k)
            flow = watch.last  # built now
            assert flow is not None and flow.index == k and flow.scale == 2.0 ** (10 + k)
            for rec in flow.params:
                assert math.isclose(rec.norm, grads[rec.name], rel_tol=1e-6)


@pytest.mark.usefixtures("reduction_path")  # one path for both watches
def test_records_built_later_equal_records_built_at_once() -> None:
    """`on_sample` builds each sample when its step ends; without it, when read. Both give
    the same numbers, step by step."""
    torch.manual_seed(0)
    models = [_mlp(), _mlp()]
    models[1].load_state_dict(models[0].state_dict())
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    at_once: list[GradFlow] = []
    with contextlib.ExitStack() as stack:
        opts = [torch.optim.SGD(m.parameters(), lr=1e-2) for m in models]
        watches = [stack.enter_context(watch_gradients(models[0], optimizer=opts[0], every=2,
                                                       on_sample=at_once.append)),
                   stack.enter_context(watch_gradients(models[1], optimizer=opts[1],
                                                       every=2))]
        for _ in range(7):
            for m, opt in zip(models, opts, strict=True):
                opt.zero_grad()
                nn.functional.mse_loss(m(x), y).backward()
                opt.step()
    assert watches[0].samples == watches[1].samples == len(at_once) == 4
    assert watches[0].history == watches[1].history
    last = watches[1].last
    assert last is not None and watches[0].last == last  # update norms joined on read
    assert at_once[-1].modules == last.modules
    assert [p.norm for p in at_once[-1].params] == [p.norm for p in last.params]


def test_exception_in_loop_removes_hooks() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with pytest.raises(KeyError), watch_gradients(model, optimizer=opt):
        model(torch.randn(2, 4)).sum().backward()
        raise KeyError("boom")
    assert audit_hooks(model, include_global=False).local_total == 0
    assert not opt._optimizer_step_pre_hooks


def test_bad_arguments() -> None:
    with pytest.raises(TorchscopeError, match="every=0"), watch_gradients(_mlp(), every=0):
        pass


# ---------------------------------------------------------------------------- step-exact
def _norms(model: nn.Module) -> dict[str, float]:
    """Each parameter's gradient norm, by the same op the watch uses."""
    return {n: torch.linalg.vector_norm(p.grad).item() for n, p in model.named_parameters()}


def _sampled(flow) -> dict[str, float]:
    return {p.name: p.norm for p in flow.params}


@pytest.mark.parametrize("positional", [True, False])
def test_closure_step_samples_that_steps_gradients(positional: bool) -> None:
    """`opt.step(closure)`: the closure runs backward inside the step; every sample holds
    the gradients of its own step (no empty first sample, not the previous step's)."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batches = [(torch.randn(8, 4), torch.randn(8, 2)) for _ in range(3)]
    expected: list[dict[str, float]] = []
    flows = []
    with watch_gradients(model, optimizer=opt, on_sample=flows.append) as watch:
        for x, y in batches:
            def closure(x=x, y=y) -> torch.Tensor:
                opt.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                expected.append(_norms(model))
                return loss
            if positional:
                opt.step(closure)
            else:
                opt.step(closure=closure)
    assert watch.steps == 3 and watch.samples == 3
    assert [f.index for f in flows] == [0, 1, 2]
    for flow, want in zip(flows, expected, strict=True):
        assert flow.backward_calls == 1 and flow.micro_batches == 1
        assert _sampled(flow) == want  # bitwise: the same norm of the same gradient
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks


def test_lbfgs_samples_the_first_evaluation_of_each_step() -> None:
    """LBFGS calls the closure several times per step; the step's gradients are those of
    its first evaluation, at the parameters the step starts from."""
    model = _mlp()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    x, y = torch.randn(16, 4), torch.randn(16, 2)
    firsts: list[dict[str, float]] = []
    evaluations = [0]
    flows = []
    with watch_gradients(model, optimizer=opt, on_sample=flows.append) as watch:
        for _ in range(3):
            per_step = [0]

            def closure() -> torch.Tensor:
                opt.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                if per_step[0] == 0:
                    firsts.append(_norms(model))
                per_step[0] += 1
                evaluations[0] += 1
                return loss
            opt.step(closure)
    assert evaluations[0] > 3  # LBFGS re-evaluated inside its steps
    assert watch.steps == 3 and [f.index for f in flows] == [0, 1, 2]
    for flow, want in zip(flows, firsts, strict=True):
        assert flow.backward_calls == 1 and flow.micro_batches == 1
        assert len([r for r in flow.modules if r.module == "0"]) == 1
        assert _sampled(flow) == want


@pytest.mark.parametrize("zero", ["none", "zeros", "after_forward"])
def test_accumulation_without_optimizer_is_inferred(zero: str) -> None:
    """Four backward passes into un-zeroed gradients are one step, whichever way the loop
    zeroes (set to None, in place, or between forward and backward)."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)  # stepped by hand, not watched
    batches = [torch.randn(4, 4) for _ in range(20)]
    accumulated: list[dict[str, float]] = []
    flows = []
    with watch_gradients(model, every=2, on_sample=flows.append) as watch:
        for i, xb in enumerate(batches):
            first = i % 4 == 0
            if first and zero != "after_forward":
                model.zero_grad(set_to_none=zero == "none")
            loss = model(xb).sum() / 4
            if first and zero == "after_forward":
                model.zero_grad()
            loss.backward()
            if i % 4 == 3:
                accumulated.append(_norms(model))
                opt.step()
    assert watch.step_by == "inferred"
    assert watch.steps == 5
    assert [f.index for f in flows] == [0, 2, 4]
    for flow in flows:
        assert flow.micro_batches == 4 and flow.backward_calls == 4
        assert sorted({r.micro for r in flow.modules}) == [0, 1, 2, 3]
        assert len([r for r in flow.modules if r.module == "0"]) == 4
        for p in flow.params:  # the accumulated gradient the update used
            assert math.isclose(p.norm, accumulated[flow.index][p.name], rel_tol=1e-6)


def test_micro_batches_counts_backward_passes() -> None:
    model = _mlp()
    flows = []
    with watch_gradients(model, micro_batches=4, on_sample=flows.append) as watch:
        for _ in range(12):  # never zeroed: inference would call it one step
            model(torch.randn(2, 4)).sum().backward()
    assert watch.step_by == "micro_batches"
    assert watch.steps == 3 and [f.index for f in flows] == [0, 1, 2]
    assert all(f.backward_calls == 4 and f.micro_batches == 4 for f in flows)


def test_a_forward_no_backward_reaches_is_no_micro_batch() -> None:
    # An evaluation pass run with gradients on (no torch.no_grad), between two steps: its
    # graph is dropped. Two forwards into one backward (a siamese loss) stay two.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    twin = copy.deepcopy(model)
    x, xv = torch.randn(16, 4), torch.randn(8, 4)
    flows: list[GradFlow] = []
    with watch_gradients(model, every=1, on_sample=flows.append):
        for step in range(3):
            model.train()
            model.zero_grad()
            model(x).square().mean().backward()
            model.eval()
            model(xv)  # gradients on, output dropped
            if step == 2:
                model.train()
                model.zero_grad()
                (model(x).mean() - model(xv).mean()).backward()
        model.zero_grad()  # ends the last step (no optimizer: a zeroing backward is a step)
    assert [f.micro_batches for f in flows] == [1, 1, 1, 2]
    assert [f.idle_forwards for f in flows] == [0, 1, 1, 1]
    assert [len(f.modules) for f in flows] == [4, 4, 4, 8]
    assert [[x.code for x in f.findings() if x.code == "grads.idle_forward"] for f in flows] \
        == [[], ["grads.idle_forward"], ["grads.idle_forward"], ["grads.idle_forward"]]
    assert all(r.output_norm is not None for f in flows for r in f.modules)
    twin.train()
    twin(x).square().mean().backward()
    for p in flows[1].params:
        ref = dict(twin.named_parameters())[p.name].grad
        assert ref is not None and p.norm is not None
        assert math.isclose(p.norm, ref.norm().item(), rel_tol=1e-6)


def test_a_backward_before_zero_grad_is_none_of_the_step() -> None:
    # A GAN: the generator's step backpropagates through the discriminator, whose
    # gradients are then set to None before its own step. The discriminator's sample holds
    # its own step's two forwards and one backward, with torch's output gradients.
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    disc = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    opt_g = torch.optim.Adam(gen.parameters(), 1e-3)
    opt_d = torch.optim.Adam(disc.parameters(), 1e-3)
    bce = nn.BCEWithLogitsLoss()
    seen: list[float] = []
    want: list[list[float]] = []
    flows: list[GradFlow] = []

    def note(_m: nn.Module, _gi: object, go: tuple[torch.Tensor, ...]) -> None:
        seen.append(go[0].norm().item())

    with watch_gradients(disc, every=1, optimizer=opt_d, on_sample=flows.append):
        for _ in range(3):
            fake = gen(torch.randn(16, 4))
            opt_d.zero_grad()
            handle = disc[2].register_full_backward_hook(note)
            loss_d = bce(disc(torch.randn(16, 8)), torch.ones(16, 1)) + \
                bce(disc(fake.detach()), torch.zeros(16, 1))
            loss_d.backward()
            handle.remove()
            want.append(sorted(seen))
            seen.clear()
            opt_d.step()
            opt_g.zero_grad()
            bce(disc(fake), torch.ones(16, 1)).backward()  # reaches disc, then zeroed
            opt_g.step()
    # The generator's pass after the discriminator's last step fed none of its updates:
    # no fourth sample.
    assert [(f.micro_batches, f.backward_calls) for f in flows] == [(2, 1)] * 3
    for f, norms in zip(flows, want, strict=True):
        got = sorted(r.output_norm for r in f.modules if r.module == "2")
        assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(got, norms, strict=True))


def _output_grads(model: nn.Sequential, on: list[bool]
                  ) -> tuple[dict[tuple[str, int], torch.Tensor], list[object]]:
    """Each child's output gradient per forward, summed over the backward passes that run
    while `on[0]`: torch's own tensor hooks, the reference."""
    got: dict[tuple[str, int], torch.Tensor] = {}
    forwards = [0]

    def count(_m: nn.Module, _args: object) -> None:
        forwards[0] += 1

    def keep(name: str) -> object:
        def hook(_m: nn.Module, _args: object, out: torch.Tensor) -> None:
            key = (name, forwards[0] - 1)

            def add(g: torch.Tensor) -> None:
                if on[0]:
                    got[key] = got.get(key, 0) + g.detach()

            if out.requires_grad:
                out.register_hook(add)

        return hook

    handles: list[object] = [model.register_forward_pre_hook(count)]
    handles += [m.register_forward_hook(keep(n)) for n, m in model.named_children()]
    return got, handles


def test_two_backward_passes_over_one_forward_report_the_sum() -> None:
    # Two losses, each with its own backward, the first keeping the graph: the update uses
    # the sum of both passes' gradients at every layer, and so does the sample.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 6))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y, r = torch.randn(16, 8), torch.randint(0, 5, (16,)), torch.randn(16)
    want, handles = _output_grads(model, [True])
    with watch_gradients(model, optimizer=opt) as watch:
        opt.zero_grad()
        out = model(x)
        nn.functional.cross_entropy(out[:, :5], y).backward(retain_graph=True)
        nn.functional.mse_loss(out[:, 5], r).backward()
        opt.step()
    for h in handles:
        h.remove()  # type: ignore[attr-defined]
    flow = watch.last
    assert flow is not None and flow.backward_calls == 2 and flow.micro_batches == 1
    assert len(flow.modules) == 3
    for rec in flow.modules:
        assert rec.output_norm is not None
        ref = want[(rec.module, 0)].norm().item()
        assert math.isclose(rec.output_norm, ref, rel_tol=1e-6), rec.module


class _Shift(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.shift  # AddBackward0: nothing saved, so backward may run twice


def test_a_later_pass_without_a_kept_gradient_is_not_summed() -> None:
    # Backward through a graph with no saved tensor twice, the first without retain_graph:
    # the first gradient was not kept, so the sum is not measured, and the record says so.
    model = nn.Sequential(_Shift())
    with watch_gradients(model, manual=True) as watch:
        out = model(torch.randn(2, 4))
        out.sum().backward()
        out.sum().backward()
        watch.end_step()
    flow = watch.last
    assert flow is not None and flow.backward_calls == 2
    (rec,) = flow.modules
    assert rec.output_norm is None
    assert rec.grad_output[0].reason == PASSES_UNSUMMED
    (param,) = flow.params
    assert param.norm == pytest.approx(2 * 2 * math.sqrt(4))  # two passes of 2 per element


@pytest.mark.parametrize("act", ["leaky_relu", "softplus"])
def test_a_gradient_penalty_pass_is_none_of_the_step(act: str) -> None:
    # WGAN-GP: `autograd.grad(create_graph=True)` through the discriminator feeds no
    # update; the update's backward then reaches that forward again through the penalty.
    # The sample holds that backward's gradients only, as torch's hooks see them.
    torch.manual_seed(0)
    make = (lambda: nn.LeakyReLU(0.2)) if act == "leaky_relu" else nn.Softplus
    disc = nn.Sequential(nn.Linear(8, 32), make(), nn.Linear(32, 32), make(),
                         nn.Linear(32, 1))
    opt = torch.optim.Adam(disc.parameters(), lr=1e-4, betas=(0.0, 0.9))
    real, fake = torch.randn(16, 8) + 2, torch.randn(16, 8)
    on = [False]
    want, handles = _output_grads(disc, on)
    with watch_gradients(disc, optimizer=opt) as watch:
        opt.zero_grad()
        mix = torch.rand(16, 1)
        xh = (mix * real + (1 - mix) * fake).requires_grad_(True)
        (g,) = torch.autograd.grad(disc(xh).sum(), xh, create_graph=True)
        penalty = ((g.norm(dim=1) - 1) ** 2).mean()
        loss = disc(fake).mean() - disc(real).mean() + 10 * penalty
        on[0] = True
        loss.backward()
        opt.step()
    for h in handles:
        h.remove()  # type: ignore[attr-defined]
    flow = watch.last
    assert flow is not None and flow.backward_calls == 1 and flow.micro_batches == 3
    assert flow.idle_forwards == 0
    checked = 0
    for rec in flow.modules:
        ref = want.get((rec.module, rec.micro))
        if ref is None:  # the penalty's graph does not reach the interpolate's logit
            assert rec.micro == 0 and rec.output_norm is None and rec.module in ("3", "4")
            continue
        assert rec.output_norm is not None
        assert math.isclose(rec.output_norm, ref.norm().item(), rel_tol=1e-5, abs_tol=1e-12)
        checked += 1
    assert checked == 13
    assert not [f for f in flow.findings() if f.severity.label != "info"]


def test_adversarial_attack_passes_are_no_steps_and_no_idle_forwards() -> None:
    # PGD adversarial training: each attack step takes `autograd.grad` of the loss with
    # respect to the input. Those passes neither end a step (no optimizer given: a step is
    # inferred) nor make the attack's forwards micro-batches or idle forwards.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    flows: list[GradFlow] = []
    with watch_gradients(model, on_sample=flows.append) as watch:
        for _ in range(4):
            xa = x.clone().requires_grad_(True)
            for _ in range(3):
                (g,) = torch.autograd.grad(nn.functional.cross_entropy(model(xa), y), xa)
                xa = (xa + 0.01 * g.sign()).detach().requires_grad_(True)
            opt.zero_grad()
            nn.functional.cross_entropy(model(xa.detach()), y).backward()
            opt.step()
    assert watch.step_by == "inferred" and watch.steps == 4
    assert [(f.micro_batches, f.backward_calls, f.idle_forwards) for f in flows] == \
        [(1, 1, 0)] * 4
    assert not [f for f in watch.findings() if f.code in ("grads.idle_forward",
                                                          "grads.no_update")]
    assert watch.passes_without_update == 12  # three attack steps before each of 4


def test_a_pass_that_feeds_no_update_leaves_earlier_passes_as_they_were() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4, requires_grad=True)
    on = [True]
    want, handles = _output_grads(model, on)
    with watch_gradients(model, optimizer=opt) as watch:
        opt.zero_grad()
        out = model(x)
        out.square().sum().backward(retain_graph=True)
        on[0] = False
        torch.autograd.grad(out.sum(), x)  # the input's saliency, after the update's pass
        opt.step()
    for h in handles:
        h.remove()  # type: ignore[attr-defined]
    flow = watch.last
    assert flow is not None and flow.backward_calls == 1
    for rec in flow.modules:
        assert rec.output_norm is not None
        assert math.isclose(rec.output_norm, want[(rec.module, 0)].norm().item(),
                            rel_tol=1e-6)


def test_backward_passes_after_the_last_step_are_no_sample_unless_none_stepped() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 4)
    with watch_gradients(model, optimizer=opt) as watch:
        for _ in range(2):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        model(x).sum().backward()  # after the last step: it updates nothing
    assert watch.steps == 2 and watch.samples == 2
    with watch_gradients(model, optimizer=opt) as only:
        opt.zero_grad()
        model(x).sum().backward()  # a block that only looks at one backward
    assert only.steps == 0 and only.samples == 1 and only.last is not None
    assert only.last.backward_calls == 1


def test_an_optimizer_that_never_steps_is_named_in_a_finding() -> None:
    # SAM-style: the loop steps the wrapper's inner optimizer, never the one given.
    model = _mlp()
    outer = torch.optim.SGD(model.parameters(), lr=0.1)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 4)
    for given in (outer, inner):
        with watch_gradients(model, optimizer=given) as watch:
            for _ in range(3):
                inner.zero_grad()
                model(x).sum().backward()
                inner.step()
        codes = [f.code for f in watch.findings()]
        assert watch.backwards == 3
        if given is outer:
            assert watch.steps == 0 and "grads.no_step" in codes
            (f,) = [f for f in watch.findings() if f.code == "grads.no_step"]
            assert f.evidence == {"backwards": 3, "optimizer": "SGD"}
        else:
            assert watch.steps == 3 and "grads.no_step" not in codes


def test_training_copies_of_the_parameters_is_named_in_a_finding() -> None:
    # torch.func on detached copies: the module's own parameters never get a gradient, so
    # no pass is a step's; the watch says why it sampled nothing.
    from torch.func import functional_call

    torch.manual_seed(0)
    model = _mlp()
    copies = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    opt = torch.optim.SGD(copies.values(), lr=0.1)
    x = torch.randn(4, 4)
    with watch_gradients(model, optimizer=opt) as watch:
        for _ in range(3):
            opt.zero_grad()
            functional_call(model, copies, (x,)).sum().backward()
            opt.step()
    assert watch.steps == 3 and watch.samples == 0
    assert (watch.backwards, watch.passes_without_update) == (0, 3)
    assert [f.code for f in watch.findings()] == ["grads.no_update"]


def test_manual_steps_end_at_end_step() -> None:
    model = _mlp()
    steps: list[tuple[int, bool]] = []
    with watch_gradients(model, every=2, manual=True,
                         on_step=lambda i, f: steps.append((i, f is not None))) as watch:
        for _ in range(4):
            model.zero_grad()
            for _ in range(2):
                model(torch.randn(2, 4)).sum().backward()
            watch.end_step()
    assert steps == [(0, True), (1, False), (2, True), (3, False)]
    assert watch.last is not None and watch.last.backward_calls == 2
    with watch_gradients(model) as other, pytest.raises(TorchscopeError, match="end_step"):
        other.end_step()


@pytest.mark.parametrize("given", [True, False], ids=["given", "found"])
def test_skipped_scaler_steps_are_counted_not_sampled(given: bool) -> None:
    """A step whose gradients overflow is skipped by the GradScaler (no optimizer step): it
    counts as a step, is listed, and its sample goes to the next step. A scaler found at
    the first step it takes counts the same."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    x = torch.randn(4, 4)
    flows = []
    with watch_gradients(model, every=2, optimizer=opt, scaler=scaler if given else None,
                         on_sample=flows.append) as watch:
        for i in range(6):
            opt.zero_grad()
            loss = model(x).sum() * (math.inf if i == 2 else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert watch.skipped == 1 and watch.skipped_steps == (2,)
    assert watch.steps == 6
    assert [f.index for f in flows] == [0, 3, 4]  # step 2's sample moved to step 3
    assert all(f.finite for f in flows)


def test_check_nonfinite_finds_the_first_bad_step_between_samples() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(4, 4)
    with watch_gradients(model, every=10, optimizer=opt, check_nonfinite=True) as watch:
        for i in range(8):
            opt.zero_grad()
            (model(x).sum() * (math.nan if i in (5, 6) else 1.0)).backward()
            if i in (5, 6):
                continue  # the loop skips the update itself
            opt.step()
        for i in range(8, 10):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
    assert watch.samples == 1  # step 0 only: the bad steps were not sampled
    assert watch.steps == 8
    assert watch.first_nonfinite_step is None  # NaN gradients never reached an update
    with watch_gradients(model, every=10, optimizer=opt, check_nonfinite=True) as watch:
        for i in range(8):
            opt.zero_grad()
            (model(x).sum() * (math.nan if i >= 5 else 1.0)).backward()
            opt.step()
    assert watch.first_nonfinite_step == 5 and watch.nonfinite_steps == 3
    with watch_gradients(model, optimizer=opt) as unchecked:
        pass
    assert unchecked.first_nonfinite_step is None and unchecked.nonfinite_steps is None


def _step_keeping_weights(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """`opt.step()`, then every weight put back: an Inf update's NaN weights would make
    every later step bad, where these tests want only the steps they spoil."""
    kept = [p.detach().clone() for p in model.parameters()]
    opt.step()
    with torch.no_grad():
        for p, w in zip(model.parameters(), kept, strict=True):
            p.copy_(w)


def test_check_nonfinite_counts_exactly_over_many_steps_read_midway() -> None:
    # The checks wait on the device in batches: read midway, and across several batches,
    # the first bad step and the count are those of a check of each step on its own.
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(4, 4)
    bad = {70, 130, 131, 199}
    with watch_gradients(model, every=1000, optimizer=opt, check_nonfinite=True) as watch:
        for i in range(200):
            opt.zero_grad()
            (model(x).sum() * (math.inf if i in bad else 1.0)).backward()
            _step_keeping_weights(model, opt)
            if i == 69:
                assert watch.first_nonfinite_step is None and watch.nonfinite_steps == 0
            if i == 100:
                assert watch.first_nonfinite_step == 70 and watch.nonfinite_steps == 1
    assert watch.first_nonfinite_step == 70 and watch.nonfinite_steps == len(bad)


def test_check_nonfinite_with_a_sparse_gradient_in_place_of_a_dense_one(
        reduction_path: str) -> None:
    """Steps that alternate between four dense gradients and three dense plus a sparse one
    (an `nn.Embedding(sparse=True)`): the second kind reaches the check with as many
    gradients as the first, the native kernel refuses the sparse one, and the check falls
    back. The bad step is found as a check of each step alone finds it."""
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 2)
    c, e = nn.Linear(4, 4, bias=False), nn.Embedding(10, 4, sparse=True)
    model = nn.ModuleDict({"a": a, "b": b, "c": c, "e": e})
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, ids = torch.randn(4, 4), torch.tensor([1, 2, 3, 4])
    with watch_gradients(model, every=1000, optimizer=opt, check_nonfinite=True) as watch:
        for i in range(12):
            opt.zero_grad()
            out = b(a(x)) if i % 2 == 0 else b(c(e(ids)))
            (out.sum() * (math.inf if i == 7 else 1.0)).backward()
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            assert len(grads) == 4 and any(g.is_sparse for g in grads) == (i % 2 == 1)
            _step_keeping_weights(model, opt)
    assert watch.first_nonfinite_step == 7 and watch.nonfinite_steps == 1
    # The fused path checked every step natively: a step with the sparse gradient met the
    # call for four, was refused, and its three dense ones were checked (the last step).
    assert watch._native_fit == (3 if reduction_path == "fused" else 0)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_check_nonfinite_takes_gradients_that_require_grad() -> None:
    # backward(create_graph=True) leaves `.grad` requiring grad: the check still runs.
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(4, 4)
    with watch_gradients(model, every=1000, optimizer=opt, check_nonfinite=True) as watch:
        for i in range(5):
            opt.zero_grad()
            (model(x).sum() * (math.inf if i == 3 else 1.0)).backward(create_graph=True)
            assert any(p.grad is not None and p.grad.requires_grad for p in model.parameters())
            _step_keeping_weights(model, opt)
    assert watch.first_nonfinite_step == 3 and watch.nonfinite_steps == 1


def test_micro_batches_with_optimizer_is_refused() -> None:
    with pytest.raises(TorchscopeError, match="micro_batches"):
        watch_gradients(_mlp(), optimizer=torch.optim.SGD(_mlp().parameters(), lr=1),
                        micro_batches=2)
    with pytest.raises(TorchscopeError, match="micro_batches=0"):
        watch_gradients(_mlp(), micro_batches=0)


@pytest.mark.parametrize("optimizer", ["sgd", "lbfgs"])
def test_closure_training_is_bitwise_unchanged(optimizer: str) -> None:
    def train(watch: bool) -> list[torch.Tensor]:
        torch.manual_seed(1)
        model = _mlp()
        opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if optimizer == "sgd"
               else torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3))
        x, y = torch.randn(8, 4), torch.randn(8, 2)

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss
        with watch_gradients(model, every=3, optimizer=opt) if watch else \
                contextlib.nullcontext():
            for _ in range(20):
                opt.step(closure)
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(train(True), train(False), strict=True):
        assert torch.equal(a, b)


def test_start_shifts_the_sampled_steps() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with watch_gradients(model, every=10, start=9, optimizer=opt) as watch:
        for _ in range(30):
            opt.zero_grad()
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
    assert watch.history.steps == (9, 19, 29)
    with pytest.raises(TorchscopeError, match="start=-1"):
        watch_gradients(model, start=-1)


def test_a_compiled_wrapper_made_before_the_watch_is_a_warning_not_a_healthy_step() -> None:
    """A `torch.compile` wrapper that ran before the watch opened never runs the hooks added
    later to the module it wraps: the watch measured nothing per layer and said nothing,
    which read as a healthy step."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    compiled = torch.compile(model, backend="eager")

    def step() -> None:
        opt.zero_grad()
        nn.functional.mse_loss(compiled(x), y).backward()
        opt.step()

    step()  # compiled before the watch
    with watch_gradients(model, every=1, optimizer=opt) as watch:
        step()
        step()
    last = watch.last
    assert last is not None and last.modules == () and last.param("0.weight").norm
    [f] = [f for f in watch.findings() if f.code == "grads.unseen_forward"]
    assert f.severity.name == "WARNING" and "compile" in f.fix
    # Given the wrapper the loop calls, the watch runs it eagerly and sees every layer.
    with watch_gradients(compiled, every=1, optimizer=opt) as watch:
        step()
    last = watch.last
    assert last is not None and {r.module for r in last.modules} == {"0", "1", "2"}
    assert not [f for f in watch.findings() if f.code == "grads.unseen_forward"]


@pytest.mark.parametrize("clips", [False, True])
def test_a_loop_that_never_zeroes_its_gradients_is_a_warning(clips: bool) -> None:
    """The classic: no `optimizer.zero_grad()`, so each step's update uses the sum of every
    gradient so far. The watch read those sums as the steps' gradients and said nothing.
    A loop that clips too changes the gradients in place before each update, which read as
    a zeroing until the evidence was taken again after the update."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    with watch_gradients(model, every=1, optimizer=opt) as watch:
        for _ in range(6):
            nn.functional.mse_loss(model(x), y).backward()
            if clips:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    assert (watch.unzeroed_steps, watch.first_unzeroed) == (5, 1)
    [f] = [f for f in watch.findings() if f.code == "grads.not_zeroed"]
    assert f.severity.name == "WARNING" and f.evidence["of"] == 6
    assert "zero_grad()" in f.fix


@pytest.mark.parametrize("loop", ["accumulate", "in_place", "in_place_clip", "module", "gan",
                                  "lbfgs", "closure"])
def test_loops_that_zero_their_gradients_are_not_said_to_miss_it(loop: str) -> None:
    torch.manual_seed(0)
    model = _mlp()
    x, y = torch.randn(4, 4), torch.randn(4, 2)

    def loss() -> torch.Tensor:
        return nn.functional.mse_loss(model(x), y)

    if loop == "lbfgs":
        lbfgs = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)

        def closure() -> torch.Tensor:
            lbfgs.zero_grad()
            value = loss()
            value.backward()
            return value

        with watch_gradients(model, every=1, optimizer=lbfgs) as watch:
            for _ in range(4):
                lbfgs.step(closure)
        assert watch.unzeroed_steps == 0
        return
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    other = torch.optim.SGD(model[0].parameters(), lr=1e-2)
    with watch_gradients(model, every=1, optimizer=opt) as watch:
        for i in range(8):
            if loop == "accumulate":  # four micro-batches a step, zeroed after each step
                (loss() / 4).backward()
                if i % 4 == 3:
                    opt.step()
                    opt.zero_grad()
            elif loop == "in_place":
                opt.zero_grad(set_to_none=False)
                loss().backward()
                opt.step()
            elif loop == "in_place_clip":
                opt.zero_grad(set_to_none=False)
                loss().backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
                opt.step()
            elif loop == "module":
                loss().backward()
                opt.step()
                model.zero_grad()
            elif loop == "closure":  # Lightning's way: one closure that zeroes, then backward

                def zero_then_backward() -> torch.Tensor:
                    opt.zero_grad()
                    value = loss()
                    value.backward()
                    return value

                opt.step(zero_then_backward)
            else:  # a second player's pass adds to these gradients between their steps
                opt.zero_grad()
                loss().backward()
                opt.step()
                other.zero_grad()
                (-loss()).backward()
                other.step()
    assert watch.steps > 1 and watch.unzeroed_steps == 0 and watch.cleared_steps == 0
    assert not [f for f in watch.findings()
                if f.code in ("grads.not_zeroed", "grads.cleared_before_step")]


@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradients_cleared_between_backward_and_step_are_a_warning(set_to_none: bool) -> None:
    """`zero_grad()` between `loss.backward()` and `step()`: every update uses no gradient
    and the model never learns. Set to None, it is read from metadata on every step; zeroed
    in place, from the norm the update used on sampled steps, which is 0. Either was
    silent; the in-place one read as gradients never zeroed."""
    torch.manual_seed(0)
    model = _mlp()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    with watch_gradients(model, every=2, optimizer=opt) as watch:
        for _ in range(6):
            nn.functional.mse_loss(model(x), y).backward()
            opt.zero_grad(set_to_none=set_to_none)
            opt.step()
    for a, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(a, b)  # torch agrees: no update moved anything
    [f] = [f for f in watch.findings() if f.code == "grads.cleared_before_step"]
    assert f.severity.name == "WARNING" and "zero_grad()" in f.fix
    if set_to_none:
        assert (watch.cleared_steps, watch.first_cleared) == (6, 0)
        assert f.evidence["steps"] == 6 and f.evidence["of"] == 6
    else:
        assert watch.cleared_steps == 0 and f.evidence["zeroed_samples"] == 3
        assert watch.history.applied_norms == (0.0, 0.0, 0.0)
    assert not [f for f in watch.findings() if f.code in ("grads.not_zeroed", "grads.clipped")]
    [still] = [f for f in watch.findings() if f.code == "grads.update_ratio"]
    assert "moved no layer" in still.summary and "zero_grad()" in still.fix


@pytest.mark.parametrize("loop", ["set_to_none", "in_place", "healthy", "clipped"])
def test_one_of_two_optimizers_cleared_before_its_step(loop: str) -> None:
    """AdamW for the matrices, SGD for the embedding and the norm; the watch is given
    AdamW. Its `zero_grad()` between the backward and its step left the other
    optimizer's gradients in place: set to None, that was silent; zeroed in place, it read
    as clipping (the whole model's total against what was left of it). What the loop does
    is now read on the watched optimizer's parameters, whose update used nothing (torch
    agrees: its matrices never move). A healthy loop stays silent, and clipping the whole
    model is still read as clipping."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 32), nn.LayerNorm(32), nn.Linear(32, 32),
                          nn.GELU(), nn.Linear(32, 50))
    matrices = [p for n, p in model.named_parameters() if p.ndim == 2 and n[0] != "0"]
    rest = [p for n, p in model.named_parameters() if not (p.ndim == 2 and n[0] != "0")]
    adamw = torch.optim.AdamW(matrices, lr=1e-3, weight_decay=0.0)  # decay moves zeros too
    sgd = torch.optim.SGD(rest, lr=0.1)
    start = [p.detach().clone() for p in matrices]
    x = torch.randint(0, 50, (8, 16), generator=torch.Generator().manual_seed(0))
    with watch_gradients(model, every=1, optimizer=adamw) as watch:
        for _ in range(4):
            if loop in ("healthy", "clipped"):
                adamw.zero_grad()
            sgd.zero_grad()
            nn.functional.cross_entropy(model(x).reshape(-1, 50), x.reshape(-1)).backward()
            if loop == "clipped":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            elif loop != "healthy":
                adamw.zero_grad(set_to_none=loop == "set_to_none")
            adamw.step()
            sgd.step()
    found = {f.code for f in watch.findings()}
    moved = any(not torch.equal(p, s) for p, s in zip(matrices, start, strict=True))
    assert "grads.not_zeroed" not in found
    assert ("grads.clipped" in found) == (loop == "clipped"), found
    if loop in ("healthy", "clipped"):
        assert moved and "grads.cleared_before_step" not in found
        # Clipping the whole model reads as such: the update used 0.1.
        assert list(watch.applied_norms.values()) == \
            ([pytest.approx(0.1, rel=1e-5)] * 4 if loop == "clipped" else [])
    else:
        assert not moved and "grads.cleared_before_step" in found
        assert watch.cleared_steps == (4 if loop == "set_to_none" else 0)


def _global_step_hooks() -> int:
    from torch.optim import optimizer

    return len(optimizer._global_optimizer_post_hooks)


def test_a_head_added_after_the_optimizer_is_named_and_nothing_else() -> None:
    # The optimizer was built from the body only: the head gets gradients that no
    # optimizer steps. torch agrees: its weights never move, and opt.zero_grad() never
    # clears its gradient, which grows with every step.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.Adam(model[0].parameters(), lr=1e-2)
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    head, body = model[2].weight.detach().clone(), model[0].weight.detach().clone()
    hooks = _global_step_hooks()
    with watch_gradients(model, optimizer=opt, every=2) as watch:
        assert _global_step_hooks() == hooks + 1
        for _ in range(6):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    assert _global_step_hooks() == hooks
    assert torch.equal(model[2].weight, head) and not torch.equal(model[0].weight, body)
    assert watch.unoptimized == ("2.weight", "2.bias")
    (f,) = [f for f in watch.findings() if f.code == "grads.not_optimized"]
    assert f.module == "2" and "(2.weight, 2.bias)" in f.summary and "Adam.zero_grad()" in \
        f.summary


def test_parameters_another_optimizer_steps_are_not_named() -> None:
    # A GAN in one module: the watch is given the discriminator's optimizer; the
    # generator's own optimizer steps the rest. A frozen layer gets no gradient at all.
    torch.manual_seed(0)
    model = nn.ModuleDict({"g": nn.Linear(8, 8), "d": nn.Linear(8, 1),
                           "frozen": nn.Linear(8, 8).requires_grad_(False)})
    opt_d = torch.optim.SGD(model["d"].parameters(), lr=0.1)
    opt_g = torch.optim.SGD(model["g"].parameters(), lr=0.1)
    z = torch.randn(16, 8)
    hooks = _global_step_hooks()
    with pytest.raises(RuntimeError, match="out of data"), \
            watch_gradients(model, optimizer=opt_d) as watch:
        for i in range(4):
            opt_d.zero_grad()
            model["d"](model["frozen"](model["g"](z)).detach()).mean().backward()
            opt_d.step()
            opt_g.zero_grad()
            (-model["d"](model["g"](z))).mean().backward()
            opt_g.step()
            if i == 3:
                raise RuntimeError("out of data")
    assert _global_step_hooks() == hooks  # removed when the loop raised, too
    assert watch.unoptimized == ()
    assert not [f for f in watch.findings() if f.code == "grads.not_optimized"]


def test_parameters_the_loop_updates_by_hand_are_not_named() -> None:
    # The head is trained by the loop's own SGD step under no_grad, beside Adam for the
    # body: torch's version counter sees the in-place update between two Adam steps. A
    # write through `p.data` escapes that counter and still reads as untrained.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.Adam(model[0].parameters(), lr=1e-2)
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))

    def train(by_data: bool) -> tuple[str, ...]:
        head = model[2].weight.detach().clone()
        with watch_gradients(model, optimizer=opt) as watch:
            for _ in range(3):
                opt.zero_grad()
                model[2].zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                for p in model[2].parameters():
                    assert p.grad is not None
                    if by_data:
                        p.data.sub_(0.1 * p.grad)
                    else:
                        with torch.no_grad():
                            p.sub_(0.1 * p.grad)  # the loop's own SGD step
        assert not torch.equal(model[2].weight, head)  # the head did train
        return watch.unoptimized

    assert train(by_data=False) == ()
    assert train(by_data=True) == ("2.weight", "2.bias")  # the limit, stated


def test_an_optimizer_that_steps_the_whole_model_adds_no_global_hook() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hooks = _global_step_hooks()
    with watch_gradients(model, optimizer=opt) as watch:
        assert _global_step_hooks() == hooks
        nn.functional.mse_loss(model(torch.randn(8, 4)), torch.randn(8, 2)).backward()
        opt.step()
    assert watch.unoptimized == ()


def test_an_optimizer_built_on_a_copy_of_the_model_steps_none_of_it() -> None:
    # The optimizer holds a deep copy's parameters (a model rebuilt after the optimizer):
    # it steps the copy, and the watched model never trains.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(copy.deepcopy(model).parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with watch_gradients(model, optimizer=opt) as watch:
        for _ in range(3):
            opt.zero_grad()
            nn.functional.mse_loss(model(torch.randn(8, 8)), torch.randn(8, 2)).backward()
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))
    assert watch.unoptimized == ("0.weight", "0.bias", "2.weight", "2.bias")
    assert [f.module for f in watch.findings() if f.code == "grads.not_optimized"] == ["0"]


class _TiedLM(nn.Module):
    """An embedding whose weight is also the LM head's, as GPT-2 ties them."""

    def __init__(self, vocab: int = 50, dim: int = 16) -> None:
        super().__init__()
        self.emb, self.mid = nn.Embedding(vocab, dim), nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, vocab)
        return self.head(torch.tanh(self.mid(self.emb(ids))))


@pytest.mark.parametrize("passes", [1, 2])
def test_inferred_steps_count_a_tied_weight_once(passes: int) -> None:
    """Without optimizer= the steps are inferred and each step's backward passes merged;
    the merged total counted the tied weight twice (4.46 against 4.43)."""
    torch.manual_seed(0)
    model, ids = _TiedLM(), torch.randint(0, 50, (4, 12))
    totals: list[float] = []
    references: list[float] = []
    with watch_gradients(model, on_sample=lambda f: totals.append(f.total_norm)):
        for _ in range(3):
            model.zero_grad()
            for _ in range(passes):  # gradient accumulation: one step of `passes` backwards
                nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
            # torch's own total: parameters() yields the tied tensor once.
            references.append(float(nn.utils.get_total_norm(
                [p.grad for p in model.parameters() if p.grad is not None])))
    assert len(totals) == 3
    assert totals == pytest.approx(references, rel=1e-6)


def test_steps_numbered_from_a_resumed_global_step() -> None:
    """number_from: a framework restores its global step after the watch opened (Lightning
    restores it after on_fit_start); the steps count on from it, sampled as if the run had
    never stopped, and it cannot be moved once a backward was counted."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    with watch_gradients(model, optimizer=opt, every=4) as watch:
        watch.number_from(6)
        for _ in range(6):  # steps 6 .. 11: 8 is the one due (8 % 4 == 0)
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        with pytest.raises(TorchscopeError, match="before the first backward"):
            watch.number_from(0)
    assert watch.steps == 12 and watch.history.steps == (8,)
