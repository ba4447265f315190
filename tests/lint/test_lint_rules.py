"""Rules TS001-TS007 on positive and negative fixture files, and on targeted snippets."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any

import pytest

from torchscope.lint import RULES, lint_file, lint_source

from ._fixtures import FIXTURES, expected, expected_with_severity, fixture_files


def _codes(src: str, **kw: object) -> list[tuple[int, str]]:
    return [(v.line, v.code) for v in lint_source(textwrap.dedent(src), **kw)]  # type: ignore[arg-type]


@pytest.mark.parametrize("path", fixture_files(), ids=lambda p: p.name)
def test_fixture_findings_match_expect_comments(path: Path) -> None:
    violations, error = lint_file(path)
    assert error is None
    assert {(v.line, v.code) for v in violations} == expected(path)
    assert {(v.line, v.code, v.severity) for v in violations} == expected_with_severity(path)


def test_every_rule_has_positive_and_negative_fixtures() -> None:
    names = {p.name for p in fixture_files()}
    for code in RULES:
        low = code.lower()
        positives = [n for n in names if n.startswith(low) and "negative" not in n]
        assert positives, f"{code} has no positive fixture"
        assert f"{low}_negative.py" in names, f"{code} has no negative fixture"
        flagged = set().union(*(expected(FIXTURES / n) for n in positives))
        assert any(c == code for _, c in flagged), f"{code}'s positive fixtures expect nothing"
        assert not expected(FIXTURES / f"{low}_negative.py")


def test_lesson_breaks_examples_are_flagged_with_message_and_fix() -> None:
    hook, _ = lint_file(FIXTURES / "ts001_breaks_hook_in_training_loop.py")
    assert [v.code for v in hook] == ["TS001"]
    assert "every iteration of the loop at line 16" in hook[0].message
    assert "handle.remove()" in hook[0].fix
    oom, _ = lint_file(FIXTURES / "ts005_breaks_empty_cache_oom_fix.py")
    assert [v.code for v in oom] == ["TS005"]
    assert "except torch.cuda.OutOfMemoryError" in oom[0].message
    assert "nothing is freed" in oom[0].message


def test_location_points_at_the_called_name_with_character_columns() -> None:
    src = 'x = "é"; model.register_forward_hook(f)\n'
    (v,) = lint_source(src, select=["TS002"])
    assert (v.line, v.col) == (1, src.index("register_forward_hook") + 1)
    assert v.end_col == len(src.rstrip("\n")) + 1


def test_ts001_discarded_handle_in_loop_reports_both_rules() -> None:
    src = """
    for step in range(10):
        model.fc.register_forward_hook(save)
    """
    assert _codes(src) == [(3, "TS001"), (3, "TS002")]


def test_ts001_handle_removed_from_dict_of_handles() -> None:
    src = """
    for x in loader:
        hooks = {}
        hooks["fc"] = model.fc.register_forward_hook(save)
        model(x)
        for h in hooks.values():
            h.remove()
    """
    assert _codes(src) == []


def test_ts001_while_loop_over_a_worklist_is_per_module() -> None:
    src = """
    todo = list(model.children())
    handles = []
    while todo:
        m = todo.pop()
        handles.append(m.register_forward_hook(save))
    """
    assert _codes(src) == []


def test_ts002_ignores_intermediate_tensor_hooks_but_not_parameter_hooks() -> None:
    src = """
    def f(model, x):
        y = model(x)
        y.register_hook(print)
        model.fc.weight.register_hook(print)
    """
    assert _codes(src) == [(5, "TS002")]


def test_ts003_fix_names_the_full_backward_hook() -> None:
    (v,) = lint_source("h = m.register_backward_hook(f)\n")
    assert v.code == "TS003"
    assert "register_full_backward_hook" in v.fix
    (g,) = lint_source(
        "import torch\nh = torch.nn.modules.module.register_module_backward_hook(f)\n")
    assert "register_module_full_backward_hook" in g.fix


def test_ts004_transitive_call_from_loop() -> None:
    src = """
    import torch
    def build(m):
        return torch.compile(m)
    def step(m, x):
        return build(m)(x)
    for x in data:
        step(model, x)
    """
    (v,) = lint_source(textwrap.dedent(src))
    assert (v.line, v.code) == (4, "TS004")
    assert "`build`" in v.message and "line 7" in v.message


def test_ts004_ignores_non_torch_compile_methods() -> None:
    src = """
    import re
    from re import compile
    from .compat import triton
    for line in lines:
        triton.compile(src, target=t)
        re.compile(line)
        compile(line, "<x>", "exec")
        pattern.compile("a+")
        keras_model.compile(optimizer="adam", loss="mse")
    """
    assert _codes(src) == []


def test_ts004_aliased_torch_import() -> None:
    src = """
    import torch as T
    for x in data:
        T.compile(model)(x)
    """
    assert _codes(src) == [(4, "TS004")]


def test_ts005_release_must_precede_in_the_same_block() -> None:
    ok = """
    import gc, torch
    def f(out):
        gc.collect()
        torch.cuda.empty_cache()
    def g(out):
        if out is not None:
            del out
        torch.cuda.empty_cache()
    """
    bad = """
    import torch
    def f(out):
        del out
    def g(out):
        torch.cuda.empty_cache()
        del out
    """
    assert _codes(ok) == []
    assert _codes(bad) == [(6, "TS005")]


def test_ts005_handler_is_flagged_even_with_del() -> None:
    src = """
    import torch
    try:
        run()
    except torch.cuda.OutOfMemoryError:
        del batch
        torch.cuda.empty_cache()
    """
    assert _codes(src) == [(7, "TS005")]


def test_ts006_session_hooks_and_closure_defaults() -> None:
    src = """
    def attach(session, model, stack):
        for name, m in model.named_modules():
            def hook(mod, args, out, _n=name):
                print(_n, out.sum())
            def meta(mod, args, out, _n=name):
                print(_n, out.shape)
            session.forward_hook(m, hook)
            session.forward_hook(m, meta)
    """
    assert _codes(src) == [(5, "TS006")]


def test_ts006_module_argument_is_not_a_tensor() -> None:
    src = """
    def hook(module, inputs, output):
        print(module)
    h = model.register_forward_hook(hook)
    """
    assert _codes(src) == []


def test_ts007_kwargs_may_carry_use_reentrant() -> None:
    src = """
    from torch.utils.checkpoint import checkpoint
    y = checkpoint(f, x, **opts)
    z = checkpoint(f, x)
    """
    assert _codes(src) == [(4, "TS007")]


def test_noqa_specific_and_bare() -> None:
    src = """
    for x in data:
        model.fc.register_forward_hook(save)  # noqa: TS002
        model.fc.register_forward_hook(save)  # noqa: TS001, TS002
        model.fc.register_forward_hook(save)  # noqa
        model.fc.register_forward_hook(save)  # noqa: E501
        s = "# noqa"; model.fc.register_forward_hook(save)
    """
    assert _codes(src) == [(3, "TS001"), (6, "TS001"), (6, "TS002"), (7, "TS001"),
                           (7, "TS002")]


def test_noqa_on_last_line_of_a_multiline_call() -> None:
    src = """
    model.register_forward_hook(
        save,
    )  # noqa: TS002
    """
    assert _codes(src) == []


def test_select_and_ignore_prefixes() -> None:
    src = "m.register_backward_hook(f)\n"
    assert {c for _, c in _codes(src)} == {"TS002", "TS003"}
    assert _codes(src, select=["TS003"]) == [(1, "TS003")]
    assert _codes(src, ignore=["TS00"]) == []
    assert _codes(src, select=["TS"], ignore=["TS002"]) == [(1, "TS003")]


def test_violation_converts_to_a_finding() -> None:
    from torchscope.findings import Severity

    (v,) = lint_source("h = m.register_backward_hook(f)\n", "train.py")
    finding = v.to_finding()
    assert finding.code == "lint.TS003"
    assert finding.severity is Severity.ERROR
    assert finding.evidence == {"path": "train.py", "line": 1, "col": 7,
                                "rule": "deprecated-backward-hook"}
    assert finding.fix == v.fix and finding.summary == v.message


NO_TORCH_IMPORT = """
from mylib import build

model, opt, loader, loss_fn = build()
for x, y in loader:
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
"""
ACCELERATE_ONLY = """
from accelerate import Accelerator

def train(model, loader, opt):
    accelerator = Accelerator()
    total = 0
    for batch in loader:
        loss = model(**batch).loss
        total += loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
    return total
"""
LIGHTNING_ONLY = """
import lightning as L

class M(L.LightningModule):
    def fit_loop(self, loader, opt):
        total = 0
        for batch in loader:
            loss = self.compute_loss(batch)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            total += loss
        return total
"""


@pytest.mark.parametrize(("src", "found"), [
    (NO_TORCH_IMPORT, [(8, "TS012")]),
    (ACCELERATE_ONLY, [(9, "TS011")]),
    (LIGHTNING_ONLY, [(12, "TS011")]),
], ids=["model-from-a-project-module", "accelerate", "lightning"])
def test_training_code_that_does_not_import_torch_is_checked(
        src: str, found: list[tuple[int, str]]) -> None:
    # The model and optimizer come from elsewhere; the loop is still torch's.
    assert _codes(src, select=["TS01"]) == found


def test_python_that_is_not_torch_code_stays_silent() -> None:
    # The same method names in a simulation: no torch, no framework, no backward.
    src = """
    import sympy

    def simulate(expr, world, steps):
        total, values = 0, []
        for t in range(steps):
            expr.eval()
            value = expr(t)
            total += value
            values.append(value)
            world.step()
        return total, values

    simulate(sympy.sympify("x**2"), World(), 10)
    """
    assert _codes(src, select=["TS01"]) == []
    # Only the torch gate keeps it silent: as torch code, TS010 reads it.
    assert _codes("import torch\n" + textwrap.dedent(src), select=["TS01"]) == [(9, "TS010")]


def test_ts011_what_it_flags_keeps_every_iterations_graph_and_its_fix_does_not() -> None:
    """The trap, run: `total += loss` after backward holds a chain of one autograd node per
    iteration, through which every iteration's graph stays reachable; `loss.item()`, the
    fix, holds a number."""
    import torch
    from torch import nn

    src = """
    import torch
    def run(model, batches, opt):
        total, fixed = 0, 0.0
        for x in batches:
            loss = torch.nn.functional.mse_loss(model(x), x[:, :2])
            loss.backward()
            total += loss
            fixed += loss.item()
        return total, fixed
    """
    assert [c for _, c in _codes(src, select=["TS011"])] == ["TS011"]
    namespace: dict[str, object] = {}
    exec(textwrap.dedent(src), namespace)  # the flagged code itself
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    batches = [torch.randn(3, 4) for _ in range(5)]
    total, fixed = namespace["run"](  # type: ignore[operator]
        model, batches, torch.optim.SGD(model.parameters(), lr=0.1))
    kept, stack = [], [total.grad_fn]  # the graph reachable from the sum (nodes held)
    while stack:
        node = stack.pop()
        if node is not None and all(node is not k for k in kept):
            kept.append(node)
            stack += [n for n, _ in node.next_functions]
    names = [type(n).__name__ for n in kept]
    assert names.count("MseLossBackward0") == 5  # every iteration's loss, still reachable
    assert names.count("AddmmBackward0") == 10  # and its model's graph
    assert isinstance(fixed, float)  # the fix holds a number, no graph


def test_ts012_what_it_flags_steps_on_summed_gradients_and_its_fix_does_not() -> None:
    """The trap, run: without zero_grad the gradient the last step used is the sum of every
    batch's (SGD at lr 0 keeps the weights, so each batch's gradient can be recomputed); with
    the fix it is the last batch's alone."""
    import torch
    from torch import nn

    src = """
    import torch
    def run(model, batches, opt, fix):
        for x in batches:
            if fix:
                opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), x[:, :2]).backward()
            opt.step()
    """
    assert [c for _, c in _codes(src, select=["TS012"])] == []  # the fix is in the loop
    flagged = src.replace("            if fix:\n                opt.zero_grad()\n", "")
    assert [c for _, c in _codes(flagged, select=["TS012"])] == ["TS012"]
    namespace: dict[str, object] = {}
    exec(textwrap.dedent(src), namespace)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    batches = [torch.randn(3, 4) for _ in range(5)]
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def grad_of(x: torch.Tensor) -> torch.Tensor:
        (g,) = torch.autograd.grad(nn.functional.mse_loss(model(x), x[:, :2]), [model.weight])
        return g

    run = namespace["run"]
    run(model, batches, opt, fix=False)  # type: ignore[operator]
    assert model.weight.grad is not None
    summed = torch.stack([grad_of(x) for x in batches]).sum(0)
    torch.testing.assert_close(model.weight.grad, summed)  # every batch's, summed
    run(model, batches, opt, fix=True)  # type: ignore[operator]
    assert torch.equal(model.weight.grad, grad_of(batches[-1]))  # the last batch's only


def test_ts013_what_it_flags_freezes_batchnorm_and_its_fix_does_not() -> None:
    """The trap, run: after the first epoch's evaluation the flagged loop trains in eval
    mode, so BatchNorm's running statistics stop updating; with `model.train()` at the top of
    each epoch they keep moving."""
    import torch
    from torch import nn

    src = """
    import torch
    def fit(model, batches, opt, epochs, fix):
        means = []
        for _ in range(epochs):
            if fix:
                model.train()
            for x in batches:
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()
            means.append(model[1].running_mean.clone())
            model.eval()
            with torch.no_grad():
                model(batches[0])
        return means
    """
    assert [c for _, c in _codes(src, select=["TS013"])] == []  # the fix is in the loop
    flagged = src.replace("            if fix:\n                model.train()\n", "")
    assert [c for _, c in _codes(flagged, select=["TS013"])] == ["TS013"]
    namespace: dict[str, object] = {}
    exec(textwrap.dedent(src), namespace)
    batches = [torch.randn(8, 4) + 3 for _ in range(4)]
    for fix in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        means = namespace["fit"](model, batches, opt, 3, fix)  # type: ignore[operator]
        assert torch.equal(means[1], means[2]) != fix  # frozen after the first evaluation


def test_ts014_what_it_flags_cannot_fit_and_its_fix_can() -> None:
    """The trap, run: cross-entropy on softmax outputs cannot go below log(1 + (C-1)/e)
    however confident the model, and its gradient is smaller than on the logits."""
    import math

    import torch

    src = """
    import torch.nn.functional as F
    def loss(logits, y, fix):
        return F.cross_entropy(logits if fix else F.softmax(logits, dim=1), y)
    """
    flagged = src.replace("logits if fix else F.softmax(logits, dim=1)",
                          "F.softmax(logits, dim=1)")
    assert [c for _, c in _codes(flagged, select=["TS014"])] == ["TS014"]
    namespace: dict[str, object] = {}
    exec(textwrap.dedent(src), namespace)
    loss = namespace["loss"]
    y = torch.tensor([0, 1])
    sure = torch.tensor([[20.0, -20.0, -20.0], [-20.0, 20.0, -20.0]], requires_grad=True)
    trapped = loss(sure, y, False)  # type: ignore[operator]
    assert float(trapped) == pytest.approx(math.log(1 + 2 / math.e), rel=1e-4)
    assert float(loss(sure, y, True)) < 1e-6  # type: ignore[operator]
    soft = torch.randn(2, 3, requires_grad=True)
    (g_trap,) = torch.autograd.grad(loss(soft, y, False), soft)  # type: ignore[operator]
    (g_fix,) = torch.autograd.grad(loss(soft, y, True), soft)  # type: ignore[operator]
    assert float(g_trap.norm()) < float(g_fix.norm())


def test_ts015_what_it_flags_clips_by_the_loss_scale_and_its_fix_does_not() -> None:
    """The trap, run: clipping the scaled gradients leaves them max_norm long after the
    scaler divides by its scale, so the update is scale times too small."""
    import torch
    from torch import nn

    src = """
    import torch
    def step(model, x, opt, scaler, fix):
        opt.zero_grad()
        scaler.scale(model(x).square().sum()).backward()
        if fix:
            scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e3)
        scaler.step(opt)
        scaler.update()
        return norm
    """
    flagged = src.replace("        if fix:\n            scaler.unscale_(opt)\n", "")
    assert [c for _, c in _codes(flagged, select=["TS015"])] == ["TS015"]
    assert [c for _, c in _codes(src, select=["TS015"])] == []
    namespace: dict[str, object] = {}
    exec(textwrap.dedent(src), namespace)
    moved = []
    for fix in (False, True):
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
        before = model.weight.detach().clone()
        namespace["step"](model, torch.ones(8, 4), opt, scaler, fix)  # type: ignore[operator]
        moved.append(float((model.weight - before).norm()))
    assert moved[1] > 1000 * moved[0]  # the clip acted on the scaled norm only


def _run_watched(text: str, *, lr: float, batches: int) -> tuple[float, Any]:
    """Run the source's `run(model, batches, opt)` on a seeded nn.Linear(4, 2) with SGD at
    `lr` under `watch_gradients`: how far its parameters moved (L2), and the watch."""
    import torch
    from torch import nn

    from torchscope.grads import watch_gradients

    namespace: dict[str, object] = {}
    exec(textwrap.dedent(text), namespace)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    before = [p.detach().clone() for p in model.parameters()]
    with watch_gradients(model, optimizer=opt) as watch:
        namespace["run"](model, [torch.randn(3, 4) for _ in range(batches)], opt)  # type: ignore[operator]
    moved = math.sqrt(sum(float((p - b).norm()) ** 2
                          for p, b in zip(model.parameters(), before, strict=True)))
    return moved, watch


def test_ts016_what_it_flags_never_moves_the_weights_and_the_watch_agrees() -> None:
    """The trap, run: `zero_grad()` between `backward()` and `step()` leaves the step no
    gradient, so the weights never move; the same loop under a gradient watch is
    `grads.cleared_before_step`. Zeroing first trains."""

    src = """
    import torch
    def run(model, batches, opt):
        for x in batches:
            loss = torch.nn.functional.mse_loss(model(x), x[:, :2])
            loss.backward()
            opt.zero_grad()
            opt.step()
    """
    fixed = src.replace("            loss.backward()\n            opt.zero_grad()\n",
                        "            opt.zero_grad()\n            loss.backward()\n")
    assert [c for _, c in _codes(src, select=["TS016"])] == ["TS016"]
    assert [c for _, c in _codes(fixed, select=["TS016"])] == []
    moved, codes = [], []
    for text in (src, fixed):
        distance, watch = _run_watched(text, lr=0.1, batches=4)
        moved.append(distance)
        codes.append({f.code for f in watch.findings()})
    assert moved[0] == 0.0 and moved[1] > 0
    assert "grads.cleared_before_step" in codes[0]
    assert "grads.cleared_before_step" not in codes[1]


def test_ts017_what_it_flags_updates_with_the_unclipped_gradients() -> None:
    """The trap, run: clipping after `step()` leaves the update unbounded (SGD moves the
    weights by lr times the whole gradient), and a gradient watch reads no clipping before
    any update; clipping before the step bounds it."""

    src = """
    import torch
    def run(model, batches, opt):
        for x in batches:
            opt.zero_grad()
            (1000 * torch.nn.functional.mse_loss(model(x), x[:, :2])).backward()
            opt.step()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    """
    fixed = src.replace("            opt.step()\n            torch.nn.utils.clip_grad_norm_("
                        "model.parameters(), 1.0)\n",
                        "            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)"
                        "\n            opt.step()\n")
    assert [c for _, c in _codes(src, select=["TS017"])] == ["TS017"]
    assert [c for _, c in _codes(fixed, select=["TS017"])] == []
    moved, applied = [], []
    for text in (src, fixed):
        distance, watch = _run_watched(text, lr=1e-3, batches=1)
        moved.append(distance)
        applied.append(watch.history.applied_norms)
    assert moved[0] > 10 * moved[1]  # lr times the whole gradient, against lr times 1.0
    assert moved[1] == pytest.approx(1e-3, rel=1e-4)
    assert applied[0] == () and applied[1] == pytest.approx((1.0,), rel=1e-5)
