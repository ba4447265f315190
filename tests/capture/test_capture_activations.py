"""Activation capture against torch's own numbers, on real models and awkward outputs."""

from __future__ import annotations

import dataclasses
import gc
import weakref
from typing import Any

import pytest
import torch
from torch import nn

from torchscope.capture import (
    ActivationRecord,
    capture_activations,
    trace_nonfinite,
    watch_activations,
)
from torchscope.errors import BudgetError, ModelError, SelectionError, TorchscopeError
from torchscope.findings import Severity
from torchscope.hooks import audit_hooks
from torchscope.models import TinyCNN

# Every test here runs twice: statistics by eager ops, and by the fused kernel.
pytestmark = pytest.mark.usefixtures("reduction_path")


def rel_close(a: float, b: float, tol: float = 1e-6) -> bool:
    return abs(a - b) <= tol * max(abs(b), 1e-12)


def test_tiny_cnn_shapes_and_stats_equal_torch(reduction_path: str) -> None:
    model = TinyCNN().eval()
    x = torch.randn(32, 3, 32, 32)
    cap = capture_activations(model, x)
    conv1 = cap.get("conv1").output
    conv2 = cap.get("conv2").output
    assert conv1 is not None and conv2 is not None
    assert conv1.shape == (32, 8, 30, 30)
    assert conv2.shape == (32, 16, 28, 28)
    with torch.no_grad():
        refs = {"conv1": model.conv1(x)}
        refs["conv2"] = model.conv2(model.relu(refs["conv1"]))
    for name, ref32 in refs.items():
        s = cap.get(name).output
        assert s is not None
        assert s.fused == (reduction_path == "fused")
        # Both are checked against torch in float64. The fused kernel sums in float64: 1e-6.
        # Eager statistics are float32 reductions, whose rounding depends on how torch
        # splits them over threads: its std read 1.0e-6 off on one thread, 1e-5 allowed.
        ref = ref32.double()
        tol = 1e-6 if s.fused else 1e-5
        assert rel_close(s.mean, ref.mean().item(), tol)
        assert rel_close(s.std, ref.std().item(), tol)
        assert s.min == ref.min().item() and s.max == ref.max().item()
        assert rel_close(s.norm, ref.norm().item(), tol)
        assert rel_close(s.zero_frac, (ref == 0).float().mean().item())
        assert s.numel == ref.numel() and s.dtype == "torch.float32" and s.device == "cpu"
        assert s.nan_count == 0 and s.inf_count == 0
    relu = cap.get("relu").output
    assert relu is not None and relu.dead_units is not None
    assert relu.dead_units == int((refs["conv1"].clamp(min=0).amax(dim=(0, 2, 3)) == 0).sum())
    assert audit_hooks(model).local_total == 0


class Reuse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.lin(x) * 2)


def test_module_reused_within_one_forward_gives_one_record_per_call() -> None:
    model = Reuse()
    x = torch.randn(3, 4)
    cap = capture_activations(model, x)
    recs = [r for r in cap.records if r.module == "lin"]
    assert [r.call for r in recs] == [0, 1]
    with torch.no_grad():
        first = model.lin(x)
        second = model.lin(first * 2)
    assert recs[0].output is not None and recs[1].output is not None
    assert rel_close(recs[0].output.mean, first.mean().item())
    assert rel_close(recs[1].output.mean, second.mean().item())


@dataclasses.dataclass
class Out:
    hidden: torch.Tensor
    extra: str
    nothing: None = None


class Structured(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> dict[str, object]:
        h = self.a(x)
        return {"pair": (h, None, 3), "list": [h * 2], "dc": Out(h + 1, "x")}


class TupleLeaf(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.relu(), -x


def test_nested_tuple_dict_dataclass_outputs() -> None:
    model = Structured()
    cap = capture_activations(model, torch.randn(2, 4), select=None, depth=None)
    root = capture_activations(
        model, torch.randn(2, 4), select=lambda n, m: True, depth=None
    ).records
    assert {r.module for r in cap.records} == {"a"}
    top = [r for r in root if r.module == ""]
    assert top == []  # the root is only selectable with include_root; predicates see children
    with pytest.raises(SelectionError, match="predicate matched no module"):
        capture_activations(TupleLeaf(), torch.randn(2, 4), select=lambda n, m: True)
    cap2 = capture_activations(nn.Sequential(Structured()), torch.randn(2, 4), select="0")
    paths = [s.path for s in cap2.get("0").outputs]
    assert paths == ["['pair'][0]", "['list'][0]", "['dc'].hidden"]


def test_hf_model_output_and_gpt2(tiny_gpt2: nn.Module) -> None:
    ids = torch.randint(0, 100, (2, 8))
    cap = capture_activations(tiny_gpt2, {"input_ids": ids}, select="transformer.h.*,lm_head")
    names = [r.module for r in cap.records]
    assert names == ["transformer.h.0", "transformer.h.1", "lm_head"]
    logits = cap.get("lm_head").output
    with torch.no_grad():
        ref = tiny_gpt2(input_ids=ids).logits
    assert logits is not None and logits.shape == (2, 8, 100)
    assert rel_close(logits.mean, ref.mean().item(), 1e-5)
    # The HF block returns a tuple whose first item is the hidden state.
    block = cap.get("transformer.h.0").outputs[0]
    assert block.shape == (2, 8, 32)
    whole = capture_activations(
        nn.ModuleDict({"m": tiny_gpt2}).m, {"input_ids": ids}, select="transformer"
    )
    out = whole.get("transformer").outputs
    assert out[0].path == "['last_hidden_state']" and out[0].shape == (2, 8, 32)
    assert audit_hooks(tiny_gpt2).local_total == 0


def test_inplace_relu_stats_taken_before_modification() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 2))
    x = torch.randn(16, 8)
    cap = capture_activations(model, x)
    with torch.no_grad():
        pre = model[0](x)
    lin = cap.get("0").output
    relu = cap.get("1").output
    assert lin is not None and relu is not None
    assert lin.min == pre.min().item() < 0  # not clobbered by the in-place ReLU
    assert relu.min == 0.0
    assert rel_close(relu.zero_frac, (pre <= 0).float().mean().item())


def test_nan_producer_and_passers() -> None:
    class Bad(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x.clone()
            y[0, 0] = float("nan")
            return y

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), Bad(), nn.Linear(4, 4), nn.Tanh())
    cap = capture_activations(model, torch.randn(3, 4))
    trace = trace_nonfinite(cap.records)
    assert trace.producer is not None and trace.producer.module == "2"
    assert trace.producer.output is not None and trace.producer.output.nan_count == 1
    assert [r.module for r in trace.passers] == ["3", "4"]
    clean = capture_activations(nn.Sequential(nn.Linear(4, 4)), torch.randn(3, 4))
    assert trace_nonfinite(clean.records).clean


def test_inf_counted_separately_from_nan() -> None:
    class Inf(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x / torch.tensor([0.0, 1.0, 1.0, float("nan")])

    cap = capture_activations(nn.Sequential(Inf()), torch.ones(2, 4))
    s = cap.get("0").output
    assert s is not None and s.inf_count == 2 and s.nan_count == 2


def test_store_tensors_budget_error_and_skip() -> None:
    model = TinyCNN()
    x = torch.randn(4, 3, 16, 16)
    cap = capture_activations(model, x, store="tensors", select="conv1,conv2")
    kept = cap.tensors
    with torch.no_grad():
        ref = model.conv1(x)
    assert torch.equal(kept[(0, "conv1#0", "")], ref)
    assert kept[(0, "conv1#0", "")].device.type == "cpu"
    assert cap.stored_bytes == sum(t.numel() * t.element_size() for t in kept.values())
    conv1_bytes = ref.numel() * 4
    with pytest.raises(BudgetError, match="max_bytes"):
        capture_activations(model, x, store="tensors", max_bytes=conv1_bytes)
    assert audit_hooks(model).local_total == 0
    with pytest.warns(RuntimeWarning, match="skipping"):
        cap = capture_activations(
            model, x, store="tensors", max_bytes=conv1_bytes, on_budget="skip", select="conv1,conv2"
        )
    assert list(cap.tensors) == [(0, "conv1#0", "")]
    assert len(cap.records) == 2  # stats are still recorded for the skipped tensor


def test_context_manager_in_user_loop_records_each_step() -> None:
    model = TinyCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with watch_activations(model, select="Conv2d") as acts:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(2, 3, 10, 10)).sum().backward()
            opt.step()
            assert audit_hooks(model).local_total > 0
    assert audit_hooks(model).local_total == 0
    assert [(r.step, r.module) for r in acts.records] == [
        (0, "conv1"),
        (0, "conv2"),
        (1, "conv1"),
        (1, "conv2"),
        (2, "conv1"),
        (2, "conv2"),
    ]
    assert [r.step for r in acts.last()] == [2, 2]


def test_model_error_cleans_up_and_restores_mode() -> None:
    model = TinyCNN().train()
    with pytest.raises(ModelError, match=r"conv1 \(Conv2d\).*3 channels"):
        capture_activations(model, torch.randn(2, 4, 8, 8), train=False)
    assert audit_hooks(model).local_total == 0
    assert all(m.training for m in model.modules())


def test_model_collected_after_capture() -> None:
    model = TinyCNN()
    ref = weakref.ref(model)
    conv_ref = weakref.ref(model.conv1)
    cap = capture_activations(model, torch.randn(1, 3, 8, 8))
    del model
    gc.collect()
    assert ref() is None and conv_ref() is None
    assert len(cap.records) == 5  # the records outlive the model


def test_half_precision_stats() -> None:
    model = nn.Sequential(nn.Linear(8, 8)).to(torch.bfloat16)
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    cap = capture_activations(model, x)
    with torch.no_grad():
        ref = model(x).float()
    s = cap.get("0").output
    assert s is not None and s.dtype == "torch.bfloat16"
    assert rel_close(s.mean, ref.mean().item(), 1e-5)


def test_uncounted_mode_keeps_exact_finiteness_and_producer() -> None:
    class Bad(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x / torch.tensor([0.0, 1.0, 1.0, 1.0])

    model = nn.Sequential(nn.Linear(4, 4), Bad(), nn.Linear(4, 4))
    cap = capture_activations(model, torch.ones(2, 4), count_nonfinite=False)
    bad = cap.get("1").output
    assert bad is not None and bad.nan_count is None and not bad.finite
    good = cap.get("0").output
    assert good is not None and good.finite
    trace = trace_nonfinite(cap.records)
    assert trace.producer is not None and trace.producer.module == "1"
    assert [r.module for r in trace.passers] == ["2"]


@pytest.mark.parametrize("shift", [0.0, 50.0])
def test_std_and_norm_accurate_with_large_mean(shift: float) -> None:
    x = torch.randn(64, 256) + shift
    cap = capture_activations(nn.Sequential(nn.Identity()), x)
    s = cap.get("0").output
    assert s is not None
    assert rel_close(s.std, x.std().item(), 1e-5)
    assert rel_close(s.norm, x.norm().item())
    assert rel_close(s.mean, x.mean().item(), 1e-5)


@pytest.mark.parametrize("count_nonfinite", [True, False])
def test_empty_int_and_bool_outputs_give_records(count_nonfinite: bool) -> None:
    class Odd(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return x[:0], x > 0, x.long()

    model = nn.Sequential(nn.ReLU(), Odd())
    x = torch.randn(3, 4)
    rec = capture_activations(model, x, count_nonfinite=count_nonfinite).get("1")
    empty, flags, ints = rec.outputs
    assert empty.numel == 0 and empty.shape == (0, 4) and empty.finite
    assert empty.nan_count == (0 if count_nonfinite else None)
    assert empty.dead_units is None
    assert rel_close(flags.mean, (x.relu() > 0).float().mean().item())
    assert ints.dtype == "torch.int64" and ints.max == x.relu().long().max().item()
    assert rec.finite and rec.inputs_finite


def test_call_without_any_tensor_gives_a_record_with_no_outputs() -> None:
    class Tick(nn.Module):
        def forward(self) -> None:
            return None

    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tick = Tick()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.tick()
            return x * 2

    cap = capture_activations(Root(), torch.ones(2))
    (rec,) = cap.records
    assert rec.module == "tick" and rec.outputs == () and rec.output is None and rec.finite


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_model_with_cpu_tensors_in_its_calls() -> None:
    # A PackedSequence keeps batch_sizes on the CPU while its data is on the GPU.
    lstm = nn.LSTM(4, 3).cuda()
    x = torch.randn(5, 2, 4, device="cuda")
    packed = nn.utils.rnn.pack_padded_sequence(x, torch.tensor([5, 3]))
    cap = capture_activations(lstm, (packed,))
    (rec,) = cap.records
    with torch.no_grad():
        ref = lstm(packed)[0].data
    data = rec.outputs[0]
    assert data.device.startswith("cuda") and rel_close(data.mean, ref.mean().item(), 1e-5)
    sizes = rec.outputs[1]
    assert sizes.device == "cpu" and sizes.max == 2.0 and rec.inputs_finite


def test_capture_whose_open_fails_removes_the_hooks_it_added() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[1].register_forward_hook = None  # type: ignore[method-assign,assignment]
    with pytest.raises(TypeError), watch_activations(model):
        pass
    del model[1].register_forward_hook
    assert audit_hooks(model).local_total == 0


@pytest.mark.parametrize(
    ("option", "match"),
    [
        ({"store": "all"}, r"store='all' is not a capture mode.*Fix: pass store="),
        ({"on_budget": "warn"}, r"on_budget='warn' is not a budget policy.*Fix: pass on_budget="),
        ({"max_bytes": -1}, r"max_bytes=-1 is negative.*Fix: pass max_bytes=0"),
    ],
)
def test_bad_options_are_one_clear_error_before_any_hook(option: dict, match: str) -> None:
    model = TinyCNN()
    with pytest.raises(TorchscopeError, match=match) as info:
        capture_activations(model, torch.randn(1, 3, 8, 8), **option)
    assert "\n" not in str(info.value)
    assert audit_hooks(model).local_total == 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_model_input_is_no_module_s_fault(bad: float) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    x = torch.randn(3, 4)
    x[1, 2] = bad
    cap = capture_activations(model, x)
    first = cap.get("0")
    assert not first.inputs_finite and not first.finite
    trace = trace_nonfinite(cap.records)
    assert trace.producer is None and not trace.clean
    clean = capture_activations(model, torch.randn(3, 4))
    assert clean.get("0").inputs_finite and trace_nonfinite(clean.records).clean


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpoint_recomputation_is_not_recorded_again(
        checkpointed_blocks: type[nn.Module], reentrant: bool) -> None:
    """Backward recomputes the checkpointed blocks' forward (a reentrant checkpoint all of
    it, the other kind until it has what it needs): the same values again, which were
    recorded as each module's second call of the step."""
    torch.manual_seed(0)
    plain = checkpointed_blocks(None)
    model = checkpointed_blocks(reentrant)
    model.load_state_dict(plain.state_dict())
    x = torch.randn(4, 8, requires_grad=True)  # else a reentrant checkpoint has no backward
    records = []
    for m in (plain, model):
        with watch_activations(m) as acts:
            for _ in range(2):
                m.zero_grad()
                m(x).sum().backward()
        records.append(acts.records)
        assert audit_hooks(m).local_total == 0
    want, got = records
    assert [(r.step, r.module, r.call) for r in got] == \
        [(r.step, r.module, r.call) for r in want]
    assert max(r.call for r in got) == 0
    for a, b in zip(want, got, strict=True):
        assert a.outputs == b.outputs, a.module


@pytest.mark.parametrize("count_nonfinite", [True, False])
def test_complex_outputs_are_read_over_both_parts(count_nonfinite: bool) -> None:
    # Spectral layers (FNO) and complex-valued networks: a cast to float would read the
    # real part only, and miss a NaN in the imaginary one.
    class Spectral(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            z = torch.fft.fft(x)  # (2, 8) complex64; the imaginary part of column 0 is 0
            return torch.complex(z.real, z.imag / torch.tensor([0.0] + [1.0] * 7))  # 0/0

    torch.manual_seed(0)
    x = torch.randn(2, 8)
    z = torch.fft.fft(x)
    cap = capture_activations(nn.Sequential(nn.Identity(), Spectral()), x,
                              count_nonfinite=count_nonfinite)
    s = cap.get("1").output
    assert s is not None and s.dtype == "torch.complex64" and not s.finite
    if count_nonfinite:
        assert s.nan_count == 2  # column 0's imaginary part, in both rows
    clean = capture_activations(nn.Sequential(nn.Identity(), nn.Identity()), z)
    c = clean.get("1").output
    assert c is not None and c.finite
    parts = torch.view_as_real(z).reshape(-1)  # (32,) real and imaginary parts
    assert rel_close(c.norm, torch.linalg.vector_norm(z).item())
    assert rel_close(c.mean, parts.mean().item(), 1e-5)
    assert (c.min, c.max) == (parts.min().item(), parts.max().item())


def test_a_parametrized_layers_record_is_its_output_not_its_weight() -> None:
    # weight_norm's module computes the layer's weight (16, 8): it was the leaf recorded,
    # with the weight's statistics in place of the layer's output.
    from torch.nn.utils import parametrizations

    torch.manual_seed(0)
    model = nn.Sequential(parametrizations.weight_norm(nn.Linear(8, 16)), nn.ReLU())
    x = torch.randn(4, 8)
    cap = capture_activations(model, x)
    assert [r.module for r in cap.records] == ["0", "1"]
    out = cap.get("0").output
    assert out is not None and out.shape == (4, 16)
    assert rel_close(out.std, model[0](x).std().item(), 1e-5)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_nested_tensors_of_the_transformer_encoder_fast_path_are_read_over_their_elements(
        ) -> None:
    # In evaluation with a padding mask, nn.TransformerEncoder passes nested tensors
    # between its layers: the capture raised in its first hook (a reshape of a nested
    # tensor). Statistics are over the elements, padding left out.
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64,
                                       batch_first=True)
    enc = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=True).eval()
    x = torch.randn(4, 10, 32)
    mask = torch.zeros(4, 10, dtype=torch.bool)
    mask[0, 7:] = True
    mask[1, 5:] = True
    seen: dict[str, torch.Tensor] = {}
    handle = enc.layers[0].linear1.register_forward_hook(
        lambda _m, _a, out: seen.__setitem__("out", out.detach()))
    with torch.no_grad():
        cap = capture_activations(enc, {"src": x, "src_key_padding_mask": mask})
    handle.remove()
    out = seen["out"]
    assert out.is_nested  # the fast path ran
    values = torch.cat(out.unbind())  # (7 + 5 + 10 + 10, 64)
    rec = cap.get("layers.0.linear1").output
    assert rec is not None and rec.shape == (4, -1, 64) and rec.numel == values.numel()
    assert rel_close(rec.mean, values.mean().item(), 1e-5)
    assert rel_close(rec.std, values.std().item(), 1e-5)
    assert rec.max == values.max().item() and rec.min == values.min().item()
    assert not cap.findings()


def test_attention_and_stacked_experts_are_recorded_and_judged_by_default() -> None:
    """nn.MultiheadAttention computes with its own weights and never calls out_proj: with
    leaves alone it had no record, and a NaN it produced was blamed on the next module.
    A module with parameters of its own is judged even where a child of it ran inside
    (a mixture of experts' expert weights, whose only child is the activation)."""
    from torchscope.capture.analyze import leaf_modules

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    model = nn.Sequential(nn.Linear(4, 16), nn.TransformerEncoder(
        layer, 2, enable_nested_tensor=False), nn.Linear(16, 3))
    x = torch.randn(2, 5, 4)
    healthy = capture_activations(model, x)
    attn = healthy.get("1.layers.0.self_attn")
    assert attn.owns_params and attn.output is not None
    assert [f for f in healthy.findings() if f.severity >= Severity.WARNING] == []
    with torch.no_grad():
        # (out_proj's weight: MHA reads it in its own forward; with need_weights=False a NaN
        # in the input projection vanishes in torch's CPU attention kernel)
        model[1].layers[1].self_attn.out_proj.weight[0, 0] = float("nan")
    broken = capture_activations(model, x)
    trace = trace_nonfinite(broken.records)
    assert trace.producer is not None and trace.producer.module == "1.layers.1.self_attn"
    nonfinite = [f for f in broken.findings() if f.code == "activations.nonfinite"]
    assert [f.module for f in nonfinite] == ["1.layers.1.self_attn"]

    class Experts(nn.Module):  # stacked expert weights, as transformers' Mixtral holds them
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Parameter(torch.randn(4, 8, 16) * 0.1)  # (experts, in, out)
            self.act = nn.SiLU()

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return self.act(h @ self.up[0]).sum(-1, keepdim=True)  # (batch, 1)

    moe = nn.Sequential(nn.Linear(8, 8), Experts())
    cap = capture_activations(moe, torch.randn(3, 8))
    assert [r.module for r in cap.records] == ["0", "1.act", "1"]
    assert leaf_modules(cap.records) == {"0", "1.act", "1"}

    class Embed(nn.Module):  # as ViT's embeddings: own position parameters, then dropout
        def __init__(self) -> None:
            super().__init__()
            self.pos = nn.Parameter(torch.randn(8) * 0.1)
            self.drop = nn.Dropout(0.0)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.drop(h + self.pos)
            return out

    # Its output is its dropout's, the same tensor: judged (and counted) there, once.
    cap = capture_activations(nn.Sequential(nn.Linear(8, 8), Embed()), torch.randn(3, 8))
    assert [r.module for r in cap.records] == ["0", "1.drop", "1"]
    assert cap.get("1").owns_params
    assert leaf_modules(cap.records) == {"0", "1.drop"}


class _Mixed(nn.Module):
    """Every kind of value a hook queues: ReLU dead units, Tanh saturation, a model input's
    feature scale, an integer input (no finiteness value) and a float one (one)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.fc, self.relu = nn.Embedding(10, 6), nn.Linear(6, 6), nn.ReLU()
        self.tanh, self.head = nn.Tanh(), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:  # (4, 6), (4,)
        h = self.relu(self.fc(x))  # the model input's statistics and feature scale
        return self.head(self.tanh(h * 3) + self.emb(ids))  # (4, 3)


def test_records_are_those_their_dataclasses_build(reduction_path: str) -> None:
    """The flush builds records without their frozen dataclasses' `__init__` (a third of
    the time): each must hold exactly the dataclass's fields, compare equal to one built
    through `__init__` and survive a pickle."""
    import pickle

    torch.manual_seed(0)
    model = _Mixed()
    with torch.no_grad():
        model.fc.bias.fill_(-1.0)  # some dead units
    with watch_activations(model, select="*") as cap:
        model(torch.randn(4, 6), torch.randint(0, 10, (4,)))
    records = cap.records
    stats = [s for r in records for s in (*r.outputs, r.model_input) if s is not None]
    assert any(s.dead_units is not None for s in stats)
    assert any(s.saturated_frac is not None for s in stats)
    assert any(s.feature_rms_max is not None for s in stats)
    objs: list[Any] = [*records, *stats]
    for obj in objs:
        assert list(vars(obj)) == [f.name for f in dataclasses.fields(obj)]
        assert dataclasses.replace(obj) == obj  # through __init__
    assert pickle.loads(pickle.dumps(records)) == records


def test_forwards_read_late_are_those_read_at_once(reduction_path: str) -> None:
    """A capture read once after many forwards (its later forwards' values joined on the
    device as they end) gives the records of one read after every forward."""
    torch.manual_seed(0)
    model = _Mixed()
    batches = [(torch.randn(4, 6) * (i + 1), torch.randint(0, 10, (4,))) for i in range(7)]
    with watch_activations(model, select="*") as each:
        per_forward: list[ActivationRecord] = []
        for x, ids in batches:
            model(x, ids)
            per_forward.extend(each.last())
    with watch_activations(model, select="*") as late:
        for x, ids in batches:
            model(x, ids)
        assert len(late._pending) == len(batches)
        assert [len(f.values) for f in late._pending][4:] == [1, 1, 1]  # joined
    assert late.records == tuple(per_forward) == each.records


def test_an_unrecorded_forward_keeps_the_recorded_one_s_input_finiteness() -> None:
    """A forward the sampler leaves out (`active=False`) between a recorded one and the
    read must not drop what that one noted about the model's own input."""
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    with watch_activations(model) as cap:
        model(torch.randn(2, 3))
        cap.active = False
        model(torch.full((2, 3), float("nan")))
    (first, _) = cap.records
    assert first.model_inputs_finite is True and first.step == 0


def test_values_on_several_devices_come_back_in_queue_order() -> None:
    """The host copy joins each device's values once for every pending forward (a CUDA
    model's calls see CPU tensors too; a model split over GPUs has outputs on each): each
    forward gets its own values back in the order its hooks queued them. The layout on
    device names, where this machine may have no GPU."""
    from torchscope.capture.activations import _assemble, _layout

    gpu0, gpu1, cpu = torch.device("cuda:0"), torch.device("cuda:1"), torch.device("cpu")
    # Forward 0 all on gpu0 (one run); forward 1 mixed, value by value.
    runs = [[(gpu0, 3)], [(gpu0, 2), (cpu, 1), (gpu1, 2), (gpu0, 1)]]
    queued = [[0.0, 1.0, 2.0], [10.0, 11.0, 12.0, 13.0, 14.0, 15.0]]
    # What each device's join holds: its values, forward after forward.
    host = {gpu0: [0.0, 1.0, 2.0, 10.0, 11.0, 15.0], cpu: [12.0], gpu1: [13.0, 14.0]}
    layout, sizes = _layout(runs)
    assert sizes == {d: len(v) for d, v in host.items()}
    assert [_assemble(p, len(q), host) for p, q in zip(layout, queued, strict=True)] == queued


def test_unnamed_walk_gives_the_same_tensors_in_the_same_order() -> None:
    """The capture walks a forward's inputs and outputs without building their paths
    (`iter_tensors(named=False)`): the same tensors, in the same order, as the named walk."""
    from torchscope.hooks.tree import iter_tensors

    @dataclasses.dataclass
    class Out:
        hidden: torch.Tensor
        extra: tuple[torch.Tensor, ...]

    class Holder:
        def __init__(self) -> None:
            self.cache = [torch.zeros(1), {"k": torch.ones(2)}]

    a, b, c, d = (torch.full((i + 1,), float(i)) for i in range(4))
    obj = {"x": a, "y": [None, (b, Out(c, (d, a)))], "z": Holder(), "n": 3}
    for objects in (False, True):
        named = list(iter_tensors(obj, objects=objects))
        bare = list(iter_tensors(obj, objects=objects, named=False))
        assert len(bare) == len(named) == 5 + 2 * objects
        assert all(x is y for (_, x), (_, y) in zip(bare, named, strict=True))
        assert {p for p, _ in bare} == {""} and len({p for p, _ in named}) == len(named)
