"""Saved-activation accounting against counts made with torch's own hooks."""

from __future__ import annotations

import dataclasses
import gc
import pickle

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

import torchscope.memory as ckpt
from torchscope.memory import memory_totals, saved_activations
from torchscope.memory.records import OUTSIDE, SavedStorage
from torchscope.models import DeepMLP, TinyCNN


def _plain_count(model: nn.Module, *args: torch.Tensor, **kwargs: torch.Tensor) -> int:
    """Saved bytes by storage, parameters excluded, with a bare saved_tensors_hooks."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    params |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t.detach()  # the output itself would form a cycle through its grad_fn

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(*args, **kwargs)
    del out
    return sum(seen.values())


def test_deep_mlp_saves_nine_storages_of_8192_bytes() -> None:
    model = DeepMLP()
    x = torch.randn(32, 64)  # does not require grad
    saved = saved_activations(model, x, loss_fn="sum")  # the sum saves nothing itself
    acts = saved.activation_storages
    assert saved.total_bytes == 73_728
    assert len(acts) == 9
    assert all(s.nbytes == 8_192 for s in acts)
    assert sum(r.bytes for r in saved.modules) == saved.total_bytes
    assert saved.total_bytes == _plain_count(model, x)
    # The input is saved by the first Linear; each ReLU output once, though two nodes save it.
    assert saved.input_bytes == 8_192
    assert [r.module for r in saved.modules] == ["0.0"] + [f"{i}.1" for i in range(8)]
    relu_rows = [r for r in saved.modules if r.module_type == "ReLU"]
    assert [r.saves for r in relu_rows] == [2] * 7 + [1]
    # Linear 1..7 save their weight (model state, not activations); Linear 0 does not,
    # because its input needs no gradient.
    assert saved.state_bytes == 7 * 64 * 64 * 4


class _Dropping(nn.Module):
    """Saves, and drops before backward, a branch of the same size as what it keeps: the
    allocator may hand a dropped storage's address to a later one."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h: torch.Tensor = self.lin(x)
        for _ in range(6):
            dropped = torch.sigmoid(h * 2)  # saved by sigmoid, freed with its graph here
            del dropped
            h = torch.tanh(h)  # saved (its output), kept
        return h


def _alive_saved_bytes(model: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """(bytes, storages) of what autograd saved that is alive before backward, parameters
    excluded, by torch's own StorageWeakRef."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    refs: list[tuple[StorageWeakRef, int]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s._cdata not in params:
            refs.append((StorageWeakRef(s), s.nbytes()))
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    alive = {r.cdata: n for r, n in refs if not r.expired()}
    del out
    return sum(alive.values()), len(alive)


def test_storages_freed_before_backward_are_not_counted_and_a_reused_address_is_new() -> None:
    torch.manual_seed(0)
    model, x = _Dropping(), torch.randn(64, 64)  # 16 KiB each: glibc reuses them at once
    saved = saved_activations(model, x, loss_fn="sum")
    want_bytes, want_storages = _alive_saved_bytes(model, x)
    assert saved.total_bytes == want_bytes == 7 * 64 * 64 * 4  # x and six tanh outputs
    assert len([s for s in saved.storages if s.kind != "parameter"]) == want_storages == 7
    assert saved.saves == 1 + 6 * 2  # addmm's input (x needs no grad: not the weight); each
    # sigmoid's and tanh's output


def test_a_parameter_made_inside_the_forward_is_state_a_flagged_tensor_too() -> None:
    """FSDP2 swaps in unsharded weights (new `nn.Parameter`s) inside the forward; torch
    also counts a plain tensor flagged `_is_param` as a Parameter."""

    class Swapping(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            fresh = nn.Parameter(self.weight.detach().clone())  # not among the model's
            flagged = self.weight.detach().clone().requires_grad_()
            flagged._is_param = True
            assert isinstance(flagged, nn.Parameter)
            return x @ fresh + x @ flagged.t()

    x = torch.randn(3, 4, requires_grad=True)
    saved = saved_activations(Swapping(), x, loss_fn="sum")
    kinds = sorted((s.kind, s.shape) for s in saved.storages)
    # mm saves both operands: x (an input) twice, one storage, and each weight once
    assert kinds == [("input", (3, 4)), ("parameter", (4, 4)), ("parameter", (4, 4))]
    assert saved.state_bytes == 2 * 16 * 4 and saved.total_bytes == 3 * 4 * 4


def test_storage_records_are_those_their_constructor_builds(tiny_gpt2: nn.Module) -> None:
    """`_freeze` builds `SavedStorage` from a dict of its fields, not through `__init__`."""
    ids = torch.randint(0, 100, (2, 16))
    saved = saved_activations(tiny_gpt2, ids, loss_fn="sum")
    names = [f.name for f in dataclasses.fields(SavedStorage)]
    assert saved.storages
    for s in saved.storages:
        assert list(vars(s)) == names  # every field, in order, and nothing else
        again = SavedStorage(*(getattr(s, n) for n in names))
        assert s == again and hash(s) == hash(again) and repr(s) == repr(again)
        with pytest.raises(dataclasses.FrozenInstanceError):
            s.nbytes = 0  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(saved)) == saved  # as ranks send it


def test_accounting_leaves_model_and_rng_untouched() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5)).train()
    x = torch.randn(16, 8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    saved_activations(model, x)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())
    assert all(p.grad is None for p in model.parameters())


def _graph_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects()
               if issubclass(type(o), torch.Tensor) and o.grad_fn is not None)


def test_accounting_keeps_no_graph_alive() -> None:
    """A pack hook returning a saved output itself would leak it (a cycle via its grad_fn)."""
    model = TinyCNN()
    x = torch.randn(4, 3, 16, 16)
    before = _graph_tensors()
    saved_activations(model, x)
    with ckpt.apply(model, blocks=["conv1", "conv2"]):
        saved_activations(model, x)
    assert _graph_tensors() == before


def test_tiny_gpt2_table_sums_to_total(tiny_gpt2: nn.Module) -> None:
    ids = torch.randint(0, 100, (2, 16))
    saved = saved_activations(tiny_gpt2, ids, loss_fn="sum")
    assert saved.total_bytes > 0
    assert sum(r.bytes for r in saved.modules) == saved.total_bytes
    assert saved.total_bytes == _plain_count(tiny_gpt2, ids)
    names = {n for n, _ in tiny_gpt2.named_modules()} | {OUTSIDE}
    assert {r.module for r in saved.modules} <= names
    assert any(r.module.startswith("transformer.h.1.") for r in saved.modules)


def test_totals_count_params_grads_and_adam_state() -> None:
    model = DeepMLP()
    x = torch.randn(32, 64)
    saved = saved_activations(model, x, loss_fn="sum")
    n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    opt = torch.optim.Adam(model.parameters())
    totals = memory_totals(model, saved, opt)
    assert totals.parameters == totals.gradients == n_bytes
    assert (totals.optimizer_state, totals.optimizer_state_source) == (2 * n_bytes, "estimated")
    assert totals.peak_estimate == 4 * n_bytes + 73_728
    model(x).sum().backward()
    opt.step()
    after = memory_totals(model, saved, opt)
    real = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
    assert (after.optimizer_state, after.optimizer_state_source) == (real, "measured")


class _SelfCheckpointed(nn.Module):
    """A stem and three blocks, each run through `torch.utils.checkpoint` by the model's own
    forward (`reentrant`: which kind), then a head."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.stem = nn.Sequential(nn.Linear(512, 128), nn.Tanh())
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 128)) for _ in range(3))
        self.head = nn.Linear(128, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        x = checkpoint(self.stem, x, use_reentrant=self.reentrant)
        for block in self.blocks:
            x = checkpoint(block.forward, x, use_reentrant=self.reentrant)  # a bound method
        out: torch.Tensor = self.head(x)  # (B, 4)
        return out


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_model_that_checkpoints_itself_keeps_its_blocks_inputs_for_them(
        reentrant: bool) -> None:
    """What a checkpoint keeps is the input of what it checkpoints: counted for that module
    (it was all the root's, which only called `checkpoint`), and named in `checkpointed`."""
    torch.manual_seed(0)
    model = _SelfCheckpointed(reentrant)
    x = torch.randn(32, 512, requires_grad=True)
    saved = saved_activations(model, x, loss_fn="sum")
    assert saved.total_bytes == _plain_count(model, x)  # the same bytes as torch's own hooks
    assert saved.checkpointed == ("stem", "blocks.0", "blocks.1", "blocks.2")
    rows = {r.module: r.bytes for r in saved.modules}
    # Each checkpoint keeps its input, (32, 512) or (32, 128) float32; the head its own.
    assert rows == {"stem": 32 * 512 * 4, "blocks.0": 32 * 128 * 4, "blocks.1": 32 * 128 * 4,
                    "blocks.2": 32 * 128 * 4, "head": 32 * 128 * 4}
    fixes = {f.code: f.fix for f in saved.findings()}
    assert "checkpointed already" in fixes["memory.largest_saver"]


def test_transformers_checkpointing_is_named_by_layer() -> None:
    """transformers checkpoints each decoder layer through `partial(forward, layer)`."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
        use_cache=False))
    # `activation_checkpointing_enable` since transformers 5.24; before, the older name.
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    model.train()
    ids = torch.randint(0, 100, (2, 16))
    saved = saved_activations(model, {"input_ids": ids, "labels": ids})
    assert saved.checkpointed == ("model.layers.0", "model.layers.1", "model.layers.2")
    rows = {r.module: r.bytes for r in saved.modules}
    for i in range(3):  # its hidden states in, (2, 16, 32) float32
        assert rows[f"model.layers.{i}"] >= 2 * 16 * 32 * 4


def test_activation_dominated_memory_in_a_checkpointed_model_is_not_told_to_checkpoint(
        ) -> None:
    torch.manual_seed(0)
    model = _SelfCheckpointed(False)
    report = ckpt.analyze_memory(model, torch.randn(512, 512, requires_grad=True),
                                 loss_fn="sum", checkpoint="none")
    found = {f.code: f for f in report.findings()}
    assert "already checkpoints 4 part(s) itself (stem, blocks.0, blocks.1, ...)" in \
        found["memory.activations_dominate"].fix
    plain = ckpt.analyze_memory(DeepMLP(), torch.randn(512, 64), loss_fn="sum",
                                checkpoint="none")
    assert not plain.saved.checkpointed
    assert "already" not in {f.code: f for f in plain.findings()}[
        "memory.activations_dominate"].fix


def test_blocks_checkpointed_with_torchscopes_own_apply_are_named() -> None:
    model = DeepMLP()
    handle = ckpt.apply(model)
    try:
        saved = saved_activations(model, torch.randn(32, 64), loss_fn="sum")
    finally:
        handle.remove()
    assert saved.checkpointed == tuple(str(i) for i in range(8))


def test_saved_bytes_of_a_compiled_model_are_said_to_be_the_eager_ones() -> None:
    """Counting saves needs hooks, which need eager code: the count of a compiled model is
    the eager model's, and both the one-shot count and the watch say so (a note on the
    count, not a warning about the model); a plain model gets no such finding."""
    import torchscope

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(16, 8)
    report = torchscope.analyze_memory(compiled, x, loss_fn="sum", measure=False)
    assert report.saved.compiled == ("",)
    found = [f for f in report.findings() if f.code == "memory.compiled_eager"]
    assert [f.severity.label for f in found] == ["info"]  # a caveat of the count
    with torchscope.watch_memory(compiled) as watch:
        compiled(x).sum().backward()
    assert "memory.compiled_eager" in [f.code for f in watch.findings()]
    plain = torchscope.analyze_memory(model, x, loss_fn="sum", measure=False)
    assert plain.saved.compiled == ()
    assert "memory.compiled_eager" not in [f.code for f in plain.findings()]
