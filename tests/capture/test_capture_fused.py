"""The fused statistics kernel against the eager ops and against float64 truth; no host sync
in the hooks; the user's Dynamo state, environment and RNG untouched; which path ran.

Tolerances. Min, max and the counts are compared exactly. The AOTInductor kernels sum in
float64 (error ~n·2^-53, below 1e-9 relative here), so against float64 torch their mean, std
and norm must agree to 1e-9. The native CPU float32 kernel sums 32 elements per float32 lane
and goes to float64 every 1024 elements: its rounding stays near float32's own (~1e-7 at
worst: 32 roundings of 2^-24 on the longest float32 chain; 1.1e-7 measured on a norm), so
it must agree to 1e-6. The eager path is torch's own float32 reductions: for n <= 2^17
elements their accumulation error stays below 1e-4 relative (float32 eps 6e-8 grown by
sequential sums per SIMD lane, up to ~n/64 eps; 2.4e-5 measured here on the norm of 50 000
elements near 1000), so fused and eager must agree to 1e-4 (the mean relative to the
tensor's RMS, since a mean near 0 has no relative precision).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import ClassVar, Literal

import pytest
import torch
from torch import nn
from torch.nn import functional

from torchscope import _kernels
from torchscope._kernels import INFS, MAX, MEAN, MIN, NANS, NORM, STD, ZEROS
from torchscope.capture import capture_activations, watch_activations
from torchscope.capture.stats import reduce_stats
from torchscope.models import TinyCNN


@pytest.fixture(scope="module")
def fused_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes whose `stats` kernel is ready (built once per machine); skips without a
    C++ compiler."""
    ready = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        status = _kernels.prepare("stats", dtype, wait=None)
        if status.state != "ready":
            pytest.skip(f"no fused kernel here: {status.reason}")
        ready.append(dtype)
    return tuple(ready)


def _cases(dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    yield "two elements", torch.tensor([1.5, -2.0]).to(dtype)
    yield "odd length", randn(100_003)
    yield "conv activation", randn(8, 16, 30, 30)
    yield "channels-last", randn(8, 16, 30, 30).contiguous(memory_format=torch.channels_last)
    yield "transposed", randn(300, 200).t()
    yield "strided slice", randn(400, 300)[:, ::3]
    yield "expanded", randn(1, 64).expand(512, 64)
    yield "relu output", torch.relu(randn(64, 32, 9, 9))
    yield "constant", torch.full((1000,), 3.25).to(dtype)
    yield "large offset", (1e3 + randn(50_000)).to(dtype)
    bad = randn(20_000)
    bad[::997] = float("nan")
    bad[5::1999] = float("inf")
    bad[7] = float("-inf")
    bad[::13] = 0.0
    yield "NaN, Inf and zeros", bad
    inf_first = randn(5000)
    inf_first[0] = float("inf")
    yield "Inf first", inf_first


def _backend(program: Literal["stats", "norm"], dtype: torch.dtype) -> str:
    """Which kernel reduces `dtype` on the CPU: `native` or `aotinductor`."""
    return _kernels.prepare(program, dtype, wait=None).backend


def _rel(a: float, b: float, scale: float) -> float:
    if math.isnan(a) or math.isnan(b):
        return 0.0 if math.isnan(a) and math.isnan(b) else math.inf
    if math.isinf(a) or math.isinf(b):
        return 0.0 if a == b else math.inf
    return abs(a - b) / max(scale, 1e-30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["float32", "bfloat16", "float16"])
def test_fused_equals_eager_and_float64_truth(fused_dtypes: tuple[torch.dtype, ...],
                                              dtype: torch.dtype) -> None:
    assert dtype in fused_dtypes
    for name, t in _cases(dtype):
        fused = _kernels.run("stats", t)
        assert fused is not None, (name, _kernels.why_eager("stats", t))
        f = fused.tolist()
        e = reduce_stats(t).tolist()
        ref = t.double()
        finite = bool(torch.isfinite(ref).all())
        # Exact: min, max, zero fraction and the NaN/Inf counts.
        assert f[MIN] == e[MIN] or (math.isnan(f[MIN]) and math.isnan(e[MIN])), name
        assert f[MAX] == e[MAX] or (math.isnan(f[MAX]) and math.isnan(e[MAX])), name
        assert f[ZEROS] == e[ZEROS] == float((ref == 0).sum()) / t.numel(), name
        assert f[NANS] == e[NANS] == float(ref.isnan().sum()), name
        assert f[INFS] == e[INFS] == float(ref.isinf().sum()), name
        if not finite:
            # Non-finite data: the moments are NaN or Inf exactly where eager's are.
            for slot in (MEAN, STD, NORM):
                assert _rel(f[slot], e[slot], 1.0) == 0.0, (name, slot, f[slot], e[slot])
            continue
        rms = math.sqrt(float((ref * ref).mean()))
        tol = 1e-6 if _backend("stats", dtype) == "native" else 1e-9
        truth = {MEAN: float(ref.mean()), STD: float(ref.std()), NORM: float(ref.norm())}
        scale = {MEAN: rms, STD: max(truth[STD], 1e-30 * rms), NORM: truth[NORM]}
        for slot, want in truth.items():
            assert _rel(f[slot], want, scale[slot]) <= tol, (name, slot, f[slot], want)
            if truth[STD] > 0 or slot != STD:
                assert _rel(f[slot], e[slot], scale[slot]) <= 1e-4, (name, slot, f, e)
            else:
                assert f[slot] == e[slot] == 0.0, name  # a constant's spread is exactly 0


def test_every_output_of_a_capture_goes_through_the_kernel(
        fused_dtypes: tuple[torch.dtype, ...]) -> None:
    model = TinyCNN()
    x = torch.randn(4, 3, 16, 16)
    fused = capture_activations(model, x)
    with _kernels.disabled():
        eager = capture_activations(model, x)
    assert fused.paths.fused == len(fused.records) and fused.paths.eager == 0
    assert eager.paths.fused == 0 and eager.paths.eager == len(eager.records)
    assert any("disabled" in r for r in eager.paths.reasons)
    assert "fused" in fused.paths.describe()
    for a, b in zip(fused.records, eager.records, strict=True):
        sa, sb = a.output, b.output
        assert sa is not None and sb is not None and sa.fused and not sb.fused
        assert (sa.min, sa.max, sa.zero_frac, sa.nan_count, sa.dead_units) == \
            (sb.min, sb.max, sb.zero_frac, sb.nan_count, sb.dead_units)
        assert math.isclose(sa.norm, sb.norm, rel_tol=1e-5)


class _Indexer(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.relu(), x.argmax(dim=1)  # float, int64


def test_outputs_the_kernel_cannot_take_stay_eager_and_say_why(
        fused_dtypes: tuple[torch.dtype, ...]) -> None:
    cap = capture_activations(_Indexer(), torch.randn(3, 5))
    (rec,) = cap.records
    assert [s.fused for s in rec.outputs] == [True, False]
    assert cap.paths.fused == 1 and cap.paths.eager == 1
    (reason,) = cap.paths.reasons
    assert "torch.int64" in reason and "dtype" in reason
    assert rec.outputs[1].max == 4 or rec.outputs[1].max < 5  # argmax of 5 columns


def test_count_nonfinite_false_reads_as_uncounted_on_the_fused_path(
        fused_dtypes: tuple[torch.dtype, ...]) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Softmax(dim=0))
    with torch.no_grad():
        model[0].weight.fill_(float("inf"))
    cap = capture_activations(model, torch.ones(2, 4), count_nonfinite=False)
    out = cap.get("0").output
    assert out is not None and out.fused
    assert out.nan_count is None and out.inf_count is None and not out.finite


class _ItemSpy(torch.overrides.TorchFunctionMode):
    """Records every host read that a torch function call makes."""

    HOST: ClassVar[set[object]] = {
        torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy,
        torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.__int__}

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in self.HOST:
            self.calls.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def _bounded() -> nn.Module:
    """Saturation reads (a tanh, a sigmoid, a tanh RNN) and a first layer that takes the
    model's input through a view."""

    class Bounded(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = nn.RNN(12, 16, batch_first=True)
            self.mlp = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 16),
                                     nn.Sigmoid())
            self.fc = nn.Linear(32, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # (8, 3, 16, 16)
            seq, _ = self.rnn(x.flatten(2)[..., :12])  # (8, 3, 16)
            h = torch.cat([self.mlp(x.flatten(1)[:, :64]), seq[:, -1]], dim=1)  # (8, 32)
            out: torch.Tensor = self.fc(h)  # (8, 10)
            return out

    return Bounded()


@pytest.mark.parametrize("build", [TinyCNN, _bounded], ids=["tinycnn", "bounded"])
@pytest.mark.parametrize("path", ["fused", "eager"])
def test_hooks_never_read_on_the_host(fused_dtypes: tuple[torch.dtype, ...], path: str,
                                      build: Callable[[], nn.Module]) -> None:
    from torchscope.grads import watch_gradients

    model = build()
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
    spy = _ItemSpy()
    with _kernels.disabled() if path == "eager" else contextlib.nullcontext():
        if path == "fused":
            assert _kernels.prepare("norm", wait=None).state == "ready"
        with watch_activations(model) as acts, watch_gradients(model) as grads, \
                torch.profiler.profile() as prof, spy:
            functional.cross_entropy(model(x), y).backward()
        records = acts.records  # the one host copy happens here, after the step
    assert not spy.calls, spy.calls
    ops = [e.name for e in prof.events()]
    assert "aten::_local_scalar_dense" not in ops and "aten::item" not in ops
    # The same probes catch a hook that does read on the host.
    control = _ItemSpy()
    peeks: list[float] = []

    def peek(_m: nn.Module, _i: object, o: torch.Tensor) -> None:
        peeks.append(o.detach().max().item())

    handle = model.fc.register_forward_hook(peek)
    try:
        with torch.profiler.profile() as prof, control:
            model(x)
    finally:
        handle.remove()
    assert control.calls == ["item"]
    assert "aten::_local_scalar_dense" in [e.name for e in prof.events()]
    assert records and all(r.output is None or r.output.fused == (path == "fused")
                           for r in records)
    inputs = [r.model_input for r in records if r.model_input is not None]
    assert inputs  # read during the step too, with their features' scale
    assert all(s.feature_rms_max is not None and s.feature_dim is not None for s in inputs)
    if build is _bounded:
        assert all(r.output is not None and r.output.saturated_frac is not None
                   for r in records if r.module in ("rnn", "mlp.1", "mlp.3"))
    flow = grads.last
    assert flow is not None and flow.modules
    assert (flow.fused_norms > 0) == (path == "fused") and (flow.eager_norms > 0) == (
        path == "eager")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("path", ["eager", "fused"])
def test_no_sync_on_cuda(path: str) -> None:
    """Nothing waits for the device during a watched step: no hook, and not the step's
    end either. Activation statistics stay on the device until read; a sampled step's
    gradient norms leave for the host by a copy that does not block, read when the
    records are built (`watch.last`, or the next sampled step)."""
    import warnings

    from torchscope.grads import watch_gradients

    if path == "fused":
        for program in ("stats", "norm"):
            status = _kernels.prepare(program, torch.float32, "cuda", wait=None)
            if status.state != "ready":
                pytest.skip(f"no fused CUDA kernel here: {status.reason}")
    model = TinyCNN().cuda()
    x = torch.randn(8, 3, 16, 16, device="cuda")
    y = torch.randint(0, 10, (8,), device="cuda")
    with _kernels.disabled() if path == "eager" else contextlib.nullcontext(), \
            watch_activations(model) as acts, watch_gradients(model):
        functional.cross_entropy(model(x), y).backward()  # warm-up: allocator, cuDNN
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                functional.cross_entropy(model(x), y).backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    syncs = [(Path(w.filename).name, w.lineno) for w in caught
             if "synchronizing" in str(w.message)]
    assert syncs == []
    assert all(r.output is None or r.output.fused == (path == "fused") for r in acts.records)
    ref = model.conv1(x).detach().double()
    s = acts.get("conv1").output
    assert s is not None and math.isclose(s.norm, float(ref.norm()), rel_tol=1e-6)


def _double(t: torch.Tensor) -> torch.Tensor:
    return 2 * t


@pytest.mark.slow
def test_dynamo_state_environment_and_rng_are_untouched(
        fused_dtypes: tuple[torch.dtype, ...]) -> None:
    from torch._dynamo import eval_frame
    from torch._dynamo.utils import counters

    from torchscope.hooks.compiled import CompileCounter

    user = torch.compile(_double)
    user(torch.randn(4))
    compiled_model = torch.compile(TinyCNN())
    graphs = counters["stats"]["unique_graphs"]
    env, rng, stance = dict(os.environ), torch.get_rng_state(), eval_frame._stance
    x, z = torch.randn(2, 3, 16, 16), torch.randn(4)
    rng = torch.get_rng_state()
    with CompileCounter() as counter:
        # A compiled model runs force_eager under the capture; the fused kernel still runs.
        cap = capture_activations(compiled_model, x)
        user(z)  # still compiled: no new frame compile
    assert cap.paths.fused == len(cap.records) > 0
    assert counter.compiles == 0 and counters["stats"]["unique_graphs"] == graphs
    assert dict(os.environ) == env
    assert torch.equal(torch.get_rng_state(), rng)
    assert eval_frame._stance == stance


def test_tensors_the_kernel_must_not_read(fused_dtypes: tuple[torch.dtype, ...]) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    x = torch.randn(100)
    assert _kernels.run("stats", x) is not None
    assert _kernels.run("stats", x[:1]) is None
    assert "elements" in (_kernels.why_eager("stats", x[:1]) or "")
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(x)
        assert _kernels.run("stats", fake) is None

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    with Passthrough():
        assert _kernels.run("stats", x) is None
        assert "TorchDispatchMode" in (_kernels.why_eager("stats", x) or "")
    batched = torch.func.vmap(lambda t: (_kernels.run("stats", t) is None) * t)(x.reshape(4, 25))
    assert batched.shape == (4, 25)
    assert _kernels.run("stats", torch.arange(10)) is None  # integer: eager
