"""`torchscope.Step`: one definition of the training step, checked against plain torch loops."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional

from torchscope.errors import ModelError, TorchscopeError
from torchscope.models import TinyCNN
from torchscope.step import Step, preserved


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _same(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> bool:
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a, b, strict=True))


@pytest.fixture
def cnn() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    model = TinyCNN()
    x = torch.randn(8, 3, 32, 32)
    y = torch.randint(0, 10, (8,))
    return model, x, y


def test_step_gradients_equal_a_plain_loop(cnn: tuple[nn.Module, torch.Tensor, torch.Tensor]
                                           ) -> None:
    model, x, y = cnn
    functional.cross_entropy(model(x), y).backward()
    expected = _grads(model)
    model.zero_grad(set_to_none=True)
    loss = Step(model, x, loss_fn="cross_entropy", target=y).forward_backward()
    assert _same(_grads(model), expected)
    assert torch.equal(loss, functional.cross_entropy(model(x), y).detach())


def test_auto_resolves_and_says_so(cnn: tuple[nn.Module, torch.Tensor, torch.Tensor]) -> None:
    model, x, y = cnn
    step = Step(model, x)
    step.forward_backward()
    assert step.resolved is not None
    assert step.resolved.describe() == "auto → cross-entropy vs seeded targets"
    given = Step(model, x, target=y)
    given.forward_backward()
    assert given.info(None).loss == "auto → cross-entropy vs given targets"
    floats = Step(model, x, target=torch.randn(8, 10))
    floats.forward_backward()
    assert floats.info(None).loss == "auto → mean squared error vs given targets"


class _Own(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.fc(x)
        return {"logits": logits, "loss": logits.square().mean()}


class _Image(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class _Scalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).mean()


@pytest.mark.parametrize(("model", "x", "said"), [
    (_Own(), torch.randn(2, 4), "auto → the model's own loss (output.loss)"),
    (_Scalar(), torch.randn(2, 4), "auto → the model's scalar output"),
    (_Image(), torch.randn(2, 3, 4, 4), "auto → mean squared error vs seeded targets"),
])
def test_auto_order(model: nn.Module, x: torch.Tensor, said: str) -> None:
    step = Step(model, x)
    loss = step.forward_backward()
    assert step.info(loss).loss == said
    assert step.info(loss).loss_value == pytest.approx(float(loss))


def test_own_loss_is_used_as_is() -> None:
    model = _Own()
    x = torch.randn(2, 4)
    out = model(x)
    assert torch.equal(Step(model, x).loss(out), out["loss"])


def test_seeded_targets_are_reproducible_and_leave_the_global_rng_alone(
        cnn: tuple[nn.Module, torch.Tensor, torch.Tensor]) -> None:
    model, x, _ = cnn
    out = model(x)
    state = torch.get_rng_state()
    a = Step(model, x, loss_fn="cross_entropy").loss(out)
    b = Step(model, x, loss_fn="cross_entropy", seed=0).loss(out)
    c = Step(model, x, loss_fn="cross_entropy", seed=1).loss(out)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    mse = Step(model, x, loss_fn="mse").loss(out)
    target = torch.randn(8, 10, generator=torch.Generator().manual_seed(0))
    assert torch.equal(mse, functional.mse_loss(out, target))


def test_sum_and_callable(cnn: tuple[nn.Module, torch.Tensor, torch.Tensor]) -> None:
    model, x, y = cnn
    out = model(x)
    assert torch.equal(Step(model, x, loss_fn="sum").loss(out), out.sum())

    def my_loss(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return functional.nll_loss(o.log_softmax(-1), t)

    step = Step(model, x, loss_fn=my_loss, target=y)
    assert torch.equal(step.loss(out), my_loss(out, y))
    assert step.info(None).loss == "my_loss(output, target)"


def test_accumulation_matches_a_plain_accumulating_loop(
        cnn: tuple[nn.Module, torch.Tensor, torch.Tensor]) -> None:
    model, x, y = cnn
    for xs, ys in zip(x.chunk(4), y.chunk(4), strict=True):
        (functional.cross_entropy(model(xs), ys) / 4).backward()
    expected = _grads(model)
    model.zero_grad(set_to_none=True)
    step = Step(model, x, loss_fn="cross_entropy", target=y, accumulate=4)
    loss = step.forward_backward()
    assert _same(_grads(model), expected)
    full = functional.cross_entropy(model(x), y).detach()
    assert float(loss) == pytest.approx(float(full), rel=1e-5)
    assert step.info(loss).accumulate == 4


def test_accumulation_needs_a_divisible_batch(
        cnn: tuple[nn.Module, torch.Tensor, torch.Tensor]) -> None:
    model, x, _ = cnn
    with pytest.raises(TorchscopeError, match="accumulate=3"):
        Step(model, x, accumulate=3).forward_backward()


def test_run_steps_the_optimizer_like_a_plain_loop() -> None:
    torch.manual_seed(0)
    a = TinyCNN()
    b = TinyCNN()
    b.load_state_dict(a.state_dict())
    x = torch.randn(4, 3, 32, 32)
    y = torch.randint(0, 10, (4,))
    opt_a = torch.optim.Adam(a.parameters(), lr=1e-2)
    opt_b = torch.optim.Adam(b.parameters(), lr=1e-2)
    step = Step(b, x, loss_fn="cross_entropy", target=y, optimizer=opt_b)
    for _ in range(3):
        opt_a.zero_grad()
        functional.cross_entropy(a(x), y).backward()
        opt_a.step()
        step.run()
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_scaler_steps_through_the_scaler() -> None:
    model = nn.Linear(4, 3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 4)
    step = Step(model, x, loss_fn="sum", optimizer=opt, scaler=scaler)
    before = model.weight.detach().clone()
    step.forward_backward()
    assert model.weight.grad is not None
    assert torch.allclose(model.weight.grad, 1024 * x.sum(0).expand(3, 4))  # scaled loss
    step.run()
    # scaler.step unscaled the gradient before the update.
    assert torch.allclose(model.weight.grad, x.sum(0).expand(3, 4))
    assert torch.allclose(model.weight, before - 0.1 * x.sum(0).expand(3, 4))


def test_with_autocast_runs_the_step_as_a_mixed_precision_loop_would() -> None:
    """bf16: the forward and loss under autocast, gradients as a plain bf16 autocast loop
    gets them; fp16: with a GradScaler on the step's device."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    plain = Step(model, x, loss_fn="cross_entropy", target=y)
    assert plain.with_autocast(None) is plain
    bf16 = plain.with_autocast("bf16")
    assert bf16.autocast is torch.bfloat16 and bf16.scaler is None
    assert plain.autocast is None  # the step it came from is unchanged
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = functional.cross_entropy(model(x), y)
    loss.backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    bf16.forward_backward()
    assert all(torch.equal(p.grad, w) for p, w in zip(model.parameters(), want, strict=True))
    fp16 = plain.with_autocast("fp16")
    assert fp16.autocast is torch.float16
    assert isinstance(fp16.scaler, torch.amp.GradScaler) and fp16.info(None).scaler
    with pytest.raises(TorchscopeError, match="choose bf16 or fp16"):
        plain.with_autocast("fp32")


def test_before_backward_sees_each_micro_batch(
        cnn: tuple[nn.Module, torch.Tensor, torch.Tensor]) -> None:
    model, x, _ = cnn
    seen: list[tuple[int, bool]] = []
    Step(model, x, accumulate=2).forward_backward(
        before_backward=lambda m, out, loss: seen.append((m, loss.requires_grad)))
    assert seen == [(0, True), (1, True)]


def test_bad_options_are_torchscope_errors(cnn: tuple[nn.Module, torch.Tensor, torch.Tensor]
                                           ) -> None:
    model, x, y = cnn
    with pytest.raises(TorchscopeError, match="not a known loss"):
        Step(model, x, loss_fn="hinge")  # type: ignore[arg-type]
    with pytest.raises(TorchscopeError, match="autocast"):
        Step(model, x, autocast=torch.float32)
    with pytest.raises(TorchscopeError, match="together with target"):
        Step.of(Step(model, x), target=y)
    with pytest.raises(TorchscopeError, match="without inputs"):
        Step.of(model)
    assert Step.of(model, x, loss_fn="mse").loss_fn == "mse"


def test_loss_that_cannot_fit_is_a_model_error(
        cnn: tuple[nn.Module, torch.Tensor, torch.Tensor]) -> None:
    model, x, _ = cnn
    with pytest.raises(ModelError, match="cross_entropy loss failed"):
        Step(model, x, loss_fn="cross_entropy", target=torch.zeros(3, dtype=torch.long)
             ).forward_backward()
    frozen = TinyCNN().requires_grad_(False)
    with pytest.raises(TorchscopeError, match="does not require grad"):
        Step(frozen, x).forward_backward()


class _WithBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.register_buffer("calls", torch.zeros(()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.bn(self.fc(x))


def test_preserved_restores_everything() -> None:
    model = _WithBuffers().train()
    model.bn.eval()
    x = torch.randn(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(x).sum().backward()
    opt.step()
    grad = model.fc.weight.grad
    assert grad is not None
    before = {k: v.clone() for k, v in [*model.named_parameters(), *model.named_buffers()]}
    grad_values = grad.clone()
    momentum = opt.state[model.fc.weight]["momentum_buffer"].clone()
    rng = torch.get_rng_state()
    with preserved(model, optimizer=opt):
        model.train()
        for _ in range(3):
            model(x).sum().backward()
            opt.step()
        torch.randn(5)
        model.fc.weight.data = torch.zeros(2, 2)  # a shape change is undone too
    for k, v in [*model.named_parameters(), *model.named_buffers()]:
        assert torch.equal(v, before[k]), k
    assert model.calls.item() == 1.0  # the non-persistent buffer too
    assert model.fc.weight.grad is grad
    assert torch.equal(grad, grad_values)
    assert not model.bn.training
    assert model.training
    assert torch.equal(opt.state[model.fc.weight]["momentum_buffer"], momentum)
    assert torch.equal(torch.get_rng_state(), rng)


def test_step_preserved_keeps_the_inputs_grad_too() -> None:
    model = nn.Linear(4, 2)
    x = torch.randn(3, 4, requires_grad=True)
    model(x).sum().backward()
    grad = x.grad
    assert grad is not None
    values = grad.clone()
    step = Step(model, x, loss_fn="sum")
    with step.preserved(clear_grads=True):
        assert x.grad is None and model.weight.grad is None
        step.forward_backward()
        step.forward_backward()
    assert x.grad is grad
    assert torch.equal(grad, values)
    assert [name for name, _ in step.input_leaves()] == ["input[0]"]


def test_with_model_keeps_the_options_and_not_the_cache(
        cnn: tuple[nn.Module, torch.Tensor, torch.Tensor]) -> None:
    model, x, _ = cnn
    step = Step(model, x, loss_fn="mse", target=torch.randn(8, 10), accumulate=2, seed=3)
    step.forward_backward()
    other = step.with_model(TinyCNN())
    assert (other.loss_fn, other.accumulate, other.seed) == ("mse", 2, 3)
    assert other.target is step.target
    assert other.resolved is None and step.resolved is not None


def test_one_output_per_sample_is_not_taken_as_one_class() -> None:
    # Cross-entropy over one class is log_softmax = 0 whatever the output: its gradient is
    # zero, and every layer would read as dead. `auto` takes (N, 1) as a regression.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    x = torch.randn(4, 8)
    step = Step(model, x)
    step.forward_backward()
    assert step.info(None).loss == "auto → mean squared error vs seeded targets"
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    with pytest.raises(ModelError, match="has 1 class"):
        Step(model, x, loss_fn="cross_entropy").forward_backward()
    with pytest.raises(ModelError, match="has 1 class"):
        Step(model, x, loss_fn="cross_entropy", target=torch.zeros(4, dtype=torch.long)
             ).forward_backward()
    # With integer labels, one logit per sample is a binary classifier.
    labels = torch.tensor([0, 1, 1, 0])
    model.zero_grad()
    binary = Step(model, x, target=labels)
    loss = binary.forward_backward()
    assert binary.info(None).loss == "auto → binary cross-entropy with logits vs given targets"
    got = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    want = functional.binary_cross_entropy_with_logits(model(x), labels.float()[:, None])
    want.backward()
    assert torch.equal(loss, want.detach())
    assert all(torch.equal(a, p.grad) for a, p in zip(got, model.parameters(), strict=True))


def _seg() -> nn.Module:
    """Per-pixel logits: (N, 3, 8, 8) -> (N, C, 8, 16), C classes on dim 1 (the width, 16,
    differs from every other size)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(),
                         nn.Upsample(size=(8, 16)), nn.Conv2d(4, 5, 1))


def test_cross_entropy_takes_a_segmentation_s_classes_on_dim_1() -> None:
    """(N, C, H, W) logits, as torch's cross_entropy takes them: seeded targets are
    (N, H, W) indices in [0, C) and a given (N, H, W) target is used as it is; the loss
    and every gradient equal torch's own. It took the width for the classes."""
    x = torch.randn(2, 3, 8, 8)
    model = _seg()
    seeded = Step(model, x, loss_fn="cross_entropy")
    loss = seeded.forward_backward()
    target = seeded._seeded_target("cross_entropy", model(x), 0)
    assert target.shape == (2, 8, 16) and int(target.max()) < 5
    assert torch.equal(loss, functional.cross_entropy(model(x), target).detach())
    labels = torch.randint(0, 5, (2, 8, 16), generator=torch.Generator().manual_seed(1))
    for spec in ("auto", "cross_entropy"):
        model.zero_grad()
        given = Step(model, x, loss_fn=spec, target=labels)
        loss = given.forward_backward()
        got = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        model.zero_grad()
        want = functional.cross_entropy(model(x), labels)
        want.backward()
        assert torch.equal(loss, want.detach())
        assert all(torch.equal(a, p.grad) for a, p in zip(got, model.parameters(), strict=True))
    # (N, C, L) against (N, L) indices: dim 1 too; (N, T, C) against (N, T): the last.
    seq = torch.randn(2, 5, 7, requires_grad=True)
    by_dim1 = Step(nn.Identity(), seq, target=torch.zeros(2, 7, dtype=torch.long))
    assert torch.equal(by_dim1.forward_backward(),
                       functional.cross_entropy(seq, torch.zeros(2, 7, dtype=torch.long)))
    by_last = Step(nn.Identity(), seq, target=torch.zeros(2, 5, dtype=torch.long))
    assert torch.equal(by_last.forward_backward(), functional.cross_entropy(
        seq.reshape(-1, 7), torch.zeros(10, dtype=torch.long)))


def test_one_logit_per_pixel_with_integer_labels_is_a_binary_segmentation() -> None:
    """(N, 1, H, W) logits against (N, H, W) 0/1 labels: binary cross-entropy with logits,
    as torch computes it; cross-entropy over its one class is refused."""
    torch.manual_seed(0)
    model = nn.Conv2d(3, 1, 3, padding=1)
    x = torch.randn(2, 3, 8, 8)
    labels = torch.randint(0, 2, (2, 8, 8), generator=torch.Generator().manual_seed(1))
    step = Step(model, x, target=labels)
    loss = step.forward_backward()
    assert step.info(None).loss == "auto → binary cross-entropy with logits vs given targets"
    assert torch.equal(loss, functional.binary_cross_entropy_with_logits(
        model(x), labels[:, None].float()).detach())
    with pytest.raises(ModelError, match="has 1 class"):
        Step(model, x, loss_fn="cross_entropy").forward_backward()
