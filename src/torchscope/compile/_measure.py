"""Measure one torch.compile mode: cold/warm compile, interleaved latency, numerical drift.

Runs inside the child process of `compile_report` (or in this process when the model or
its loss cannot be sent to a child). Everything here returns plain numbers and records.
In this process the measurement goes through `torchscope.compile._isolate`, so that the
user's own compiled code and the process environment are left as they were.
"""

from __future__ import annotations

import copy
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from torchscope.compile._isolate import private_code
from torchscope.compile.breaks import find_graph_breaks
from torchscope.compile.records import CompileMeasure, Recompile, ShapeCall
from torchscope.compile.watch import RecompileWatcher, recompile_limit
from torchscope.hooks.tree import iter_tensors
from torchscope.models.target import ModelInputs
from torchscope.step import LossSpec, Step

__all__ = [
    "MeasureJob", "RawMode", "StepSpec", "first_line", "is_no_compiler_error", "measure_mode",
    "resize_batch", "run_job",
]


@dataclass(frozen=True)
class StepSpec:
    """What a child process needs to rebuild the caller's `Step` around its own copy of the
    model: the loss, the target, AMP and accumulation (not the optimizer, which belongs to
    the caller's parameters, nor the GradScaler)."""

    loss_fn: LossSpec = "auto"
    target: Any = None
    autocast: torch.dtype | None = None
    accumulate: int = 1
    seed: int = 0

    @classmethod
    def of(cls, step: Step) -> StepSpec:
        """The parts of `step` that travel."""
        return cls(step.loss_fn, step.target, step.autocast, step.accumulate, step.seed)

    def build(self, model: nn.Module, inputs: ModelInputs) -> Step:
        """The step on `model` (a private copy, or a `torch.compile` wrapper of one)."""
        return Step(model, inputs, loss_fn=self.loss_fn, target=self.target,
                    autocast=self.autocast, accumulate=self.accumulate, seed=self.seed)


@dataclass(frozen=True)
class MeasureJob:
    """Everything one mode's measurement needs besides the model and inputs."""

    mode: str
    measure: CompileMeasure
    iters: int
    warmup: int
    dynamic: bool | None
    explain: bool
    step: StepSpec = field(default_factory=StepSpec)
    batch_sizes: tuple[int, ...] = ()
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def train(self) -> bool:
        """Whether the measured call is the training step (train mode, with backward)."""
        return self.measure == "step"


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
    loss: str | None = None
    loss_value: float | None = None


# ---------------------------------------------------------------------- figures
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu" and hasattr(torch, "accelerator"):
        torch.accelerator.synchronize()


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


def _batch_of(inputs: ModelInputs) -> int:
    leaves = list(iter_tensors((inputs.args, dict(inputs.kwargs))))
    if not leaves or leaves[0][1].dim() == 0:
        raise ValueError("the inputs have no batch dimension to resize")
    return int(leaves[0][1].shape[0])


def _fit(v: Any, batch: int, batch_size: int) -> Any:
    """A tensor whose first dim is the batch, cut or tiled to `batch_size`; else `v`."""
    if not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape[0] != batch:
        return v
    if batch_size <= batch:
        return v[:batch_size].clone()
    reps = -(-batch_size // batch)
    return torch.cat([v] * reps)[:batch_size]


def resize_batch(inputs: ModelInputs, batch_size: int) -> ModelInputs:
    """The same inputs with every tensor whose first dim is the batch cut or tiled to
    `batch_size` (the batch is the first dim of the first tensor)."""
    batch = _batch_of(inputs)
    return ModelInputs(tuple(_fit(a, batch, batch_size) for a in inputs.args),
                       {k: _fit(v, batch, batch_size) for k, v in inputs.kwargs.items()})


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

    The measured call is the step's forward under `no_grad` (eval mode), or with
    `measure="step"` the step's forward, loss and backward (train mode; no optimizer step).
    Order: cold compile (first compiled call, private code objects, fresh inductor cache)
    → eager reference (its loss is the step's loss) and numerical diffs → warm compile (new
    private code objects, inductor's in-memory caches cleared, its on-disk cache reused) →
    warm-up → interleaved steady-state timing → calls with other batch sizes.
    """
    from torch._dynamo.utils import counters
    from torch._inductor.utils import clear_caches

    eager = copy.deepcopy(model).train(job.train)
    subject = copy.deepcopy(model).train(job.train)
    eager_step = job.step.build(eager, inputs)
    device = eager_step.device
    cudagraphs = job.mode.startswith("reduce-overhead") and device.type == "cuda"
    compiled_step = eager_step  # replaced by the compiled wrapper's step below

    def call(s: Step, compiled: bool = False) -> tuple[Any, torch.Tensor | None]:
        """One measured call: `(first micro-batch's output, loss or None)`."""
        if compiled and cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        if not job.train:
            with torch.no_grad():
                return s.forward(), None
        outputs: list[Any] = []

        def keep(micro: int, output: Any, _loss: torch.Tensor) -> None:
            if micro == 0:
                outputs.append(output)

        s.zero_grad()
        loss = s.forward_backward(before_backward=keep)
        return outputs[0], loss

    def timed(s: Step, compiled: bool) -> tuple[float, Any, torch.Tensor | None]:
        _sync(device)
        t0 = time.perf_counter()
        out, loss = call(s, compiled)
        _sync(device)
        return time.perf_counter() - t0, out, loss

    def make() -> Step:
        wrapper = torch.compile(subject, mode=None if job.mode == "default" else job.mode,
                                dynamic=job.dynamic, options=job.options or None)
        assert isinstance(wrapper, nn.Module)
        return job.step.build(wrapper, inputs)

    watcher = RecompileWatcher()
    with watcher:
        graphs_before = int(counters["stats"]["unique_graphs"])
        with private_code(subject):
            log("cold compile")
            compiled_step = make()
            cold_first_s, out_c, _ = timed(compiled_step, True)
            graphs = int(counters["stats"]["unique_graphs"]) - graphs_before or None
            got = _detach(out_c)
            got_grads = _grads(subject) if job.train else []
        _, out_e, eager_loss = timed(eager_step, False)
        diffs = _max_diffs(got, _detach(out_e))
        grad_diffs = _max_diffs(got_grads, _grads(eager)) if job.train else None
        resolved = eager_step.resolved
        del out_c, out_e

        log("warm compile")
        clear_caches()
        with private_code(subject):
            compiled_step = make()
            warm_first_s, _, _ = timed(compiled_step, True)

            log("timing")
            for _ in range(job.warmup):
                call(eager_step)
                call(compiled_step, True)
            eager_s: list[float] = []
            compiled_s: list[float] = []
            for i in range(job.iters):
                # Alternate who goes first so neither always runs on a cache the other warmed.
                order = ((eager_step, False), (compiled_step, True)) if i % 2 == 0 else \
                    ((compiled_step, True), (eager_step, False))
                for s, is_c in order:
                    dt, _, _ = timed(s, is_c)
                    (compiled_s if is_c else eager_s).append(dt)

            shape_calls = []
            for bs in job.batch_sizes:
                log(f"batch size {bs}")
                batch = _batch_of(inputs)
                resized = replace(compiled_step, inputs=resize_batch(inputs, bs),
                                  target=_fit(compiled_step.target, batch, bs))
                before = watcher.compiles
                dt, _, _ = timed(resized, True)
                shape_calls.append(ShapeCall(bs, dt, watcher.compiles > before))

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
        loss=None if resolved is None or not job.train else resolved.describe(),
        loss_value=None if eager_loss is None else float(eager_loss),
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
