"""The two routes of `torchscope.grads.collect` that read what a call passes to its inputs:
walking the call's own autograd nodes, and reading where earlier calls showed the inputs
enter the graph.

A watch walks a module's first call and, for a `torch.nn` leaf whose call consumed each
input at one node, reads its later calls on that node. Both routes read the same gradient
tensors, so with unchanged weights and inputs every step must give the same norms, bit for
bit; a call that does not fit the earlier ones must be reported as unmeasured, never
measured wrong; and neither route puts a node into the graph (an alias of an input would
change the order in which autograd adds up that input's gradients).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional

from torchscope.grads import watch_gradients
from torchscope.grads.records import NOT_MEASURED, GradFlow
from torchscope.hooks import audit_hooks
from torchscope.models import ResNetMini

# Every test here runs twice: norms by eager `vector_norm`, and by the fused kernel.
pytestmark = pytest.mark.usefixtures("reduction_path")


def _aliases(loss: torch.Tensor) -> int:
    """AliasBackward0 nodes in the graph behind `loss` (the watch must add none)."""
    # Keeps every node it saw alive: a node's Python object may be made anew on each
    # `next_functions`, and a freed one's id can come back for another node.
    seen: dict[int, Any] = {}
    todo: list[Any] = [loss.grad_fn]
    count = 0
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        count += type(node).__name__ == "AliasBackward0"
        todo.extend(n for n, _ in node.next_functions)
    return count


def _watched(model: nn.Module, loss_of: Callable[[], torch.Tensor], steps: int = 3,
             **kwargs: Any) -> tuple[list[GradFlow], list[int]]:
    """`steps` steps under one watch, weights unchanged: each step's flow, and the aliases
    each step's graph held."""
    flows: list[GradFlow] = []
    aliases: list[int] = []
    with watch_gradients(model, every=1, manual=True, on_sample=flows.append,
                         **kwargs) as watch:
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            loss = loss_of()
            aliases.append(_aliases(loss))
            loss.backward()
            watch.end_step()
    assert audit_hooks(model, include_global=False).local_total == 0
    return flows, aliases


def _calls(flow: GradFlow) -> list[tuple[Any, ...]]:
    """Every call's identity, backward order and (norm, reason) per input and output."""
    return [(r.module, r.call, r.order,
             tuple((g.path, g.norm, g.reason) for g in r.grad_input),
             tuple((g.path, g.norm, g.reason) for g in r.grad_output)) for r in flow.modules]


def _assert_routes_agree(flows: list[GradFlow]) -> None:
    first = _calls(flows[0])
    assert any(g[1] is not None for c in first for g in c[3]), "no input was measured"
    for flow in flows[1:]:
        assert _calls(flow) == first
        assert [(p.name, p.norm) for p in flow.params] == \
            [(p.name, p.norm) for p in flows[0].params]


def test_resnet_inputs_read_on_the_graph_equal_the_aliases() -> None:
    torch.manual_seed(0)
    model = ResNetMini(channels=4, blocks=3).train()
    x, y = torch.randn(2, 3, 8, 8), torch.randint(0, 10, (2,))
    flows, aliases = _watched(model, lambda: functional.cross_entropy(model(x), y))
    assert aliases == [0, 0, 0]
    _assert_routes_agree(flows)
    # A residual block's conv passes down only its share of the block input's gradient.
    conv = flows[-1].get("blocks.1.conv")
    block_in = flows[-1].get("blocks.0.relu")
    assert conv.grad_input[0].norm != block_in.grad_output[0].norm


class _Seq(nn.Module):
    """Linear on 3-D inputs (its input enters at a reshape, not at the output's node), a
    LayerNorm, GELU, an in-place ReLU and `relu_()` after a layer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.norm = nn.LayerNorm(16)
        self.act = nn.GELU()
        self.relu = nn.ReLU(inplace=True)
        self.fc2 = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.relu(self.act(self.norm(self.fc1(x))))  # (B, T, 16)
        h = self.fc2(h).relu_()  # (B, T, 16)
        out: torch.Tensor = self.head(h).sum(1)  # (B, 3)
        return out


def test_sequence_model_and_in_place_ops() -> None:
    torch.manual_seed(0)
    model = _Seq()
    x = torch.randn(2, 5, 6, requires_grad=True)  # a leaf: read at its AccumulateGrad edge
    flows, aliases = _watched(model, lambda: model(x).square().sum())
    assert aliases == [0, 0, 0]
    _assert_routes_agree(flows)
    assert flows[-1].get("fc1").grad_input[0].norm == pytest.approx(
        torch.autograd.grad(model(x).square().sum(), x)[0].norm().item(), rel=1e-6)


def test_a_linear_on_3d_input_takes_one_node_hook() -> None:
    """Its input's reshape and its output's pass the gradient on as it is: both are read
    on the addmm's node (mm's without a bias), by one hook per call; the norms stay
    torch's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 8, bias=False),
                          nn.Linear(8, 3))
    x = torch.randn(2, 5, 6, requires_grad=True)
    hooks = []
    with watch_gradients(model, every=1, manual=True) as watch:
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            loss = model(x).square().sum()
            hooks.append(len(watch._collector._step_handles))
            loss.backward()
            watch.end_step()
    assert hooks[1:] == [4, 4]  # graph-read calls: one node hook each
    flow = watch.last
    assert flow is not None
    outs: list[torch.Tensor] = []  # each layer's output, its gradient retained
    handles = [layer.register_forward_hook(lambda _m, _i, o: outs.append(o.retain_grad() or o))
               for layer in model]
    x.grad = None  # the watched steps accumulated into it
    try:
        model(x).square().sum().backward()
    finally:
        for h in handles:
            h.remove()
    assert x.grad is not None
    assert flow.get("0").grad_input[0].norm == pytest.approx(x.grad.norm().item(), rel=1e-6)
    for i, o in enumerate(outs):
        assert o.grad is not None
        assert flow.get(str(i)).grad_output[0].norm == pytest.approx(o.grad.norm().item(),
                                                                     rel=1e-6), i


def test_a_call_read_when_the_root_returns_keeps_its_place_on_a_shared_node() -> None:
    """A torch.nn leaf's calls inside the root's forward are read on the graph when the root
    returns; a module of the user's code that returns the leaf's output as it is (the same
    autograd node) is read at once. The leaf's hook must still come first on that node, as
    its call ended first: the same backward order on every step."""

    class Wrap(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.fc(x)
            return out

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), Wrap())
    x = torch.randn(5, 3)
    flows, aliases = _watched(model, lambda: model(x).square().sum(),
                              select=["0", "1", "1.fc"])
    assert aliases == [0, 0, 0]
    _assert_routes_agree(flows)
    assert [r.module for r in flows[-1].modules] == ["1.fc", "1", "0"]


class _ViewThenInplace(nn.Module):
    """Linear layers on 3-D input (their outputs are views of their addmm's result), each
    output changed in place afterwards, as transformer MLPs and user code do, and an
    nn.Flatten (a view of its input) whose output is left alone."""

    def __init__(self, inplace: bool = True) -> None:
        super().__init__()
        self.inplace = inplace
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.ReLU(inplace=inplace)
        self.fc2 = nn.Linear(16, 16)
        self.flat = nn.Flatten()
        self.head = nn.Linear(5 * 16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 5, 8)
        h = self.act(self.fc1(x))  # (B, 5, 16)
        h = self.fc2(h)
        h = h.relu_() if self.inplace else h.relu()
        return self.head(self.flat(h))  # (B, 80) -> (B, 3)


def test_an_in_place_op_on_a_linear_output_view_is_read_on_both_routes() -> None:
    """An in-place op on a view takes the view's own node out of the graph; the layer's
    gradient is read where its base was made, and what the in-place ReLU passes down on
    the node the rebase put in front of it; both equal torch's on the first call
    (aliases) and on later calls (graph)."""
    torch.manual_seed(0)
    model = _ViewThenInplace()
    twin = _ViewThenInplace(inplace=False)
    twin.load_state_dict(model.state_dict())
    x = torch.randn(4, 5, 8, requires_grad=True)
    ref: dict[str, tuple[float, float]] = {}
    handles = [getattr(twin, n).register_full_backward_hook(
        lambda _m, gi, go, _n=n: ref.__setitem__(
            _n, (float(go[0].norm()), float(gi[0].norm()))))
        for n in ("fc1", "act", "fc2", "flat", "head")]
    try:
        twin(x).sum().backward()
    finally:
        for h in handles:
            h.remove()
    flows, _ = _watched(model, lambda: model(x).sum())
    for flow in flows:
        for name, (out_norm, in_norm) in ref.items():
            rec = flow.get(name)
            assert rec.grad_output[0].norm == pytest.approx(out_norm, rel=1e-6), name
            assert rec.grad_input[0].norm == pytest.approx(in_norm, rel=1e-6), name


def test_calls_outside_the_root_forward_are_read_at_once() -> None:
    """Leaves called without the root (the user calls the submodules) are read as their
    calls end: the same numbers as through the root, which reads them when it returns."""
    torch.manual_seed(0)
    model = _Seq()
    x = torch.randn(2, 5, 6)

    def by_hand() -> torch.Tensor:
        h = model.relu(model.act(model.norm(model.fc1(x))))
        return model.head(model.fc2(h).relu_()).sum(1).square().sum()

    through_root, _ = _watched(model, lambda: model(x).square().sum())
    direct, _ = _watched(model, by_hand)
    assert _calls(direct[-1]) == _calls(through_root[-1])
    for name in ("head", "relu", "act", "norm", "fc1"):
        assert direct[-1].get(name).grad_output[0].norm is not None


def test_attention_lstm_and_user_modules_agree_on_every_step() -> None:
    """MultiheadAttention (not a leaf), an LSTM (tuple outputs) and a module of the user's
    code, which are walked at every call: the same numbers on every step."""

    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(16))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.w

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Linear(6, 16)
            self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
            self.scale = Scale()
            self.lstm = nn.LSTM(16, 8, batch_first=True)
            self.head = nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.emb(x)
            a, _ = self.attn(h, h, h, need_weights=False)
            out, _ = self.lstm(self.scale(h + a))
            result: torch.Tensor = self.head(out[:, -1])
            return result

    torch.manual_seed(0)
    model = Net()
    x = torch.randn(2, 5, 6)
    flows, aliases = _watched(model, lambda: model(x).sum(),
                              select=["emb", "attn", "scale", "lstm", "head"])
    assert aliases == [0, 0, 0]
    _assert_routes_agree(flows)


def test_tiny_gpt2_routes_agree(tiny_gpt2: nn.Module) -> None:
    model = tiny_gpt2
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    own = _aliases(model(input_ids=ids, labels=ids).loss)  # GPT-2's own
    flows, aliases = _watched(model, lambda: model(input_ids=ids, labels=ids).loss)
    assert aliases == [own] * 3
    _assert_routes_agree(flows)


def test_dropout_returning_its_input_in_eval() -> None:
    """Learned in training (dropout is an op there); in eval the module returns its input:
    what it passes down is what it receives."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    calls = [0]

    def loss() -> torch.Tensor:
        calls[0] += 1
        model.train(calls[0] <= 2)  # one watch: two steps in training, then one in eval
        out: torch.Tensor = model(x).sum()
        return out

    flows, aliases = _watched(model, loss)
    assert aliases == [0, 0, 0]
    assert flows[1].get("1").grad_input[0].norm is not None
    drop = flows[2].get("1")
    assert drop.grad_input[0].norm == drop.grad_output[0].norm is not None
    assert drop.grad_input[0].norm == flows[2].get("0").grad_output[0].norm


def test_a_call_that_does_not_fit_is_unmeasured_not_wrong() -> None:
    """A Bilinear first called with two tensors, then with one tensor twice: its input is
    then consumed at two nodes, so no node holds its whole gradient. That call reports its
    input as unmeasured, and the next call is walked again, which adds up both nodes'
    shares."""
    torch.manual_seed(0)
    bil = nn.Bilinear(4, 4, 3)
    fc = nn.Linear(4, 4)
    a, b = torch.randn(5, 4), torch.randn(5, 4)
    same = [False]

    def loss() -> torch.Tensor:
        h = fc(a)
        out: torch.Tensor = bil(h, h if same[0] else fc(b)).sum()
        return out

    flows: list[GradFlow] = []
    pre_hooks = []
    with watch_gradients(bil, every=1, manual=True, on_sample=flows.append) as watch:
        for step in range(4):
            same[0] = step >= 2
            bil.zero_grad(set_to_none=True)
            fc.zero_grad(set_to_none=True)
            loss().backward()
            watch.end_step()
            pre_hooks.append(len(bil._forward_pre_hooks))
    # The watch's step hook on the root, plus the pre-hook of a walked call, which comes off
    # once the module reads on the graph and is back after the misfit.
    assert pre_hooks == [1, 1, 2, 2]
    assert not bil._forward_pre_hooks and not bil._forward_hooks
    assert flows[1].modules[0].grad_input[0].norm is not None  # read on the graph
    misfit = flows[2].modules[0].grad_input[0]
    assert misfit.norm is None and misfit.reason == NOT_MEASURED
    h = fc(a).detach().requires_grad_()
    (grad,) = torch.autograd.grad(bil(h, h).sum(), h)
    assert flows[3].modules[0].grad_input[0].norm == pytest.approx(grad.norm().item(),
                                                                   rel=1e-6)


def test_a_user_module_that_keeps_its_input_reports_what_its_outputs_pass_down() -> None:
    """A module of the user's code may use its input again outside its outputs (kept for a
    later loss term). That use is not the call's: its grad_input is what its outputs pass
    down (an alias, which would also see the later use, would change the order in which
    autograd adds the input's gradients up), and the gradients stay torch's, bit for bit."""

    class Keep(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.kept: torch.Tensor | None = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.kept = x
            out: torch.Tensor = self.fc(x)
            return out

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Linear(3, 4)
            self.keep = Keep()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.keep(self.stem(x)).sum()
            assert self.keep.kept is not None
            total: torch.Tensor = out + self.keep.kept.square().sum()  # a later loss term
            return total

    torch.manual_seed(0)
    model = Net()
    x = torch.randn(5, 3)
    model.zero_grad(set_to_none=True)
    model(x).backward()
    bare = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    flows, _ = _watched(model, lambda: model(x), select=["keep", "keep.fc"])
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.equal(p.grad, bare[n]), n
    h = model.stem(x).detach().requires_grad_()
    (grad,) = torch.autograd.grad(model.keep(h).sum(), h)
    for flow in flows:
        assert flow.get("keep").grad_input[0].norm == pytest.approx(grad.norm().item(),
                                                                     rel=1e-6)


def test_a_one_input_call_that_does_not_fit() -> None:
    """A hypernetwork-style call: `functional_call` gives a Linear a weight computed from its
    own input, which then reaches the call's graph twice (the matmul, and the weight). The
    graph cannot tell the call's share from the weight's: that call is left unmeasured. The
    next is walked again and measures what passes through the input argument (the weight
    was made from the input outside the call, before the call's own nodes)."""
    torch.manual_seed(0)
    stem, lin = nn.Linear(3, 4), nn.Linear(4, 4)
    x = torch.randn(5, 3)
    hyper = [False]

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem, self.lin = stem, lin

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.stem(x)
            if not hyper[0]:
                return self.lin(h)
            weight = self.lin.weight * h.mean()  # (4, 4), from the input
            out: torch.Tensor = torch.func.functional_call(self.lin, {"weight": weight}, (h,))
            return out

    model = Net()
    calls = [0]

    def loss() -> torch.Tensor:
        calls[0] += 1
        hyper[0] = calls[0] >= 3
        out: torch.Tensor = model(x).sum()
        return out

    flows, aliases = _watched(model, loss, steps=4)
    assert aliases == [0, 0, 0, 0]
    assert flows[1].get("lin").grad_input[0].norm is not None
    misfit = flows[2].get("lin").grad_input[0]
    assert misfit.norm is None and misfit.reason == NOT_MEASURED
    h = stem(x).detach().requires_grad_()
    w = (lin.weight * h.mean()).detach()
    (grad,) = torch.autograd.grad(functional.linear(h, w, lin.bias).sum(), h)
    assert flows[3].get("lin").grad_input[0].norm == pytest.approx(grad.norm().item(),
                                                                    rel=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("which", ["resnet", "sequence"])
def test_cuda_routes_agree(which: str, reduction_path: str,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The same on a GPU: graph-route and walked norms agree bit for bit, by the CUDA
    kernel or by eager ops. cuDNN's deterministic algorithms make each step's gradients
    themselves bitwise repeatable."""
    from torchscope import _kernels

    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    if reduction_path == "fused":
        for program in _kernels.PROGRAMS:
            status = _kernels.prepare(program, torch.float32, "cuda", wait=None)
            if status.state != "ready":
                pytest.skip(f"no fused CUDA kernel here: {status.reason}")
    torch.manual_seed(0)
    if which == "resnet":
        model: nn.Module = ResNetMini(channels=4, blocks=3).cuda().train()
        x, y = torch.randn(2, 3, 8, 8, device="cuda"), torch.randint(0, 10, (2,), device="cuda")
        flows, aliases = _watched(model, lambda: functional.cross_entropy(model(x), y))
    else:
        model = _Seq().cuda()
        x = torch.randn(2, 5, 6, device="cuda", requires_grad=True)
        flows, aliases = _watched(model, lambda: model(x).square().sum())
    assert aliases == [0, 0, 0]
    _assert_routes_agree(flows)
    assert (flows[-1].fused_norms > 0) == (reduction_path == "fused")
