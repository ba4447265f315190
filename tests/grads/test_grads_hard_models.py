"""Models where `register_full_backward_hook` fails or misleads: in-place ops, reused modules,
frozen and unreached parameters, and a transformers GPT-2. Gradients must stay bitwise equal."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from torchscope.findings import Severity
from torchscope.grads import gradient_flow
from torchscope.grads.records import (
    FROZEN,
    INPUT_NO_GRAD,
    NO_GRAD,
    NOT_REACHED,
    NOT_RUN,
    OUTPUT_NO_GRAD,
)
from torchscope.hooks import audit_hooks

# Every test here runs twice: norms by eager `vector_norm`, and by the fused kernel.
pytestmark = pytest.mark.usefixtures("reduction_path")


def _close(a: float | None, b: float | None) -> bool:
    assert a is not None and b is not None
    return math.isclose(a, b, rel_tol=1e-6)


def _plain_grads(model: nn.Module, step) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    step()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_grads(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert after.keys() == before.keys()
    for n, g in before.items():
        assert torch.equal(after[n], g), n


class InplaceNet(nn.Module):
    """nn.ReLU(inplace=True) right after a hooked layer, and x.relu_() inside forward."""

    def __init__(self, inplace: bool = True) -> None:
        super().__init__()
        self.inplace = inplace
        self.fc1 = nn.Linear(16, 32)
        self.act = nn.ReLU(inplace=inplace)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc1(x))
        h = self.fc2(h)
        h = h.relu_() if self.inplace else h.relu()
        return self.fc3(h)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_inplace_model_full_backward_hook_raises_but_torchscope_works() -> None:
    model = InplaceNet()
    x = torch.randn(8, 16)

    # The problem this solves: the classic approach raises on this model.
    h = model.fc1.register_full_backward_hook(lambda *a: None)
    try:
        with pytest.raises(RuntimeError, match="inplace"):
            model(x).sum().backward()
    finally:
        h.remove()

    before = _plain_grads(model, lambda: model(x).sum().backward())
    flow = gradient_flow(model, x, loss_fn="sum")
    _assert_same_grads(model, before)
    assert [r.module for r in flow.modules] == ["fc3", "fc2", "act", "fc1"]

    # Reference: the same weights without in-place ops, read with full backward hooks.
    twin = InplaceNet(inplace=False)
    twin.load_state_dict(model.state_dict())
    ref: dict[str, tuple[float, float | None]] = {}
    handles = [
        getattr(twin, n).register_full_backward_hook(
            lambda _m, gi, go, _n=n: ref.__setitem__(
                _n, (go[0].norm().item(), None if gi[0] is None else gi[0].norm().item())))
        for n in ("fc1", "act", "fc2", "fc3")
    ]
    try:
        twin(x).sum().backward()
    finally:
        for h in handles:
            h.remove()
    for name, (out_norm, in_norm) in ref.items():
        rec = flow.get(name)
        assert _close(rec.grad_output[0].norm, out_norm), name
        if in_norm is None:
            assert rec.grad_input[0].norm is None
            assert rec.grad_input[0].reason == INPUT_NO_GRAD
        else:
            assert _close(rec.grad_input[0].norm, in_norm), name
    assert audit_hooks(model, include_global=False).local_total == 0


class ReusedNet(nn.Module):
    """One block called twice in the same forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.out = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(self.block(self.inp(x))))


def test_reused_module_one_record_per_call() -> None:
    model = ReusedNet()
    x = torch.randn(4, 8)
    before = _plain_grads(model, lambda: model(x).pow(2).sum().backward())
    flow = gradient_flow(model, x, loss_fn=lambda out: out.pow(2).sum(),
                         select=["block", "block.0", "out"])
    _assert_same_grads(model, before)
    keys = [(r.module, r.call) for r in flow.modules]
    # Backward meets the second call first.
    assert keys == [("out", 0), ("block", 1), ("block.0", 1), ("block", 0), ("block.0", 0)]
    # Each call has its own gradient: the input of call 1 is the output of call 0.
    assert _close(flow.get("block", 1).grad_input[0].norm,
                  flow.get("block", 0).grad_output[0].norm)
    assert flow.get("block", 0).grad_output[0].norm != flow.get("block", 1).grad_output[0].norm

    ref: list[float] = []
    h = model.block.register_full_backward_hook(
        lambda _m, gi, go: ref.append(go[0].norm().item()))
    try:
        model(x).pow(2).sum().backward()
    finally:
        h.remove()
    assert _close(flow.get("block", 1).output_norm, ref[0])
    assert _close(flow.get("block", 0).output_norm, ref[1])
    # The shared parameters hold one accumulated gradient.
    assert _close(flow.param("block.0.weight").norm, before["block.0.weight"].norm().item())


class PartialNet(nn.Module):
    """A frozen stem, an auxiliary head the loss ignores, and a module never called."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8).requires_grad_(False)
        self.body = nn.Linear(8, 8)
        self.aux = nn.Linear(8, 3)
        self.head = nn.Linear(8, 2)
        self.unused = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(self.stem(x))
        self.last_aux = self.aux(h)  # computed, never part of the loss
        return self.head(h)


def test_frozen_and_unreached() -> None:
    model = PartialNet()
    x = torch.randn(4, 8)
    before = _plain_grads(model, lambda: model(x).sum().backward())
    flow = gradient_flow(model, x, loss_fn="sum")
    _assert_same_grads(model, before)
    stem = flow.get("stem")
    assert stem.grad_output[0].norm is None and stem.grad_output[0].reason == OUTPUT_NO_GRAD
    assert stem.order is None
    assert flow.get("body").grad_input[0].reason == INPUT_NO_GRAD
    aux = flow.get("aux")
    assert not aux.reached and aux.grad_output[0].reason == NOT_REACHED
    assert flow.param("stem.weight").reason == FROZEN
    assert flow.param("aux.weight").reason == NOT_REACHED
    assert flow.param("unused.bias").reason == NOT_RUN  # hooked, and it had no call
    assert flow.param("head.weight").norm is not None
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    assert _close(flow.total_norm, total.item())
    from torchscope.grads.analyze import find_unreached

    # One finding per module the loss does not reach; the frozen stem is none of them.
    found = {f.module: f for f in find_unreached(flow)}
    assert set(found) == {"aux", "unused"}
    assert found["aux"].evidence["reason"] == NOT_REACHED
    assert found["unused"].evidence["params"] == 2
    assert found["unused"].summary.startswith("unused did not run in the step's forward")
    assert "router" in found["unused"].fix and "router" not in found["aux"].fix
    # A module left out of the selection is not watched: whether it ran is not known.
    partial = gradient_flow(model, x, loss_fn="sum", select=["body", "head"])
    assert partial.param("unused.bias").reason == NO_GRAD
    codes = {(f.code, f.module) for f in flow.findings()}
    assert ("grads.frozen", "stem") in codes
    assert not any(m == "stem" for c, m in codes if c in ("grads.dead", "grads.unreached"))


def test_checkpointed_block_records_once() -> None:
    from torch.utils.checkpoint import checkpoint

    class Ckpt(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(checkpoint(self.a, x, use_reentrant=False))

    model = Ckpt()
    x = torch.randn(4, 8)
    before = _plain_grads(model, lambda: model(x).sum().backward())
    flow = gradient_flow(model, x, loss_fn="sum")
    _assert_same_grads(model, before)
    assert [(r.module, r.call) for r in flow.modules] == [("b", 0), ("a", 0)]
    assert flow.get("a").reached


def test_tiny_gpt2_gradients_bitwise_identical(tiny_gpt2) -> None:
    model = tiny_gpt2
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    before = _plain_grads(model, model(input_ids=ids, labels=ids).loss.backward)
    flow = gradient_flow(model, {"input_ids": ids, "labels": ids})
    _assert_same_grads(model, before)
    assert flow.modules[0].module == "lm_head"
    wte = flow.get("transformer.wte")
    assert wte.grad_input[0].reason == INPUT_NO_GRAD and wte.reached
    # Tied lm_head/wte weight: named under both modules, the second as tied to the first,
    # and counted once in the total, as clip_grad_norm_ does.
    assert model.lm_head.weight is model.transformer.wte.weight
    assert sum(p.name.endswith("wte.weight") for p in flow.params) == 1
    assert flow.tied() == {"lm_head.weight": "transformer.wte.weight"}
    head, wte_w = flow.param("lm_head.weight"), flow.param("transformer.wte.weight")
    assert head.module == "lm_head" and wte_w.tied_to is None
    assert head.norm == wte_w.norm and head.weight_norm == wte_w.weight_norm
    assert flow.param_norms()["lm_head"] == wte_w.norm  # lm_head shows its gradient
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    assert _close(flow.total_norm, total.item())
    for rec in flow.params:
        if rec.norm is not None:
            name = rec.tied_to or rec.name
            assert _close(rec.norm, before[name].norm().item()), rec.name
            w = dict(model.named_parameters())[name]
            assert rec.weight_norm == pytest.approx(w.detach().norm().item(), rel=1e-6)
    assert audit_hooks(model, include_global=False).local_total == 0


class SeqNet(nn.Module):
    """Self-attention (query is key is value), an LSTM with tuple outputs, and LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(6, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.norm = nn.LayerNorm(16)
        self.lstm = nn.LSTM(16, 8, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        a, _ = self.attn(h, h, h, need_weights=False)
        out, (hn, _) = self.lstm(self.norm(h + a))
        return self.head(out[:, -1]) + hn[0].sum()


def test_attention_and_lstm_bitwise_and_shared_inputs() -> None:
    model = SeqNet()
    x = torch.randn(2, 5, 6)
    before = _plain_grads(model, lambda: model(x).sum().backward())
    flow = gradient_flow(model, x, loss_fn="sum", select=["emb", "attn", "norm", "lstm",
                                                          "head"])
    _assert_same_grads(model, before)
    attn = flow.get("attn")
    # query, key and value are one tensor: one gradient, reported under each position.
    assert [g.path for g in attn.grad_input] == ["[0]", "[1]", "[2]"]
    assert attn.grad_input[0].norm is not None
    assert attn.grad_input[0].norm == attn.grad_input[1].norm == attn.grad_input[2].norm
    lstm = flow.get("lstm")
    assert [g.path for g in lstm.grad_output] == ["[0]", "[1][0]", "[1][1]"]
    assert lstm.grad_output[0].norm is not None and lstm.grad_output[1].norm is not None
    assert lstm.grad_output[2].reason == NOT_REACHED  # the cell state is unused


def test_inplace_module_that_leaves_input_alone() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5, inplace=True), nn.Linear(4, 2))
    model.eval()  # dropout is the identity and returns its input
    x = torch.randn(3, 4)
    before = _plain_grads(model, lambda: model(x).sum().backward())
    flow = gradient_flow(model, x, loss_fn="sum")
    _assert_same_grads(model, before)
    drop = flow.get("1")
    assert drop.grad_input[0].norm == drop.grad_output[0].norm is not None
    assert _close(drop.grad_input[0].norm, flow.get("0").grad_output[0].norm)


class BasicBlock(nn.Module):
    """torchvision's pattern: one inplace ReLU used twice and `out += identity`."""

    def __init__(self, inplace: bool = True) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        self.relu = nn.ReLU(inplace=inplace)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(4)
        self.inplace = inplace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out = out.add_(x) if self.inplace else out + x
        return self.relu(out)


def test_torchvision_style_block() -> None:
    stem = nn.Conv2d(3, 4, 1)
    model = nn.Sequential(stem, BasicBlock(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(4, 2))
    twin = nn.Sequential(nn.Conv2d(3, 4, 1), BasicBlock(inplace=False), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(4, 2))
    twin.load_state_dict(model.state_dict())
    x = torch.randn(2, 3, 6, 6)
    before = _plain_grads(model, lambda: model(x).sum().backward())
    twin_grads = _plain_grads(twin, lambda: twin(x).sum().backward())
    flow = gradient_flow(model, x, loss_fn="sum")
    _assert_same_grads(model, before)
    ref = gradient_flow(twin, x, loss_fn="sum")  # no in-place ops anywhere
    assert [r.key for r in flow.modules] == [r.key for r in ref.modules]
    assert [r.key for r in flow.modules if r.module == "1.relu"] == ["1.relu#1", "1.relu#0"]
    for a, b in zip(flow.modules, ref.modules, strict=True):
        for ga, gb in zip(a.grad_output + a.grad_input, b.grad_output + b.grad_input,
                          strict=True):
            assert (ga.norm is None) == (gb.norm is None), a.key
            if ga.norm is not None:
                assert math.isclose(ga.norm, gb.norm, rel_tol=1e-5), a.key
    for name, g in twin_grads.items():
        assert torch.allclose(before[name], g, rtol=1e-5, atol=1e-7)


class Diamond(nn.Module):
    """`h` feeds the ReLU and a skip path: its gradient is accumulated from both."""

    def __init__(self, skip_first: bool) -> None:
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.relu = nn.ReLU()
        self.b = nn.Linear(64, 64)
        self.skip_first = skip_first  # which branch's gradient reaches `h` first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.skip_first:
            s = h * 0.5
            return self.b(self.relu(h)) + s
        return self.b(self.relu(h)) + h * 0.5


@pytest.mark.parametrize("skip_first", [False, True])
def test_accumulated_gradient_is_not_mistaken_for_its_first_part(skip_first: bool) -> None:
    model = Diamond(skip_first)
    x = torch.randn(8, 64)
    # Plain reference values with retain_grad.
    h = model.a(x)
    h.retain_grad()
    r = model.relu(h)
    r.retain_grad()
    (model.b(r) + h * 0.5).pow(2).sum().backward()
    relu_in = (h > 0) * r.grad
    flow = gradient_flow(model, x, loss_fn=lambda out: out.pow(2).sum())
    assert _close(flow.get("relu").grad_input[0].norm, relu_in.norm().item())
    assert _close(flow.get("a").grad_output[0].norm, h.grad.norm().item())
    assert not math.isclose(h.grad.norm().item(), relu_in.norm().item(), rel_tol=1e-3)


def _norms_by_call(flow) -> list[tuple[str, int, list[float | None], list[float | None]]]:
    return [(r.module, r.call, [t.norm for t in r.grad_output], [t.norm for t in r.grad_input])
            for r in sorted(flow.modules, key=lambda r: (r.module, r.call))]


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointed_blocks_are_measured_as_without_checkpointing(
        checkpointed_blocks: type[nn.Module], reentrant: bool) -> None:
    """A reentrant checkpoint (torch's default when `use_reentrant` is not given) runs its
    first forward under no_grad and backpropagates through its recomputation: every layer
    inside was missing from the flow. Both kinds must measure what the plain model does."""
    torch.manual_seed(0)
    plain = checkpointed_blocks(None)
    model = checkpointed_blocks(reentrant)
    model.load_state_dict(plain.state_dict())
    x = torch.randn(4, 8, requires_grad=True)
    flows = [gradient_flow(m, x, loss_fn="sum") for m in (plain, model)]
    want, got = (_norms_by_call(f) for f in flows)
    assert [r[:2] for r in got] == [r[:2] for r in want]
    assert len(got) == 7  # the leaves: 2 blocks of 3, and the head
    for a, b in zip(want, got, strict=True):
        for u, v in zip(a[2] + a[3], b[2] + b[3], strict=True):
            assert (u is None) == (v is None) and (u is None or _close(u, v)), (a, b)
    assert flows[1].micro_batches == 1 and flows[1].backward_calls == 1
    assert _close(flows[1].total_norm, flows[0].total_norm)
    assert not [f for f in flows[1].findings() if f.code == "grads.unreached"]
    assert audit_hooks(model).local_total == 0


def test_a_reentrant_checkpoint_of_the_whole_model_is_one_micro_batch(
        checkpointed_blocks: type[nn.Module]) -> None:
    """The root itself recomputed inside backward: its forward under no_grad recorded
    nothing, and its recomputation is the micro-batch's one forward with grad."""
    from torch.utils.checkpoint import checkpoint

    from torchscope.grads import watch_gradients

    torch.manual_seed(0)
    model = checkpointed_blocks(None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8, requires_grad=True)  # else reentrant checkpointing drops every grad
    with watch_gradients(model, optimizer=opt) as watch:
        for _ in range(2):
            opt.zero_grad()
            checkpoint(model, x, use_reentrant=True).sum().backward()
            opt.step()
    flow = watch.last
    assert flow is not None
    assert flow.micro_batches == 1 and flow.backward_calls == 1
    assert {r.module for r in flow.modules} == {"head", *(f"blocks.{b}.{i}" for b in (0, 1)
                                                          for i in range(3))}
    assert all(r.call == 0 for r in flow.modules)
    assert flow.get("blocks.0.0").reached


def test_a_reentrant_checkpoint_without_input_grad_is_named_as_the_cause(
        checkpointed_blocks: type[nn.Module]) -> None:
    """The classic trap: a reentrant checkpoint over an input that does not require grad.
    torch gives every parameter inside no gradient (and a UserWarning); the finding must
    name the cause and its fix, not tell the user to make the loss depend on them."""
    from torchscope.grads.records import RAN_IN_REENTRANT_CHECKPOINT

    torch.manual_seed(0)
    model = checkpointed_blocks(True)
    x = torch.randn(4, 8)  # data: no grad
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad=True"):
        flow = gradient_flow(model, x, loss_fn="sum")
    with pytest.warns(UserWarning):
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()
    dropped = sorted(n for n, p in model.named_parameters() if p.grad is None)
    # torch's own verdict: every parameter of both blocks, none of the head's.
    assert dropped == sorted(n for n, _ in model.blocks.named_parameters(prefix="blocks"))
    assert sorted(p.name for p in flow.params if p.norm is None) == dropped
    assert {p.reason for p in flow.params if p.norm is None} == {RAN_IN_REENTRANT_CHECKPOINT}
    unreached = [f for f in flow.findings() if f.code == "grads.unreached"]
    assert [(f.severity, f.module) for f in unreached] == [(Severity.WARNING, "blocks")]
    assert unreached[0].evidence["params"] == 8
    assert "use_reentrant=False" in unreached[0].fix


def test_a_module_run_under_no_grad_in_the_forward_is_info_with_its_cause() -> None:
    """A teacher run under torch.no_grad inside the forward (distillation): its trainable
    parameters get no gradient on purpose; said as info, with that cause."""
    from torchscope.grads.records import RAN_NO_GRAD

    class Distilled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.teacher = nn.Linear(8, 2)
            self.student = nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                target = self.teacher(x)  # (B, 2)
            out: torch.Tensor = (self.student(x) - target).pow(2).mean()
            return out

    flow = gradient_flow(Distilled(), torch.randn(4, 8), loss_fn="sum")
    assert {p.name: p.reason for p in flow.params if p.norm is None} == \
        {"teacher.weight": RAN_NO_GRAD, "teacher.bias": RAN_NO_GRAD}
    unreached = [f for f in flow.findings() if f.code == "grads.unreached"]
    assert [(f.severity, f.module) for f in unreached] == [(Severity.INFO, "teacher")]
    assert "torch.no_grad" in unreached[0].fix
    assert not [f for f in flow.findings() if f.severity >= Severity.WARNING]


def test_a_torchscript_submodule_is_left_out_and_its_parameters_still_measured(
        scripted_part: Callable[[], nn.Module]) -> None:
    """`register_forward_pre_hook is not supported on ScriptModules` was raised from inside
    gradient_flow; the scripted part's parameters are still plain parameters."""
    model = nn.Sequential(scripted_part(), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    before = _plain_grads(model, lambda: model(x).sum().backward())
    flow = gradient_flow(model, x, loss_fn="sum")
    _assert_same_grads(model, before)
    assert [r.module for r in flow.modules] == ["1"]
    assert {p.name for p in flow.params} == set(before)
    for p in flow.params:
        assert _close(p.norm, before[p.name].norm().item()), p.name
    assert audit_hooks(model).local_total == 0


def test_a_parametrized_layer_is_measured_at_its_output_and_owns_its_parameters() -> None:
    """With weight_norm and spectral_norm the records were the parametrizations' (the
    gradient of the computed weight, not of the layer's output), and the parameters they
    compute the weight from a layer of their own."""
    from torch.nn.utils import parametrizations

    torch.manual_seed(0)
    model = nn.Sequential(parametrizations.weight_norm(nn.Linear(8, 16)), nn.ReLU(),
                          parametrizations.spectral_norm(nn.Linear(16, 4)))
    model.eval()  # spectral_norm's power iteration updates its vectors in training
    x = torch.randn(8, 8)
    outputs: dict[str, torch.Tensor] = {}

    def keep(name: str) -> Callable[..., None]:
        def hook(_m: nn.Module, _a: object, out: torch.Tensor) -> None:
            out.register_hook(lambda g: outputs.__setitem__(name, g))

        return hook

    handles = [m.register_forward_hook(keep(n)) for n, m in model.named_children()]
    before = _plain_grads(model, lambda: model(x).square().sum().backward())
    for h in handles:
        h.remove()
    flow = gradient_flow(model, x, loss_fn=lambda out: out.square().sum(), train=False)
    _assert_same_grads(model, before)
    assert [r.module for r in flow.modules] == ["2", "1", "0"]
    for r in flow.modules:
        assert _close(r.output_norm, outputs[r.module].norm().item()), r.module
    per_layer = flow.param_norms()
    assert set(per_layer) == {"0", "2"}
    for layer in ("0", "2"):
        want = math.sqrt(sum(g.norm().item() ** 2 for n, g in before.items()
                             if n.startswith(layer + ".")))
        assert _close(per_layer[layer], want), layer
    assert not flow.findings()


def test_a_jagged_nested_input_is_measured_over_its_elements() -> None:
    """A model on a jagged nested tensor (`layout=torch.jagged`): its gradients' norms are
    over their elements; reading them raised in `vector_norm`, and the records' ragged
    shapes broke the findings."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    nt = torch.nested.nested_tensor([torch.randn(3, 16), torch.randn(5, 16)],
                                    layout=torch.jagged)
    outputs: dict[str, torch.Tensor] = {}

    def keep(name: str) -> Callable[..., None]:
        def hook(_m: nn.Module, _a: object, out: torch.Tensor) -> None:
            out.register_hook(lambda g: outputs.__setitem__(name, g.values().clone()))

        return hook

    handles = [m.register_forward_hook(keep(n)) for n, m in model.named_children()]
    before = _plain_grads(model, lambda: model(nt).values().square().sum().backward())
    for h in handles:
        h.remove()
    flow = gradient_flow(model, nt, loss_fn=lambda out: out.values().square().sum())
    _assert_same_grads(model, before)
    assert [r.module for r in flow.modules] == ["2", "1", "0"]
    for r in flow.modules:
        want = outputs[r.module]
        assert _close(r.output_norm, want.norm().item()), r.module
        assert r.grad_output[0].numel == want.numel()  # (3 + 5) rows
    # The analyzers run on the records (they raised on a ragged shape): a healthy model.
    assert not [f for f in flow.findings() if f.severity != Severity.INFO]


def test_the_default_selection_measures_attention_and_stacked_experts() -> None:
    """nn.MultiheadAttention and a mixture of experts' expert weights (transformers'
    Mixtral: one module holds every expert's weights, its only child the activation) compute
    with parameters of their own: the default selection records them, and their output
    gradients equal torch's tensor hooks. Before, neither had a record at all."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    seq = SeqNet()
    x = torch.randn(2, 5, 6)
    mix = MixtralForCausalLM(MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=32))
    ids = torch.randint(0, 64, (2, 8))
    cases: list[tuple[nn.Module, Callable[[], torch.Tensor], dict[str, Any]]] = [
        (seq, lambda: seq(x).sum(), {"inputs": x, "loss_fn": "sum"}),
        (mix, lambda: mix(input_ids=ids, labels=ids).loss,
         {"inputs": {"input_ids": ids, "labels": ids}}),
    ]
    for model, loss, kwargs in cases:
        wanted = [n for n, m in model.named_modules()
                  if isinstance(m, nn.MultiheadAttention) or type(m).__name__ == "MixtralExperts"]
        assert len(wanted) == (1 if model is seq else 2)
        ref: dict[str, float] = {}

        def hook(name: str) -> Callable[..., None]:
            def fwd(_m: nn.Module, _a: object, out: Any) -> None:
                t = out[0] if isinstance(out, tuple) else out
                t.register_hook(lambda g: ref.__setitem__(name, g.norm().item()))
            return fwd

        mods = dict(model.named_modules())
        handles = [mods[n].register_forward_hook(hook(n)) for n in wanted]
        before = _plain_grads(model, lambda: loss().backward())
        for h in handles:
            h.remove()
        flow = gradient_flow(model, **kwargs)
        _assert_same_grads(model, before)
        for name in wanted:
            rec = flow.get(name)
            assert rec.owns_params
            assert _close(rec.grad_output[0].norm, ref[name]), name
        assert audit_hooks(model, include_global=False).local_total == 0


class _RMSNorm(nn.Module):
    """Llama's norm, as transformers and most user code write it: its input is squared and
    scaled (two uses), and the residual stream uses it a third time outside."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class _PreNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = _RMSNorm(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x))


def test_an_input_used_twice_inside_a_call_and_once_outside_keeps_torch_s_gradients(
        ) -> None:
    """An alias of the norm's input added its two uses up first and the residual's after:
    another order of float additions, and gradients off in the last bits for every layer
    below (a transformers Llama too). Walking the call's own nodes puts nothing into the
    graph: the gradients are torch's bit for bit, one-shot and watched, and the input
    gradient the norm reports is the sum of its two uses."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from torchscope.grads import watch_gradients

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), *[_PreNorm(32) for _ in range(3)],
                          nn.Linear(32, 4))
    x = torch.randn(64, 16)
    llama = LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
    ids = torch.randint(0, 64, (2, 8))
    cases: list[tuple[nn.Module, Callable[[], torch.Tensor], dict[str, Any]]] = [
        (model, lambda: model(x).pow(2).sum(), {}),
        (llama, lambda: llama(input_ids=ids, labels=ids).loss,
         {"inputs": {"input_ids": ids, "labels": ids}}),
    ]
    for net, loss, kwargs in cases:
        before = _plain_grads(net, lambda: loss().backward())
        if net is model:
            gradient_flow(net, x, loss_fn=lambda o: o.pow(2).sum())
        else:
            gradient_flow(net, **kwargs)
        _assert_same_grads(net, before)
        with watch_gradients(net):
            for _ in range(2):
                _plain_grads(net, lambda: loss().backward())  # under the watch
                _assert_same_grads(net, before)
        assert audit_hooks(net, include_global=False).local_total == 0
    # What the first norm passes down: both of its uses, as torch sums them.
    flow = gradient_flow(model, x, loss_fn=lambda o: o.pow(2).sum())
    ref: dict[str, torch.Tensor] = {}

    def keep(_m: nn.Module, _a: object, o: torch.Tensor) -> None:
        o.register_hook(lambda g: ref.__setitem__("out", g))

    handle = model[1].norm.register_forward_hook(keep)
    h = model[0](x).detach().requires_grad_()
    try:
        model[1:](h).pow(2).sum().backward()
    finally:
        handle.remove()
    (via_norm,) = torch.autograd.grad(model[1].norm(h), h, ref["out"])  # (64, 32)
    assert _close(flow.get("1.norm").grad_input[0].norm, via_norm.norm().item())


def test_an_input_used_inside_and_outside_a_reentrant_checkpoint_of_one_call() -> None:
    """A call that uses its input in a reentrant checkpoint (a nested backward) and once
    more outside it: what it passes down adds both parts up, as torch's full backward hook
    on the same module reads it."""
    from torch.utils.checkpoint import checkpoint

    class Mix(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a = checkpoint(lambda t: self.fc(t).tanh(), x, use_reentrant=True)  # (B, 8)
            return a + x * 2

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), Mix(), nn.Linear(8, 2))
    x = torch.randn(5, 4)
    ref: dict[str, float] = {}
    handle = model[1].register_full_backward_hook(
        lambda _m, gi, _go: ref.__setitem__("in", gi[0].norm().item()))
    _plain_grads(model, lambda: model(x).pow(2).sum().backward())
    handle.remove()
    before = _plain_grads(model, lambda: model(x).pow(2).sum().backward())
    flow = gradient_flow(model, x, loss_fn=lambda o: o.pow(2).sum(),
                         select=["0", "1", "1.fc", "2"])
    _assert_same_grads(model, before)
    assert _close(flow.get("1").grad_input[0].norm, ref["in"])
    assert flow.get("1.fc").grad_output[0].norm is not None


@pytest.mark.parametrize("scale", [1e-5, 1.0])
def test_blocks_behind_a_small_layer_scale_are_left_out_of_the_depth_profile(
        scale: float, train_own_loss: Any) -> None:
    """transformers' DINOv2 with the paper's layer scale of 1e-5, after 4 AdamW steps: each
    block's matrices get the stream's gradient times the scale (about 3e-4 by then), the
    patch embedding on the stream gets all of it. That step read as "likely exploding
    gradients ... 221x over 3 layers toward the input"; with a scale of 1 the blocks stay in."""
    transformers = pytest.importorskip("transformers")
    from torchscope.grads import watch_gradients
    from torchscope.grads.analyze import depth_profile

    torch.manual_seed(0)
    model = transformers.Dinov2ForImageClassification(transformers.Dinov2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        image_size=28, patch_size=14, layerscale_value=scale, num_labels=3))
    batch = {"pixel_values": torch.randn(2, 3, 28, 28), "labels": torch.randint(0, 3, (2,))}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with watch_gradients(model, every=1, optimizer=opt) as watch:
        train_own_loss(model, batch, opt, 4)
    last = watch.last
    assert last is not None
    profile = depth_profile(last)
    behind = {m for m, why in profile.excluded if why.startswith("behind a layer scale")}
    blocks = {u.name for u in profile.units}
    if scale < 1:
        assert "dinov2.encoder.layer.0.attention.q_proj" in behind
        assert "dinov2.encoder.layer.0" not in blocks
        assert not [f for f in last.findings()
                    if f.code in ("grads.exploding", "grads.vanishing")]
    else:
        assert not behind and {"dinov2.encoder.layer.0", "dinov2.encoder.layer.1"} <= blocks


def test_reformer_s_reversible_layers_are_read_in_the_backward_that_recomputes_them() -> None:
    """transformers' Reformer runs its layers inside a custom autograd Function: forward
    under no_grad, then its backward recomputes each layer with gradients and
    backpropagates through it, as a reentrant checkpoint does. The flow held no record of
    any encoder layer; each leaf's output gradient now equals the one torch gives a tensor
    hook in that recomputation."""
    transformers = pytest.importorskip("transformers")
    config = transformers.ReformerConfig(
        vocab_size=64, hidden_size=32, num_attention_heads=2, attention_head_size=16,
        feed_forward_size=64, attn_layers=["local", "local"], axial_pos_embds_dim=[16, 16],
        axial_pos_shape=[4, 4], max_position_embeddings=16, is_decoder=True,
        local_attn_chunk_length=8, hidden_dropout_prob=0.0,
        local_attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = transformers.ReformerModelWithLMHead(config).train()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    seen: dict[str, float] = {}

    def note(name: str) -> Callable[..., None]:
        def read(g: torch.Tensor) -> None:
            seen.setdefault(name, g.norm().item())

        def hook(_m: nn.Module, _args: Any, out: Any) -> None:
            recomputing = torch._C._current_autograd_node() is not None
            if recomputing and isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(read)
        return hook

    handles = [m.register_forward_hook(note(n)) for n, m in model.named_modules()
               if n.startswith("reformer.encoder.layers.") and next(m.children(), None) is None]
    try:
        model(input_ids=ids, labels=ids).loss.backward()
    finally:
        for h in handles:
            h.remove()
    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()

    want = _plain_grads(model, step)
    flow = gradient_flow(model, {"input_ids": ids, "labels": ids})
    _assert_same_grads(model, want)
    read = {r.module: r.output_norm for r in flow.modules
            if r.module.startswith("reformer.encoder.layers.")}
    assert len(seen) >= 14 and set(read) == set(seen)
    for name, norm in seen.items():
        assert read[name] is not None and _close(read[name], norm), name
    assert audit_hooks(model).local_total == 0


def test_a_custom_function_inside_a_non_reentrant_checkpoint_is_still_a_replay() -> None:
    """The replay of a non-reentrant checkpoint runs when a node unpacks a saved tensor;
    that node may be a custom Function's. Its forward is no recomputation with gradients
    of its own (backward runs the first forward's graph), so nothing is recorded twice."""
    from torch.utils.checkpoint import checkpoint

    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            (x,) = ctx.saved_tensors
            return 2 * x * g

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return Square.apply(self.a(x))

    class Net(nn.Module):
        def __init__(self, ckpt: bool) -> None:
            super().__init__()
            self.block, self.head, self.ckpt = Block(), nn.Linear(8, 2), ckpt

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = checkpoint(self.block, x, use_reentrant=False) if self.ckpt else self.block(x)
            return self.head(h)

    torch.manual_seed(0)
    plain, model = Net(False), Net(True)
    model.load_state_dict(plain.state_dict())
    x = torch.randn(4, 8)
    flows = [gradient_flow(m, x, loss_fn="sum") for m in (plain, model)]
    want, got = (_norms_by_call(f) for f in flows)
    assert [r[:2] for r in got] == [r[:2] for r in want] == [("block.a", 0), ("head", 0)]
    for a, b in zip(want, got, strict=True):
        for u, v in zip(a[2] + a[3], b[2] + b[3], strict=True):
            assert (u is None) == (v is None) and (u is None or _close(u, v)), (a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_fused_experts_gradient_is_read_per_expert(dtype: torch.dtype) -> None:
    """transformers' Mixtral keeps its experts' weights fused, (experts, ...) each: the
    one-shot flow reads each expert's slice of their gradient, equal to torch's (bfloat16
    summed in float32)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2)).to(dtype)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    flow = gradient_flow(model, {"input_ids": ids, "labels": ids})
    experts = model.model.layers[0].mlp.experts
    for name, p in experts.named_parameters():
        rec = flow.param(f"model.layers.0.mlp.experts.{name}")
        want = torch.linalg.vector_norm(p.grad.float().flatten(1), dim=1)  # (experts,)
        assert rec.expert_norms is not None and len(rec.expert_norms) == 4
        assert list(rec.expert_norms) == pytest.approx(want.tolist(), rel=1e-5)
    # Any other weight has none.
    assert flow.param("model.layers.0.mlp.gate.weight").expert_norms is None


def test_fused_experts_in_float64_are_read_in_float64() -> None:
    """A float64 experts module (transformers' own run only in 32 and 16 bits) raised:
    float64 cannot be summed in float32."""

    class ToyExperts(nn.Module):  # transformers' layout: one (experts, out, in) weight
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(3, 4, 4, dtype=torch.float64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.weight[0].T + x @ self.weight[2].T  # expert 1 gets nothing

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4).double(), ToyExperts())
    flow = gradient_flow(model, torch.randn(2, 4, dtype=torch.float64), loss_fn="sum")
    grad = model[1].weight.grad  # (experts, out, in)
    norms = flow.param("1.weight").expert_norms
    assert norms is not None and norms[1] == 0.0
    assert list(norms) == pytest.approx(
        torch.linalg.vector_norm(grad.flatten(1), dim=1).tolist(), rel=1e-12)
