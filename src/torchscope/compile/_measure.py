"""Measure one torch.compile mode: cold/warm compile, interleaved latency, numerical drift.

Runs inside the child process of `compile_report` (or in-process when the model cannot be
sent to a child). Everything here returns plain numbers and records.
"""

from __future__ import annotations

import contextlib
import copy
import os
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torchscope.compile.breaks import find_graph_breaks
from torchscope.compile.records import Recompile, ShapeCall
from torchscope.compile.watch import RecompileWatcher, recompile_limit
from torchscope.hooks.tree import iter_tensors
from torchscope.models.target import ModelInputs

__all__ = [
    "MeasureJob", "RawMode", "first_line", "is_no_compiler_error", "measure_mode", "resize_batch",
    "run_job",
]


@dataclass(frozen=True)
class MeasureJob:
    """Everything one mode's measurement needs besides the model and inputs."""

    mode: str
    train: bool
    iters: int
    warmup: int
    dynamic: bool | None
    explain: bool
    batch_sizes: tuple[int, ...] = ()
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RawMode:
    """Raw figures of one mode, before speedup and break-even are derived."""

    cold_first_s: float
    warm_first_s: float
    eager_ms: float
    compiled_ms: float
    max_abs_diff: float | None
    max_rel_diff: float | None
    grad_max_abs_diff: float | None
    grad_max_rel_diff: float | None
    graphs: int | None
    recompiles: tuple[Recompile, ...]
    recompile_limit: int
    limit_hit: bool
    shape_calls: tuple[ShapeCall, ...]


@contextlib.contextmanager
def fresh_inductor_cache() -> Iterator[None]:
    """An empty on-disk inductor cache and empty in-memory caches; Dynamo reset on both ends.

    Without it a later mode reuses the C++ kernels an earlier mode compiled (same source,
    same hash) and its "cold" compile looks cheap. TORCHINDUCTOR_CACHE_DIR is restored after.
    """
    import torch._dynamo
    from torch._inductor.utils import clear_caches

    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="torchscope-compile-") as tmp:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tmp
        torch._dynamo.reset()
        clear_caches()
        try:
            yield
        finally:
            if old is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = old
            torch._dynamo.reset()
            clear_caches()


def _device_of(model: nn.Module, inputs: ModelInputs) -> torch.device:
    for p in model.parameters():
        return p.device
    for _, t in iter_tensors((inputs.args, dict(inputs.kwargs))):
        return t.device
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu" and hasattr(torch, "accelerator"):
        torch.accelerator.synchronize()


def _scalar_loss(out: Any) -> torch.Tensor:
    """A scalar that depends on every floating output: sum of mean squares."""
    parts = [t.float().square().mean() for _, t in iter_tensors(out)
             if t.is_floating_point() and t.requires_grad]
    if not parts:
        raise ValueError("train=True needs a floating-point output that requires grad")
    return torch.stack(parts).sum()


def _detach(out: Any) -> list[torch.Tensor]:
    """Detached copies of every floating output (CUDA graphs reuse output buffers)."""
    return [t.detach().clone() for _, t in iter_tensors(out) if t.is_floating_point()]


def _max_diffs(got: list[torch.Tensor], ref: list[torch.Tensor]) -> tuple[float, float] | None:
    if not ref or len(got) != len(ref):
        return None
    abs_max = 0.0
    ref_max = 0.0
    for g, r in zip(got, ref, strict=True):
        if g.shape != r.shape:
            return None
        d = (g.float() - r.float()).abs()
        abs_max = max(abs_max, float(d.max()) if d.numel() else 0.0)
        ref_max = max(ref_max, float(r.float().abs().max()) if r.numel() else 0.0)
    return abs_max, (abs_max / ref_max if ref_max > 0 else (0.0 if abs_max == 0 else float("inf")))


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def resize_batch(inputs: ModelInputs, batch_size: int) -> ModelInputs:
    """The same inputs with every tensor whose first dim is the batch cut or tiled to
    `batch_size` (the batch is the first dim of the first tensor)."""
    leaves = list(iter_tensors((inputs.args, dict(inputs.kwargs))))
    if not leaves or leaves[0][1].dim() == 0:
        raise ValueError("the inputs have no batch dimension to resize")
    batch = leaves[0][1].shape[0]

    def fit(v: Any) -> Any:
        if not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape[0] != batch:
            return v
        if batch_size <= batch:
            return v[:batch_size].clone()
        reps = -(-batch_size // batch)
        return torch.cat([v] * reps)[:batch_size]

    return ModelInputs(tuple(fit(a) for a in inputs.args),
                       {k: fit(v) for k, v in inputs.kwargs.items()})


def is_no_compiler_error(exc: BaseException) -> bool:
    """Whether `exc` (or its cause) is inductor's "no working C++ compiler"."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return False
        if type(seen).__name__ == "InvalidCxxCompiler" or "C++ compiler" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def measure_mode(model: nn.Module, inputs: ModelInputs, job: MeasureJob,
                 log: Callable[[str], None] = lambda _s: None) -> RawMode:
    """Measure one mode on private copies of `model` (the original is never called).

    Order: cold compile (first compiled call, fresh inductor
    cache) → eager reference and numerical diffs → warm compile (after
    `torch._dynamo.reset()` and clearing inductor's in-memory caches; the on-disk cache is
    reused) → warm-up → interleaved steady-state timing → calls with other batch sizes.
    """
    device = _device_of(model, inputs)
    args, kwargs = inputs.args, dict(inputs.kwargs)
    eager = copy.deepcopy(model).train(job.train)
    target = copy.deepcopy(model).train(job.train)
    cudagraphs = job.mode.startswith("reduce-overhead") and device.type == "cuda"

    def step(m: Callable[..., Any], a: tuple[Any, ...] = args, k: dict[str, Any] = kwargs,
             compiled: bool = False) -> Any:
        if compiled and cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        if job.train:
            for p in target.parameters() if compiled else eager.parameters():
                p.grad = None
            out = m(*a, **k)
            _scalar_loss(out).backward()
            return out
        with torch.no_grad():
            return m(*a, **k)

    def timed(m: Callable[..., Any], compiled: bool) -> tuple[float, Any]:
        _sync(device)
        t0 = time.perf_counter()
        out = step(m, compiled=compiled)
        _sync(device)
        return time.perf_counter() - t0, out

    def make() -> Callable[..., Any]:
        return torch.compile(target, mode=None if job.mode == "default" else job.mode,
                             dynamic=job.dynamic, options=job.options or None)

    torch._dynamo.reset()
    watcher = RecompileWatcher()
    with watcher:
        counters = torch._dynamo.utils.counters
        counters.clear()
        log("cold compile")
        compiled = make()
        cold_first_s, out_c = timed(compiled, True)
        graphs = int(counters["stats"]["unique_graphs"]) or None
        got = _detach(out_c)
        got_grads = _grads(target) if job.train else []
        _, out_e = timed(eager, False)
        diffs = _max_diffs(got, _detach(out_e))
        grad_diffs = _max_diffs(got_grads, _grads(eager)) if job.train else None

        log("warm compile")
        torch._dynamo.reset()
        from torch._inductor.utils import clear_caches

        clear_caches()
        watcher.reinstall()
        compiled = make()
        warm_first_s, _ = timed(compiled, True)

        log("timing")
        for _ in range(job.warmup):
            step(eager)
            step(compiled, compiled=True)
        eager_s: list[float] = []
        compiled_s: list[float] = []
        for i in range(job.iters):
            # Alternate who goes first so neither always runs on a cache the other warmed.
            order = ((eager, False), (compiled, True)) if i % 2 == 0 else \
                ((compiled, True), (eager, False))
            for m, is_c in order:
                dt, _ = timed(m, is_c)
                (compiled_s if is_c else eager_s).append(dt)

        shape_calls = []
        for bs in job.batch_sizes:
            log(f"batch size {bs}")
            resized = resize_batch(inputs, bs)
            before = watcher.compiles
            _sync(device)
            t0 = time.perf_counter()
            step(compiled, resized.args, dict(resized.kwargs), compiled=True)
            _sync(device)
            shape_calls.append(ShapeCall(bs, time.perf_counter() - t0, watcher.compiles > before))

    return RawMode(
        cold_first_s=cold_first_s,
        warm_first_s=warm_first_s,
        eager_ms=statistics.median(eager_s) * 1e3,
        compiled_ms=statistics.median(compiled_s) * 1e3,
        max_abs_diff=diffs[0] if diffs else None,
        max_rel_diff=diffs[1] if diffs else None,
        grad_max_abs_diff=grad_diffs[0] if grad_diffs else None,
        grad_max_rel_diff=grad_diffs[1] if grad_diffs else None,
        graphs=graphs,
        recompiles=tuple(watcher.recompiles),
        recompile_limit=recompile_limit(),
        limit_hit=watcher.limit_hit,
        shape_calls=tuple(shape_calls),
    )


def run_job(model: nn.Module, inputs: ModelInputs, job: MeasureJob,
            log: Callable[[str], None] = lambda _s: None) -> dict[str, Any]:
    """Scan graph breaks (when asked) and measure one mode; failures become a status.

    Returns:
        `{"status", "error", "raw", "scan"}`: status is `ok`, `error` or `no_compiler`.
    """
    payload: dict[str, Any] = {"status": "ok", "error": None, "raw": None, "scan": None}
    if job.explain:
        log("scanning graph breaks")
        try:
            payload["scan"] = find_graph_breaks(
                copy.deepcopy(model).train(job.train), inputs, train=job.train)
        except Exception as exc:
            payload["scan_error"] = first_line(exc)
    try:
        payload["raw"] = measure_mode(model, inputs, job, log)
    except Exception as exc:
        payload["status"] = "no_compiler" if is_no_compiler_error(exc) else "error"
        payload["error"] = first_line(exc)
        payload["traceback"] = traceback.format_exc()
    return payload


def first_line(exc: BaseException) -> str:
    """`TypeName: first line of the message`."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".strip()
