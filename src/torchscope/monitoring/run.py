"""`Monitor`: the capabilities' own watches on the user's training run, sampled together.

One `GradWatch` defines the steps (optimizer steps, closures, accumulation, the GradScaler's
skipped steps) and samples one in `every`; on the forwards of a sampled step a root hook
switches on the `ActivationCapture` and the `MemoryWatch`, which skip every other forward.
An optional `TimeWatch` profiles a few steps early in the run and is closed when its window
is done. The monitor keeps what it reads in a bounded `SampleHistory` (and per-step times in
`StepBuckets`), so a run of any length holds the same memory; on exit it builds a `RunRecord`
and writes the run report.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from torchscope._util import output_problem
from torchscope.capture import ActivationCapture, trace_nonfinite
from torchscope.capture.analyze import leaf_modules
from torchscope.distributed.world import world
from torchscope.errors import TorchscopeError, describe
from torchscope.grads import GradFlow, GradWatch
from torchscope.grads.loss import labelled_modules, padded_label_counts
from torchscope.hooks.compiled import compiled_parts, eager_stance
from torchscope.hooks.lifecycle import HookedContext
from torchscope.hooks.select import Selector
from torchscope.hooks.session import HookSession
from torchscope.hooks.tree import iter_tensors
from torchscope.memory import MemoryWatch
from torchscope.models.target import ModelInputs
from torchscope.monitoring.flight import FlightRecorder
from torchscope.monitoring.history import METRICS, SampleHistory, StepBuckets
from torchscope.monitoring.records import (
    ExpertUse,
    HistoryBudget,
    LayerSeries,
    ModeCounts,
    NonFiniteOnset,
    RunRecord,
    mode_sensitive,
)
from torchscope.profiling import ProfilingError, TimeWatch
from torchscope.step import autocast_dtype, inner_optimizer, own_loss

__all__ = ["Monitor", "monitor"]

KEEP_FORWARDS = 8  # forwards of a sampled step the activation capture keeps (micro-batches)
PROFILE_WAIT = 5  # steps before the profiled window: past the first, slow steps
# The memory watch's cadence (`Monitor._memory_due`): what a forward saves for backward
# follows from the graph and the input's shapes, so after the first few sampled steps it
# is measured where those change, and at the samples whose index is a multiple of
# `_MEMORY_EVERY` (a power of 2: the history's whole-run view, which keeps every
# stride-th sample as it thins, keeps those). A sampled step's saved-tensor hooks cost
# about 1.4 ms of a 13 ms tiny GPT-2 step on the CPU.
_MEMORY_FIRST = 3
_MEMORY_EVERY = 8


def _check_out(out: str | Path) -> Path:
    """The output folder, created now: an unwritable path fails before training starts."""
    problem = output_problem(str(out), "out=", folder=True)
    if problem is not None:
        raise TorchscopeError(problem[0], fix=problem[1])
    path = Path(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TorchscopeError(f"out={str(out)!r} cannot be created ({exc.strerror or exc}).",
                              fix="pass out= a folder you can write to, or None.") from exc
    if not path.is_dir() or not os.access(path, os.W_OK | os.X_OK):
        raise TorchscopeError(f"out={str(out)!r} is not a writable folder.",
                              fix="pass out= a folder you can write to, or None.")
    return path


def _positive(label: str, value: Any, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise TorchscopeError(f"{label}={value!r} is out of range.",
                              fix=f"pass {label}={low} or more.")
    return value


# Recorded forwards whose output pre-hooks are kept while no backward has reached them.
_WAITING_FORWARDS = 8


class Monitor(HookedContext):
    """Watches a training run and writes its run report; build it with `torchscope.monitor`.

    The arguments are `torchscope.monitor`'s, and seven that the framework callbacks use:
    `manual=True` (steps end at `end_step()`), `start` (the first sampled step, see
    `watch_gradients`), `producer` (who drove it, for report.json's `options`) and
    `parallel` (the `DistributedDataParallel` wrapper `model` trains through when `model` is
    the module inside it, or `"ddp"` for one kept out of sight, so that the gradients are
    read synchronised; see `GradWatch`), and `compiled_outside` (the loop calls `model`
    through a `torch.compile` wrapper kept out of sight, the HF Trainer's
    `torch_compile=True`: the whole model then runs eagerly while the monitor is open, as
    compiled parts it is given do, and the report says so), and `clip_setting` (the
    framework's clipping setting, `RunRecord.clip_setting`: the advice then knows the loop
    clips, even where no sampled step reached the threshold), and `first_step` (the
    framework's global step where the run resumed from a checkpoint: steps are numbered on
    from it, as its logs number them).

    Attributes:
        result: the `RunRecord`, set when the block ends (also through an exception).
        paths: (report.html, report.json) once written, else None (as on every rank
            but 0 under torchrun, where rank 0 writes it).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        every: int = 10,
        out: str | Path | None = "torchscope-run",
        scaler: Any = None,
        micro_batches: int | None = None,
        manual: bool = False,
        start: int = 0,
        select: Selector = None,
        depth: int | None = None,
        activations: bool = True,
        memory: bool = True,
        profile: int = 0,
        history: int = 512,
        recent: int = 128,
        name: str | None = None,
        on_sample: Callable[[int, Mapping[str, float]], None] | None = None,
        producer: str = "torchscope.monitor",
        parallel: nn.Module | Literal["ddp"] | None = None,
        compiled_outside: bool = False,
        clip_setting: str = "",
        first_step: int = 0,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TorchscopeError(f"the model is a {type(model).__name__}, not an nn.Module.",
                                  fix="pass the model (an nn.Module) first.")
        self.every = _positive("every", every)
        self._history = SampleHistory(_positive("history", history, 2),
                                      _positive("recent", recent))
        # Per sampled step the loop clipped: the total norm its update used.
        self._applied: dict[int, float] = {}
        # Per fused experts module: (the weight read per expert, [samples, idle per expert]).
        self._experts: dict[str, tuple[str, list[int]]] = {}
        # Per read sampled forward whose output got a gradient: `_softmax_ce_scale`'s (2,)
        # on the device, the newest few (read when the run ends), and the sampled forwards
        # offered so far (`_scale_due`).
        self._scales: collections.deque[torch.Tensor] = collections.deque(maxlen=32)
        self._scale_offers = 0
        self._flight: FlightRecorder | None = None  # set when open
        # The newest sample's step, and per layer its weight matrices' names and norm, until
        # its update is read (`_fill_update`).
        self._update_of: tuple[int, dict[str, tuple[tuple[str, ...], float | None]]] | None \
            = None
        self._profile_steps = _positive("profile", profile, 0)
        self._out = None if out is None else _check_out(out)
        self._model: nn.Module | None = model
        self._parallel = parallel
        optimizer = inner_optimizer(optimizer)  # accelerate's wrapper has no hooks
        self._optimizer = optimizer
        self._groups: tuple[tuple[float, float], ...] = ()  # see `_note_groups`
        self._scaler = scaler
        self._micro_batches = micro_batches
        self._manual = manual
        self._start = start
        self._select, self._depth = select, depth
        self._want_activations, self._want_memory = activations, memory
        self._name = name
        self._options: dict[str, Any] = {
            "every": every, "step_by": "", "activations": activations, "memory": memory,
            "profile": profile, "history": history, "recent": recent, "producer": producer}
        self._optimizer_name = None if optimizer is None else type(optimizer).__name__
        self._on_sample = on_sample
        self._times = StepBuckets(history)
        self._peaks = StepBuckets(history)
        self._grads: GradWatch | None = None
        self._acts: ActivationCapture | None = None
        self._mem: MemoryWatch | None = None
        self._time: TimeWatch | None = None
        self._session: HookSession | None = None
        self._profile: Any = None
        self._profile_note = ""
        self._acts_seen = -1
        self._recording = False  # the forward in progress is recorded
        self._reached: set[int] = set()  # recorded forwards that a backward reached
        self._waiting: list[list[Any]] = []  # their pre-hooks' handles, newest last
        self._mem_seen = 0
        # The memory watch's cadence (`_memory_due`): the step it was last decided for and
        # the decision, what the last measured step's input looked like, and how many
        # steps it measured.
        self._mem_step = -1
        # The watches' hooks on the submodules: all on (True, as opened), all but the
        # memory watch's (False), or none (None, between samples; see `_rest`).
        self._woken: bool | None = True
        self._mem_on = False
        self._mem_key: tuple[Any, ...] | None = None
        self._mem_measured = 0
        # What the activation capture and the memory watch held at the end of the last
        # backward: (forwards recorded, memory samples, the last one's saved bytes). An
        # inferred step ends one backward late, when the next step's forward has been
        # recorded too.
        self._at_backward: tuple[int, int, int | None] | None = None
        self._inputs = ""
        # Whether the model's input repeats from step to step (`_note_input`): the
        # fingerprint of a sampled step's first training forward, (step, what it holds,
        # its sums on the device), and over the pairs of steps compared, how many held
        # the same input (a 0-d count on the device, read when the run ends).
        self._fp_step = -1
        self._fp_prev: tuple[int, tuple[Any, ...], torch.Tensor] | None = None
        self._fp_pairs = 0
        self._fp_same: torch.Tensor | None = None
        # Sampled training forwards' label positions that the attention mask pads: (those
        # padded, those of them with a label the loss counts), (2,) on the device, read
        # when the run ends (`RunRecord.padded_labels`). Counted by a pre-hook on each
        # transformers model that is no encoder-decoder: the watched one, or the outermost
        # ones inside it (`labelled_modules`, `_padding_gate`).
        self._padded: torch.Tensor | None = None
        self._forward_onset: tuple[int, str | None, str | None, str | None] | None = None
        self._error = ""
        self._t0 = self._last = 0.0
        self._created = ""
        self._cuda: torch.device | None = None
        self._order: dict[str, int] = {}
        self._facts: tuple[str, int, int, str] = (type(model).__name__, 0, 0, "cpu")
        self._compiled: tuple[str, ...] = ()
        self._mode: bool | None = None  # `training` at the step's last forward with grad
        self._autocast: str | None = None  # and its autocast dtype, None without
        self._device_type = "cpu"
        self._modes = ModeCounts()
        # Training steps since the last mode change, all of one autocast state, not yet in
        # `_modes` (`_fold_modes`): a step adds one to a count, not a new record.
        self._run_steps = 0
        self._run_autocast: str | None = None
        self._compiled_outside = compiled_outside
        self._clip_setting = clip_setting
        self._first_step = first_step
        # Steps at which the run was resumed into the report it continues (`_go_on_from`);
        # whether it continues `out`'s report, or why that report is not this run's.
        self._resumed_at: tuple[int, ...] = ()
        self._continues = False
        self._not_continued = ""
        self._eager = contextlib.ExitStack()  # the eager stance, for a wrapper out of sight
        self._resting: list[HookSession] = []  # sessions whose submodule hooks `_rest` lifts
        self._latest: Mapping[str, float] = {}  # built when read (`_Scalars`)
        self.result: RunRecord | None = None
        self.paths: tuple[Path, Path] | None = None
        self._writes = True  # this rank writes the report (`open`)

    # ------------------------------------------------------------------ lifecycle
    def open(self) -> None:
        """Open the watches, in the order their root hooks must run (see the module doc)."""
        model = self._model
        assert model is not None
        # Under torchrun every rank runs this monitor, and one folder is every rank's `out`:
        # rank 0 writes the report, read now (the group may be gone at close).
        self._writes = world().rank == 0
        params = list(model.parameters())
        device = params[0].device if params else torch.device("cpu")
        self._cuda = device if device.type == "cuda" else None
        self._device_type = device.type
        # Layers in the model's order (the input side first) in every series.
        self._order = {name: i for i, (name, _) in enumerate(model.named_modules())}
        # torch.compile imports torch._dynamo: without it nothing is compiled.
        self._compiled = compiled_parts(model) if "torch._dynamo" in sys.modules else ()
        if self._compiled_outside and not self._compiled:
            # Before any hook: Dynamo would trace them into the wrapper's graph.
            self._eager.enter_context(eager_stance("the monitor"))
            self._compiled = ("",)
        self._modes = ModeCounts(sensitive=mode_sensitive(model))
        self._run_steps = 0
        self._facts = (type(model).__name__, sum(p.numel() for p in params),
                       sum(p.numel() for p in params if p.requires_grad), str(device))
        if self._want_activations:
            self._acts = ActivationCapture(model, select=self._select, depth=self._depth,
                                           keep_last=KEEP_FORWARDS, count_nonfinite=False)
            self._acts.active = False
            self._acts.open()
        if self._want_memory:
            self._mem = MemoryWatch(model, select=self._select, depth=self._depth, max_samples=1)
            self._mem.active = False
            self._mem.open()
        self._session = HookSession(model)
        # Before the watches' own root hooks (each registered with prepend before it) and
        # after the GradWatch's, which decide whether the step in progress is sampled.
        self._session.forward_pre_hook(self._session.model, self._gate,
                                       with_kwargs=True, prepend=True)
        # Accelerate (the HF Trainer's bf16/fp16) enters autocast inside the model's forward,
        # after the root's pre-hooks: its first layer with parameters sees it.
        first = next((m for m in model.modules() if next(m.children(), None) is None
                      and next(m.parameters(recurse=False), None) is not None), None)
        if first is not None and first is not model:
            self._session.forward_pre_hook(first, self._inner_autocast)
        if self._acts is not None:
            self._session.forward_hook(self._session.model, self._forward_end)
        self._session.forward_hook(self._session.model, self._note_output_scale)
        # Appended: on the root it runs after the GradWatch's prepended hook, which decides
        # whether the step in progress is sampled.
        for labelled, first_label in labelled_modules(model):
            self._session.forward_pre_hook(
                labelled, functools.partial(self._padding_gate, first_label), with_kwargs=True)
        self._grads = GradWatch(
            model, every=self.every, start=self._start, optimizer=self._optimizer,
            scaler=self._scaler,
            micro_batches=self._micro_batches, manual=self._manual, select=self._select,
            depth=self._depth, inputs_grad=False, max_samples=1,
            check_nonfinite=self._scaler is None, on_step=self._on_step,
            parallel=self._parallel, on_backward=self._backward_end,
            first_step=self._first_step)
        self._grads.open()
        # The flight recorder: every step's loss and gradient magnitudes, in a ring that
        # holds at least the steps between two samples.
        self._flight = FlightRecorder(min(max(16, self.every + 1), 1024),
                                      [n for n, p in model.named_parameters()
                                       if p.requires_grad])
        self._grads.on_check = self._flight.on_grads
        self._grads.check_row = self._flight.row_for
        # The watches' hooks on submodules, taken off for the steps that are not sampled
        # (`_rest`): only the model's own hooks and the parameters' stay on every step.
        # The memory watch's first: taken off while the others' are on, it keeps its
        # place among all of theirs, and can come and go alone (`_wake`).
        self._resting = [w.session for w in (self._mem, self._acts, self._grads)
                         if w is not None]
        if self._profile_steps:
            self._time = TimeWatch(model, optimizer=self._optimizer, steps=self._profile_steps,
                                   wait=PROFILE_WAIT, warmup=1)
            self._time.open()
        self._created = datetime.now(timezone.utc).isoformat(timespec="seconds")
        self._t0 = self._last = time.perf_counter()
        if self._first_step:
            self._go_on_from(self._first_step)

    def __exit__(self, *exc: object) -> None:
        if isinstance(exc[1], BaseException):
            self._error = describe(exc[1])
        self.close(failed=exc[0] is not None)

    def close(self, *, failed: bool = False) -> None:
        """Remove every hook, build the `RunRecord` and write the report.

        Args:
            failed: an exception is unwinding: the step in progress is dropped, the report
                says where the run stopped, and a failure to write it only warns.
        """
        # The optimizer's settings, before the reference is dropped: peaks seen at samples.
        self._note_groups(end=True)
        groups = self._groups
        # Every close runs even if one raises: last in, first out (the profile, then the
        # gradient watch, which may still sample an unfinished step, then the others).
        with contextlib.ExitStack() as stack:
            stack.push(self._eager)  # left last: no hook is on when compiled code runs again
            stack.callback(setattr, self, "_optimizer", None)
            stack.callback(setattr, self, "_model", None)
            if self._session is not None:
                stack.callback(self._session.close, failed=failed)
            for watch in (self._acts, self._mem, self._grads):
                if watch is not None:
                    stack.callback(watch.close, failed=failed)
            stack.callback(self._close_profile, failed=failed)
        if self._grads is None:
            return  # open() failed before anything ran
        self.result = dataclasses.replace(self._record(stopped=failed), param_groups=groups)
        if self._out is not None and self._writes:
            from torchscope.monitoring.report import write_run_report

            earlier = self._out / "report.json"
            if earlier.is_file() and not self._continues:
                # Never silently: the report there is another run's (or this run's first
                # part, resumed without saying where: `first_step=`).
                warnings.warn(
                    f"torchscope: {earlier} held the report of an earlier run"
                    f"{' (' + self._not_continued + ')' if self._not_continued else ''}, "
                    "which this run's report replaces; pass another out=, or first_step= "
                    "(the step resumed at) to continue that run's report.",
                    UserWarning, stacklevel=2)
            try:
                self.paths = write_run_report(
                    self.result, self._out, name=self._name, created=self._created,
                    options={**self._options, "step_by": self.result.step_by})
            except Exception as exc:
                if not failed:
                    raise
                warnings.warn(f"torchscope could not write the partial run report to "
                              f"{self._out}: {describe(exc)}", RuntimeWarning, stacklevel=2)

    # ------------------------------------------------------------------ stepping
    def end_step(self) -> None:
        """End the current step now (only with `manual=True`; framework callbacks call it
        where the framework's gradients are final, before clipping)."""
        self._open_watch().end_step()

    def _open_watch(self) -> GradWatch:
        if self._grads is None:
            raise TorchscopeError("this monitor is not open.",
                                  fix="use it in a `with` block: with torchscope.monitor(...):")
        return self._grads

    def check_loss(self, loss: torch.Tensor) -> None:
        """Hand the monitor a step's loss before its backward: its graph is read once for
        a loss that broadcasts the model's output against its target, or that applies its
        own softmax or sigmoid to probabilities (`GradWatch.check_loss`). The Lightning
        callback calls it; a plain loop may, once a step.

        Args:
            loss: the scalar loss, before its backward.

        Raises:
            TorchscopeError: the monitor is not open.
        """
        watch = self._open_watch()
        watch.check_loss(loss)
        if self._flight is not None:
            self._flight.on_loss(watch.steps, loss)

    def number_from(self, first_step: int) -> None:
        """Number the steps from `first_step` (a framework's global step, restored from a
        checkpoint after the monitor opened), before the first backward.

        Raises:
            TorchscopeError: the monitor is not open, or a step was counted already.
        """
        self._open_watch().number_from(first_step)
        if first_step:
            self._go_on_from(first_step)

    def _go_on_from(self, first_step: int) -> None:
        """A run resumed at `first_step`: where `out` holds the report of this run before
        (the same model), its samples and step times before `first_step` begin this run's
        history, so that the report goes on as one series, with the resume marked
        (`RunRecord.resumed_at`). Samples of that run at or after `first_step` (it went on
        past the checkpoint) are the steps this run does again: dropped."""
        if self._continues:  # numbered again (first_step=, then number_from): kept as begun
            return
        self._resumed_at = (first_step,)
        if self._out is None or not self._writes:
            return
        from torchscope.monitoring.report import earlier_run

        before, why = earlier_run(self._out, model=self._facts[0],
                                  parameters=self._facts[1], before=first_step)
        self._not_continued = why
        if before is None:
            return
        self._continues = True
        self._resumed_at = (*before.resumed_at, first_step)
        order = self._order
        for step, per_layer, total, applied, saved in before.rows:
            layers = sorted(per_layer, key=lambda k: order.get(k, len(order)))  # input first
            self._history.add(step, {k: per_layer[k] for k in layers}, total_norm=total,
                              saved_bytes=saved)
            if applied is not None:
                self._applied[step] = applied
        for b in before.step_ms:  # a bucket's mean for each of its steps
            for i in range(b.count):
                self._times.add(b.first_step + i, b.mean)

    @property
    def steps(self) -> int:
        """Steps completed so far (in this run: a resumed run's earlier steps not counted)."""
        return 0 if self._grads is None else self._grads.steps - self._grads.first_step

    @property
    def grads(self) -> GradWatch | None:
        """The gradient watch that defines the steps (None before the block)."""
        return self._grads

    def _gate(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
              ) -> None:
        if not self._inputs:
            self._inputs = ModelInputs(tuple(args), dict(kwargs)).describe()
        if torch.is_grad_enabled():  # a training forward's mode (evaluation runs without)
            self._mode = module.training
            self._autocast = autocast_dtype(self._device_type)
            self._note_input(args, kwargs)
        collecting = self._grads is not None and self._grads.collecting
        record = collecting and torch.is_grad_enabled()
        memory = record and self._mem is not None and self._memory_due(module, args, kwargs)
        if collecting and (record or self._woken is None):
            self._wake(memory=memory)
        if self._acts is not None:
            self._acts.active = record
        if self._mem is not None:
            self._mem.active = memory
        self._recording = record

    def _memory_due(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                    ) -> bool:
        """Whether the memory watch measures the sampled step in progress (decided at its
        first training forward). What autograd saves is set by the graph and the input's
        shapes, not by the values: the watch measures the first `_MEMORY_FIRST` sampled
        steps, any whose input shapes, mode or autocast differ from the last one measured,
        and the samples whose index is a multiple of `_MEMORY_EVERY`. Steps inferred from
        backward passes, known only one backward late, are all measured."""
        g = self._grads
        assert g is not None
        if g.step_by == "inferred":
            return True
        if g.steps == self._mem_step:
            return self._mem_on
        self._mem_step = g.steps
        key = (module.training, self._autocast,
               tuple((tuple(t.shape), t.dtype) for _, t in
                     iter_tensors((args, kwargs), named=False) if type(t) is torch.Tensor))
        self._mem_on = self._mem_measured < _MEMORY_FIRST or key != self._mem_key or \
            self._history.samples % _MEMORY_EVERY == 0  # the index this sample will get
        if self._mem_on:
            self._mem_key, self._mem_measured = key, self._mem_measured + 1
        return self._mem_on

    def _note_input(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """At a step's first training forward: fingerprint the input where the step is
        sampled and where the step before was, and count whether the two steps' inputs are
        the same (`RunRecord.same_inputs`). A step's later forwards (micro-batches, a second
        pass over the same batch) are no step of their own. Not for steps ended by the
        next backward (no optimizer), which are not known at the forward."""
        g = self._grads
        if g is None or g.step_by == "inferred" or g.steps == self._fp_step:
            return
        step, prev = g.steps, self._fp_prev
        self._fp_step = step
        if not g.collecting and (prev is None or prev[0] != step - 1):
            return
        now = _fingerprint(args, kwargs)
        if prev is not None and prev[0] == step - 1 and now is not None:
            self._fp_pairs += 1
            if prev[1] == now[0]:
                count = (prev[2] == now[1]).all().to(torch.int64)  # () on the device
                self._fp_same = count if self._fp_same is None else self._fp_same + count
        self._fp_prev = (step, *now) if g.collecting and now is not None else None

    def _padding_gate(self, first: int, _module: nn.Module, _args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> None:
        """A transformers model's forward (the watched one's, or one's inside it):
        `_note_padding` at a sampled step's training forward."""
        if torch.is_grad_enabled() and self._grads is not None and self._grads.collecting:
            self._note_padding(kwargs, first)

    def _note_padding(self, kwargs: dict[str, Any], first: int) -> None:
        """At a sampled step's training forward: count the label positions from `first`
        on (1 for a causal language model, whose loss never reads position 0) that the
        attention mask pads (0), and those of them whose label is not -100, which a
        transformers model's loss counts. Two reductions on the device, read at the end."""
        counts = padded_label_counts(kwargs, first)  # (2,) on the device, or None
        if counts is not None:
            self._padded = counts if self._padded is None else self._padded + counts

    def _padded_labels(self) -> tuple[int, int]:
        if self._padded is None:
            return (0, 0)
        padded, counted = self._padded.tolist()  # the run's one read of them
        return int(padded), int(counted)

    def _inner_autocast(self, _module: nn.Module, _args: tuple[Any, ...]) -> None:
        if self._autocast is None and torch.is_grad_enabled():
            self._autocast = autocast_dtype(self._device_type)

    def _forward_end(self, _module: nn.Module, _args: tuple[Any, ...], output: Any) -> None:
        """Note when a backward reaches a recorded forward's output: the step's activation
        columns come from such a forward, not from an evaluation pass that ran with
        gradients on and whose graph was dropped."""
        if not self._recording or self._acts is None or \
                torch._C._current_autograd_node() is not None:  # a checkpoint's recompute
            return
        self._recording = False
        forward = self._acts.forwards - 1  # this forward's records' `step`
        session = self._session
        assert session is not None
        handles = session.when_reached(output, lambda: self._reached.add(forward))
        if handles is None:
            return
        # A forward whose graph was dropped never fires them: keep the newest few only.
        self._waiting.append(handles)
        if len(self._waiting) > _WAITING_FORWARDS:
            old = self._waiting.pop(0)
            session.release(old)
            old.clear()

    def _note_output_scale(self, _module: nn.Module, _args: tuple[Any, ...],
                           output: Any) -> None:
        """At a sampled step's training forward whose output is a tensor of scores (the
        last dim the classes): a hook on it reads, in its backward, the scale of the
        gradient that reaches it (`_softmax_ce_scale`, on the device; read when the run
        ends), to tell a loss divided by the micro-batches from one that is not."""
        g = self._grads
        if g is not None and self._flight is not None and torch.is_grad_enabled():
            loss = own_loss(output)  # a model that returns its own loss
            if loss is not None:
                self._flight.on_loss(g.steps, loss)
        if type(output) is not torch.Tensor:  # a transformers output: its logits
            output = getattr(output, "logits", None)
        if g is None or not g.collecting or not torch.is_grad_enabled() or \
                torch._C._current_autograd_node() is not None or \
                type(output) is not torch.Tensor or not output.requires_grad or \
                output.dim() < 2 or not output.is_floating_point() or output.shape[-1] < 2:
            return
        self._scale_offers += 1
        if not _scale_due(self._scale_offers):
            return
        z = output.detach()

        def read(grad: torch.Tensor) -> None:
            self._scales.append(_softmax_ce_scale(z, grad))

        output.register_hook(read)

    def _backward_end(self) -> None:
        if self._grads is not None and self._grads.step_by == "inferred":
            mem = self._mem
            self._at_backward = (0 if self._acts is None else self._acts.forwards,
                                 0 if mem is None else mem.samples,
                                 None if mem is None else mem.last_total_bytes)

    def _keep_applied(self) -> None:
        """Keep the total norms the updates of sampled steps used where the loop clipped
        (`GradWatch.applied_norms`, which keeps only the newest here), for the kept rows."""
        if self._grads is None:
            return
        self._applied.update(self._grads.applied_norms)
        h = self._history
        if len(self._applied) > 2 * (h.capacity + h.recent):
            kept = {r.step for r in h.rows()}
            self._applied = {k: v for k, v in self._applied.items() if k in kept}

    def _on_step(self, index: int, flow: GradFlow | None) -> None:
        self._keep_applied()
        if self._mode is not None:  # the mode of the step's last forward with gradients on
            if self._mode and self._run_steps and self._run_autocast == self._autocast:
                self._run_steps += 1
            elif self._mode:
                self._fold_modes()
                self._run_steps, self._run_autocast = 1, self._autocast
            else:
                self._modes = self._fold_modes().with_step(False, index, self._autocast)
            self._mode = None
        now = time.perf_counter()
        self._times.add(index, (now - self._last) * 1e3)
        self._last = now
        if self._cuda is not None:  # host-side allocator counters: no device sync
            self._peaks.add(index, float(torch.cuda.max_memory_allocated(self._cuda)))
            torch.cuda.reset_peak_memory_stats(self._cuda)
        if flow is not None:
            self._sample(index, flow)
        elif self._acts is not None and self._grads is not None and \
                self._grads.step_by != "inferred":
            # Forwards of a step that gave no sample (the GradScaler skipped it) are not
            # the next sample's. (Inferred steps end one backward late: left as they are.)
            self._acts_seen = self._acts.forwards - 1
        tw = self._time
        if tw is not None and tw.boundaries >= tw.window:
            self._close_profile(failed=False)
        self._rest()

    def _fold_modes(self) -> ModeCounts:
        """`_modes` with the training steps counted since the last fold."""
        if self._run_steps:
            m, counts = self._modes, dict(self._modes.autocast)
            if self._run_autocast is not None:
                counts[self._run_autocast] = counts.get(self._run_autocast, 0) + self._run_steps
            self._modes = dataclasses.replace(m, train=m.train + self._run_steps,
                                              autocast=tuple(counts.items()))
            self._run_steps = 0
        return self._modes

    def _rest(self) -> None:
        """Between two sampled steps, take the watches' hooks off the submodules (see
        `HookSession.suspend`): an unsampled step then runs them as torch runs an unhooked
        module, and pays only the model's own hooks and the parameters'. Not while a
        profiled window is open, nor for steps inferred from backward passes, which end
        one backward late; `_wake` puts them back at the next sampled step's forward."""
        g = self._grads
        if g is None or self._time is not None or g.step_by == "inferred":
            return
        if g.collecting:  # woken by `_gate` at its first forward
            return
        for session in self._resting:
            session.suspend()
        self._woken = None

    def _wake(self, *, memory: bool = True) -> None:
        """Put the watches' hooks back on the submodules, the memory watch's only with
        `memory`. A session restores its hooks' places among the hooks that were there
        when `suspend` took them off: the sessions go back in the reverse order, and the
        memory watch's, taken off first, alone where only it changes. Not inside a
        profiled window, whose steps keep the hooks they started with (an unmeasured
        step's memory watch is inactive)."""
        if self._woken == memory:
            return
        mem = None if self._mem is None else self._mem.session
        if self._woken is None:
            for session in reversed(self._resting):
                if memory or session is not mem:
                    session.resume()
        elif mem is None or self._time is not None:
            return
        elif memory:
            mem.resume()
        else:
            mem.suspend()
        self._woken = memory

    def _note_groups(self, *, end: bool = False) -> None:
        """Each parameter group's largest learning rate seen at a sampled step (and at the
        run's `end`, the only read of a tensor one), and its weight decay: a schedule that
        ends at 0 acted with its peak, not its last value."""
        now = _param_groups(self._optimizer, tensors=end)
        if len(now) != len(self._groups):  # the first read, or a group added since
            self._groups = now
            return
        self._groups = tuple(
            (max(lr, peak) if math.isfinite(lr) else peak, wd)
            for (lr, wd), (peak, _) in zip(now, self._groups, strict=True))

    def _sample(self, index: int, flow: GradFlow) -> None:
        self._note_groups()
        # A mixture of experts' experts that no token reached: [samples, idle per expert].
        for module, (name, idle) in flow.idle_experts().items():
            _, counts = self._experts.setdefault(module, (name, [0] * (1 + len(idle))))
            counts[0] += 1
            for e, none in enumerate(idle):
                counts[1 + e] += none
        nan = math.nan
        params, outs, weights = flow.param_norms(), flow.output_norms(), flow.weight_norms()
        per_layer: dict[str, list[float]] = {}
        order = self._order
        self._fill_update()  # the previous sample's update, read by now
        if self._flight is not None:
            self._flight.read()
        matrices = {g.module: g for g in flow.layer_grads()}  # weight matrices only
        self._update_of = (index, {g.module: (g.params, g.weight_norm)
                                   for g in matrices.values()})
        for layer in sorted({*params, *outs}, key=lambda k: order.get(k, len(order))):
            p, o, w = params.get(layer), outs.get(layer), weights.get(layer)
            m = matrices.get(layer)
            gw = None if m is None else m.grad_norm
            per_layer[layer] = [nan if p is None else p, nan if o is None else o, nan, nan, nan,
                                nan if w is None else w, nan, nan if gw is None else gw,
                                nan]  # `METRICS`' order
        nonfinite = False
        if self._acts is not None:
            nonfinite = self._read_activations(index, per_layer, flow.micro_batches)
        saved = None
        if self._mem is not None:
            # An inferred step's: as the step's last backward left them.
            # The total alone: the sample's records are built only when read.
            samples, saved_now = (self._mem.samples, self._mem.last_total_bytes) \
                if self._at_backward is None else self._at_backward[1:]
            if samples > self._mem_seen:
                self._mem_seen = samples
                saved = saved_now
        self._history.add(index, per_layer, total_norm=flow.total_norm, saved_bytes=saved,
                          nonfinite=nonfinite)
        self._latest = _Scalars(index, flow.total_norm, params, self._times.last_mean(),
                                0 if self._grads is None else self._grads.skipped)
        if self._on_sample is not None:
            self._on_sample(index, self._latest)

    def _fill_update(self) -> None:
        """The update ratio ‖Δw‖/‖w‖ of each layer's weight matrices at the newest sampled
        step whose update the gradient watch has read on the host (`GradWatch.read_update`,
        read at the next sample or the end, when its copy has arrived), into its row."""
        kept, g = self._update_of, self._grads
        read = None if g is None else g.read_update
        if kept is None or read is None or read[0] != kept[0]:
            return
        self._update_of = None
        norms = read[1].norms
        ratios: dict[str, float] = {}
        for layer, (names, weight) in kept[1].items():
            ups = [norms.get(n) for n in names]
            if weight and names and None not in ups:
                ratios[layer] = math.sqrt(sum(u * u for u in ups if u is not None)) / weight
        self._history.fill(kept[0], "update", ratios)

    def _read_activations(self, index: int, per_layer: dict[str, list[float]],
                          micro_batches: int) -> bool:
        """Fill the activation columns from the step's first micro-batch; note where NaN/Inf
        first came from. Returns whether any output of the step was non-finite.

        The step's micro-batches (`GradFlow.micro_batches`) are its last forwards that a
        backward reached: passes before a `zero_grad()` in the step are none (a GAN's other
        player's pass through this model), nor are forwards no backward reached."""
        assert self._acts is not None
        # An inferred step's forwards: those recorded before its last backward ended.
        limit = None if self._at_backward is None else self._at_backward[0]
        fresh = [r for r in self._acts.records  # one host copy
                 if r.step > self._acts_seen and (limit is None or r.step < limit)]
        if not fresh:
            return False
        self._acts_seen = fresh[-1].step
        steps = sorted({r.step for r in fresh})
        reached = [k for k in steps if k in self._reached]
        # The first micro-batch, else the first recorded forward.
        at = min(max(len(reached) - micro_batches, 0), len(reached) - 1)
        step = reached[at] if reached else steps[0]
        self._reached = {k for k in self._reached if k > self._acts_seen}
        first = [r for r in fresh if r.step == step]
        leaves = leaf_modules(first)
        for r in first:
            s = r.output
            if r.module not in leaves or r.call or s is None or "float" not in s.dtype:
                continue
            row = per_layer.setdefault(r.module, [math.nan] * len(METRICS))
            row[2], row[3] = s.std, s.zero_frac
            if s.dead_units is not None and s.channels:
                row[4] = s.dead_units / s.channels
            if s.saturated_frac is not None:
                row[6] = s.saturated_frac
        bad = next((r.step for r in fresh if not r.finite), None)
        if bad is None:
            return False
        if self._forward_onset is None:
            trace = trace_nonfinite(fresh, step=bad)
            producer = trace.producer
            self._forward_onset = (index, None if producer is None else producer.module,
                                   None if producer is None else producer.module_type,
                                   trace.passers[0].label if trace.made_between else None)
        return True

    @property
    def latest(self) -> dict[str, float]:
        """The newest sample's scalars (`torchscope/...` names), for loggers."""
        return dict(self._latest)

    def _close_profile(self, *, failed: bool) -> None:
        tw, self._time = self._time, None
        if tw is None:
            return
        try:
            tw.close(failed=failed)
            self._profile = tw.result
        except ProfilingError as exc:
            self._profile_note = exc.one_line()

    # ------------------------------------------------------------------ results
    def _series(self, metric: str) -> LayerSeries:
        rows = self._history.rows()
        return LayerSeries(metric, tuple(r.step for r in rows), tuple(self._history.layers),
                           tuple(tuple(v) for v in self._history.matrix(metric, rows)))

    def _record(self, *, stopped: bool) -> RunRecord:
        grads = self._grads
        assert grads is not None
        self._keep_applied()  # a manual step's comes after its end
        if grads.last is not None:  # reads the last sample's update
            self._fill_update()
        if self._flight is not None:
            self._flight.read()
        h = self._history
        rows = h.rows()
        onset = self._forward_onset or (None, None, None, None)
        return RunRecord(
            model=self._facts[0], parameters=self._facts[1], trainable=self._facts[2],
            inputs=self._inputs or "(no forward seen)", device=self._facts[3],
            every=self.every, step_by=grads.step_by, steps=grads.steps - grads.first_step,
            first_step=grads.first_step,
            samples=grads.samples, status="stopped" if stopped else "completed",
            error=self._error, seconds=time.perf_counter() - self._t0,
            grad_param=self._series("grad_param").present(),
            grad_output=self._series("grad_output").present(),
            total_norms=tuple(r.total_norm for r in rows),
            applied_norms=tuple(self._applied.get(r.step) for r in rows)
            if self._applied else (),
            act_std=self._series("act_std").present(),
            act_zero=self._series("act_zero").present(),
            act_dead=self._series("act_dead").present(),
            weight=self._series("weight").present(),
            act_sat=self._series("act_sat").present(),
            grad_weight=self._series("grad_weight").present(),
            update=self._series("update").present(),
            step_ms=self._times.buckets(), device_peak=self._peaks.buckets(),
            saved_bytes=tuple(r.saved_bytes for r in rows) if self._mem is not None else (),
            skipped=grads.skipped, skipped_steps=grads.skipped_steps,
            onset=NonFiniteOnset(grads.first_nonfinite_step, grads.nonfinite_steps, *onset),
            budget=HistoryBudget(h.capacity, h.recent, h.stride, len(rows), h.budget_bytes(),
                                 self._times.width),
            last=grads.last, activations=self._acts, memory=self._mem,
            profile=self._profile,
            profile_note=self._profile_note if self._profile_steps else "",
            optimizer=self._optimizer_name, scaler=grads.scaler is not None,
            compiled=self._compiled, backwards=grads.backwards,
            passes_without_update=grads.passes_without_update,
            unzeroed_steps=grads.unzeroed_steps, first_unzeroed=grads.first_unzeroed,
            cleared_steps=grads.cleared_steps, first_cleared=grads.first_cleared,
            unoptimized=grads.unoptimized,
            broken_update=grads.broken_update,  # read after `last`, which checks its update
            loss_broadcast=grads.loss_broadcast,
            loss_on_probabilities=grads.loss_on_probabilities,
            same_inputs=(self._fp_pairs, 0 if self._fp_same is None else int(self._fp_same)),
            padded_labels=self._padded_labels(),
            output_scales=tuple((float(a), float(b)) for a, b in
                                torch.stack(list(self._scales)).tolist())
            if self._scales else (),
            clip_setting=self._clip_setting,
            loss_seen=grads.loss_seen or not grads.backwards,
            producer=self._options["producer"],
            resumed_at=self._resumed_at,
            spikes=() if self._flight is None else tuple(self._flight.spikes),
            modes=self._fold_modes(),
            experts=tuple(ExpertUse(m, name, c[0], tuple(c[1:]))
                          for m, (name, c) in self._experts.items()),
        )


# Entries of scores `_softmax_ce_scale` copies at a time (about 16 MiB a float32 copy).
_SCALE_CHUNK = 1 << 22
# The loss's factor at the scores is a property of the loop's code, not of a step: it is
# read at the first `_SCALE_FIRST` sampled training forwards, then at one in
# `_SCALE_EVERY` (a loop that changes its loss later is still seen). A read costs about
# ten passes over the scores: 1.5 ms on a tiny GPT-2 step of 13 ms (CPU).
_SCALE_FIRST = 8
_SCALE_EVERY = 16


def _scale_due(offer: int) -> bool:
    """Whether the `offer`-th sampled training forward (from 1) has its scale read."""
    return offer <= _SCALE_FIRST or offer % _SCALE_EVERY == 0


class _Scalars(Mapping[str, float]):
    """A sample's scalars for loggers (`torchscope/...` names), built on first read: a
    monitor whose sample nobody logs does not pay for them."""

    def __init__(self, index: int, total: float, params: Mapping[str, float | None],
                 step_ms: float | None, skipped: int) -> None:
        self._args = (index, total, params, step_ms, skipped)
        self._built: dict[str, float] | None = None

    def _values(self) -> dict[str, float]:
        if self._built is None:
            index, total, params, step_ms, skipped = self._args
            out = {"torchscope/grad_norm/total": total, "torchscope/step": float(index)}
            for layer, norm in params.items():
                if norm is not None:
                    out[f"torchscope/grad_norm/{layer or '<root>'}"] = norm
            if step_ms is not None:
                out["torchscope/step_ms"] = step_ms
            if skipped:
                out["torchscope/skipped_steps"] = float(skipped)
            self._built = out
        return self._built

    def __getitem__(self, key: str) -> float:
        return self._values()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values())

    def __len__(self) -> int:
        return len(self._values())


def _softmax_ce_scale(z: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """(s × rows, spread) on the device, for the gradient `grad` of a loss at scores `z`
    (..., C). A mean softmax cross-entropy over its `rows` counted rows (those with a
    gradient), times a factor, has ∂loss/∂z = s (softmax(z) - onehot) with s = factor /
    rows: every entry but the target's is s × softmax(z), so their ratio to softmax(z) is
    one number. `spread` (the smallest of those ratios over the largest) is 1 where the
    loss is such a cross-entropy; s × rows is then the factor (1 for a plain mean, 1/k for
    a mean divided by k micro-batches)."""
    with torch.no_grad():
        c = z.shape[-1]
        zs, gs = z.reshape(-1, c), grad.reshape(-1, c)  # (rows, C) each
        # A language model's scores are rows × a vocabulary: a few float32 copies of them
        # all at once would be gigabytes. Row by row the numbers are the same (softmax is
        # per row, and max, min and count combine over chunks), so at most about 4M
        # entries are copied at a time.
        chunk = max(1, _SCALE_CHUNK // c)
        rows = torch.zeros((), dtype=torch.int64, device=z.device)  # () counted rows
        hi = torch.full((), -math.inf, device=z.device)
        lo = torch.full((), math.inf, device=z.device)
        for start in range(0, zs.shape[0], chunk):
            p = torch.softmax(zs[start:start + chunk].float(), dim=-1)  # (chunk, C)
            g = gs[start:start + chunk].float()  # (chunk, C)
            rows += (g.abs().amax(dim=-1) > 0).sum()
            ratio = g / p.clamp_min(torch.finfo(torch.float32).tiny)  # (chunk, C)
            positive = (ratio > 0) & (p > 1e-6)  # non-target entries, read precisely
            hi = torch.maximum(hi, ratio.masked_fill(~positive, -math.inf).amax())
            lo = torch.minimum(lo, ratio.masked_fill(~positive, math.inf).amin())
        return torch.stack([hi * rows, lo / hi])  # (2,)


def _fingerprint(args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> tuple[tuple[Any, ...], torch.Tensor] | None:
    """What a forward's input holds (each plain tensor, once however often it is passed:
    its shape and dtype, and the device of the first) and, on that device, each tensor's
    sum and L2 norm in float64: two different batches that agree on all of them do not
    occur in practice. Tensors on other devices are left out. None without a tensor."""
    # Each tensor once: a language model is often given its ids as its labels too.
    tensors = list({id(t): t for _, t in iter_tensors((args, kwargs))
                    if type(t) is torch.Tensor and t.layout == torch.strided
                    and not t.is_complex()}.values())
    if not tensors:
        return None
    device = tensors[0].device
    tensors = [t for t in tensors if t.device == device]
    key = (device, *((tuple(t.shape), t.dtype) for t in tensors))
    with torch.no_grad():
        sums: list[torch.Tensor] = []
        for t in tensors:
            # Token ids and masks (small) are copied to float64, which `vector_norm` needs.
            x = t if t.is_floating_point() else t.to(torch.float64)
            sums += [x.sum(dtype=torch.float64),
                     torch.linalg.vector_norm(x, dtype=torch.float64)]  # () each
        return key, torch.stack(sums)  # (2 * len(tensors),)


def _param_groups(optimizer: Any, *, tensors: bool = True) -> tuple[tuple[float, float], ...]:
    """(lr, weight_decay) of each of the optimizer's parameter groups, where both read as
    numbers. A tensor learning rate (`capturable` optimizers, schedulers that keep one) is
    read only with `tensors` (the run's end: a read of a device tensor waits for it) and
    is NaN otherwise."""
    out = []
    for g in getattr(optimizer, "param_groups", None) or ():
        lr, wd = g.get("lr", math.nan), g.get("weight_decay", 0.0) or 0.0
        if isinstance(lr, torch.Tensor) and not tensors:
            lr = math.nan
        try:
            out.append((float(lr), float(wd)))
        except (TypeError, ValueError, RuntimeError):
            continue
    return tuple(out)


def monitor(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    every: int = 10,
    out: str | Path | None = "torchscope-run",
    scaler: Any = None,
    micro_batches: int | None = None,
    select: Selector = None,
    depth: int | None = None,
    activations: bool = True,
    memory: bool = True,
    profile: int = 0,
    history: int = 512,
    recent: int = 128,
    name: str | None = None,
    on_sample: Callable[[int, Mapping[str, float]], None] | None = None,
    first_step: int = 0,
) -> Monitor:
    """Watch your own training loop and write a run report when it ends.

    One context manager around the loop. Every `every`-th optimizer step is sampled: the
    per-layer gradient norms of the gradients that step used (after accumulation, before
    the update; unscaled under a GradScaler), the statistics of each module's output in the
    step's first forward, and what that forward saved for backward. Every step adds its wall
    time, its device peak (CUDA) and a check, on the device, of whether any gradient is
    NaN/Inf. Steps are counted as `watch_gradients` counts them: `optimizer.step()` calls
    (closures and LBFGS included), steps the GradScaler skipped counted apart; without an
    optimizer, backward passes into zeroed gradients, or `micro_batches=`.

    Memory is bounded: the newest `recent` samples in full plus at most `history` samples
    spread evenly over the whole run (every other one is dropped when it fills), and
    per-step numbers in at most `history` buckets: `result.budget.bytes` states the most
    the rows can take (about 1.3 MB for 50 layers with the defaults).

    On exit, also through an exception (the report then says where the run stopped), every
    hook is removed and `out/report.html` and `out/report.json` are written: a *run* report
    (the doctor's renderers and schema, `"kind": "run"`) with the gradient flow over the run
    as a layer × step heat map, activation drift, dead units, NaN/Inf onset, step time and
    memory, and findings about the run ("conv1's gradient fell 40× between step 100 and
    900"). Training is bitwise the same as without the monitor; hooks never sync the host.

    Args:
        model: the model being trained.
        optimizer: its optimizer; its `step()` calls are the steps (None: inferred).
        every: sample one step in `every`.
        out: folder for report.html and report.json (created now, so a bad path fails
            before training); None writes nothing (read `result`). Under torchrun rank 0
            writes it, from its own record; every rank's `result` holds its own.
        scaler: the loop's `torch.amp.GradScaler`, if any (its scale is divided out of
            the norms; a float16 autocast run without one is a `run.fp16_unscaled` warning).
            Not given, the scaler whose `step(optimizer)` steps the optimizer is found at
            its first step (see `watch_gradients`).
        micro_batches: backward passes per step, for a loop without an optimizer whose
            steps cannot be inferred (see `watch_gradients`).
        select: modules to watch (see `select_modules`); default the layers.
        depth: limit the selection depth.
        activations: sample activation statistics.
        memory: sample what the forward saves for backward: at the first three sampled
            steps, those whose input shapes (or mode, or autocast) changed, and every
            eighth sample, since it follows from the shapes (with steps inferred from
            backward passes, at every sampled step).
        profile: profile this many steps with `torch.profiler` (after 5 steps and one
            warm-up step); the report then has the profile section of `torchscope doctor`.
        history: samples (and step buckets) spread over the whole run.
        recent: newest samples kept in full.
        name: the run's name in the report (default: the model's class).
        on_sample: called with `(step, scalars)` after each sample (e.g. a logger).
        first_step: the step a resumed run starts at (the global step of its checkpoint):
            steps are numbered on from it, and where `out` holds the report of the run
            before (the same model), the new report goes on from its samples before
            `first_step`, as one series with the resume marked. Otherwise a report
            already in `out` is replaced, with a warning.

    Returns:
        A `Monitor` for a `with` block; `monitor.result` (a `RunRecord`) and
        `monitor.paths` are set when the block ends.

    Raises:
        TorchscopeError: a bad option, or an `out` folder that cannot be written.

    Example:
        >>> with torchscope.monitor(model, opt, every=10, out="run-report") as mon:
        ...     for x, y in loader:
        ...         opt.zero_grad()
        ...         F.cross_entropy(model(x), y).backward()
        ...         opt.step()
        >>> mon.result.findings()
    """
    return Monitor(model, optimizer, every=every, out=out, scaler=scaler,
                   micro_batches=micro_batches, select=select, depth=depth,
                   activations=activations, memory=memory, profile=profile, history=history,
                   recent=recent, name=name, on_sample=on_sample, first_step=first_step)
