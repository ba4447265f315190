"""Reversible checkpointing: every block, no lost gradient, exact restore, dropout."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

import torchscope.memory as ckpt
from torchscope.errors import SelectionError, TorchscopeError, VerificationError
from torchscope.memory import saved_activations
from torchscope.models import DeepMLP


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: p.grad for n, p in model.named_parameters()}


def test_every_block_checkpointed_including_the_last() -> None:
    model = DeepMLP()
    x = torch.randn(32, 64)
    with ckpt.apply(model, example_inputs=x) as handle:
        assert handle.checkpointed == tuple(str(i) for i in range(8))
        assert handle.verification is not None and handle.verification.bitwise_equal
        saved = saved_activations(model, x, loss_fn="sum")
    # Each block keeps only its input; the last block's output is no longer saved.
    assert saved.total_bytes == 8 * 8_192
    assert [r.module for r in saved.modules] == [str(i) for i in range(8)]


def test_gradients_bitwise_identical_against_a_plain_step() -> None:
    model = DeepMLP()
    x = torch.randn(32, 64)
    model(x).sum().backward()
    ref = {n: g.clone() for n, g in _grads(model).items() if g is not None}
    model.zero_grad(set_to_none=True)
    with ckpt.apply(model, segments=[(0, 3), (3, 6), (6, 8)]):
        model(x).sum().backward()
    got = _grads(model)
    assert set(ref) == {n for n, g in got.items() if g is not None} and len(ref) == 16
    assert all(torch.equal(ref[n], got[n]) for n in ref)  # type: ignore[arg-type]


@pytest.mark.parametrize("segments", [None, [(0, 3), (3, 6), (6, 8)], [(0, 8)], [(7, 8)]])
def test_no_parameter_gradient_lost_when_input_needs_no_grad(segments) -> None:
    model = DeepMLP()
    x = torch.randn(32, 64)
    assert not x.requires_grad
    with ckpt.apply(model, segments=segments, example_inputs=x) as handle:
        model(x).sum().backward()
        assert handle.verification is not None and handle.verification.ok
    assert all(p.grad is not None for p in model.parameters())


def test_the_reentrant_pitfall_that_torchscope_avoids() -> None:
    """torch's reentrant checkpoint_sequential drops gradients here; torchscope's plans don't."""
    model = DeepMLP()
    x = torch.randn(32, 64)
    with pytest.warns(UserWarning):  # torch warns that no input requires grad
        checkpoint_sequential(model, 2, x, use_reentrant=True).sum().backward()
    lost = [n for n, p in model.named_parameters() if p.grad is None]
    assert len(lost) == 8  # the first segment (blocks 0-3) gets no gradient at all


def test_kv_cache_mutation_is_a_verification_error(tiny_gpt2: nn.Module) -> None:
    """With `use_cache=True` each attention layer appends to the KV cache it returns, and
    recomputation appends again. transformers 4 then fails the recomputation (the keys
    have another shape); transformers 5 recomputes the same gradients (causal attention
    over the doubled cache sees the same first keys), and the returned cache ends twice as
    long: the verification compares what the model returned, after backward."""
    import transformers

    ids = torch.randint(0, 100, (2, 16))  # use_cache=True: forward appends to a KV cache
    major = int(transformers.__version__.split(".")[0])
    match = "use_cache=False" if major < 5 else (
        r"4 tensor\(s\) the model returned .* output\[.+\]\.layers\[0\]\.keys "
        r"was \(2, 2, 16, 16\) float32 and became \(2, 2, 32, 16\) float32.*use_cache=False")
    with pytest.raises(VerificationError, match=match):
        ckpt.apply(tiny_gpt2, example_inputs=ids)
    assert not any("forward" in vars(m) for m in tiny_gpt2.modules())


class _Log:
    """State a model returns and its blocks append to, as a KV cache is."""

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []
        self.calls = torch.zeros((), dtype=torch.int64)


class _Block(nn.Module):
    def __init__(self, record: bool) -> None:
        super().__init__()
        self.record = record
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, log: _Log) -> torch.Tensor:
        # Before any op that saves for backward: non-reentrant recomputation stops once the
        # last saved tensor is back, so only what comes before it runs twice.
        with torch.no_grad():
            log.calls += 1
        if self.record:
            log.seen.append(x.detach())
        return torch.tanh(self.linear(x))


class _Logging(nn.Module):
    def __init__(self, record: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(record) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, _Log]:
        log = _Log()
        for block in self.blocks:
            x = block(x, log)
        return x, log


def _returned_paths(v: object) -> list[tuple[str, str, str]]:
    from torchscope.memory import Verification

    assert isinstance(v, Verification)
    return [(c.path, c.without, c.with_checkpointing) for c in v.outputs]


def test_state_the_recomputation_changes_fails_the_verification() -> None:
    """A block whose forward bumps a counter the model returns: the gradients are exact,
    but with checkpointing the counter ends at 6, not 3."""
    model = _Logging(record=False)
    x = torch.randn(4, 8)
    handle = ckpt.apply(model, "blocks")
    try:
        v = ckpt.verify(model, handle, x, loss_fn=lambda out: out[0].sum())
    finally:
        handle.remove()
    assert v.ok and v.bitwise_equal
    assert _returned_paths(v) == [("output[1].calls", "() int64", "() int64")]
    with pytest.raises(VerificationError, match=r"the values of output\[1\]\.calls \(\(\) "
                       r"int64\) changed"):
        ckpt.check(v)
    from torchscope.report.memory import verification_table

    assert verification_table(v).caption.endswith(
        "; 1 returned tensor(s) ended differently, first output[1].calls")


def test_appended_state_is_named_per_micro_batch() -> None:
    """Recomputed blocks append to a list the model returns; with two micro-batches each
    one's output is read after its own backward."""
    from torchscope.step import Step

    model = _Logging(record=True)
    step = Step(model, torch.randn(4, 8), loss_fn=lambda out: out[0].sum(), accumulate=2)
    with ckpt.apply(model, "blocks") as handle:
        v = ckpt.verify(step, handle)
    assert v.ok
    changed = _returned_paths(v)
    # Each micro-batch (`output[micro]`, whose `[1]` is the log): 3 recorded calls
    # without, 6 with, the recomputation recording again.
    for micro in (0, 1):
        assert (f"output[{micro}][1].calls", "() int64", "() int64") in changed
        assert [c for c in changed if c[0].startswith(f"output[{micro}][1].seen")] == [
            (f"output[{micro}][1].seen[{i}]", "absent", "(2, 8) float32") for i in (3, 4, 5)]
    assert len(changed) == 8


def test_a_model_that_returns_state_it_does_not_change_verifies() -> None:
    """Healthy: the returned state (hidden states in a tuple, a dict) is the same."""
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)])

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = model

        def forward(self, x: torch.Tensor) -> dict[str, object]:
            hidden = [x]
            for block in self.body:
                hidden.append(torch.relu(block(hidden[-1])))
            return {"out": hidden[-1], "hidden": tuple(hidden), "log": _Log()}

    wrapped = Wrapped()
    with ckpt.apply(wrapped, "body", example_inputs=torch.randn(4, 8),
                    loss_fn=lambda out: out["out"].sum()) as handle:
        assert handle.verification is not None and handle.verification.outputs == ()


def test_apply_and_remove_leave_gpt2_identical(tiny_gpt2: nn.Module) -> None:
    ids = {"input_ids": torch.randint(0, 100, (2, 16)), "use_cache": False}
    state = {k: v.clone() for k, v in tiny_gpt2.state_dict().items()}
    attrs = {n: dict(vars(m)) for n, m in tiny_gpt2.named_modules()}
    with torch.no_grad():
        out = tiny_gpt2(**ids).logits
    handle = ckpt.apply(tiny_gpt2, example_inputs=ids)
    assert handle.blocks.names == ("transformer.h.0", "transformer.h.1")
    assert handle.verification is not None and handle.verification.bitwise_equal
    assert handle.verification.outputs == ()  # the logits, compared after backward
    assert "forward" in vars(tiny_gpt2.transformer.h[0])
    handle.remove()
    handle.remove()  # idempotent
    after = tiny_gpt2.state_dict()
    assert list(after) == list(state)
    assert all(torch.equal(state[k], v) for k, v in after.items())
    for n, m in tiny_gpt2.named_modules():
        assert set(vars(m)) == set(attrs[n]), n
    with torch.no_grad():
        assert torch.equal(tiny_gpt2(**ids).logits, out)
    assert all(p.grad is None for p in tiny_gpt2.parameters())


def test_dropout_model_verifies_bitwise() -> None:
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Dropout(0.3), nn.GELU())
                            for _ in range(4)]).train()
    x = torch.randn(8, 32, requires_grad=True)
    with ckpt.apply(model, segments=[(0, 2), (2, 3), (3, 4)], example_inputs=x) as handle:
        v = handle.verification
        assert v is not None and v.bitwise_equal and v.ok
        assert any(g.name == "input[0]" for g in v.grads)
    assert x.grad is None


def test_unreplayed_randomness_fails_loudly_and_is_removed() -> None:
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Dropout(0.5))
                            for _ in range(3)]).train()
    x = torch.randn(8, 32)
    with pytest.raises(VerificationError, match="checkpointing changed the result"):
        ckpt.apply(model, preserve_rng_state=False, example_inputs=x)
    assert not any("forward" in vars(m) for m in model.modules())


def test_block_resolution_and_errors(tiny_gpt2: nn.Module) -> None:
    assert ckpt.resolve_blocks(tiny_gpt2).names == ("transformer.h.0", "transformer.h.1")
    assert not ckpt.resolve_blocks(tiny_gpt2).groupable
    assert ckpt.resolve_blocks(tiny_gpt2, "transformer.h.*").names == (
        "transformer.h.0", "transformer.h.1")
    assert ckpt.resolve_blocks(tiny_gpt2, "GPT2MLP").names == (
        "transformer.h.0.mlp", "transformer.h.1.mlp")
    with pytest.raises(SelectionError, match="contains block"):
        ckpt.resolve_blocks(tiny_gpt2, ["transformer.h.0", "transformer.h.0.mlp"])
    with pytest.raises(SelectionError, match="cannot run under one checkpoint"):
        ckpt.apply(tiny_gpt2, segments=[(0, 2)])
    model = DeepMLP()
    assert ckpt.resolve_blocks(model).groupable
    with ckpt.apply(model), pytest.raises(TorchscopeError, match="already checkpointed"):
        ckpt.apply(model)
    assert not any("forward" in vars(m) for m in model.modules())


def test_deepcopy_and_pickle_of_a_checkpointed_model() -> None:
    import copy
    import pickle

    model = DeepMLP()
    x = torch.randn(32, 64)
    ref = model(x).detach()
    with ckpt.apply(model, segments=[(0, 4), (4, 5), (7, 8)]):
        twin = copy.deepcopy(model)
        clone = pickle.loads(pickle.dumps(model))
    for other in (twin, clone):
        with torch.no_grad():
            other[0][0].weight.zero_()  # the copy must not run the original's parameters
        assert not torch.equal(other(x), ref)
        other(x).sum().backward()
        assert all(p.grad is not None for p in other.parameters())
        assert all(p.grad is None for p in model.parameters())
    assert torch.equal(model(x), ref)
    assert not any("forward" in vars(m) for m in model.modules())
