"""Measure one torch.compile mode: cold/warm compile, interleaved latency, numerical drift.

Runs inside the child process of `compile_report` (`child_main`), or in this process when
the model or its loss cannot be sent to a child. In this process the measurement goes
through `torchscope.compile._isolate`, so that the user's own compiled code and the process
environment are left as they were.
"""

from __future__ import annotations

import contextlib
import copy
import math
import pickle
import shutil
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchscope import _process
from torchscope._timing import compare
from torchscope.compile._isolate import private_code
from torchscope.compile.breaks import find_graph_breaks
from torchscope.compile.records import (
    CompileMeasure,
    ModeResult,
    Recompile,
    ShapeCall,
    derive_speed,
)
from torchscope.compile.watch import RecompileWatcher, recompile_limit
from torchscope.errors import describe
from torchscope.hooks.tree import iter_tensors
from torchscope.models.target import ModelInputs, load_target
from torchscope.step import LossSpec, Step, StepInfo, synchronize

__all__ = ["MeasureJob", "child_main", "measure_mode", "run_job"]


@dataclass(frozen=True)
class MeasureJob:
    """Everything one mode's measurement needs besides the model and inputs, the parts of
    the caller's `Step` that travel to a child included: loss, target, AMP and accumulation
    (not the optimizer, which belongs to the caller's parameters, nor the GradScaler)."""

    mode: str
    measure: CompileMeasure
    iters: int
    warmup: int
    dynamic: bool | None
    explain: bool
    batch_sizes: tuple[int, ...] = ()
    options: dict[str, Any] = field(default_factory=dict)
    loss_fn: LossSpec = "auto"
    target: Any = None
    autocast: torch.dtype | None = None
    accumulate: int = 1
    seed: int = 0
    budget_s: float = 10.0

    def step(self, model: nn.Module, inputs: ModelInputs) -> Step:
        """The caller's step on `model` (a private copy, or a `torch.compile` wrapper of one)."""
        return Step(model, inputs, loss_fn=self.loss_fn, target=self.target,
                    autocast=self.autocast, accumulate=self.accumulate, seed=self.seed)


# ---------------------------------------------------------------------- figures
def _detach(out: Any) -> list[torch.Tensor]:
    """Detached copies of every floating output (CUDA graphs reuse output buffers)."""
    return [t.detach().clone() for _, t in iter_tensors(out) if t.is_floating_point()]


def _max_diffs(got: list[torch.Tensor], ref: list[torch.Tensor]
               ) -> tuple[float | None, float | None]:
    """Largest |got - ref|, and that divided by the largest |ref|; None for a figure that
    cannot be compared or is not finite."""
    if not ref or len(got) != len(ref):
        return None, None
    abs_max = 0.0
    ref_max = 0.0
    for g, r in zip(got, ref, strict=True):
        if g.shape != r.shape:
            return None, None
        d = (g.float() - r.float()).abs()
        abs_max = max(abs_max, float(d.max()) if d.numel() else 0.0)
        ref_max = max(ref_max, float(r.float().abs().max()) if r.numel() else 0.0)
    rel = abs_max / ref_max if ref_max > 0 else (0.0 if abs_max == 0 else math.inf)
    return (abs_max if math.isfinite(abs_max) else None,
            rel if math.isfinite(rel) else None)


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def _resized(step: Step, batch_size: int) -> Step:
    """`step` with every tensor whose first dim is the batch (the first dim of the first
    input tensor), its target included, cut or tiled to `batch_size`. A tensor passed
    twice (`input_ids=ids, labels=ids`) stays one tensor: two would fail Dynamo's guard
    that they are the same, a recompile the user's own loop never makes."""
    leaves = [t for _, t in iter_tensors((step.inputs.args, dict(step.inputs.kwargs)))]
    if not leaves or leaves[0].dim() == 0:
        raise ValueError("the inputs have no batch dimension to resize")
    batch = int(leaves[0].shape[0])
    made: dict[int, torch.Tensor] = {}

    def fit(v: Any) -> Any:
        if not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape[0] != batch:
            return v
        if id(v) not in made:
            made[id(v)] = v[:batch_size].clone() if batch_size <= batch else \
                torch.cat([v] * -(-batch_size // batch))[:batch_size]  # (batch_size, ...)
        return made[id(v)]

    inputs = ModelInputs(tuple(fit(a) for a in step.inputs.args),
                         {k: fit(v) for k, v in step.inputs.kwargs.items()})
    return replace(step, inputs=inputs, target=fit(step.target))


def _is_no_compiler_error(exc: BaseException | None) -> bool:
    """Whether `exc` (or its cause) is inductor's "no working C++ compiler"."""
    for _ in range(8):
        if exc is None:
            return False
        if type(exc).__name__ == "InvalidCxxCompiler" or "C++ compiler" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _our_backend(r: Recompile) -> bool:
    """A recompile only because this measurement compiled with a backend of its own: a
    helper the user compiled before (shared code, see `private_code`) meets another
    `torch.compile`. Not one the user's own loop would see."""
    return r.guard.startswith("BACKEND_MATCH")


def measure_mode(model: nn.Module, inputs: ModelInputs, job: MeasureJob,
                 log: Callable[[str], None] = lambda _s: None
                 ) -> tuple[ModeResult, StepInfo | None]:
    """Measure one mode on private copies of `model` (the original is never called).

    The measured call is the step's forward under `no_grad` (eval mode), or with
    `measure="step"` the step's forward, loss and backward (train mode; no optimizer step).
    Order: cold compile (first compiled call, private code objects, fresh inductor cache)
    → eager reference (its loss is the step's loss) and numerical diffs → warm compile (new
    private code objects, inductor's in-memory caches cleared, its on-disk cache reused) →
    warm-up → interleaved steady-state timing → calls with other batch sizes.

    Returns:
        The mode's result (`isolated` and `wall_s` are the caller's to fill in), and the
        eager copy's `StepInfo` with `measure="step"`.
    """
    from torch._dynamo.utils import counters
    from torch._inductor.utils import clear_caches

    train = job.measure == "step"
    eager = copy.deepcopy(model).train(train)
    subject = copy.deepcopy(model).train(train)
    eager_step = job.step(eager, inputs)
    device = eager_step.device
    cudagraphs = job.mode.startswith("reduce-overhead") and device.type == "cuda"

    def call(s: Step, compiled: bool = False) -> tuple[Any, torch.Tensor | None]:
        """One measured call: `(first micro-batch's output, loss or None)`."""
        if compiled and cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        if not train:
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
        synchronize(device)
        t0 = time.perf_counter()
        out, loss = call(s, compiled)
        synchronize(device)
        return time.perf_counter() - t0, out, loss

    def make() -> Step:
        wrapper = torch.compile(subject, mode=None if job.mode == "default" else job.mode,
                                dynamic=job.dynamic, options=job.options or None)
        assert isinstance(wrapper, nn.Module)
        return job.step(wrapper, inputs)

    with RecompileWatcher() as watcher:
        graphs_before = int(counters["stats"]["unique_graphs"])
        with private_code(subject):
            log("cold compile")
            cold_first_s, out_c, _ = timed(make(), True)
            graphs = int(counters["stats"]["unique_graphs"]) - graphs_before or None
            got = _detach(out_c)
            got_grads = _grads(subject) if train else []
        _, out_e, eager_loss = timed(eager_step, False)
        max_abs, max_rel = _max_diffs(got, _detach(out_e))
        grad_abs, grad_rel = _max_diffs(got_grads, _grads(eager)) if train else (None, None)
        info = eager_step.info(eager_loss) if train else None
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
            eager_s, compiled_s, timing_s = _time_pairs(
                lambda: timed(eager_step, False)[0], lambda: timed(compiled_step, True)[0],
                job.iters, job.budget_s)

            shape_calls = []
            for bs in job.batch_sizes:
                log(f"batch size {bs}")
                before = watcher.compiles
                dt, _, _ = timed(_resized(compiled_step, bs), True)
                shape_calls.append(ShapeCall(bs, dt, watcher.compiles > before))

    eager_ms = statistics.median(eager_s) * 1e3
    compiled_ms = statistics.median(compiled_s) * 1e3
    # A first call's cost beyond one steady-state call is the compile.
    cold = max(cold_first_s - compiled_ms / 1e3, 0.0)
    warm = max(warm_first_s - compiled_ms / 1e3, 0.0)
    ratio = compare(eager_s, compiled_s)  # the speedup with its noise
    speedup, break_even = derive_speed(eager_ms, compiled_ms, cold, ratio)
    result = ModeResult(
        mode=job.mode,
        status="ok",
        cold_compile_s=cold,
        warm_compile_s=warm,
        eager_ms=eager_ms,
        compiled_ms=compiled_ms,
        speedup=speedup,
        break_even_calls=break_even,
        break_even_calls_warm=derive_speed(eager_ms, compiled_ms, warm, ratio)[1],
        max_abs_diff=max_abs,
        max_rel_diff=max_rel,
        grad_max_abs_diff=grad_abs,
        grad_max_rel_diff=grad_rel,
        graphs=graphs,
        recompiles=tuple(r for r in watcher.recompiles if not _our_backend(r)),
        recompile_limit=recompile_limit(),
        limit_hit=watcher.limit_hit,
        shape_calls=tuple(shape_calls),
        iters=len(eager_s),
        speedup_ratio=ratio,
        timing_s=timing_s,
        timing_budget_s=job.budget_s,
    )
    return result, info


#: Timed pairs at most, however much budget is left: 40 times the calls asked for, never
#: fewer than `_MIN_CAP` nor more than `_MAX_CAP` (the order-statistic interval of a median
#: costs quadratic time in its samples: 0.1 s at 500, 2 s at 1,000).
_MAX_ROUNDS = 40
_MIN_CAP = 400
_MAX_CAP = 500


def max_pairs(iters: int) -> int:
    """Timed pairs of calls at most, for `iters` asked for."""
    return max(min(_MAX_ROUNDS * iters, _MAX_CAP), _MIN_CAP, iters)


def _time_pairs(eager: Callable[[], float], compiled: Callable[[], float], iters: int,
                budget_s: float) -> tuple[list[float], list[float], float]:
    """Eager and compiled calls timed in alternating pairs: `iters` pairs, then more until
    the speedup's interval excludes 1 (a verdict) or `budget_s` seconds of timing are spent
    (at most `max_pairs(iters)`). The interval is looked at after `iters` pairs and then
    each time the pairs have grown by a quarter. Returns both samples (seconds) and the
    seconds spent timing."""
    eager_s: list[float] = []
    compiled_s: list[float] = []
    pair = ((eager, eager_s), (compiled, compiled_s))
    start = time.perf_counter()
    i, look, cap = 0, iters, max_pairs(iters)
    while True:
        # Alternate who goes first so neither always runs on a cache the other warmed.
        for fn, into in pair if i % 2 == 0 else pair[::-1]:
            into.append(fn())
        i += 1
        if i < iters:
            continue
        if time.perf_counter() - start >= budget_s or i >= cap:
            break
        if i >= look:
            if compare(eager_s, compiled_s).measurable:
                break
            look = max(i + 1, i * 5 // 4)
    return eager_s, compiled_s, time.perf_counter() - start


def run_job(model: nn.Module, inputs: ModelInputs, job: MeasureJob,
            log: Callable[[str], None] = lambda _s: None) -> dict[str, Any]:
    """Scan graph breaks (when asked) and measure one mode; failures become a status.

    Returns:
        `status` (`ok`, `error` or `no_compiler`), and when there is one: `error` (one
        line) and its `traceback`, `result` (the `ModeResult`), `step` (its `StepInfo` with
        `measure="step"`) and `scan` (the `BreakScan`, when asked and it succeeded).
    """
    payload: dict[str, Any] = {"status": "ok"}
    if job.explain:
        log("scanning graph breaks")
        train = job.measure == "step"
        # A failed scan leaves None; the report says when no mode's scan succeeded.
        with contextlib.suppress(Exception):
            payload["scan"] = find_graph_breaks(copy.deepcopy(model).train(train), inputs,
                                                train=train)
    try:
        payload["result"], payload["step"] = measure_mode(model, inputs, job, log)
    except Exception as exc:
        payload["status"] = "no_compiler" if _is_no_compiler_error(exc) else "error"
        payload["error"] = describe(exc)
        payload["traceback"] = traceback.format_exc()
    return payload


def child_main(argv: list[str]) -> int:
    """The child process of `compile_report`, on the parent's torchscope: measures the job
    saved with `torch.save` at `argv[0]` and pickles `run_job`'s payload to `argv[1]`. Any
    exception becomes a status: only a hard crash or a hang leaves no result (the parent
    reports those).

    It ends with its parent, whose pid is `argv[2]` (`_process.child_of`). Stopped by a
    signal or by that death, it removes the job's folder at once (the one holding
    `argv[0]`, made for this child alone, with inductor's cache): a parent that is gone, or
    that leaves at once on its own SIGTERM (a doctor rank, `_process.stop_and_exit`),
    cannot remove it.

    Returns:
        The exit code: 0 whenever a result was written.
    """
    job_path, result_path, parent = argv
    folder = Path(job_path).parent
    with _process.child_of(int(parent), cleanup=lambda: shutil.rmtree(folder, ignore_errors=True)):
        return _measure_job(job_path, result_path)


def _measure_job(job_path: str, result_path: str) -> int:
    try:
        job = torch.load(job_path, weights_only=False)
        torch.set_num_threads(int(job["threads"]))
        model = job["model"]
        if model is None:  # not picklable: rebuilt from its TARGET
            model = load_target(job["factory"]).model
    except Exception as exc:
        payload = {"status": "not_sent",
                   "error": f"the child could not load the model ({describe(exc)})"}
    else:
        payload = run_job(model, job["inputs"], job["job"],
                          log=lambda s: print(f"[torchscope] {s}", flush=True))
        if payload.get("traceback"):
            print(payload["traceback"], file=sys.stderr, flush=True)
    Path(result_path).write_bytes(pickle.dumps(payload))
    return 0
