"""The memory area runs the shared `Step`: the same loss, the same first step, the model left
exactly as found, per-module rows by select/depth."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import torchscope.memory as mem
from torchscope.errors import SelectionError, TorchscopeError
from torchscope.memory import (
    OUTSIDE,
    MemoryReport,
    analyze_memory,
    measure_step,
    plan_checkpointing,
    saved_activations,
)
from torchscope.models import DeepMLP
from torchscope.step import Step


def test_report_loss_is_a_plain_steps_loss_on_gpt2_with_dropout(tiny_gpt2: nn.Module) -> None:
    model = tiny_gpt2.train()  # dropout on: the loss depends on the RNG stream
    ids = torch.randint(0, 100, (2, 16))
    torch.manual_seed(0)
    report = analyze_memory(model, ids)
    torch.manual_seed(0)
    want = Step(model, ids).forward_backward()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    other = Step(model, ids).forward_backward()
    model.zero_grad(set_to_none=True)
    assert float(other) != float(want)  # so equality below is not luck
    assert report.step.loss == "auto → cross-entropy vs seeded targets"
    assert report.step.loss_value == float(want)
    assert report.saved.step == report.step
    # The measurement is the same first step, on the same RNG stream.
    assert report.measured is not None and report.measured.step is not None
    assert report.measured.step.loss_value == float(want)
    assert "loss: auto → cross-entropy vs seeded targets = " in report.step.describe()


def test_accumulation_counts_micro_batch_zero_and_reports_the_mean_loss() -> None:
    model, x = DeepMLP(), torch.randn(32, 64)
    step = Step(model, x, loss_fn="sum", accumulate=2)
    saved = saved_activations(step)
    # Micro-batch 0 is a (16, 64) view of x: x's whole storage stays allocated (8 KiB),
    # and eight ReLU outputs of 16 × 64 float32.
    assert saved.input_bytes == 8_192
    assert saved.total_bytes == 8_192 + 8 * 4_096
    assert saved.step is not None and saved.step.accumulate == 2
    want = Step(model, x, loss_fn="sum", accumulate=2).forward_backward()
    model.zero_grad(set_to_none=True)
    assert saved.step.loss_value == float(want)


def test_what_the_loss_saves_is_counted_outside_the_modules() -> None:
    model, x = DeepMLP(), torch.randn(32, 64)
    plain = saved_activations(model, x, loss_fn="sum")
    ce = saved_activations(model, x)  # auto: cross-entropy vs seeded targets
    assert ce.step is not None and ce.step.loss == "auto → cross-entropy vs seeded targets"
    assert OUTSIDE not in {r.module for r in plain.modules}
    outside = next(r for r in ce.modules if r.module == OUTSIDE)
    assert ce.total_bytes == plain.total_bytes + outside.bytes
    # log_softmax keeps its (32, 64) float32 result; nll_loss keeps the (32,) int64 target.
    sizes = sorted(s.nbytes for s in ce.activation_storages if s.module == OUTSIDE)
    assert 8_192 in sizes and 256 in sizes
    assert [r for r in ce.modules if r.module != OUTSIDE] == list(plain.modules)


class _Counter(nn.Module):
    """Counts its calls in a non-persistent buffer, which state_dict() never sees."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x


def _stateful() -> nn.Sequential:
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU(),
                                         nn.Dropout(0.2), _Counter()) for _ in range(3)])


def test_model_optimizer_inputs_and_rng_are_left_exactly_as_found() -> None:
    model = _stateful().train()
    model[1].eval()  # a mixed mode must come back mixed
    x = torch.randn(8, 16, requires_grad=True)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    torch.nn.functional.mse_loss(model(x), torch.zeros(8, 16)).backward()
    opt.step()  # Adam has state now; every .grad and x.grad are set
    tensors = {n: (t, t.detach().clone()) for n, t in
               [*model.named_parameters(), *model.named_buffers()]}
    grads = {n: (p.grad, p.grad.clone()) for n, p in model.named_parameters()
             if p.grad is not None}
    x_grad = x.grad
    assert x_grad is not None
    x_grad_values = x_grad.clone()
    flags = [m.training for m in model.modules()]
    opt_state = {k: {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in s.items()}
                 for k, s in opt.state_dict()["state"].items()}
    rng = torch.get_rng_state()
    calls_before = int(model[0][4].calls)

    report = analyze_memory(model, x, optimizer=opt, checkpoint="sqrt", repeats=1)

    assert report.verification is not None and report.verification.ok
    assert int(model[0][4].calls) == calls_before  # it did run: restored, not untouched
    named = dict([*model.named_parameters(), *model.named_buffers()])
    for n, (t, values) in tensors.items():
        assert named[n] is t, n
        assert torch.equal(t, values), n
    assert model[0][1].num_batches_tracked.item() == 1  # BatchNorm ran one step, not more
    for n, p in model.named_parameters():
        g, values = grads[n]
        assert p.grad is g and torch.equal(g, values), n
    assert x.grad is x_grad and torch.equal(x_grad, x_grad_values)
    assert [m.training for m in model.modules()] == flags
    for k, s in opt.state_dict()["state"].items():
        for n, v in s.items():
            want = opt_state[k][n]
            assert torch.equal(v, want) if isinstance(v, torch.Tensor) else v == want
    assert torch.equal(torch.get_rng_state(), rng)
    assert not any("forward" in vars(m) for m in model.modules())  # checkpointing removed


def test_a_step_is_taken_whole_or_not_with_options() -> None:
    model, x = DeepMLP(), torch.randn(4, 64)
    step = Step(model, x, loss_fn="sum")
    assert measure_step(step).step == saved_activations(step).step
    assert plan_checkpointing(step, measure=False, repeats=1).step is not None
    with mem.apply(step, segments=[(0, 8)]) as handle:
        assert handle.verification is not None and handle.verification.bitwise_equal
    for call in (lambda: saved_activations(step, x), lambda: measure_step(step, loss_fn="mse"),
                 lambda: analyze_memory(step, target=x), lambda: mem.apply(step, loss_fn="mse")):
        with pytest.raises(TorchscopeError, match="a Step was given together with"):
            call()
    assert not any("forward" in vars(m) for m in model.modules())


def test_findings_come_from_the_registered_analyzer() -> None:
    assert "findings" not in {f.name for f in dataclasses.fields(MemoryReport)}
    report = analyze_memory(DeepMLP(), torch.randn(32, 64), loss_fn="sum", checkpoint="sqrt",
                            measure=False, repeats=1)
    found = report.findings()
    assert report.plans is not None
    chosen = [f for f in report.plans.findings() if f.evidence["plan"] == "sqrt"]
    assert found == report.saved.findings() + report.totals.findings() + chosen
    assert {"memory.saved_by_type", "memory.checkpoint_plan"} <= {f.code for f in found}
    assert report.findings() == found  # pure, repeatable
    assert [f.evidence["plan"] for f in report.plans.findings()] == ["all", "sqrt"]


# --------------------------------------------------------------------------- select / depth
def _rows(saved: mem.SavedActivations) -> dict[str, int]:
    return {r.module: r.bytes for r in saved.modules}


def _ancestor(name: str, chosen: set[str]) -> str:
    while name not in chosen:
        name = name.rpartition(".")[0]
    return name


def test_depth_counts_deeper_storages_for_their_ancestor(tiny_gpt2: nn.Module) -> None:
    ids = torch.randint(0, 100, (2, 16))
    inner = saved_activations(tiny_gpt2, ids, loss_fn="sum")
    names = {n for n, _ in tiny_gpt2.named_modules()}
    for depth in (0, 1, 2, 3):
        rows = _rows(saved_activations(tiny_gpt2, ids, loss_fn="sum", depth=depth))
        chosen = {n for n in names if n == "" or n.count(".") + 1 <= depth}
        want: dict[str, int] = {}
        for name, nbytes in _rows(inner).items():
            key = _ancestor(name, chosen)
            want[key] = want.get(key, 0) + nbytes
        assert rows == want, depth
        assert sum(rows.values()) == inner.total_bytes
    assert set(_rows(saved_activations(tiny_gpt2, ids, loss_fn="sum", depth=0))) == {""}
    assert "transformer.h.0" in _rows(saved_activations(tiny_gpt2, ids, loss_fn="sum", depth=3))


def test_select_counts_storages_for_the_nearest_selected_ancestor(tiny_gpt2: nn.Module) -> None:
    ids = torch.randint(0, 100, (2, 16))
    inner = _rows(saved_activations(tiny_gpt2, ids, loss_fn="sum"))
    report = analyze_memory(tiny_gpt2, ids, loss_fn="sum", select="GPT2Block", measure=False)
    rows = _rows(report.saved)
    blocks = {"transformer.h.0", "transformer.h.1"}
    assert set(rows) == blocks | {""}  # the embeddings and the head go to the root
    for block in blocks:
        assert rows[block] == sum(b for n, b in inner.items() if n.startswith(block + "."))
    assert rows[""] == sum(b for n, b in inner.items() if _ancestor(n, blocks | {""}) == "")
    types = {r.module: r.module_type for r in report.saved.modules}
    assert types["transformer.h.0"] == "GPT2Block" and types[""] == "GPT2LMHeadModel"
    with pytest.raises(SelectionError, match="matched no module"):
        saved_activations(tiny_gpt2, ids, select="NoSuchBlock")
    with pytest.raises(SelectionError, match="depth=-1"):
        analyze_memory(tiny_gpt2, ids, depth=-1)


def test_one_module_holding_a_whole_type_is_one_finding_that_names_it() -> None:
    from torchscope.models import TinyCNN

    # TinyCNN reuses one ReLU module after every layer: its type's bytes are that module's.
    saved = saved_activations(TinyCNN(), torch.randn(8, 3, 32, 32))
    found = saved.findings()
    assert [f.code for f in found] == ["memory.saved_by_type"]
    assert found[0].module == "relu" and "all of them relu's" in found[0].summary
    # Two ReLU modules share the type's bytes: the type and its largest holder both stand.
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 10))
    found = saved_activations(model, torch.randn(32, 64)).findings()
    by_type = next(f for f in found if f.code == "memory.saved_by_type")
    assert by_type.module is None and by_type.summary.endswith(").")
    assert "memory.largest_saver" in [f.code for f in found]
