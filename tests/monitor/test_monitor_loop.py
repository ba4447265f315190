"""torchscope.monitor in a hand-written loop: training unchanged, samples on the right steps
with that step's gradients, accumulation, AMP (unscaled norms, skipped steps), and a run that
raises at step 7."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import torchscope
from torchscope.errors import TorchscopeError
from torchscope.hooks import audit_hooks

from ._models import batches, mlp


def _train(model: nn.Module, opt: torch.optim.Optimizer, data, ctx, *, accumulate: int = 1,
           on_step=None) -> None:
    with ctx:
        for i in range(0, len(data), accumulate):
            opt.zero_grad(set_to_none=True)
            for x, y in data[i:i + accumulate]:
                (nn.functional.mse_loss(model(x), y) / accumulate).backward()
            if on_step is not None:
                on_step()
            opt.step()


def _module_norm(model: nn.Module, module: str) -> float:
    owner = model.get_submodule(module)
    return math.sqrt(math.fsum(torch.linalg.vector_norm(p.grad).item() ** 2
                               for p in owner.parameters(recurse=False)))


def test_training_is_bitwise_unchanged_and_no_hook_stays(tmp_path: Path) -> None:
    """20 steps with dropout (the RNG stream), momentum and every part of the monitor on."""
    data = batches(20)

    def run(watched: bool) -> tuple[list[torch.Tensor], nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        ctx = torchscope.monitor(model, opt, every=3, out=tmp_path / "run", profile=2) \
            if watched else contextlib.nullcontext()
        _train(model, opt, data, ctx)
        return [p.detach().clone() for p in model.parameters()], model, opt

    watched, model, opt = run(True)
    plain, _, _ = run(False)
    for a, b in zip(watched, plain, strict=True):
        assert torch.equal(a, b)
    assert audit_hooks(model, include_global=False).local_total == 0
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    assert (tmp_path / "run" / "report.html").is_file()


def test_samples_hold_the_gradients_of_their_step() -> None:
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    expected: dict[int, float] = {}
    step = [0]

    def note() -> None:  # before opt.step(): the gradients this step's update uses
        expected[step[0]] = _module_norm(model, "0")
        step[0] += 1

    with torchscope.monitor(model, opt, every=4, out=None) as mon:
        _train(model, opt, batches(40), contextlib.nullcontext(), accumulate=2, on_step=note)
    run = mon.result
    assert run is not None and run.steps == 20 and run.samples == 5
    assert run.grad_param.steps == (0, 4, 8, 12, 16)
    assert run.last is not None and run.last.micro_batches == 2
    assert run.last.backward_calls == 2
    for s, v in zip(run.grad_param.steps, run.grad_param.series("0"), strict=True):
        assert math.isclose(v, expected[s], rel_tol=1e-6)
    assert run.status == "completed" and run.step_by == "optimizer"
    assert run.inputs == "(8x8)"
    assert len(run.act_std.steps) == 5 and "1" in run.act_dead.layers  # the ReLU


def test_an_evaluation_pass_with_gradients_on_is_not_the_step_sampled() -> None:
    """A validation forward without torch.no_grad, on other data, before each training
    forward: the activation columns, the micro-batch count and the saved bytes are the
    training forward's."""
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = batches(4)
    xv = torch.randn(3, 8) * 10
    stds: list[float] = []

    def keep_std(_m: nn.Module, _a: object, out: torch.Tensor) -> None:
        if model.training:
            stds.append(out.std().item())

    with torchscope.monitor(model, opt, every=1, out=None) as mon:
        for x, y in data:
            model.eval()
            model(xv)  # gradients on, output dropped
            model.train()
            opt.zero_grad()
            handle = model[0].register_forward_hook(keep_std)
            nn.functional.mse_loss(model(x), y).backward()
            handle.remove()
            opt.step()
        model.eval()
        model(xv)  # after the last step
    run = mon.result
    assert run is not None and run.samples == 4 and run.last is not None
    assert run.last.micro_batches == 1 and run.last.idle_forwards == 1
    assert "grads.idle_forward" in {f.code for f in run.findings()}
    for got, want in zip(run.act_std.series("0"), stds, strict=True):
        assert math.isclose(got, want, rel_tol=1e-4)
    saved = torchscope.memory.saved_activations(model.train(), data[-1][0], loss_fn="sum")
    assert run.memory is not None and run.memory.last is not None
    assert run.memory.last.saved.total_bytes == saved.total_bytes


@pytest.mark.parametrize("with_optimizer", [True, False])
def test_adversarial_attack_passes_are_not_the_step_sampled(with_optimizer: bool) -> None:
    """PGD adversarial training: two attack steps before each update, each a forward and
    `autograd.grad` with respect to the input, on other inputs. The columns, the saved
    bytes and the step count are the training step's."""
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = batches(4)
    stds: list[float] = []
    training = [False]

    def keep_std(_m: nn.Module, _a: object, out: torch.Tensor) -> None:
        if training[0]:
            stds.append(out.std().item())

    handle = model[0].register_forward_hook(keep_std)
    with torchscope.monitor(model, opt if with_optimizer else None, every=1, out=None) as mon:
        for x, y in data:
            xa = (x[:2] * 3).requires_grad_(True)  # another batch size, another scale
            for _ in range(2):
                (g,) = torch.autograd.grad(nn.functional.mse_loss(model(xa), y[:2]), xa)
                xa = (xa + 0.1 * g.sign()).detach().requires_grad_(True)
            opt.zero_grad()
            training[0] = True
            nn.functional.mse_loss(model(x), y).backward()
            training[0] = False
            opt.step()
    handle.remove()
    run = mon.result
    assert run is not None and run.steps == 4 and run.samples == 4
    assert run.last is not None and run.last.micro_batches == 1
    assert run.last.idle_forwards == 0
    for got, want in zip(run.act_std.series("0"), stds, strict=True):
        assert math.isclose(got, want, rel_tol=1e-4)
    saved = torchscope.memory.saved_activations(model, data[-1][0], loss_fn="sum")
    assert run.memory is not None and run.memory.last is not None
    assert run.memory.last.saved.total_bytes == saved.total_bytes


def test_a_gan_discriminators_columns_come_from_its_own_step() -> None:
    """The generator's step runs the discriminator on the fakes and backpropagates through
    it; its gradients are then set to None before the discriminator's step. The watched
    discriminator's activation columns are those of its own step's first forward."""
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
    disc = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.01)
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.01)
    bce = nn.BCEWithLogitsLoss()
    stds: list[float] = []  # disc[0]'s output: real, fake.detach(), fake, per iteration
    handle = disc[0].register_forward_hook(lambda _m, _a, out: stds.append(out.std().item()))
    with torchscope.monitor(disc, opt_d, every=1, out=None) as mon:
        for _ in range(4):
            real = torch.randn(16, 8) * 3  # another scale than the fakes'
            fake = gen(torch.randn(16, 4))
            opt_d.zero_grad()
            (bce(disc(real), torch.ones(16, 1)) +
             bce(disc(fake.detach()), torch.zeros(16, 1))).backward()
            opt_d.step()
            opt_g.zero_grad()
            bce(disc(fake), torch.ones(16, 1)).backward()
            opt_g.step()
    handle.remove()
    run = mon.result
    assert run is not None
    assert run.grad_param.steps[:4] == (0, 1, 2, 3)
    for got, want in zip(run.act_std.series("0")[:4], stds[::3], strict=True):
        assert math.isclose(got, want, rel_tol=1e-4)


def test_autocast_and_a_gradscaler_report_unscaled_norms() -> None:
    """bfloat16 autocast on CPU; with a GradScaler (scale 2^10) the reported norms are
    those of the run without scaling."""
    data = batches(12)

    def run(scaled: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=10**6) \
            if scaled else None
        with torchscope.monitor(model, opt, every=2, scaler=scaler, out=None) as mon:
            for x, y in data:
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = nn.functional.mse_loss(model(x).float(), y)
                if scaler is None:
                    loss.backward()
                    opt.step()
                else:
                    scaler.scale(loss).backward()
                    scaler.step(opt)
                    scaler.update()
        assert mon.result is not None
        return mon.result

    plain, scaled = run(False), run(True)
    assert scaled.steps == plain.steps == 12 and scaled.skipped == 0
    assert scaled.grad_param.steps == plain.grad_param.steps
    assert scaled.last is not None and scaled.last.scale == 2.0**10
    for layer in plain.grad_param.layers:
        for a, b in zip(plain.grad_param.series(layer), scaled.grad_param.series(layer),
                        strict=True):
            assert math.isclose(a, b, rel_tol=1e-6), (layer, a, b)  # not 1024× larger
    for a, b in zip(plain.total_norms, scaled.total_norms, strict=True):
        assert math.isclose(a, b, rel_tol=1e-6)


def test_steps_the_scaler_skipped_are_counted_and_reported() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    with torchscope.monitor(model, opt, every=2, scaler=scaler, out=None) as mon:
        for i, (x, y) in enumerate(batches(10)):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y) * (math.inf if i in (4, 5) else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    run = mon.result
    assert run is not None
    assert run.steps == 10 and run.skipped == 2 and run.skipped_steps == (4, 5)
    assert run.grad_param.steps == (0, 2, 6, 8)  # step 4's sample went to step 6
    assert all(math.isfinite(v) for v in run.total_norms)
    codes = {f.code for f in run.findings()}
    assert "run.skipped_steps" in codes
    assert "run.nonfinite" not in codes and "grads.nonfinite" not in codes


def test_an_exception_at_step_7_leaves_no_hooks_and_a_partial_report(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="data loader broke"), \
            torchscope.monitor(model, opt, every=2, out=tmp_path) as mon:
        for i, (x, y) in enumerate(batches(20)):
            if i == 7:
                raise RuntimeError("data loader broke")
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    assert audit_hooks(model, include_global=False).local_total == 0
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    run = mon.result
    assert run is not None and run.status == "stopped" and run.steps == 7
    assert run.grad_param.steps == (0, 2, 4, 6)
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["kind"] == "run"
    data = doc["sections"]["run"]["data"]
    assert data["status"] == "stopped" and data["steps"] == 7
    assert "RuntimeError: data loader broke" in data["error"]
    stopped = [f for f in doc["findings"] if f["code"] == "run.stopped"]
    assert len(stopped) == 1 and "stopped in step 7" in stopped[0]["summary"]
    assert "stopped in step 7" in (tmp_path / "report.html").read_text()


def test_an_exception_inside_backward_leaves_no_hooks(tmp_path: Path) -> None:
    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[override]
            return x.clone()

        @staticmethod
        def backward(ctx, g):  # type: ignore[override]
            raise ValueError("backward failed")

    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="backward failed"), \
            torchscope.monitor(model, opt, every=1, out=tmp_path):
        for i, (x, y) in enumerate(batches(5)):
            opt.zero_grad()
            out = model(x)
            if i == 3:
                out = Boom.apply(out)
            nn.functional.mse_loss(out, y).backward()
            opt.step()
    assert audit_hooks(model, include_global=False).local_total == 0
    assert json.loads((tmp_path / "report.json").read_text())["sections"]["run"]["data"][
        "steps"] == 3


@pytest.mark.parametrize("kind", ["lbfgs", "inferred"])
def test_closure_steps_and_loops_without_an_optimizer(kind: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    data = batches(6)
    if kind == "lbfgs":
        opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3)
        with torchscope.monitor(model, opt, every=1, out=None) as mon:
            for x, y in data:
                def closure(x=x, y=y) -> torch.Tensor:
                    opt.zero_grad()
                    loss = nn.functional.mse_loss(model(x), y)
                    loss.backward()
                    return loss
                opt.step(closure)
    else:
        with torchscope.monitor(model, every=1, out=None) as mon:
            for x, y in data:
                model.zero_grad()
                for half in (x[:4], x[4:]):
                    model(half).sum().backward()
    run = mon.result
    assert run is not None and run.steps == 6 and run.samples == 6
    assert run.step_by == ("optimizer" if kind == "lbfgs" else "inferred")
    assert run.last is not None
    assert run.last.backward_calls == (1 if kind == "lbfgs" else 2)


@pytest.mark.parametrize(("every", "halves"), [(1, 1), (2, 2)])
def test_an_inferred_steps_columns_are_its_own(every: int, halves: int) -> None:
    """Without an optimizer a step ends at the next step's first backward, when the next
    step's forward has run too: the activation columns are the step's first micro-batch's,
    and the saved bytes its last's, not the next step's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    stds: list[float] = []  # model[0]'s output, per step: its first micro-batch
    saved: list[int] = []  # per step: its last micro-batch's saved bytes
    handle = model[0].register_forward_hook(
        lambda _m, _a, out: stds.append(out.std().item()) if len(stds) < step[0] + 1 else None)
    step = [0]
    with torchscope.monitor(model, every=every, out=None) as mon:
        for step[0] in range(5):
            model.zero_grad()
            x = torch.randn(4 * (step[0] + 1), 8) * (step[0] + 1)  # its own size and scale
            for part in [c.clone() for c in x.chunk(halves)]:  # a view saves all of x
                model(part).square().mean().backward()
            saved.append(part.shape[0])
    handle.remove()
    run = mon.result
    assert run is not None and run.step_by == "inferred" and run.steps == 5
    assert run.act_std.steps == tuple(range(0, 5, every))
    for got, want in zip(run.act_std.series("0"), stds[::every], strict=True):
        assert math.isclose(got, want, rel_tol=1e-4)
    rows = [torchscope.memory.saved_activations(
        model, torch.randn(n, 8), loss_fn="sum").total_bytes for n in saved[::every]]
    assert run.saved_bytes == tuple(rows)


def test_bad_options_fail_before_training() -> None:
    model = mlp()
    with pytest.raises(TorchscopeError, match="every=0"):
        torchscope.monitor(model, every=0)
    with pytest.raises(TorchscopeError, match="out="):
        torchscope.monitor(model, out="/proc/torchscope-run")
    with pytest.raises(TorchscopeError, match=r"nn\.Module"):
        torchscope.monitor("model")  # type: ignore[arg-type]


def test_training_a_transformers_llama_is_bitwise_unchanged(tmp_path: Path) -> None:
    """The monitor and a gradient watch that reads every call's input gradient, both on a
    transformers Llama trained with AdamW. Its RMSNorm uses its input twice and the
    residual stream once more: an input alias once changed the order in which autograd
    adds those gradients, and the weights drifted in the last bits from the first sampled
    step on."""
    from transformers import LlamaConfig, LlamaForCausalLM

    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 64, (2, 12), generator=gen) for _ in range(6)]

    def run(watched: bool) -> tuple[list[torch.Tensor], nn.Module]:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with contextlib.ExitStack() as stack:
            if watched:
                stack.enter_context(torchscope.monitor(model, opt, every=2,
                                                       out=tmp_path / "run"))
                stack.enter_context(torchscope.watch_gradients(model, every=3,
                                                               optimizer=opt))
            for batch in ids:
                opt.zero_grad(set_to_none=True)
                model(input_ids=batch, labels=batch).loss.backward()
                opt.step()
        return [p.detach().clone() for p in model.parameters()], model

    watched, model = run(True)
    plain, _ = run(False)
    for a, b in zip(watched, plain, strict=True):
        assert torch.equal(a, b)
    assert audit_hooks(model, include_global=False).local_total == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_device_peak_is_kept_and_training_unchanged(tmp_path: Path) -> None:
    data = [(x.cuda(), y.cuda()) for x, y in batches(20)]

    def run(watched: bool) -> tuple[list[torch.Tensor], object]:
        torch.manual_seed(0)
        model = mlp().cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        ctx = torchscope.monitor(model, opt, every=4, out=tmp_path) if watched else \
            contextlib.nullcontext()
        _train(model, opt, data, ctx)
        return [p.detach().clone() for p in model.parameters()], ctx

    watched, mon = run(True)
    plain, _ = run(False)
    for a, b in zip(watched, plain, strict=True):
        assert torch.equal(a, b)
    record = mon.result  # type: ignore[attr-defined]
    assert record.device.startswith("cuda") and record.device_peak
    assert sum(b.count for b in record.device_peak) == 20
    assert record.onset.nonfinite_steps == 0
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["sections"]["mem_history"]["data"]["device_peak_bytes"]


def test_a_run_whose_optimizer_never_steps_says_so() -> None:
    torch.manual_seed(0)
    model = mlp()
    given = torch.optim.SGD(model.parameters(), lr=0.1)
    stepped = torch.optim.SGD(model.parameters(), lr=0.1)  # what the loop really steps
    with torchscope.monitor(model, given, every=1, out=None) as mon:
        for x, y in batches(3):
            stepped.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            stepped.step()
    run = mon.result
    assert run is not None and run.steps == 0 and run.backwards == 3
    assert "grads.no_step" in {f.code for f in run.findings()}
