"""`watch_time`: profile a window of your own training loop, with the analysis of
`profile_steps` (which runs its steps through the same window).

A step ends after each `optimizer.step()` (a step post-hook, owned by a `HookSession`, marks
it; the next `phase()` or the model's next forward outside a phase closes it, so that no
labelled phase is cut in two) or at an explicit `watch.step()`. The window follows
`torch.profiler.schedule(wait, warmup, active=steps)`: later steps run unprofiled. Kineto is
quieted only while the window is open.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from torchscope._process import quiet_kineto
from torchscope.distributed.ranked import Ranked
from torchscope.distributed.world import world
from torchscope.hooks.lifecycle import HookedContext
from torchscope.hooks.select import Selector
from torchscope.hooks.session import HookSession
from torchscope.profiling.attribution import attribute
from torchscope.profiling.comm import comm_time
from torchscope.profiling.loader import input_wait
from torchscope.profiling.module_ranges import ModuleRanges
from torchscope.profiling.ops import op_records
from torchscope.profiling.records import (
    OWN_SYNC_RANGE,
    ProfileResult,
    ProfilingError,
    StepTiming,
)
from torchscope.profiling.syncs import host_reads
from torchscope.profiling.trace import export_trace, rank_trace_path
from torchscope.step import inner_optimizer, synchronize

# Phases opened with `phase()` on this thread, and the watches open in this process: a step
# boundary never falls inside a labelled phase (its range would be cut at the window's edges).
_phases = threading.local()
_OPEN: list[TimeWatch] = []


def _phase_depth() -> int:
    depth: int = getattr(_phases, "depth", 0)
    return depth


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Label a phase of your own step: `with phase("forward"): ...`.

    A `torch.profiler.record_function(name)` range; use the names `forward`, `backward`
    and `optimizer` so that `profile_steps` and `watch_time` report the split. Unlike a
    bare `record_function`, it keeps `watch_time`'s step boundaries out of the phase: a step
    that `optimizer.step()` ended inside a phase is closed when the next phase opens.
    """
    if _phase_depth() == 0:
        for watch in list(_OPEN):
            if watch._pending:  # optimizer.step() ended it: close it before the phase
                watch.step()
    with record_function(name):
        _phases.depth = _phase_depth() + 1
        try:
            yield
        finally:
            _phases.depth = _phase_depth() - 1


class TimeWatch(HookedContext):
    """Profiles the steps of your own loop (build it with `watch_time`); `.result` is a
    `ProfileResult` after the block, with the tables of `profile_steps`.

    The step's wall time is measured from one step boundary to the next (the device is
    synchronised at each boundary inside the window); there is no unprofiled baseline. In a
    distributed job every rank's result is joined on rank 0 at the end of the block
    (`gathered`) unless it was built with `gather=False` (`profile_steps` leaves that to
    its caller's `result.gather()`).

    Attributes:
        result: the `ProfileResult`, set when the block exits without an exception.
        boundaries: step boundaries seen so far.
        gathered: in a distributed job, every rank's result joined on rank 0 at the end of
            the block (`Ranked[ProfileResult]`); None on the other ranks and on one process.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        steps: int = 5,
        wait: int = 1,
        warmup: int = 1,
        by_module: bool = True,
        select: Selector = None,
        depth: int | None = None,
        group_by_input_shape: bool = False,
        record_shapes: bool = False,
        trace: str | Path | None = None,
        trace_steps: int | None = 3,
        cuda: bool | None = None,
        gather: bool = True,
    ) -> None:
        for label, value, low in (("steps", steps, 1), ("wait", wait, 0), ("warmup", warmup, 0)):
            if int(value) < low:
                raise ProfilingError(f"{label}={value} is out of range.",
                                     fix=f"pass {label} >= {low}.")
        if trace_steps is not None and trace_steps < 1:
            raise ProfilingError(f"trace_steps={trace_steps} keeps no step in the trace.",
                                 fix="pass trace_steps >= 1, or None to keep every profiled step.")
        if model is not None and not isinstance(model, nn.Module):
            raise ProfilingError(f"model is a {type(model).__name__}, not an nn.Module.",
                                 fix="pass the model (or None to profile without modules).")
        self._model = model
        self._optimizer = inner_optimizer(optimizer)  # accelerate's wrapper has no hooks
        self._steps, self._wait, self._warmup = int(steps), int(wait), int(warmup)
        self._by_module = by_module and model is not None
        self._select, self._depth = select, depth
        self._group = group_by_input_shape
        self._record_shapes = record_shapes or group_by_input_shape
        self._trace, self._trace_steps = trace, trace_steps
        self._cuda = torch.cuda.is_available() if cuda is None else bool(cuda)
        param = next(model.parameters(), None) if model is not None else None
        self._device = param.device if param is not None else \
            torch.device("cuda" if self._cuda else "cpu")
        self._stack = ExitStack()
        self._prof: Any = None
        self._ranges: ModuleRanges | None = None
        self._active: list[float] = []
        self._last = 0.0
        self._pending = False
        self.boundaries = 0
        self.result: ProfileResult | None = None
        self.gathered: Ranked[ProfileResult] | None = None
        self._gather = gather

    @property
    def window(self) -> int:
        """Steps the schedule covers: `wait + warmup + steps`."""
        return self._wait + self._warmup + self._steps

    def sync(self) -> None:
        """Wait for the watched device to finish its queued work; no-op on CPU."""
        synchronize(self._device)

    def _boundary_sync(self) -> None:
        # The watch's own wait, so that a step's time includes its device work. Named, so
        # that it is not counted as a sync of the user's step.
        if self._device.type == "cpu":
            return
        with record_function(OWN_SYNC_RANGE):
            synchronize(self._device)

    def open(self) -> None:
        """Start the window: hooks, then the profiler (use the watch as a context manager)."""
        stack = self._stack
        stack.enter_context(quiet_kineto())
        session: HookSession | None = None
        if self._by_module:
            assert self._model is not None
            self._ranges = ModuleRanges(self._model, self._select, self._depth)
            session = stack.enter_context(self._ranges).session
        elif self._model is not None and self._optimizer is not None:
            # Only the optimizer hook: compiled parts keep running compiled.
            session = stack.enter_context(HookSession(self._model, compiled="as_is"))
        if self._optimizer is not None:
            handle = self._optimizer.register_step_post_hook(self._on_optimizer_step)
            if session is not None:
                session.track(handle)
                # Before every other pre-hook, so the step boundary precedes the
                # model's own profiler range.
                session.forward_pre_hook(session.model, self._on_forward, prepend=True)
            else:
                stack.callback(handle.remove)
        activities = [ProfilerActivity.CPU]
        if self._cuda:
            activities.append(ProfilerActivity.CUDA)
        self._prof = stack.enter_context(profile(
            activities=activities, record_shapes=self._record_shapes,
            schedule=schedule(wait=self._wait, warmup=self._warmup, active=self._steps,
                              repeat=1)))
        _OPEN.append(self)
        self._boundary_sync()
        self._last = time.perf_counter()

    def _on_optimizer_step(self, _opt: Any, _args: Any, _kwargs: Any) -> None:
        # The step ends at the next `phase()` or at the model's next forward outside a
        # phase (or at the block's end), so that what follows `optimizer.step()` in the loop
        # body (zero_grad, the end of the phase around it) stays in this step. Without a
        # model to watch, it ends right away unless a phase is open.
        self._pending = True
        if self._model is None and _phase_depth() == 0:
            self.step()

    def _on_forward(self, _module: nn.Module, _args: tuple[Any, ...]) -> None:
        if self._pending and _phase_depth() == 0:
            self.step()

    def step(self) -> None:
        """End the current step now.

        With `optimizer=` there is no need: each `optimizer.step()` ends its step at the
        next `phase()`, the model's next forward outside a phase, or the end of the block.
        """
        self._pending = False
        if self._prof is None or self.boundaries >= self.window:
            self.boundaries += 1
            return
        self._boundary_sync()
        now = time.perf_counter()
        if self.boundaries >= self._wait + self._warmup:
            self._active.append((now - self._last) * 1e3)
        self.boundaries += 1
        self._prof.step()
        # The profiler's own start/stop work at a transition is no step's time.
        self._last = time.perf_counter()

    def close(self, *, failed: bool = False) -> None:
        """End the window: the last step, the profiler, the hooks; then the result (unless
        the block is unwinding an exception)."""
        prof = self._prof
        try:
            if self._pending and not failed:
                self.step()
            self._stack.close()
        finally:
            self._prof = None
            if self in _OPEN:
                _OPEN.remove(self)
        if not failed and prof is not None:
            self.result = self._summarize(prof)
            if self._gather and world().distributed:
                self.gathered = self.result.gather()  # rank 0 gets every rank's result

    def _summarize(self, prof: Any) -> ProfileResult:
        if not self._active:
            raise ProfilingError(
                f"watch_time saw {self.boundaries} step(s) but its window profiles steps "
                f"{self._wait + self._warmup + 1} to {self.window} (wait={self._wait}, "
                f"warmup={self._warmup}, steps={self._steps}).",
                fix="run more steps inside the block, pass optimizer= (each optimizer.step() "
                "ends a step), call watch.step() after each step, or lower wait/warmup.")
        events = prof.events()
        averages = prof.key_averages(group_by_input_shape=self._group)
        ranges = self._ranges
        attr = attribute(events, ranges.labels if ranges is not None else {})
        trace_path = None
        if self._trace is not None:
            w = world()
            where = rank_trace_path(self._trace, w.rank) if w.distributed else self._trace
            trace_path = str(export_trace(prof, where, steps=self._trace_steps))
        notes = list(attr.notes)
        if len(self._active) < self._steps:
            notes.append(f"the block ended after {len(self._active)} of {self._steps} "
                         "profiled steps.")
        if not attr.phases:
            notes.append("the step labelled no phase; wrap its parts in phase('forward'), "
                         "phase('backward') and phase('optimizer') to get the split.")
        timing = StepTiming(
            baseline_ms=None, profiled_ms=statistics.median(self._active),
            profiled_total_ms=sum(self._active), baseline_steps=0,
            profiled_steps=len(self._active), profiled_samples=tuple(self._active))
        return ProfileResult(
            steps=len(self._active), device=self._device.type, ops=op_records(averages),
            phases=attr.phases, modules=attr.modules, reconciliation=attr.reconciliation,
            timing=timing, by_module=ranges is not None, trace_path=trace_path,
            notes=tuple(notes), comm=comm_time(events, len(self._active)),
            input_wait=input_wait(events), host_reads=host_reads(events),
            compiled=ranges.session.compiled if ranges is not None else ())


def watch_time(
    model: nn.Module | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    steps: int = 5,
    wait: int = 1,
    warmup: int = 1,
    by_module: bool = True,
    select: Selector = None,
    depth: int | None = None,
    group_by_input_shape: bool = False,
    record_shapes: bool = False,
    trace: str | Path | None = None,
    trace_steps: int | None = 3,
    cuda: bool | None = None,
) -> TimeWatch:
    """Profile `steps` steps of your own training loop: ops, phases and time per module.

    A step ends after every `optimizer.step()` of `optimizer`: at the next `phase()` you
    open or the model's next forward outside a phase (so `zero_grad()` and anything else
    after it in the loop body belong to the step); or at each `watch.step()` you call.
    Label phases with `torchscope.profiling.phase`, not a bare `record_function`, so that
    no step boundary falls inside one. The first `wait` steps run unprofiled, the next
    `warmup` are profiled and discarded, the next `steps` are kept; the rest of the loop
    runs unprofiled. Every hook is removed on exit, also when the loop raises; the model
    trains exactly as without it.

    Args:
        model: the model whose modules are timed (None: ops and phases only).
        optimizer: each of its `step()` calls ends a step.
        steps: profiled (active) steps.
        wait: steps skipped before the profiler warms up.
        warmup: steps the profiler runs but discards.
        by_module: time every selected module (forward ranges + backward attribution).
        select: which modules to time (glob, type, ...; see `select_modules`); None = all.
        depth: time only modules this deep or shallower.
        group_by_input_shape: one op record per (name, input shapes).
        record_shapes: record input shapes (implied by `group_by_input_shape`).
        trace: write a Chrome/Perfetto trace here (`.gz` compresses it). In a distributed
            job every rank writes its own (see `rank_trace_path`): one folder that
            HolisticTraceAnalysis reads as it is.
        trace_steps: keep only the last N profiled steps in the trace (None: all).
        cuda: record CUDA activity; default: when CUDA is available.

    Returns:
        A `TimeWatch` context manager; its `.result` is a `ProfileResult` after the block,
        and in a distributed job `.gathered` holds every rank's on rank 0.

    Raises:
        ProfilingError: bad arguments; on exit, when no step was profiled.

    Example:
        >>> with torchscope.watch_time(model, optimizer=opt, steps=5) as watch:
        ...     for x, y in loader:
        ...         with phase("forward"):
        ...             loss = F.cross_entropy(model(x), y)
        ...         with phase("backward"):
        ...             loss.backward()
        ...         opt.step()
        ...         opt.zero_grad()
        >>> watch.result.findings()
    """
    return TimeWatch(model, optimizer=optimizer, steps=steps, wait=wait, warmup=warmup,
                     by_module=by_module, select=select, depth=depth,
                     group_by_input_shape=group_by_input_shape, record_shapes=record_shapes,
                     trace=trace, trace_steps=trace_steps, cuda=cuda)
