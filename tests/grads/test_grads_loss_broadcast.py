"""`grads.loss_broadcast`: a loss that compares `(N, 1)` predictions with `(N,)` targets
pairwise. Told on the graph between the loss and the model's output, whatever wrote the
loss; silent where the shapes agree and on losses that enlarge the output on purpose."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn import functional

import torchscope
from torchscope.errors import ModelError
from torchscope.grads import gradient_flow, watch_gradients
from torchscope.step import Step, loss_broadcast

N = 32


def _regressor() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 1))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(N, 8, generator=g), torch.randn(N, generator=g)  # y: (N,)


def _quiet(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
           ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`fn` without torch's once-per-site UserWarning on mismatched sizes."""
    def call(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return fn(o, t)
    return call


# Each: a loss of (output (N, 1), target (N,)) that broadcasts, and the node that does.
BROADCASTING: dict[str, tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], str]] = {
    "by hand": (lambda o, t: ((o - t) ** 2).mean(), "SubBackward0"),
    "nn.MSELoss": (_quiet(nn.MSELoss()), "ExpandBackward0"),
    "l1_loss": (_quiet(functional.l1_loss), "ExpandBackward0"),
    "huber_loss": (_quiet(functional.huber_loss), "ExpandBackward0"),
    "scaled and cast": (lambda o, t: ((2 * o.double() - t) ** 2).mean(), "SubBackward0"),
    "squeezed output, (N, 1) target": (
        lambda o, t: ((o.squeeze(-1) - t[:, None]) ** 2).mean(), "SubBackward0"),
}


@pytest.mark.parametrize("name", list(BROADCASTING))
def test_a_broadcasting_loss_is_told_with_its_shapes(name: str) -> None:
    model, (x, y) = _regressor(), _data()
    loss_fn, op = BROADCASTING[name]
    flow = gradient_flow(model, x, loss_fn=loss_fn, target=y)
    b = flow.step.loss_broadcast if flow.step is not None else None
    assert b is not None
    assert (b.output, b.output_shape, b.shape, b.op, b.target_shape) == \
        ("", (N, 1), (N, N), op, (N,))
    found = [f for f in flow.findings() if f.code == "grads.loss_broadcast"]
    assert len(found) == 1 and found[0].severity.label == "error"
    assert f"({N}, 1) against the target ({N},) into ({N}, {N})" in found[0].summary
    assert f"target.view({N}, 1)" in found[0].fix


def test_what_the_finding_says_the_gradient_is() -> None:
    # Every prediction against every target: the gradient at the output is exactly the one
    # of a loss against the targets' mean, so the model learns that mean.
    model, (x, y) = _regressor(), _data()
    out = model(x)  # (N, 1)
    broadcast = torch.autograd.grad(((out - y) ** 2).mean(), out)[0]
    to_mean = torch.autograd.grad(((out - y.mean()) ** 2).mean(), out)[0]
    right = torch.autograd.grad(((out - y[:, None]) ** 2).mean(), out)[0]
    torch.testing.assert_close(broadcast, to_mean)
    assert not torch.allclose(broadcast, right)


def _pairwise(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    # A ranking loss: every pair of predictions, (N, 1) - (1, N); both carry gradient.
    sign = torch.sign(t[:, None] - t[None, :])
    return functional.relu(1 - sign * (o - o.T)).mean()


def _bins(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    # A soft histogram: (N, 1) against 10 fixed bin centres, N x 10 elements.
    centres = torch.linspace(-2, 2, 10)
    soft = torch.softmax(-(o - centres) ** 2, dim=1)
    return -(soft * torch.softmax(-(t[:, None] - centres) ** 2, dim=1)).sum(1).mean()


SILENT: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "shapes agree": lambda o, t: functional.mse_loss(o, t[:, None]),
    "output squeezed": lambda o, t: functional.mse_loss(o.squeeze(-1), t),
    "pairwise ranking": _pairwise,
    "bin centres": _bins,
    "binary cross-entropy": lambda o, t: functional.binary_cross_entropy_with_logits(
        o.squeeze(-1), (t > 0).float()),
    "against a learned (N,) vector": lambda o, t: ((o - _LEARNED) ** 2).mean(),
}
_LEARNED = nn.Parameter(torch.zeros(N))


@pytest.mark.parametrize("name", list(SILENT))
def test_losses_that_compare_shapes_rightly_or_pairs_on_purpose_are_silent(name: str) -> None:
    model, (x, y) = _regressor(), _data()
    flow = gradient_flow(model, x, loss_fn=SILENT[name], target=y)
    assert flow.step is not None and flow.step.loss_broadcast is None
    assert "grads.loss_broadcast" not in [f.code for f in flow.findings()]


def test_torchscope_own_mse_refuses_such_a_target() -> None:
    model, (x, y) = _regressor(), _data()
    for loss_fn in ("mse", "auto"):
        with pytest.raises(ModelError, match=rf"the target \({N},\) and the output \({N}, 1\) "
                           rf"broadcast to \({N}, {N}\).*target.reshape\({N}, 1\)"):
            Step(model, x, loss_fn=loss_fn, target=y).forward_backward()
    # As many elements in the output's shape: auto is mean squared error, as before.
    step = Step(model, x, target=y[:, None])
    step.forward_backward()
    info = step.info(None)
    assert info.loss == "auto → mean squared error vs given targets"
    assert info.loss_broadcast is None


def test_a_classifier_under_cross_entropy_is_silent() -> None:
    torch.manual_seed(0)
    # N classes for a batch of N: (N, N) logits and (N,) labels, the shape a careless rule
    # would take for a broadcast.
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, N))
    x, _ = _data()
    flow = gradient_flow(model, x, target=torch.arange(N))
    assert flow.step is not None and flow.step.loss_broadcast is None


def test_a_transformers_regression_head_under_its_own_and_a_users_loss() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, num_labels=1, problem_type="regression")
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    g = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, 100, (8, 12), generator=g), torch.randn(8, generator=g)
    # The model's own loss squeezes its (8, 1) logits against (8,) labels: silent.
    own = gradient_flow(model, {"input_ids": ids, "labels": labels})
    assert own.step is not None and own.step.loss.startswith("auto → the model's own loss")
    assert own.step.loss_broadcast is None
    # A loss of the user's on the logits, against the same labels: told, on `.logits`.
    def loss_fn(out: object, target: torch.Tensor) -> torch.Tensor:
        return _quiet(functional.mse_loss)(out.logits, target)  # type: ignore[attr-defined]
    users = gradient_flow(model, {"input_ids": ids}, loss_fn=loss_fn, target=labels)
    b = users.step.loss_broadcast if users.step is not None else None
    assert b is not None and (b.output_shape, b.shape, b.target_shape) == ((8, 1), (8, 8), (8,))
    assert b.output == "['logits']"
    assert "grads.loss_broadcast" in [f.code for f in users.findings()]


def test_the_walk_is_the_losss_own_part_of_the_graph() -> None:
    # A regularisation term over every weight joins the loss: the walk passes it, stops at
    # the output, and still finds the broadcast.
    model, (x, y) = _regressor(), _data()
    out = model(x)
    reg = sum(p.square().sum() for p in model.parameters())
    loss = ((out - y) ** 2).mean() + 1e-4 * reg
    b = loss_broadcast(loss, out, y)
    assert b is not None and b.shape == (N, N)
    assert loss_broadcast(functional.mse_loss(out, y[:, None]) + 1e-4 * reg, out) is None
    # No graph, nothing to read.
    with torch.no_grad():
        assert loss_broadcast(((model(x) - y) ** 2).mean(), out) is None


@pytest.mark.parametrize("broadcast", [True, False])
def test_a_loop_that_hands_its_loss_to_the_watch_is_told_once(broadcast: bool) -> None:
    model, (x, y) = _regressor(), _data()
    reference = copy.deepcopy(model)
    target = y if broadcast else y[:, None]
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    loss_fn = _quiet(functional.mse_loss)
    with watch_gradients(model, every=2, optimizer=opt) as watch:
        collector = watch._collector
        for step in range(4):
            opt.zero_grad()
            loss = loss_fn(model(x), target)
            watch.check_loss(loss)
            # Armed by the first loss, the watch holds the second forward's output until
            # the second loss is read, and nothing after.
            assert collector.keep_outputs == (step == 0)
            assert collector.outputs is None
            loss.backward()
            opt.step()
            ref_opt.zero_grad()
            loss_fn(reference(x), target).backward()
            ref_opt.step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)  # the loop trained as it would without the watch
    codes = [f.code for f in watch.findings()]
    if broadcast:
        b = watch.loss_broadcast
        assert b is not None and (b.output_shape, b.shape, b.op, b.target_shape) == \
            ((N, 1), (N, N), "ExpandBackward0", None)
        assert codes.count("grads.loss_broadcast") == 1
        (found,) = [f for f in watch.findings() if f.code == "grads.loss_broadcast"]
        assert "a tensor without gradient (the target)" in found.summary
    else:
        assert watch.loss_broadcast is None and "grads.loss_broadcast" not in codes


def test_the_monitor_reports_what_its_watch_read() -> None:
    model, (x, y) = _regressor(), _data()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with torchscope.monitor(model, opt, every=1, out=None) as mon:
        for _ in range(3):
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            mon.check_loss(loss)
            loss.backward()
            opt.step()
    run = mon.result
    assert run is not None and run.loss_broadcast is not None
    assert run.loss_broadcast.op == "SubBackward0"
    assert [f.code for f in run.findings()].count("grads.loss_broadcast") == 1
