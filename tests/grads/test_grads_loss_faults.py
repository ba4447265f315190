"""Two mistakes between the model's output and its loss, read on autograd's graph whatever
wrote the loss: `grads.loss_broadcast` (`(N, 1)` predictions against `(N,)` targets,
compared pairwise, or against `(N, K)` targets, each row's K) and
`grads.loss_on_probabilities` (a softmax or sigmoid, then a loss that applies its own).
Silent where the loss is right, and on losses that enlarge the output or take
probabilities on purpose."""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn import functional

import torchscope
from torchscope.errors import ModelError
from torchscope.grads import gradient_flow, watch_gradients
from torchscope.grads.loss import loss_faults
from torchscope.step import Step

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
    b = flow.loss_broadcast
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
    assert flow.loss_broadcast is None
    assert "grads.loss_broadcast" not in [f.code for f in flow.findings()]


def test_torchscope_own_mse_refuses_such_a_target() -> None:
    model, (x, y) = _regressor(), _data()
    for loss_fn in ("mse", "auto"):
        with pytest.raises(ModelError, match=rf"the target \({N},\) and the output \({N}, 1\) "
                           rf"broadcast to \({N}, {N}\).*target.reshape\({N}, 1\)"):
            Step(model, x, loss_fn=loss_fn, target=y).forward_backward()
    # As many elements in the output's shape: auto is mean squared error, as before.
    step = Step(model, x, target=y[:, None])
    flow = gradient_flow(step)
    assert flow.step is not None
    assert flow.step.loss == "auto → mean squared error vs given targets"
    assert flow.loss_broadcast is None


def test_a_classifier_under_cross_entropy_is_silent() -> None:
    torch.manual_seed(0)
    # N classes for a batch of N: (N, N) logits and (N,) labels, the shape a careless rule
    # would take for a broadcast.
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, N))
    x, _ = _data()
    flow = gradient_flow(model, x, target=torch.arange(N))
    assert flow.loss_broadcast is None


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
    assert own.loss_broadcast is None
    # A loss of the user's on the logits, against the same labels: told, on `.logits`.
    def loss_fn(out: object, target: torch.Tensor) -> torch.Tensor:
        return _quiet(functional.mse_loss)(out.logits, target)  # type: ignore[attr-defined]
    users = gradient_flow(model, {"input_ids": ids}, loss_fn=loss_fn, target=labels)
    b = users.loss_broadcast
    assert b is not None and (b.output_shape, b.shape, b.target_shape) == ((8, 1), (8, 8), (8,))
    assert b.output == "['logits']"
    assert "grads.loss_broadcast" in [f.code for f in users.findings()]


K = 3

# Each: a loss of (output (N, 1), target (N, K)) that broadcasts the output along the
# target's own K, and whether the step must name the target (l1_loss saves none).
PER_ROW: dict[str, tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], bool]] = {
    "mse_loss": (_quiet(functional.mse_loss), False),
    "huber_loss": (_quiet(functional.huber_loss), False),
    "smooth_l1_loss": (_quiet(functional.smooth_l1_loss), False),
    "l1_loss": (_quiet(functional.l1_loss), True),
}


def _rows() -> torch.Tensor:
    return torch.randn(N, K, generator=torch.Generator().manual_seed(2))  # (N, K)


@pytest.mark.parametrize("name", list(PER_ROW))
def test_an_output_broadcast_along_a_larger_targets_rows_is_a_warning(name: str) -> None:
    model, (x, _) = _regressor(), _data()
    loss_fn, needs_target = PER_ROW[name]
    flow = gradient_flow(model, x, loss_fn=loss_fn, target=_rows())
    b = flow.loss_broadcast
    assert b is not None and b.per_row == K
    assert (b.output_shape, b.shape, b.target_shape) == ((N, 1), (N, K), (N, K))
    (found,) = [f for f in flow.findings() if f.code == "grads.loss_broadcast"]
    assert found.severity.label == "warning" and found.evidence["per_row"] == K
    assert f"compared with the {K} targets of its row" in found.summary
    assert f"give the model {K} outputs per row" in found.fix
    # Read from the loss's graph alone, without the step's target, where the loss saved it.
    out = model(x)
    alone = loss_faults(loss_fn(out, _rows()), out).broadcast
    assert (alone is None) == needs_target
    if not needs_target:  # a step target of the output's element count does not hide it
        out = model(x)
        other = loss_faults(loss_fn(out, _rows()), out, torch.zeros(N)).broadcast
        assert other is not None and other.per_row == K and other.target_shape == (N, K)


def test_what_the_per_row_finding_says_the_gradient_is() -> None:
    # Each prediction against its row's K targets: exactly the gradient of a loss against
    # the row's mean, so each row learns that mean.
    model, (x, _) = _regressor(), _data()
    y = _rows()
    out = model(x)  # (N, 1)
    broadcast = torch.autograd.grad(_quiet(functional.mse_loss)(out, y), out)[0]
    to_mean = torch.autograd.grad(functional.mse_loss(out, y.mean(1, keepdim=True)), out)[0]
    torch.testing.assert_close(broadcast, to_mean)


def _soft_histogram(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    # A scalar output softly binned over K fixed centres, against (N, K) target histograms:
    # (N, 1) - (K,) is an (N, K) subtraction of the target's shape, and right.
    centres = torch.linspace(-2, 2, K)
    return -(torch.softmax(-(o - centres) ** 2, dim=1) * t.softmax(1)).sum(1).mean()


PER_ROW_SILENT: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "soft histogram against (N, K)": _soft_histogram,
    "mse_loss against (1, K) centres": lambda o, t: _quiet(functional.mse_loss)(
        o, torch.linspace(-1, 1, K)[None]),
    "one column of the target": lambda o, t: functional.mse_loss(o, t[:, :1]),
}


@pytest.mark.parametrize("name", list(PER_ROW_SILENT))
def test_a_scalar_against_fixed_centres_or_its_own_column_is_silent(name: str) -> None:
    model, (x, _) = _regressor(), _data()
    flow = gradient_flow(model, x, loss_fn=PER_ROW_SILENT[name], target=_rows())
    assert flow.loss_broadcast is None
    assert "grads.loss_broadcast" not in [f.code for f in flow.findings()]


def test_a_loop_whose_mse_broadcasts_along_the_targets_rows_is_told() -> None:
    model, (x, _) = _regressor(), _data()
    y = _rows()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with watch_gradients(model, every=1, optimizer=opt) as watch:
        for _ in range(2):
            opt.zero_grad()
            loss = _quiet(functional.mse_loss)(model(x), y)
            watch.check_loss(loss)
            loss.backward()
            opt.step()
    b = watch.loss_broadcast
    assert b is not None and b.per_row == K and b.target_shape == (N, K)
    assert [f.code for f in watch.findings()].count("grads.loss_broadcast") == 1


def test_the_walk_is_the_losss_own_part_of_the_graph() -> None:
    # A regularisation term over every weight joins the loss: the walk passes it, stops at
    # the output, and still finds the broadcast.
    model, (x, y) = _regressor(), _data()
    out = model(x)
    reg = sum(p.square().sum() for p in model.parameters())
    loss = ((out - y) ** 2).mean() + 1e-4 * reg
    b = loss_faults(loss, out, y).broadcast
    assert b is not None and b.shape == (N, N)
    healthy = loss_faults(functional.mse_loss(out, y[:, None]) + 1e-4 * reg, out)
    assert healthy == (None, None, True)  # it reached the output, and found nothing
    # Another forward's output, or no graph: nothing reached, nothing to read.
    assert loss_faults(loss, model(x), y) == (None, None, False)
    with torch.no_grad():
        assert loss_faults(((model(x) - y) ** 2).mean(), out) == (None, None, False)


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


@pytest.mark.parametrize("extra", [(1,), (0, 1, 2, 3, 4, 5)])
def test_a_check_after_another_forward_is_tried_again_at_the_next_step(
        extra: tuple[int, ...]) -> None:
    """A forward with gradients between a step's own forward and its check (a validation
    batch outside no_grad) leaves the watch holding that forward's output, which the loss
    does not reach: the next step's check reads it. A loop that always does so is given
    up after four losses, and holds nothing more."""
    model, (x, y) = _regressor(), _data()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loss_fn = _quiet(functional.mse_loss)
    with watch_gradients(model, every=1, optimizer=opt) as watch:
        for step in range(6):
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            if step in extra:
                model(x + 1.0)  # its output goes nowhere
            watch.check_loss(loss)
            loss.backward()
            opt.step()
            if extra == (1,):
                # Armed at step 0, missed at step 1, read at step 2.
                assert (watch.loss_broadcast is not None) == (step >= 2)
    if extra == (1,):
        assert watch.loss_broadcast is not None and watch.loss_broadcast.shape == (N, N)
    else:
        assert watch.loss_broadcast is None
        assert not watch._collector.keep_outputs and watch._collector.outputs is None


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


# ---------------------------------------------------------------- probabilities as logits
C = 10


def _classifier(last: nn.Module | None = None, classes: int = C) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, classes)]
    return nn.Sequential(*layers, *([last] if last is not None else []))


def _labels(classes: int = C) -> torch.Tensor:
    return torch.randint(0, classes, (N,), generator=torch.Generator().manual_seed(2))


def _tokens_ce(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    # A language model's shape: (B, T, C) probabilities flattened for cross-entropy.
    probs = torch.softmax(o.view(4, N // 4, C), dim=-1)
    return functional.cross_entropy(probs.reshape(-1, C), t)


# Each: (the model's last layer, the loss, and what must be read: squash, loss, in_model).
ON_PROBABILITIES: dict[str, tuple[nn.Module | None, Callable[..., torch.Tensor],
                                  tuple[str, str, bool]]] = {
    "nn.Softmax then CrossEntropyLoss": (
        nn.Softmax(dim=1), nn.CrossEntropyLoss(), ("softmax", "cross_entropy", True)),
    "softmax in the loss": (
        None, lambda o, t: functional.cross_entropy(functional.softmax(o, dim=1), t),
        ("softmax", "cross_entropy", False)),
    "label smoothing": (
        nn.Softmax(dim=1), nn.CrossEntropyLoss(label_smoothing=0.1),
        ("softmax", "cross_entropy", True)),
    "flattened tokens": (None, _tokens_ce, ("softmax", "cross_entropy", False)),
    "softmax into nll_loss": (
        nn.Softmax(dim=1), nn.NLLLoss(), ("softmax", "nll_loss", True)),
}


@pytest.mark.parametrize("name", list(ON_PROBABILITIES))
def test_probabilities_given_to_a_loss_that_wants_logits_are_told(name: str) -> None:
    last, loss_fn, (squash, loss, in_model) = ON_PROBABILITIES[name]
    model, (x, _) = _classifier(last), _data()
    flow = gradient_flow(model, x, loss_fn=loss_fn, target=_labels())
    p = flow.loss_on_probabilities
    assert p is not None
    assert (p.output, p.output_shape, p.squash, p.loss, p.in_model, p.classes, p.assumed) == \
        ("", (N, C), squash, loss, in_model, C, False)
    (found,) = [f for f in flow.findings() if f.code == "grads.loss_on_probabilities"]
    assert found.severity.label == "error"
    if loss == "cross_entropy":
        assert "cannot fall below log(1 + (C - 1)/e) = 1.46 (C = 10)" in found.summary
        assert ("drop the model's final Softmax layer" in found.fix) == in_model


def test_the_floor_that_the_finding_gives_is_cross_entropys() -> None:
    # The best a softmax's output can do: one-hot probabilities of the right class.
    labels = _labels()
    best = functional.one_hot(labels, C).float()  # (N, C), each row a softmax's limit
    floor = functional.cross_entropy(best, labels)
    assert math.isclose(float(floor), math.log(1 + (C - 1) / math.e), rel_tol=1e-6)


def test_a_sigmoid_into_bce_with_logits_is_told() -> None:
    model, (x, y) = _classifier(nn.Sigmoid(), classes=1), _data()
    labels = (y > 0).float()[:, None]  # (N, 1)
    flow = gradient_flow(model, x, loss_fn=nn.BCEWithLogitsLoss(), target=labels)
    p = flow.loss_on_probabilities
    assert p is not None and (p.squash, p.loss, p.in_model, p.classes) == \
        ("sigmoid", "binary_cross_entropy_with_logits", True, None)
    (found,) = [f for f in flow.findings() if f.code == "grads.loss_on_probabilities"]
    assert "between 0.5 and 0.73" in found.summary
    # What it says of the predictions: the loss's own sigmoid of a probability.
    with torch.no_grad():
        probs = model(x)
    assert float(torch.sigmoid(probs).min()) >= 0.5 and \
        float(torch.sigmoid(probs).max()) <= 1 / (1 + math.exp(-1))


def test_under_autocast_the_casts_between_are_passed() -> None:
    model, (x, _) = _classifier(nn.Softmax(dim=1)), _data()
    step = Step(model, x, loss_fn=nn.CrossEntropyLoss(), target=_labels(),
                autocast=torch.bfloat16)
    p = gradient_flow(step).loss_on_probabilities
    assert p is not None and (p.squash, p.loss, p.in_model) == ("softmax", "cross_entropy", True)


SILENT_CLASSIFIERS: dict[str, tuple[nn.Module | None, Callable[..., torch.Tensor]]] = {
    "logits into cross_entropy": (None, nn.CrossEntropyLoss()),
    "log_softmax into nll_loss": (nn.LogSoftmax(dim=1), nn.NLLLoss()),
    "log of softmax into nll_loss": (
        nn.Softmax(dim=1), lambda o, t: functional.nll_loss(torch.log(o), t)),
    "probabilities against one-hot": (
        nn.Softmax(dim=1), lambda o, t: functional.mse_loss(o, functional.one_hot(t, C).float())),
    "distillation": (None, lambda o, t: functional.kl_div(
        functional.log_softmax(o, dim=1), torch.softmax(torch.randn(N, C), dim=1),
        reduction="batchmean")),
}


@pytest.mark.parametrize("name", list(SILENT_CLASSIFIERS))
def test_losses_that_take_probabilities_as_such_are_silent(name: str) -> None:
    last, loss_fn = SILENT_CLASSIFIERS[name]
    model, (x, _) = _classifier(last), _data()
    flow = gradient_flow(model, x, loss_fn=loss_fn, target=_labels())
    assert flow.loss_on_probabilities is None and flow.loss_broadcast is None
    assert not [f for f in flow.findings() if f.code.startswith("grads.loss_")]


def test_a_sigmoid_into_binary_cross_entropy_is_silent() -> None:
    model, (x, y) = _classifier(nn.Sigmoid(), classes=1), _data()
    flow = gradient_flow(model, x, loss_fn=nn.BCELoss(), target=(y > 0).float()[:, None])
    assert flow.loss_on_probabilities is None


def test_torchscopes_own_cross_entropy_on_a_softmax_output_is_a_warning() -> None:
    # `auto` takes (N, C) as logits: the step itself takes cross-entropy of probabilities,
    # which is the training's mistake only where the training does the same.
    model, (x, _) = _classifier(nn.Softmax(dim=1)), _data()
    flow = gradient_flow(model, x)
    assert flow.step is not None and flow.step.loss == "auto → cross-entropy vs seeded targets"
    p = flow.loss_on_probabilities
    assert p is not None and p.assumed and p.in_model
    (found,) = [f for f in flow.findings() if f.code == "grads.loss_on_probabilities"]
    assert found.severity.label == "warning"
    assert found.summary.startswith("if the training takes cross_entropy as this step does")


def test_a_monitored_loop_that_hands_its_loss_is_told_of_a_final_softmax() -> None:
    model, (x, _) = _classifier(nn.Softmax(dim=1)), _data()
    labels = _labels()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with torchscope.monitor(model, opt, every=1, out=None) as mon:
        for _ in range(3):
            opt.zero_grad()
            loss = functional.cross_entropy(model(x), labels)
            mon.check_loss(loss)
            loss.backward()
            opt.step()
    run = mon.result
    assert run is not None and run.loss_on_probabilities is not None
    assert run.loss_on_probabilities.in_model and not run.loss_on_probabilities.assumed
    assert [f.code for f in run.findings()].count("grads.loss_on_probabilities") == 1


class _OwnLoss(nn.Module):
    """Returns its own loss, as a transformers model given labels does."""

    def __init__(self, squeeze: bool) -> None:
        super().__init__()
        self.net = _regressor()
        self.squeeze = squeeze

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.net(x)  # (N, 1)
        pred = out.squeeze(-1) if self.squeeze else out
        return {"logits": out, "loss": (pred - labels).square().mean()}


@pytest.mark.parametrize("squeeze", [False, True])
def test_a_models_own_loss_is_read_at_its_first_forward(squeeze: bool) -> None:
    # No loss handed over: the one the model returns is read when the model returns it.
    model, (x, y) = _OwnLoss(squeeze), _data()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with watch_gradients(model, every=1, optimizer=opt) as watch:
        with torch.no_grad():
            model(x, labels=y)  # an evaluation first: no graph, not read
        assert watch._collector.on_output is not None
        for _ in range(2):
            opt.zero_grad()
            model(x, labels=y)["loss"].backward()
            assert watch._collector.on_output is None  # once
            opt.step()
    b = watch.loss_broadcast
    if squeeze:
        assert b is None
    else:
        assert b is not None and (b.output, b.shape, b.op) == ("['logits']", (N, N),
                                                               "SubBackward0")
    assert ("grads.loss_broadcast" in [f.code for f in watch.findings()]) != squeeze


def test_a_monitor_that_is_not_open_refuses_the_loss() -> None:
    model, (x, y) = _regressor(), _data()
    mon = torchscope.monitor(model, out=None)
    with pytest.raises(torchscope.TorchscopeError, match="this monitor is not open"):
        mon.check_loss(((model(x) - y) ** 2).mean())


@pytest.mark.parametrize("where", ["slice first", "softmax first"])
def test_a_language_model_s_shift_does_not_hide_a_softmax(where: str) -> None:
    """`logits[:, :-1]` (predict the next token) picks some of the elements: the walk that
    keeps every element stopped there, and a softmax before cross_entropy went untold."""
    torch.manual_seed(0)
    head = nn.Linear(8, 11)
    logits = head(torch.randn(2, 6, 8))  # (B, T, vocab)
    labels = torch.randint(0, 11, (2, 6))
    probs = logits[:, :-1].softmax(-1) if where == "slice first" else \
        logits.softmax(-1)[:, :-1]  # (B, T - 1, vocab)
    told = loss_faults(functional.cross_entropy(probs.reshape(-1, 11),
                                                labels[:, 1:].reshape(-1)),
                       logits).probabilities
    assert told is not None and (told.squash, told.loss, told.classes) == \
        ("softmax", "cross_entropy", 11)
    # The healthy shift, on logits or on log-probabilities, stays silent.
    for loss in (functional.cross_entropy(logits[:, :-1].reshape(-1, 11),
                                          labels[:, 1:].reshape(-1)),
                 functional.nll_loss(logits[:, :-1].log_softmax(-1).reshape(-1, 11),
                                     labels[:, 1:].reshape(-1))):
        assert loss_faults(loss, logits).probabilities is None
