"""`profile_steps`: run training steps under `torch.profiler` and summarise them."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from torchscope.hooks.select import Selector
from torchscope.hooks.tree import iter_tensors
from torchscope.models.target import ModelInputs, call_model
from torchscope.profiling.attribution import attribute
from torchscope.profiling.module_ranges import ModuleRanges
from torchscope.profiling.ops import op_records
from torchscope.profiling.records import ProfileResult, ProfilingError, StepTiming
from torchscope.profiling.trace import export_trace

__all__ = [
    "default_loss",
    "make_train_step",
    "phase",
    "profile_steps",
    "quiet_kineto",
    "random_target_loss",
]

StepFn = Callable[[], Any]
LossFn = Callable[..., torch.Tensor]


def quiet_kineto() -> None:
    """Silence Kineto's `profiler_start`/`profiler_stop` lines on stderr.

    Kineto reads `KINETO_LOG_LEVEL` once, when the first profiler starts in the process. Its
    `USDT` lines are level 5, so only a level above 5 hides them; a user's own setting wins
    unless it is the 5 that does not.
    """
    if os.environ.get("KINETO_LOG_LEVEL") in (None, "", "5"):
        os.environ["KINETO_LOG_LEVEL"] = "6"


def phase(name: str) -> Any:
    """Label a phase of your own step function: `with phase("forward"): ...`.

    Equivalent to `torch.profiler.record_function(name)`; use the names `forward`,
    `backward` and `optimizer` so that `profile_steps` reports the split.
    """
    return record_function(name)


def default_loss(output: Any, targets: Any = None) -> torch.Tensor:
    """The loss used when none is given: `output.loss` if the model returns one (HF models
    given labels), otherwise the mean of the first floating-point output tensor.

    Raises:
        ProfilingError: the output holds no floating-point tensor.
    """
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    for _path, t in iter_tensors(output):
        if t.is_floating_point():
            return t.float().mean()
    raise ProfilingError(
        f"the model output ({type(output).__name__}) holds no floating-point tensor to "
        "build a loss from.",
        fix="pass loss_fn=... that turns the output into a scalar loss.",
    )


def _logits(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    for _path, t in iter_tensors(output):
        if t.is_floating_point():
            return t
    raise ProfilingError(
        f"the model output ({type(output).__name__}) holds no floating-point tensor.",
        fix="profile a model that returns logits, or pass your own loss_fn.",
    )


def random_target_loss(seed: int = 0) -> LossFn:
    """Cross-entropy against random integer class targets, drawn once and reused every step.

    Logits `(B, C)` get targets `(B,)`; sequence logits `(B, T, V)` get `(B, T)`; any other
    floating output falls back to mean squared error against zeros. This is what the CLI
    trains with: a realistic classification step without needing a dataset.
    """
    cache: dict[str, torch.Tensor] = {}

    def loss(output: Any) -> torch.Tensor:
        logits = _logits(output)
        if logits.dim() < 2 or not logits.is_floating_point():
            return torch.nn.functional.mse_loss(logits.float(),
                                                torch.zeros_like(logits, dtype=torch.float32))
        classes = logits.shape[-1]
        target = cache.get("t")
        if target is None or target.shape != logits.shape[:-1]:
            g = torch.Generator().manual_seed(seed)
            target = torch.randint(0, classes, logits.shape[:-1], generator=g)
            target = cache["t"] = target.to(logits.device)
        # (N, C) against (N,): sequence positions become rows.
        return torch.nn.functional.cross_entropy(logits.reshape(-1, classes).float(),
                                                 target.reshape(-1))

    return loss


def _check_loss(loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ProfilingError(
            f"the loss is {shape}, expected a scalar tensor.",
            fix="make loss_fn reduce to a scalar (e.g. .mean()).",
        )
    if not loss.requires_grad:
        raise ProfilingError(
            "the loss does not require grad, so backward() cannot run.",
            fix="make sure the model has trainable parameters and runs outside torch.no_grad().",
        )
    return loss


def make_train_step(
    model: nn.Module,
    inputs: ModelInputs,
    *,
    loss_fn: LossFn | None = None,
    targets: Any = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> StepFn:
    """A training step labelled with the `forward`, `backward` and `optimizer` phases.

    The step runs `model(*inputs)`, the loss (`loss_fn(output, targets)`, or
    `loss_fn(output)` when `targets` is None), `backward()`, then `optimizer.step()` and
    `optimizer.zero_grad(set_to_none=True)`. Without an optimizer the gradients are just
    cleared (outside any phase).

    Args:
        model: the model to train.
        inputs: its inputs.
        loss_fn: `loss_fn(output, targets)` or `loss_fn(output)`; default `default_loss`.
        targets: passed to `loss_fn` when not None.
        optimizer: stepped and zeroed in the `optimizer` phase.

    Returns:
        A zero-argument function that runs one step.
    """
    fn = loss_fn or default_loss

    def step() -> None:
        with record_function("forward"):
            out = call_model(model, inputs)
            loss = _check_loss(fn(out) if targets is None else fn(out, targets))
        with record_function("backward"):
            loss.backward()
        if optimizer is not None:
            with record_function("optimizer"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)

    return step


def _device_of(model: nn.Module | None, inputs: ModelInputs | None) -> torch.device:
    if model is not None:
        for p in model.parameters():
            return p.device
    if inputs is not None:
        for _path, t in iter_tensors((inputs.args, dict(inputs.kwargs))):
            return t.device
    return torch.device("cpu")


def _timed(step: StepFn, sync: Callable[[], None]) -> float:
    sync()
    t0 = time.perf_counter()
    step()
    sync()
    return (time.perf_counter() - t0) * 1e3


def profile_steps(
    step: StepFn | nn.Module,
    inputs: ModelInputs | torch.Tensor | tuple[Any, ...] | Mapping[str, Any] | None = None,
    *,
    loss_fn: LossFn | None = None,
    targets: Any = None,
    optimizer: torch.optim.Optimizer | None = None,
    model: nn.Module | None = None,
    steps: int = 5,
    wait: int = 1,
    warmup: int = 1,
    by_module: bool = True,
    select: Selector = None,
    depth: int | None = None,
    group_by_input_shape: bool = False,
    record_shapes: bool = False,
    baseline_steps: int | None = None,
    trace: str | Path | None = None,
    trace_steps: int | None = 3,
    cuda: bool | None = None,
) -> ProfileResult:
    """Profile training steps with `torch.profiler` and summarise ops, phases and modules.

    Give either a step function (`profile_steps(train_step, model=model)`) or a model and
    its inputs (`profile_steps(model, x, loss_fn=F.cross_entropy, targets=y,
    optimizer=opt)`). In the second form each step is labelled `forward` (model and loss),
    `backward` and `optimizer` with `record_function`; label your own step function the
    same way (`torchscope.profiling.phase`) to get the split.

    The run is: one unprofiled warm-up step, `baseline_steps` timed steps without a
    profiler, then `wait + warmup + steps` steps under `torch.profiler.profile` with
    `schedule(wait, warmup, active=steps)`. Every step really trains: parameters change.

    Args:
        step: a zero-argument step function, or the model.
        inputs: the model's inputs (a tensor, tuple, dict or `ModelInputs`); model form only.
        loss_fn: `loss_fn(output, targets)` (or `loss_fn(output)` without targets); default
            `default_loss`.
        targets: passed to `loss_fn`.
        optimizer: stepped and zeroed in the `optimizer` phase; none means no such phase.
        model: the model, for per-module time when `step` is a function.
        steps: profiled (active) steps.
        wait: schedule steps skipped before the profiler warms up.
        warmup: schedule steps the profiler runs but discards.
        by_module: time every module (forward ranges + backward attribution).
        select: which modules to time (glob, type, ...; see `select_modules`); None = all.
        depth: time only modules this deep or shallower.
        group_by_input_shape: one op record per (name, input shapes).
        record_shapes: record input shapes (implied by `group_by_input_shape`).
        baseline_steps: unprofiled steps timed for the overhead figure; default `steps`,
            0 skips the measurement.
        trace: write a Chrome/Perfetto trace here (`.gz` compresses it).
        trace_steps: keep only the last N profiled steps in the trace (None: all).
        cuda: record CUDA activity; default: when CUDA is available.

    Returns:
        A `ProfileResult`.

    Raises:
        ProfilingError: bad arguments, or a loss that is not a differentiable scalar.
        ModelError: the model raised.
    """
    quiet_kineto()
    for label, value, low in (("steps", steps, 1), ("wait", wait, 0), ("warmup", warmup, 0)):
        if int(value) < low:
            raise ProfilingError(f"{label}={value} is out of range.",
                                 fix=f"pass {label} >= {low}.")
    if trace_steps is not None and trace_steps < 1:
        raise ProfilingError(f"trace_steps={trace_steps} keeps no step in the trace.",
                             fix="pass trace_steps >= 1, or None to keep every profiled step.")
    net: nn.Module | None
    model_inputs: ModelInputs | None
    if isinstance(step, nn.Module):
        net = step
        if inputs is None:
            raise ProfilingError("a model was given without inputs.",
                                 fix="pass the inputs: profile_steps(model, x, ...).")
        model_inputs = ModelInputs.of(inputs)
        step_fn: StepFn = make_train_step(net, model_inputs, loss_fn=loss_fn, targets=targets,
                                          optimizer=optimizer)
    elif callable(step):
        if inputs is not None or loss_fn is not None or optimizer is not None:
            raise ProfilingError(
                "a step function was given together with inputs/loss_fn/optimizer.",
                fix="either pass a step function, or a model with its inputs, loss and optimizer.",
            )
        net, model_inputs, step_fn = model, None, step
    else:
        raise ProfilingError(f"step is a {type(step).__name__}, expected a callable or a Module.",
                             fix="pass a step function or an nn.Module.")

    device = _device_of(net, model_inputs)
    use_cuda = torch.cuda.is_available() if cuda is None else bool(cuda)
    if device.type == "cuda":
        def sync() -> None:
            torch.cuda.synchronize(device)
    else:
        def sync() -> None:
            return None
    activities = [ProfilerActivity.CPU]
    if use_cuda:
        activities.append(ProfilerActivity.CUDA)

    # Warm-up: first-call costs (allocator, kernels selection, lazy init) out of every figure.
    _timed(step_fn, sync)
    n_base = steps if baseline_steps is None else max(int(baseline_steps), 0)
    baseline = [_timed(step_fn, sync) for _ in range(n_base)]

    ranges = ModuleRanges(net, select, depth) if (by_module and net is not None) else None
    active: list[float] = []
    sched = schedule(wait=wait, warmup=warmup, active=steps, repeat=1)
    with ExitStack() as stack:
        if ranges is not None:
            stack.enter_context(ranges)
        prof = stack.enter_context(profile(
            activities=activities, schedule=sched,
            record_shapes=record_shapes or group_by_input_shape,
        ))
        for i in range(wait + warmup + steps):
            ms = _timed(step_fn, sync)
            if i >= wait + warmup:
                active.append(ms)
            prof.step()
    events = prof.events()
    averages = prof.key_averages(group_by_input_shape=group_by_input_shape)
    attr = attribute(events, ranges.labels if ranges is not None else {})
    trace_path = None
    if trace is not None:
        trace_path = str(export_trace(prof, trace, steps=trace_steps))
    timing = StepTiming(
        baseline_ms=statistics.median(baseline) if baseline else None,
        profiled_ms=statistics.median(active),
        profiled_total_ms=sum(active),
        baseline_steps=len(baseline),
        profiled_steps=len(active),
    )
    notes = list(attr.notes)
    if not attr.phases:
        notes.append("the step labelled no phase; wrap its parts in phase('forward'), "
                     "phase('backward') and phase('optimizer') to get the split.")
    return ProfileResult(
        steps=steps,
        device=device.type,
        ops=op_records(averages),
        phases=attr.phases,
        modules=attr.modules,
        reconciliation=attr.reconciliation,
        timing=timing,
        by_module=ranges is not None,
        trace_path=trace_path,
        notes=tuple(notes),
    )
