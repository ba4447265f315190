"""`profile_steps`: run training steps under `torch.profiler` and summarise them."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchscope._process import seeded
from torchscope._timing import MIN_SAMPLES, compare, repeat, timed_ms
from torchscope.hooks.select import Selector
from torchscope.profiling.records import ProfileResult, ProfilingError
from torchscope.profiling.watch import TimeWatch
from torchscope.step import LossSpec, Step

StepFn = Callable[[], Any]


_BASELINE_BUDGET_S = 2.0  # seconds of unprofiled steps, once the minimum is done


def profile_steps(
    step: StepFn | nn.Module | Step,
    inputs: Any = None,
    *,
    loss_fn: LossSpec = "auto",
    target: Any = None,
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
    on_step: Callable[[str, int, int], None] | None = None,
) -> ProfileResult:
    """Profile training steps with `torch.profiler` and summarise ops, phases and modules.

    Give a model and its inputs (`profile_steps(model, x, loss_fn="cross_entropy",
    target=y, optimizer=opt)`), a ready `Step` (for AMP or accumulation), or a step
    function of your own (`profile_steps(train_step, model=model)`). A model or `Step` runs
    each step as `Step.run()`, which labels `forward` (model and loss), `backward` and
    `optimizer` with `record_function`; label your own step function the same way
    (`torchscope.profiling.phase`) to get the split.

    The run is: one unprofiled warm-up step (its loss is `result.step.loss_value`),
    `baseline_steps` timed steps without a profiler, then `wait + warmup + steps` steps
    under `torch.profiler.profile` with `schedule(wait, warmup, active=steps)` (the window
    of `watch_time`). Every step really trains: parameters and the optimizer's state change
    (wrap the call in `torchscope.step.preserved` to undo that). The caller's random
    generators continue as if the steps had not drawn from them.

    Args:
        step: the model, a `Step`, or a zero-argument step function.
        inputs: the model's inputs (a tensor, tuple, dict or `ModelInputs`); model form only.
        loss_fn: the loss (see `torchscope.step`): `auto`, `cross_entropy`, `mse`, `sum`
            or a callable; model form only.
        target: the loss target; None draws seeded targets for the named losses.
        optimizer: stepped in the `optimizer` phase; none means no such phase.
        model: the model, for per-module time when `step` is a function.
        steps: profiled (active) steps.
        wait: schedule steps skipped before the profiler warms up.
        warmup: schedule steps the profiler runs but discards.
        by_module: time every module (forward ranges + backward attribution).
        select: which modules to time (glob, type, ...; see `select_modules`); None = all.
        depth: time only modules this deep or shallower.
        group_by_input_shape: one op record per (name, input shapes).
        record_shapes: record input shapes (implied by `group_by_input_shape`).
        baseline_steps: unprofiled steps timed for the overhead figure; default at least
            `steps` (and 3), more until their median is known to 5 % (up to 4× or about
            2 s); 0 skips the measurement. The overhead is the ratio of the medians with an
            interval (`result.timing.overhead_ratio`): inside the noise it is none.
        trace: write a Chrome/Perfetto trace here (`.gz` compresses it); in a distributed
            job one per rank, in one folder (see `watch_time`).
        trace_steps: keep only the last N profiled steps in the trace (None: all).
        cuda: record CUDA activity; default: when CUDA is available.
        on_step: called with `(part, k, n)` as step k (1-based) of n of a part of the run
            begins: the warm-up step, the unprofiled steps, each profiled step (progress).

    Returns:
        A `ProfileResult`; `result.findings()` reads it. On a DDP or FSDP2 model, call it on
        every rank; `result.comm` splits the step into computation and communication, and
        `result.gather()` joins every rank's result on rank 0.

    Raises:
        ProfilingError: bad arguments.
        TorchscopeError: a model without inputs, or a loss that does not require grad.
        ModelError: the model or the loss raised, or the loss is not a scalar.
    """
    run: StepFn
    net: nn.Module | None
    the_step: Step | None = None
    if isinstance(step, (nn.Module, Step)):
        if model is not None:
            raise ProfilingError("model= was given together with a model or a Step.",
                                 fix="model= is for a step function; drop it.")
        the_step = Step.of(step, inputs, loss_fn=loss_fn, target=target, optimizer=optimizer)
        run, net = the_step.run, the_step.model
    elif callable(step):
        given = [n for n, v in (("inputs", inputs), ("target", target),
                                ("optimizer", optimizer)) if v is not None]
        if callable(loss_fn) or loss_fn != "auto":
            given.append("loss_fn")
        if given:
            raise ProfilingError(
                f"a step function was given together with {', '.join(given)}.",
                fix="either pass a step function, or a model with its inputs, loss and "
                "optimizer.")
        run, net = step, model
    else:
        raise ProfilingError(f"step is a {type(step).__name__}, expected a model, a Step or "
                             "a step function.", fix="pass a model, a Step or a function.")
    say = on_step or (lambda _part, _k, _n: None)
    watch = TimeWatch(net, steps=steps, wait=wait, warmup=warmup, by_module=by_module,
                      select=select, depth=depth, group_by_input_shape=group_by_input_shape,
                      record_shapes=record_shapes, trace=trace, trace_steps=trace_steps,
                      cuda=cuda, gather=False)
    with seeded(None):
        # Warm-up: first-call costs (allocator, kernel selection, lazy init) out of every
        # figure; its loss, on the unchanged model, is the step's loss.
        say("warm-up step", 1, 1)
        first = run()
        info = the_step.info(first) if the_step is not None else None
        timed = timed_ms(run, watch.sync)
        baseline: tuple[float, ...] = ()
        say("unprofiled steps (the overhead's baseline)", 1, 1)
        if baseline_steps is None:
            least = max(steps, MIN_SAMPLES)
            baseline = repeat(timed, min_repeats=least, max_repeats=4 * least,
                              budget_s=_BASELINE_BUDGET_S)
        elif baseline_steps > 0:
            baseline = tuple(timed() for _ in range(int(baseline_steps)))
        with watch:
            for k in range(1, watch.window + 1):
                say("step under the profiler", k, watch.window)
                run()
                watch.step()
    assert watch.result is not None
    result = watch.result
    samples = result.timing.profiled_samples
    timing = replace(result.timing, baseline_ms=statistics.median(baseline) if baseline else None,
                     baseline_steps=len(baseline), baseline_samples=tuple(baseline),
                     overhead_ratio=compare(samples, baseline) if baseline and samples else None)
    return replace(result, timing=timing, step=info)
