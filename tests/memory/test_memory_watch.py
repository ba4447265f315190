"""`watch_memory` in real training loops: the same bytes as `saved_activations`, gradients
bitwise identical to a loop without it, every hook removed, a bounded history."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from torch import nn
from torch.nn import functional

from torchscope.errors import TorchscopeError
from torchscope.hooks import audit_hooks
from torchscope.memory import MemoryHistory, saved_activations, watch_memory
from torchscope.models import DeepMLP, TinyCNN


def _no_saved_tensor_hooks() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def _train(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        opt.zero_grad()
        functional.cross_entropy(model(x), y).backward()
        opt.step()


def _rows(saved) -> list[tuple[str, int, int, int]]:  # type: ignore[no-untyped-def]
    return [(r.module, r.bytes, r.storages, r.saves) for r in saved.modules]


def test_a_watched_loop_trains_bitwise_like_a_plain_one() -> None:
    torch.manual_seed(0)
    model = TinyCNN()
    twin = copy.deepcopy(model)
    batches = [(torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))) for _ in range(6)]
    with watch_memory(model, every=2) as watch:
        _train(model, batches)
        assert audit_hooks(model).local_total > 0
    _train(twin, batches)
    for (n, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q), n
        assert p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad), n
    assert audit_hooks(model).local_total == 0 and _no_saved_tensor_hooks()
    assert (watch.forwards, watch.samples) == (6, 3)
    assert watch.history.forwards == (0, 2, 4)


def test_a_sample_counts_what_saved_activations_counts() -> None:
    torch.manual_seed(0)
    model = TinyCNN()
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    want = saved_activations(model, x, loss_fn="sum")  # the sum saves nothing
    with watch_memory(model) as watch:
        functional.cross_entropy(model(x), y).backward()
    last = watch.last
    assert last is not None and last.forward == 0 and last.peak_bytes is None  # CPU
    assert last.saved.total_bytes == want.total_bytes > 0
    assert _rows(last.saved) == _rows(want)
    assert last.saved.input_bytes == want.input_bytes == x.numel() * 4
    assert last.saved.state_bytes == want.state_bytes
    assert watch.history.total_bytes == (want.total_bytes,)
    assert watch.history.series("relu") == (want.modules[1].bytes,)
    assert "memory.saved_by_type" in [f.code for f in watch.findings()]


def test_a_sample_read_later_is_what_was_alive_at_its_forwards_end() -> None:
    """A sample's records are built when first read, from what its forward left alive;
    `last_total_bytes` is their total without building them."""
    torch.manual_seed(0)
    model = DeepMLP()
    xs = [torch.randn(n, 64) for n in (8, 4, 6, 2, 5)]
    with watch_memory(model, every=2) as watch:
        assert watch.last_total_bytes is None and watch.last is None
        for i, x in enumerate(xs):
            model(x).sum().backward()
            if i == 2:
                at_2 = watch.last  # built now, while forward 2's storages are freed
    want = saved_activations(model, xs[4], loss_fn="sum")
    last = watch.last  # built after forwards that were not sampled, and the graph's end
    assert last is not None and last is watch.last and last.forward == 4
    assert last.saved.storages == want.storages and last.saved.modules == want.modules
    assert watch.last_total_bytes == last.saved.total_bytes == want.total_bytes
    assert watch.history.total_bytes[-1] == want.total_bytes
    assert at_2 is not None and at_2.forward == 2
    assert at_2.saved == replace(saved_activations(model, xs[2], loss_fn="sum"), step=None)


def test_select_and_depth_rows_match_the_one_shot(tiny_gpt2: nn.Module) -> None:
    model = tiny_gpt2.train()
    ids = torch.randint(0, 100, (2, 16))
    batch = {"input_ids": ids, "labels": ids}  # the model's own loss runs inside its forward
    for select, depth in ((None, None), ("GPT2Block", None), (None, 2), ("transformer.h.*.mlp", 4)):
        want = saved_activations(model, batch, select=select, depth=depth)  # auto: .loss
        assert want.step is not None and "output.loss" in want.step.loss
        with watch_memory(model, select=select, depth=depth) as watch:
            model(**batch).loss.backward()
        model.zero_grad(set_to_none=True)
        assert watch.last is not None
        assert _rows(watch.last.saved) == _rows(want), (select, depth)
        assert watch.last.saved.total_bytes == want.total_bytes


def test_gpt2_with_dropout_trains_bitwise_like_a_plain_loop(tiny_gpt2: nn.Module) -> None:
    model = tiny_gpt2.train()
    twin = copy.deepcopy(model)
    ids = torch.randint(0, 100, (2, 16))

    def run(m: nn.Module) -> list[torch.Tensor]:
        torch.manual_seed(0)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        for _ in range(3):
            opt.zero_grad()
            m(ids, labels=ids).loss.backward()
            opt.step()
        return [p.grad.clone() for p in m.parameters() if p.grad is not None]

    with watch_memory(model) as watch:
        got = run(model)
    want = run(twin)
    assert len(got) == len(want) > 0
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters(),
                                                 strict=True))
    assert watch.samples == 3 and audit_hooks(model).local_total == 0


def test_unsampled_and_no_grad_forwards() -> None:
    model, x = DeepMLP(), torch.randn(8, 64)
    with watch_memory(model, every=3, max_samples=2) as watch:
        for _ in range(7):
            with torch.no_grad():
                model(x)  # evaluation: not a training forward, not counted
            model(x).sum().backward()
    assert watch.forwards == 7 and watch.samples == 3  # forwards 0, 3, 6
    assert watch.history.forwards == (3, 6)  # the newest two
    assert _no_saved_tensor_hooks()


def test_a_forward_no_backward_reaches_is_no_sample() -> None:
    # Evaluation passes run with gradients on (no torch.no_grad), on half the batch: they
    # save tensors that no step uses. The last one, after the last step, was the sample.
    torch.manual_seed(0)
    model, x, xv = DeepMLP(), torch.randn(8, 64), torch.randn(4, 64)
    want = saved_activations(model, x, loss_fn="sum").total_bytes
    with watch_memory(model) as watch:
        for _ in range(3):
            model(x).sum().backward()
            model.eval()
            model(xv)  # forwards 1, 3, 5: output dropped
            model.train()
        assert audit_hooks(model).local_total > 0
    assert watch.forwards == 6 and watch.samples == 3
    assert watch.history.forwards == (0, 2, 4)
    assert watch.history.total_bytes == (want, want, want)
    assert watch.last is not None and watch.last.forward == 4
    assert audit_hooks(model).local_total == 0 and _no_saved_tensor_hooks()


def test_two_forwards_into_one_backward_are_two_samples_in_order() -> None:
    torch.manual_seed(0)
    model, a, b = DeepMLP(), torch.randn(8, 64), torch.randn(4, 64)
    with watch_memory(model) as watch:
        (model(a).sum() - model(b).sum()).backward()  # backward reaches b's output first
    assert watch.history.forwards == (0, 1) and watch.samples == 2
    assert watch.history.total_bytes == (
        saved_activations(model, a, loss_fn="sum").total_bytes,
        saved_activations(model, b, loss_fn="sum").total_bytes)
    assert watch.last is not None and watch.last.forward == 1


def test_forwards_without_any_backward_are_kept_when_the_watch_closes() -> None:
    model, x = DeepMLP(), torch.randn(8, 64)
    with watch_memory(model) as watch:
        out = model(x)
    assert watch.samples == 1 and watch.history.forwards == (0,)
    out.sum().backward()  # after the block: nothing of the watch is left on the graph
    assert audit_hooks(model).local_total == 0


def test_a_checkpointed_root_recomputed_in_backward_is_no_forward_of_its_own() -> None:
    """A loop that checkpoints the whole model: on an unsampled step, backward runs its
    forward again, inside backward, to refill what the checkpoint did not keep; that was
    counted as a forward, and sampled. (On a sampled step the watch's own saved-tensor
    hooks, entered inside the checkpoint's, keep everything: nothing is recomputed.)"""
    from torch.utils.checkpoint import checkpoint

    model, x = DeepMLP(), torch.randn(8, 64, requires_grad=True)
    with watch_memory(model, every=2) as watch:
        for _ in range(4):
            checkpoint(model, x, use_reentrant=False).sum().backward()
    assert watch.forwards == 4 and watch.samples == 2
    assert _no_saved_tensor_hooks()


class _SavesThenMutates(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x).exp()  # exp saves its output for backward
        h.add_(1)  # ...which this modifies: autograd must refuse the backward
        return h


def test_a_saved_tensor_modified_in_place_still_fails_backward() -> None:
    model, x = _SavesThenMutates(), torch.randn(2, 4)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(x).sum().backward()
    with watch_memory(model), pytest.raises(RuntimeError,
                                            match="modified by an inplace operation"):
        model(x).sum().backward()
    assert _no_saved_tensor_hooks() and audit_hooks(model).local_total == 0


class _Fails(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 3:
            raise ValueError("bad batch")
        return self.lin(x)


def test_a_forward_that_raises_leaves_no_saved_tensor_hooks_and_no_sample() -> None:
    model = _Fails()
    with watch_memory(model) as watch:
        with pytest.raises(ValueError, match="bad batch"):
            model(torch.randn(3, 4))
        assert _no_saved_tensor_hooks() and watch.samples == 0
        model(torch.randn(2, 4)).sum().backward()
        assert watch.samples == 1
    with pytest.raises(KeyError), watch_memory(model) as watch:
        model(torch.randn(2, 4))
        raise KeyError("user error")
    assert _no_saved_tensor_hooks() and audit_hooks(model).local_total == 0


def test_growing_inputs_are_a_finding_constant_ones_are_not() -> None:
    model = DeepMLP()
    with watch_memory(model) as steady:
        for _ in range(3):
            model(torch.randn(8, 64)).sum().backward()
    assert not [f for f in steady.findings() if f.code.endswith("_growth")]
    with watch_memory(model) as growing:
        for batch in (8, 16, 32):
            model(torch.randn(batch, 64)).sum().backward()
    found = [f for f in growing.findings() if f.code == "memory.saved_growth"]
    assert len(found) == 1 and found[0].evidence["ratio"] == 4.0


def test_history_analysis_of_a_peak_that_grows_without_activations() -> None:
    steady = MemoryHistory((0, 1, 2), ("a",), ((100,), (100,), (100,)), (100, 100, 100),
                           (1_000, 1_010, 1_000))
    assert steady.findings() == []
    leak = MemoryHistory((0, 1, 2), ("a",), ((100,), (100,), (100,)), (100, 100, 100),
                         (1_000, 1_600, 2_400))
    (finding,) = leak.findings()
    assert finding.code == "memory.peak_growth" and finding.severity.label == "warning"
    assert finding.evidence["ratio"] == 2.4 and "loss.item()" in finding.fix


def test_bad_arguments_fail_before_any_hook() -> None:
    model = DeepMLP()
    with pytest.raises(TorchscopeError, match="every=0"):
        watch_memory(model, every=0)
    with pytest.raises(TorchscopeError, match="max_samples=0"):
        watch_memory(model, max_samples=0)
    with pytest.raises(Exception, match="matched no module"), watch_memory(model, select="Nope"):
        pass
    assert audit_hooks(model).local_total == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_peak_covers_the_sampled_step() -> None:
    model = DeepMLP().cuda()
    x = torch.randn(32, 64, device="cuda")
    with watch_memory(model) as watch:
        for _ in range(2):
            model(x).sum().backward()
    peaks = watch.history.peak_bytes
    assert len(peaks) == 2 and all(p is not None for p in peaks)
    assert watch.last is not None and watch.last.peak_bytes == peaks[-1]
    assert peaks[-1] >= watch.last.saved.total_bytes  # type: ignore[operator]


def test_a_compiled_wrapper_made_before_the_watch_is_a_warning_not_a_clean_record() -> None:
    """The loop calls a `torch.compile` wrapper that ran before the watch opened: its root
    hooks never fire, and an empty watch said nothing, as one with nothing to say does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(4, 4)
    compiled(x).sum().backward()  # compiled before the watch
    with watch_memory(model) as watch:
        compiled(x).sum().backward()
    assert watch.forwards == 0 and watch.samples == 0
    [f] = watch.findings()
    assert (f.code, f.severity.name) == ("memory.unseen_forward", "WARNING")
    with watch_memory(compiled) as watch:
        compiled(x).sum().backward()
    assert watch.samples == 1
    assert "memory.unseen_forward" not in {f.code for f in watch.findings()}
    assert audit_hooks(model, include_global=False).local_total == 0
