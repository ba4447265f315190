"""Entry points: `gradient_flow` for one step, `watch_gradients` for a training loop."""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from types import FrameType
from typing import Any, Literal

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from torchscope import _kernels
from torchscope.distributed.ranked import Ranked
from torchscope.distributed.world import local_tensor, strategy_of, world
from torchscope.errors import TorchscopeError
from torchscope.findings import Analyzed
from torchscope.grads.collect import (
    GradCollector,
    HostUpdates,
    _host_floats,
    total_norm,
    updates_later,
    with_updates,
)
from torchscope.grads.loss import (
    LossBroadcast,
    LossOnProbabilities,
    StepLossCheck,
    loss_faults,
    loss_faults_at,
)
from torchscope.grads.records import (
    BrokenUpdate,
    GradFlow,
    GradHistory,
    ModuleGradRecord,
    combine_norms,
)
from torchscope.hooks.lifecycle import HookedContext
from torchscope.hooks.select import Selector
from torchscope.hooks.session import HookSession
from torchscope.step import (
    LossSpec,
    Step,
    inner_optimizer,
    own_loss,
)


def gradient_flow(
    model: nn.Module | Step,
    inputs: Any = None,
    *,
    loss_fn: LossSpec = "auto",
    target: Any = None,
    optimizer: torch.optim.Optimizer | None = None,
    select: Selector = None,
    depth: int | None = None,
    train: bool | None = None,
    zero_grad: bool = True,
    inputs_grad: bool = True,
) -> GradFlow:
    """Run one forward and backward of a training step and measure the gradient through
    every selected module call and every parameter.

    The step is `Step.of(model, inputs, loss_fn=, target=, optimizer=)`, or the given `Step`
    (for AMP and gradient accumulation). It runs as `step.forward_backward()`: every
    micro-batch's forward, loss and backward, and no optimizer step (the optimizer is only
    recorded in `flow.step`). With the step's GradScaler the loss is scaled and the scale
    divided out of every norm.

    Args:
        model: any `nn.Module`, or a `Step` (then leave `inputs`, `loss_fn`, `target` and
            `optimizer` unset).
        inputs: a tensor, a tuple of positional inputs, a dict of keyword inputs, or
            `ModelInputs`.
        loss_fn: "auto" (default), "cross_entropy", "mse", "sum", or a callable
            `(output, target) -> loss` (`(output) -> loss` when `target` is None); see
            `torchscope.step` for what each means.
        target: the target for `loss_fn`; None with a named loss draws a seeded one.
        optimizer: recorded in `flow.step`; not stepped.
        select: modules to record per call (see `select_modules`); default the layers.
        depth: limit the selection depth.
        train: put the model in train (True) or eval (False) mode; restored afterwards.
            None leaves the mode as it is.
        zero_grad: set every `.grad` to None first, so the reading is this step's alone.
        inputs_grad: also measure each call's grad_input (on the autograd nodes of the
            call that consume each input; nothing is put into the graph).

    Returns:
        The step's `GradFlow`, with `flow.step` saying which loss ran and its value, and
        what its loss did with the output (`flow.loss_broadcast`,
        `flow.loss_on_probabilities`) and with labels on padding (`flow.padded_labels`).
        The parameters' `.grad` hold this step's gradients, exactly as a plain `loss.backward()`
        (per micro-batch) leaves them; every hook is already removed.

    Raises:
        ModelError: the model or the loss raised.
        TorchscopeError: the loss does not depend on anything that requires grad, or a
            `Step` was given together with inputs or step options.

    Examples:
        >>> flow = torchscope.gradient_flow(model, x, loss_fn="cross_entropy", target=y,
        ...                                 select=["conv1", "conv2", "fc"])
        >>> [r.module for r in flow.modules]
        ['fc', 'conv2', 'conv1']
        >>> flow.get("conv1").grad_input[0].reason
        'input does not require grad'
        >>> flow.param("conv1.weight").relative   # ‖g‖/‖w‖, scale-free
        0.0071
        >>> flow.findings()   # three healthy layers: no trend, no alarm
        []
    """
    step = Step.of(model, inputs, loss_fn=loss_fn, target=target, optimizer=optimizer)
    collector = GradCollector(step.model, select=select, depth=depth, inputs=inputs_grad,
                              scaler=step.scaler)
    with collector:
        if train is not None:
            collector.session.set_training(train)
        if zero_grad:
            step.zero_grad()
        check = StepLossCheck(step)
        with check:
            loss = step.forward_backward(before_backward=check.before_backward)
        flow = collector.finish(0, step=step.info(loss))
    return replace(flow, loss_broadcast=check.faults.broadcast,
                   loss_on_probabilities=check.faults.probabilities,
                   padded_labels=check.padded_labels())


StepBy = Literal["optimizer", "micro_batches", "inferred", "manual"]

# Parameters whose `.grad` tells a fresh step from accumulation (inferred steps), and a
# zero_grad() between two backward passes of one sampled step. Spread over the optimizer's
# parameters and read twice at every step, in Python: a loop zeroes all of an optimizer's
# gradients at once, so a few tell it as well as all.
_EVIDENCE = 8
# How far above the optimizer's step hook a GradScaler's `step` is looked for: torch's step
# wrapper, then `GradScaler._maybe_opt_step`, then `GradScaler.step` (accelerate's and
# Lightning's own step wrappers call that).
_SCALER_FRAMES = 6
_SKIPPED_KEPT = 1000  # indices of GradScaler-skipped steps kept (the newest; all are counted)
# Every-step NaN/Inf checks whose results wait on the device, one number each, before one
# reduction reads them all into the first bad step and the count (`_reduce_checks`).
_CHECK_RING = 64
_NO_STEP = 2**62  # larger than any step index: "no bad step" in the ring's reduction
# Losses handed to `check_loss` whose graph may miss the kept output (each from another
# forward than the latest) before the watch stops looking: a step that runs another forward
# with gradients between its own forward and the check (a validation batch outside
# no_grad) is followed by one that does not; a loss that never reaches the model's output
# (past the walk's 1024 nodes) costs four walks in all.
_LOSS_TRIES = 4


def _merged(builds: list[Callable[[], GradFlow]], index: int) -> Callable[[], GradFlow]:
    """`_merge` of the flows `builds` will give, built at the first call."""
    return functools.cache(lambda: _merge([b() for b in builds], index))


def _merge(flows: list[GradFlow], index: int) -> GradFlow:
    """One step's `GradFlow` from the flows of its backward passes, in order.

    Module calls are renumbered as micro-batches of one step; each parameter keeps its last
    reading (its `.grad` after the last backward that reached it: the accumulated value).
    """
    modules: list[ModuleGradRecord] = []
    micro = order = 0
    for f in flows:
        modules += [replace(r, index=index, micro=r.micro + micro,
                            order=None if r.order is None else r.order + order)
                    for r in f.modules]
        micro += f.micro_batches
        order += 1 + max((r.order for r in f.modules if r.order is not None), default=-1)
    modules.sort(key=lambda r: (r.order is None, r.order or 0))  # stable: forward order kept
    params = tuple(next((f.params[i] for f in reversed(flows) if f.params[i].norm is not None),
                        flows[-1].params[i]) for i in range(len(flows[-1].params)))
    # What the last pass read of the model (its experts, frozen zeros, the exchange after
    # the last backward: the final .grad) stands for the step; the rest adds up.
    return replace(flows[-1], index=index, modules=tuple(modules), params=params,
                   # Each tensor once, as clip_grad_norm_ counts tied weights.
                   total_norm=combine_norms(p.norm for p in params if p.tied_to is None) or 0.0,
                   micro_batches=micro, backward_calls=sum(f.backward_calls for f in flows),
                   fused_norms=sum(f.fused_norms for f in flows),
                   eager_norms=sum(f.eager_norms for f in flows),
                   idle_forwards=sum(f.idle_forwards for f in flows))


def _check_step(label: str, value: Any) -> None:
    """`value` as a step index (an int, 0 or more), else one error that names `label`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TorchscopeError(f"{label}={value!r} is not a step.", fix=f"pass {label}=0 or more.")


def _with_closure(args: tuple[Any, ...], kwargs: dict[str, Any], closure: Callable[[], Any]
                  ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """An optimizer step pre-hook's result that passes `closure` in place of the step's
    own (a keyword argument, or step's first parameter after the optimizer)."""
    if "closure" in kwargs:
        return args, {**kwargs, "closure": closure}
    return (args[0], closure, *args[2:]), kwargs


class GradWatch(HookedContext, Analyzed):
    """Samples gradient flow in the user's own training loop; see `watch_gradients`.

    Its findings (`watch.findings()`) judge the last sample (as `torchscope.grads.diagnose`)
    and the history (a total norm that turns NaN/Inf or grows out of bounds).

    Two arguments are not `watch_gradients`': `parallel`, the `DistributedDataParallel`
    wrapper that `model` trains through when `model` is the module inside it (what a
    framework callback is given), or `"ddp"` when the framework keeps a wrapper over the
    default process group out of sight; the gradients are then read synchronised, as for a
    wrapped model. And `on_backward`, called at the end of each backward pass of the step,
    after `on_step` for a step that this pass ended (an inferred step ends at the next
    step's first backward). And `first_step`, the index of the first step it sees (a
    framework's global step where a run resumes from a checkpoint): steps are numbered on
    from it, in the samples, `start` and everything that names a step.

    Attributes:
        every: sample one step in `every`.
        start: the first sampled step.
        first_step: the index of the first step (0 unless a run resumed).
        steps: the index of the step in progress: `first_step` plus the steps counted so
            far (see `step_by`).
        samples: samples taken so far (unbounded count; the history keeps the newest).
        backwards: backward passes of the model seen so far (a pass that updates no
            parameter, such as `torch.autograd.grad`'s, is not one).
        passes_without_update: backward passes that added to no trainable parameter's
            gradient, left out (`torch.autograd.grad`, `backward(inputs=...)`).
        optimizer_name: the class name of the optimizer whose steps are the steps, or None.
        skipped: steps the GradScaler skipped (inf/NaN gradients) so far.
        unzeroed_steps: optimizer steps (after the first) whose gradients still held the
            previous step's: the backward passes in between only accumulated into them, so
            nothing zeroed them (`optimizer.zero_grad()` missing). Read from the gradients'
            identity and version counters; what the loop does to them between the backward
            and the update (clipping) is no zeroing, so a loop that zeroes them in place
            there counts too (`grads.cleared_before_step` names it from a sampled step).
        first_unzeroed: the first such step (optimizer steps counted from 0), or None.
        cleared_steps: optimizer steps whose gradients the loop set to None between the
            last backward and the step (`zero_grad()` before `step()` instead of after it):
            the update used no gradient. Metadata only.
        first_cleared: the first such step (optimizer steps counted from 0), or None.
        broken_update: with `optimizer=` (and `updates=True`), the first sampled step's
            update that wrote NaN/Inf into parameters whose weights and gradients were
            finite (`BrokenUpdate`), or None. Only sampled steps' updates are measured.
        loss_broadcast: where the loop's loss broadcast the model's output against its
            target into every pair of the two (`LossBroadcast`), read once: from the loss
            the model returns with its output, else from a loss handed to `check_loss`;
            None where it did not, or where no loss was seen.
        loss_on_probabilities: where the loop's loss applied its own softmax or sigmoid
            to an output that already went through one (`LossOnProbabilities`), read with
            `loss_broadcast`; else None.
        gathered: in a distributed job, every rank's last sample joined on rank 0 at the end
            of the block (`Ranked[GradFlow]`); None on the other ranks and on one process.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        every: int = 1,
        start: int = 0,
        optimizer: torch.optim.Optimizer | None = None,
        scaler: Any = None,
        micro_batches: int | None = None,
        manual: bool = False,
        select: Selector = None,
        depth: int | None = None,
        inputs_grad: bool = True,
        max_samples: int = 1000,
        check_nonfinite: bool = False,
        on_sample: Callable[[GradFlow], None] | None = None,
        on_step: Callable[[int, GradFlow | None], None] | None = None,
        updates: bool = True,
        parallel: nn.Module | Literal["ddp"] | None = None,
        on_backward: Callable[[], None] | None = None,
        first_step: int = 0,
    ) -> None:
        for label, value in (("every", every), ("max_samples", max_samples)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TorchscopeError(
                    f"{label}={value!r} " + ("samples nothing." if label == "every" else
                                             "keeps no history."),
                    fix=f"pass {label}=1 or more.")
        _check_step("start", start)
        _check_step("first_step", first_step)
        if micro_batches is not None:
            if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or \
                    micro_batches < 1:
                raise TorchscopeError(f"micro_batches={micro_batches!r} is not a number of "
                                      "backward passes.", fix="pass micro_batches=1 or more.")
            if optimizer is not None or manual:
                raise TorchscopeError(
                    "micro_batches= was given together with " +
                    ("optimizer=" if optimizer is not None else "manual=True") + ".",
                    fix="leave micro_batches unset: it counts backward passes per step only "
                    "when nothing else says where a step ends.")
        if optimizer is None and not manual and world().distributed and \
                (parallel is not None or strategy_of(model) != "none"):
            raise TorchscopeError(
                "watch_gradients on a DDP or FSDP2 model needs optimizer=: the synchronised "
                "gradients exist only once backward has returned, and ranks exchange their "
                "norms at each sampled optimizer step.",
                fix="pass optimizer=your_optimizer (or manual=True and end_step() where the "
                "gradients are final).")
        self.every = every
        self.start = start
        self.first_step = first_step
        self.steps = first_step
        self.samples = 0
        self.backwards = 0
        optimizer = inner_optimizer(optimizer)  # accelerate's wrapper: its inner one's hooks
        self.optimizer_name = None if optimizer is None else type(optimizer).__name__
        self.skipped = 0
        self._step_by: StepBy = "manual" if manual else "optimizer" if optimizer is not None \
            else "micro_batches" if micro_batches is not None else "inferred"
        self.gathered: Ranked[GradFlow] | None = None
        self._optimizer = optimizer
        self._scaler = scaler
        self._micro_batches = micro_batches or 1
        self._collector = GradCollector(model, select=select, depth=depth, inputs=inputs_grad,
                                        scaler=scaler, parallel=parallel)
        # Under DDP the ranks' numbers are joined once, at the end (`close`): a sampled
        # step starts no collective of torchscope's.
        self._collector.hold_ranks = True
        self._on_sample = on_sample
        self._on_step = on_step
        self._on_backward = on_backward
        self._last: GradFlow | None = None
        # Newest `max_samples` samples: (step, {layer: output norm}, {layer: param norm}, total)
        self._rows: deque[tuple[int, dict[str, float], dict[str, float], float]] = deque(
            maxlen=max_samples)
        self._layers: dict[str, None] = {}
        self._skipped_steps: deque[int] = deque(maxlen=_SKIPPED_KEPT)
        self._from_zero: set[str] = set()  # parameters read all zero at open or a sample
        # Missing zero_grad: optimizer steps seen, backward passes since the last one, and
        # whether any of them found the gradients set to None, replaced or changed in place.
        self.unzeroed_steps = 0
        self.first_unzeroed: int | None = None
        self.cleared_steps = 0
        self.first_cleared: int | None = None
        self._optimizer_steps = 0
        self._passes_since_step = 0
        self._cleared = False
        self._carry = False  # a due step had no gradients (or was skipped): sample the next
        self._in_step = 0  # backward passes of the current step (micro_batches, inferred)
        # Inferred: the due step's flow per backward, built when its step has ended.
        self._partials: list[Callable[[], GradFlow]] = []
        # Sampled steps not built into records yet, oldest first.
        self._untaken: deque[Callable[[], GradFlow]] = deque()
        self._last_index: int | None = None  # the newest sampled step, built or not
        # `parameters()` yields a tied parameter once.
        self._params = [p for p in self._collector.session.model.parameters() if p.requires_grad]
        # The gradients the watched optimizer's update uses: where it steps only part of the
        # model (Muon for the matrices, AdamW for the rest), what the loop does to them is
        # read on its own parameters (`_note_applied`).
        self._stepped_params = _stepped_by(optimizer, self._params)
        self._partial_update = len(self._stepped_params) < len(self._params)
        # The model's other trainable parameters: one that gets a gradient must be stepped
        # by another optimizer (a GAN's, AdamW beside Muon), or it never trains (a head
        # added after the optimizer was built). Which of them had a gradient at a watched
        # step, and which any other optimizer stepped while the watch was open (`unoptimized`).
        # (An optimizer that holds none of them, built on a copy of the model or before
        # FSDP2's `fully_shard` replaced its parameters, steps none of them: all are others.)
        model = self._collector.session.model
        held = set() if optimizer is None else _held(optimizer)
        self._others = [p for p in self._params if id(p) not in held] \
            if optimizer is not None else []
        self._other_names = {id(p): name for name, p in model.named_parameters()
                             if p.requires_grad and id(p) not in held} \
            if self._others else {}  # kept after close
        self._with_grad: set[int] = set()
        self._stepped_elsewhere: set[int] = set()
        self._other_versions: dict[int, int] = {}  # id -> `_version` at the last step
        spread = max(1, len(self._stepped_params) // _EVIDENCE)
        self._evidence_params = self._stepped_params[::spread][:_EVIDENCE]
        # Per evidence parameter, its `.grad` at the end of the last backward: (ref, version).
        self._evidence: list[_Evidence | None] = []
        self._check_nonfinite = check_nonfinite
        self._nonfinite: tuple[torch.Tensor, torch.Tensor] | None = None  # (first step, count)
        self._native_fit = 0  # gradients the native norms took at the last check (`_check_step`)
        # Checks not reduced yet: per check, the largest gradient magnitude (NaN/Inf iff an
        # element is) in a ring on the device (with a view of each slot), and its step.
        self._checks: tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None = None
        self._check_steps: list[int] = []
        self._scaler_states: Any = None
        self._stepped = False  # the optimizer stepped since the scaler's last update()
        self._closure_pending = False
        self._updates = updates and optimizer is not None
        # The optimizer update of a sampled step: (step index, ‖Δw‖ per parameter on its
        # way to the host), merged into that step's sample when `last` is read, and checked
        # for NaN/Inf against that step's records (`_check_update`) once both are there:
        # the records come first where a callback takes each sample at once
        # (`_awaiting`), else the update.
        self._update_step: int | None = None
        self._pending_updates: tuple[int, Callable[[], HostUpdates]] | None = None
        # The newest sampled update read on the host, with its step (the monitor's update
        # ratios over the run): read at the next sample, when its copy has arrived.
        self.read_update: tuple[int, HostUpdates] | None = None
        # Called at every step's check with (step, per-gradient magnitudes (n,) on the
        # device, in the order of the trainable parameters that have one; to be copied, not
        # kept): the monitor's flight recorder. One device only.
        self.on_check: Callable[[int, torch.Tensor], None] | None = None
        # Where the check may write step k's n magnitudes itself (`check_row(k, n)`: a
        # contiguous float64 (n,) CPU row the monitor keeps, or None), in place of
        # `on_check`: the native check writes them there, no copy follows.
        self.check_row: Callable[[int, int], torch.Tensor | None] | None = None
        self._check_out: torch.Tensor | None = None  # the native check's row without one
        self._awaiting: GradFlow | None = None
        self.broken_update: BrokenUpdate | None = None
        self.loss_broadcast: LossBroadcast | None = None
        self.loss_on_probabilities: LossOnProbabilities | None = None
        # Whether the loss's graph has been read (`check_loss`), and how many losses
        # handed to it did not reach the kept output (see `_LOSS_TRIES`).
        self._loss_read = False
        self._loss_missed = 0
        # Sampled steps whose gradients the loop changed in place before the update
        # (clipping): (step index, the total norm of the model's gradients then, and of the
        # watched optimizer's where it steps only part of the model, 0-d on the device),
        # and those already copied to the host.
        self._applied: deque[tuple[int, torch.Tensor, torch.Tensor | None]] = deque(
            maxlen=max_samples)
        self._applied_host: dict[int, float] = {}
        self._max_samples = max_samples

    # ------------------------------------------------------------------ lifecycle
    def open(self) -> None:
        """Register the hooks: the collector's, the optimizer's step hooks, and a check of
        the GradScaler on each forward."""
        c = self._collector
        c.open()
        s = c.session
        if self._optimizer is not None:
            s.track(self._optimizer.register_step_pre_hook(self._on_optimizer_step))
            s.track(self._optimizer.register_step_post_hook(self._after_optimizer_step))
            if self._others:
                # Every optimizer's steps, the process over: removed with the session's.
                s.track(register_optimizer_step_post_hook(
                    self._any_optimizer_step))
            if self._scaler is not None:
                self._scaler_states = getattr(self._scaler, "_per_optimizer_states", None)
                s.forward_pre_hook(s.model, self._check_scaler, prepend=True)
        c.on_backward_end = self._on_backward_end
        # DDP's write of the averaged gradients moves their versions after the backward's
        # end: taken as the evidence, it is no change by the loop (`_note_applied` would read
        # every gradient again at each sampled step: 0.5 ms on a small Llama).
        c.on_synced = self._grad_evidence
        c.on_output = self._read_own_loss
        c.active = self._collecting(self.steps)
        if self._updates:
            # Parameters that start at zero (LoRA's B) before the first sampled step, which
            # may come after their first updates (a callback sampling every 10th step).
            self._from_zero.update(c.zero_parameters())

    def close(self, *, failed: bool = False) -> None:
        """Sample a due step left unfinished, then remove every hook.

        Where the optimizer's steps or `end_step()` end steps, backward passes after the
        last step are none (a GAN's generator pass through the watched discriminator after
        the discriminator's last step): they fed no update. Only a block in which the
        optimizer never stepped samples its backward passes, as one step.

        Args:
            failed: the caller is unwinding an exception: the unfinished step is dropped
                rather than sampled, so that nothing can raise over the original error.
        """
        c = self._collector
        try:
            if not failed:
                if self._optimizer is not None and self._scaler is not None:
                    self._check_scaler()  # the last iteration may have been skipped
                if self._step_by == "inferred" and self._in_step:
                    # The block's end ends the step in progress.
                    flows, self._partials = self._partials, []
                    self._advance(self._sample(self.steps, _merged(flows, self.steps))
                                  if flows else None)
                elif c.active and c.backward_calls > 0 and self._due(self.steps) and (
                        self._step_by == "micro_batches" or
                        (self._step_by == "optimizer" and self.steps == self.first_step)):
                    self._sample(self.steps, c.finish_later(self.steps))
                self._settle()
        finally:
            c.on_backward_end = c.on_synced = None
            self._partials = []
            if failed:  # keep what finished steps measured, but raise nothing over the error
                with contextlib.suppress(Exception):
                    self._settle()
            self._untaken.clear()
            # They hold the parameters: results must not keep the model alive.
            self._optimizer = None
            self._params = []
            self._evidence_params = []
            self._stepped_params = []
            self._others = []
            self._evidence = []
            held, c.held = c.held, None  # DDP: it holds the parameters too
            c.close(failed=failed)
        if not failed and self._last is not None and world().distributed:
            if held is not None and held[0] == self._last.index:
                # DDP: every rank's numbers of the last sample, in one exchange for the run.
                self._last = replace(self._last, ranks=held[1].join())
            self.gathered = self._last.gather()  # after the hooks are off; rank 0 gets it

    def check_loss(self, loss: torch.Tensor) -> None:
        """Hand the watch a step's loss between its forward and its backward, once a step
        (the Lightning callback does, from `on_before_backward`): the watch reads the
        loss's graph once, back to the model's output, for a broadcast against the target
        and for probabilities given to a loss that wants logits (`loss_broadcast`,
        `loss_on_probabilities`; `grads.loss_broadcast`, `grads.loss_on_probabilities`,
        `torchscope.grads.loss.loss_faults`). The first call arms it: the output of the model's
        next forward is kept until the next call reads it, and is dropped then. A few
        autograd nodes are walked, once; no tensor is read. Where the loss's graph does not
        reach that output (another forward ran in between), the next call tries again, up
        to four losses. A model that returns its own loss has it read at its first forward,
        and the calls after that do nothing.

        Args:
            loss: the scalar loss, before its backward.
        """
        c = self._collector
        if self._loss_read or loss.grad_fn is None:
            return
        edges, c.outputs = c.outputs, None
        if edges is None:
            c.keep_outputs = True  # the next forward's output, for the next call
            return
        faults = loss_faults_at(loss, edges)
        if not faults.reached and edges and self._loss_missed + 1 < _LOSS_TRIES:
            # The latest forward was not this loss's (an evaluation forward with
            # gradients between the step's forward and its loss): the next one may be.
            self._loss_missed += 1
            return
        self.loss_broadcast, self.loss_on_probabilities = faults.broadcast, faults.probabilities
        self._loss_read, c.keep_outputs = True, False

    def _read_own_loss(self, out: Any) -> None:
        """The model's first forward with gradients: a model that returns its own loss (a
        transformers model given labels, under the HF Trainer too) has that loss's graph
        read at once, as `check_loss` would; the forwards after it are not looked at."""
        loss = own_loss(out)
        if self._loss_read or loss is None or loss.grad_fn is None:
            return
        faults = loss_faults(loss, out)
        self.loss_broadcast, self.loss_on_probabilities = faults.broadcast, faults.probabilities
        self._loss_read, self._collector.keep_outputs = True, False

    @property
    def loss_seen(self) -> bool:
        """Whether a loss of the loop was read (`check_loss`, or one the model returned):
        without one, `loss_broadcast` and `loss_on_probabilities` were not checked."""
        return self._loss_read

    @property
    def passes_without_update(self) -> int:
        """Backward passes that added to no trainable parameter's gradient, left out."""
        return self._collector.passes_without_update

    @property
    def compiled(self) -> tuple[str, ...]:
        """The model's compiled parts (qualified names, `""` the root), which run eagerly
        while the watch is open: torchscope's hooks fire only in eager code."""
        return self._collector.session.compiled

    @property
    def session(self) -> HookSession:
        """The `HookSession` owning every hook of this watch."""
        return self._collector.session

    @property
    def step_by(self) -> StepBy:
        """What ends a step: `optimizer` (its `step()`), `micro_batches` (a fixed number
        of backward passes), `inferred` (a backward into zeroed gradients starts a new
        step) or `manual` (`end_step()`)."""
        return self._step_by

    @property
    def collecting(self) -> bool:
        """Whether the hooks record the step in progress (it is due for a sample)."""
        return self._collector.active

    def number_from(self, first_step: int) -> None:
        """Number the steps from `first_step` (the global step a framework restored from a
        checkpoint, once the watch was open), as if it had been given at the start.

        Raises:
            TorchscopeError: a step was counted already, or `first_step` is no step.
        """
        _check_step("first_step", first_step)
        if self.steps != self.first_step or self.backwards:
            raise TorchscopeError(
                f"the steps are to be numbered from {first_step} after "
                f"{self.steps - self.first_step} step(s) and {self.backwards} backward "
                "pass(es) were counted.", fix="call number_from before the first backward.")
        self.first_step = self.steps = first_step
        self._collector.active = self._collecting(self.steps)

    # ------------------------------------------------------------------ stepping
    def _due(self, step: int) -> bool:
        return (step >= self.start and (step - self.start) % self.every == 0) or \
            (self._carry and step == self.steps)

    def _collecting(self, step: int) -> bool:
        # Inferred: a backward may begin the next step, known only when it ends.
        return self._due(step) or (self._step_by == "inferred" and self._due(step + 1))

    def end_step(self) -> None:
        """End the current step now, sampling it if it is due (`manual=True` only).

        Framework callbacks call it where the framework's step has its final, unscaled
        gradients, before clipping (Lightning's `on_before_optimizer_step`).

        Raises:
            TorchscopeError: the watch was not made with `manual=True`.
        """
        if self._step_by != "manual":
            raise TorchscopeError(
                f"end_step() was called on a watch whose steps end by {self._step_by}.",
                fix="pass manual=True to end steps yourself.")
        self._end_step()

    def _on_optimizer_step(self, _opt: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                           ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if self._scaler is None:
            found = _stepping_scaler()
            if found is not None:
                self._adopt_scaler(found)
        self._stepped = True
        self._check_cleared()
        for p in self._others:  # metadata only; none where the optimizer steps them all
            if p.grad is not None:
                self._with_grad.add(id(p))
            # Changed in place since the last step (the loop's own `p -= lr * p.grad` under
            # no_grad, or an update torch's optimizer hooks do not see): it is trained.
            # Only `p.data` writes escape the version counter.
            version = p._version
            if self._other_versions.setdefault(id(p), version) != version:
                self._stepped_elsewhere.add(id(p))
        if self._updates:
            # Before the update (a closure only recomputes the gradients, never w): keep w of
            # a sampled step to measure the update it applies. Manual steps end before
            # `step()`; the others end during it.
            c = self._collector
            if self._step_by == "manual":
                index = self.steps - 1
                sampled = self._last_index == index
            else:
                index = self.steps
                sampled = c.active and self._due(index)
            if sampled:
                self._update_step = index
                # Only what this optimizer updates: a second optimizer's parameters (AdamW
                # beside Muon) move at its own step, after this one's update is measured.
                c.snapshot_weights(_held(self._optimizer))
        # args[0] is the optimizer; a closure is step's first parameter.
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if self._step_by == "manual":
            # The step ended before `step()`, or ends inside its closure (Lightning's runs
            # the backward, then clipping): the update's gradients are final after it.
            if not callable(closure):
                self._before_update(self.steps - 1, self._last_index == self.steps - 1)
                return None
            return _with_closure(args, kwargs, self._noting_closure(closure))
        if not callable(closure):
            self._before_update(self.steps, self._due_now())
            self._end_step()  # before the update: `.grad` is final and not yet zeroed
            return None
        # `step(closure)` runs forward and backward inside the step (Lightning, LBFGS): the
        # step's gradients exist once the closure has returned, before the update.
        self._closure_pending = True
        return _with_closure(args, kwargs, self._closure_of_step(closure))

    def _noting_closure(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """`closure`, after whose first evaluation a manual step's gradients are checked
        (`_before_update`): there they are the ones the update uses."""
        first = True

        def evaluate() -> Any:
            nonlocal first
            result = closure()
            if first:
                first = False
                self._before_update(self.steps - 1, self._last_index == self.steps - 1)
            return result

        return evaluate

    def _before_update(self, index: int, sampled: bool) -> None:
        """Where step `index`'s gradients are those the update will use: count the step if
        the loop cleared them since the last backward (every evidence parameter's `.grad`
        set to None: the update uses none), else read what it applies (`_note_applied`)."""
        had = False  # an evidence parameter had a gradient at the last backward's end
        for p, before in zip(self._evidence_params, self._evidence, strict=False):
            if before is not None:
                if p.grad is not None:  # not all cleared: usually the first one says so
                    had = False
                    break
                had = True
        if had:
            self.cleared_steps += 1
            if self.first_cleared is None:
                self.first_cleared = self._optimizer_steps - 1  # this step, counted from 0
            return
        self._note_applied(index, sampled)

    def _note_applied(self, index: int, sampled: bool) -> None:
        """Where step `index`'s gradients are those the update will use: on a sampled step
        whose gradients the loop changed since the last backward's end (clipping), read
        the total norm the update uses (`applied_norm`): one read of the gradients, no host
        sync. Whether they changed is read from metadata (under FSDP2, which hides it, the
        step's rank exchange compares the two totals instead)."""
        if not sampled:
            return
        grads = [g for p in self._params if (g := p.grad) is not None]
        if not grads:
            return
        if any(local_tensor(g) is not g for g in grads):
            # FSDP2: this rank holds shards, and clipping them moves no version counter
            # (DTensor runs the in-place op below autograd), so every sampled step reads
            # them. The step's exchange joins every rank's into the total where it differs
            # from the backward's (`GradFlow.applied_norm`); a manual step has had its
            # exchange.
            if self._step_by != "manual":
                self._collector.note_applied()
            return
        if not self._changed_since_backward():
            return
        # With two optimizers, the watched one's gradients all 0 is a zeroing before its
        # step (the other's are left); otherwise the model's total compares with the
        # backward's (clipping the whole model).
        mine = [g.detach() for p in self._stepped_params if (g := p.grad) is not None] \
            if self._partial_update else []
        self._applied.append((index, total_norm([g.detach() for g in grads]),
                              total_norm(mine) if mine else None))

    def _changed_since_backward(self) -> bool:
        """Whether an evidence parameter's `.grad` was replaced or changed in place since
        the last backward's end (metadata only)."""
        for p, before in zip(self._evidence_params, self._evidence, strict=False):
            g = p.grad
            if before is not None and g is not None and \
                    (g is not before[0]() or _versions(g)[0] > before[1]):
                return True
        return False

    def _due_now(self) -> bool:
        """Whether the step in progress is sampled when it ends now."""
        c = self._collector
        return c.active and c.backward_calls > 0 and self._due(self.steps)

    def _closure_of_step(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        def evaluate() -> Any:
            if not self._closure_pending:
                # A second evaluation (LBFGS' line search and inner iterations) is at other
                # parameters: not the gradients this step starts from. Record nothing.
                c = self._collector
                active, c.active = c.active, False
                try:
                    return closure()
                finally:
                    c.active = active
                    c.discard()  # backward counts of the re-evaluation
            result = closure()
            self._closure_pending = False
            self._before_update(self.steps, self._due_now())
            self._end_step()
            return result

        return evaluate

    def _after_optimizer_step(self, _opt: Any, _args: Any, _kwargs: Any) -> None:
        # What the loop did to the gradients before the update (clipping multiplies them in
        # place) is no zeroing: the next backward's evidence starts from the update.
        self._grad_evidence()
        if self._closure_pending:  # the optimizer never called its closure
            self._closure_pending = False
            self._end_step()
        if self._update_step is not None:
            self._pending_updates = (self._update_step,
                                     updates_later(self._collector.measure_updates()))
            self._update_step = None

    def _any_optimizer_step(self, opt: Any, _args: Any, _kwargs: Any) -> None:
        """Any optimizer's step in the process: the parameters of the model it holds."""
        if opt is not self._optimizer:
            self._stepped_elsewhere.update(_held(opt))

    @property
    def unoptimized(self) -> tuple[str, ...]:
        """Trainable parameters that had a gradient at a step of the watched optimizer but
        that neither it nor any other optimizer that stepped while the watch was open
        holds, and that nothing changed in place between two of its steps: they never
        train (`grads.not_optimized`). A loop that updates one by hand through `p.data`,
        which torch's version counter does not see, reads as not training it."""
        return tuple(name for key, name in self._other_names.items()
                     if key in self._with_grad and key not in self._stepped_elsewhere)

    def _check_cleared(self) -> None:
        """At an optimizer step: count it when backward passes since the last step only
        accumulated into the gradients that step had used (nothing set them to None,
        replaced them or changed them in place: no zero_grad). Metadata only."""
        if self._passes_since_step and self._optimizer_steps and not self._cleared:
            self.unzeroed_steps += 1
            if self.first_unzeroed is None:
                self.first_unzeroed = self._optimizer_steps
        self._optimizer_steps += 1
        self._passes_since_step = 0
        self._cleared = False

    def _end_step(self) -> None:
        """The collector holds the whole step: sample it if due, then count it."""
        c = self._collector
        if self._check_nonfinite:
            self._check_step()
        if self._due_now():
            self._advance(self._sample(self.steps, c.finish_later(self.steps)))
        else:
            c.discard()  # counters of an unsampled step
            self._advance(None)

    def _advance(self, sampled: Callable[[], GradFlow] | None) -> None:
        index = self.steps
        # A due step without gradients gives its sample to the next step.
        self._carry = sampled is None and self._due(index)
        self.steps += 1
        self._collector.active = self._collecting(self.steps)
        if self._on_step is not None:
            self._on_step(index, None if sampled is None else sampled())

    def _on_backward_end(self) -> None:
        self.backwards += 1
        self._count_backward()
        if self._on_backward is not None:
            self._on_backward()

    def _count_backward(self) -> None:
        """Count a backward pass of the step: where it ends a step, end it."""
        c = self._collector
        if self._step_by in ("optimizer", "manual"):
            # No evidence from an earlier backward (the first one, inside the first step's
            # closure under Lightning): nothing says that it accumulated.
            known = any(e is not None for e in self._evidence)
            replaced, zeroed, _ = self._grad_evidence()
            self._cleared = self._cleared or replaced or zeroed or not known
            self._passes_since_step += 1
            # Gradients set to None since the last backward of a sampled step: the passes
            # before this one feed no update (a GAN's other player's step).
            if c.active and replaced and c.backward_calls > 1:
                c.restart_at_last_backward()
            return
        if self._step_by == "micro_batches":
            self._in_step += 1
            if self._in_step == self._micro_batches:
                self._in_step = 0
                self._end_step()
            return
        # Inferred: a step ends when the next backward starts from zeroed gradients, so each
        # backward of a due step is finished on its own and merged once its step has ended.
        was_active = c.active
        if self._fresh_gradients() and self._in_step:
            flows, self._partials, self._in_step = self._partials, [], 0
            self._advance(self._sample(self.steps, _merged(flows, self.steps))
                          if flows else None)
        self._in_step += 1
        if self._check_nonfinite:
            self._check_step()
        if was_active and self._due(self.steps):
            self._partials.append(c.finish_later(self.steps))
        else:
            c.discard()
        c.active = self._collecting(self.steps)

    def _fresh_gradients(self) -> bool:
        """Whether the backward that just ended accumulated into zeroed gradients.

        Autograd accumulates into an existing `.grad` in place (its version counter moves
        by one); `zero_grad()` sets it to None (a new tensor follows) or zeroes it in place
        (the version moves once more). Only metadata is read: no device work.
        """
        replaced, zeroed, accumulated = self._grad_evidence()
        return replaced or zeroed or not accumulated

    def _grad_evidence(self) -> tuple[bool, bool, bool]:
        """What happened to the evidence parameters' `.grad` since the last backward's end:
        set to None or replaced by a new tensor; changed in place more than one
        accumulation would (zeroed in place, or clipped); accumulated into. A parameter
        without a gradient then is skipped. The evidence is updated to now.

        A DTensor gradient (FSDP2) keeps two counters (`_versions`): the loop's in-place
        ops move the DTensor's own, FSDP2's accumulation into its shard moves only the
        shard's."""
        replaced = zeroed = accumulated = False
        now: list[_Evidence | None] = []
        old = self._evidence
        if len(old) < len(self._evidence_params):  # the first look
            old = [*old, *[None] * (len(self._evidence_params) - len(old))]
        # Runs twice a step over up to `_EVIDENCE` parameters: a plain gradient's counter
        # read inline, and its weak reference kept while it is the same tensor (names
        # bound to locals: this loop is most of what a step that is not sampled costs).
        plain, ref_of, add = torch.Tensor, weakref.ref, now.append
        for p, before in zip(self._evidence_params, old, strict=False):
            g = p.grad
            if g is None:
                if before is not None:
                    replaced = True
                add(None)
                continue
            if type(g) is plain:
                loop, shard = g._version, None
            else:
                loop, shard = _versions(g)
            if before is None:
                add((ref_of(g), loop, shard))
                continue
            ref, version, shard_version = before
            if g is not ref():
                replaced = True
                ref = ref_of(g)
            elif shard_version is not None:  # DTensor
                if loop > version:
                    zeroed = True
                elif shard is not None and shard > shard_version:
                    accumulated = True
            elif loop > version + 1:
                zeroed = True
            elif loop == version + 1:
                accumulated = True
            add((ref, loop, shard))
        self._evidence = now
        return replaced, zeroed, accumulated

    @property
    def scaler(self) -> Any:
        """The loop's GradScaler: the one given, or the one found stepping the optimizer
        (`scaler.step(optimizer)`); None without one."""
        return self._scaler

    def _adopt_scaler(self, scaler: Any) -> None:
        """Take `scaler`, found stepping the optimizer, as if it had been given: its scale
        is divided out of the norms from this step on (this one's included where the step
        ends here), the steps it skips are counted, and inf/NaN gradients are its to
        handle (the steps it skipped never reached the optimizer: none was checked)."""
        self._scaler = scaler
        self._collector.set_scaler(scaler)
        self._scaler_states = getattr(scaler, "_per_optimizer_states", None)
        s = self._collector.session
        if not s.closed:
            s.forward_pre_hook(s.model, self._check_scaler, prepend=True)
        self._check_nonfinite = False
        self._nonfinite = None
        self._check_steps.clear()

    def _check_scaler(self, *_args: Any) -> None:
        """Count a step the GradScaler skipped: its `update()` ran with no optimizer step
        since the last one (found inf/NaN). Reads host-side state only."""
        states = getattr(self._scaler, "_per_optimizer_states", None)
        if states is None or states is self._scaler_states:
            return
        self._scaler_states = states
        stepped, self._stepped = self._stepped, False
        if stepped:
            return
        self.skipped += 1
        if self._step_by == "manual":
            index = self.steps - 1  # end_step() came before the scaler's decision
            self._reduce_checks()
            if self._nonfinite is not None:  # that step's check saw the inf/NaN: not a fault
                first, count = self._nonfinite
                first.masked_fill_(first == index, -1)
                count.sub_(1)
            self._skipped_steps.append(index)
            return
        self._skipped_steps.append(self.steps)
        self._collector.discard()
        self._advance(None)

    def _check_step(self) -> None:
        """Note on the device whether any gradient element of this step is NaN/Inf (no host
        sync): one fused norm per gradient, which is non-finite iff an element is (on the
        CPU L2 norms summed in float64, which no float32 element can overflow: a 30-layer
        ReLU MLP's finite 6e31 elements read as Inf in a float32 L2 norm; elsewhere the
        infinity norm), and their largest into a ring that `_reduce_checks` reads every
        `_CHECK_RING` checks: two ops on the device a step, one native call on the CPU."""
        grads = [g for p in self._params if (g := p.grad) is not None]
        if self._native_fit and self._native_fit == len(grads) and self._check_native(grads):
            return
        grads = [g for g in grads if not g.is_sparse]
        if not grads:
            return
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for grad in grads:
            g = grad if type(grad) is torch.Tensor else local_tensor(grad)  # FSDP2: the shard
            by_device.setdefault(g.device, []).append(g)
        vectors: list[torch.Tensor] = []
        self._native_fit = 0
        for group in by_device.values():
            vector = _kernels.norm_vector(group)  # (n,) float64, or None
            if vector is not None and len(by_device) == 1:
                self._native_fit = len(group)
            if vector is None:
                norms = list(torch._foreach_norm(group, math.inf))  # one 0-d max per gradient
                if len({n.dtype for n in norms}) > 1:
                    norms = [n.float() for n in norms]
                vector = torch.stack(norms)  # (n,)
            if self.on_check is not None and len(by_device) == 1:
                self.on_check(self.steps, vector)
            vectors.append(vector)
        self._note_check(vectors)

    def _check_native(self, grads: list[torch.Tensor]) -> bool:
        """`_check_step` by one native call where it takes the same parameters' gradients
        as the last check did (all plain float32 on the CPU, which it checks itself, in
        C++): their norms into the monitor's flight-recorder row, or the watch's own, and
        the largest into the ring's next slot. False, nothing noted, where it cannot."""
        n = len(grads)
        row = None if self.check_row is None else self.check_row(self.steps, n)
        out = row
        if out is None:
            out = self._check_out
            if out is None or out.numel() != n:
                out = self._check_out = torch.empty(n, dtype=torch.float64)  # (n,)
        slot = self._next_slot(grads[0].device)
        if not _kernels.norms_into(grads, out, slot):
            if row is not None:
                row.fill_(math.nan)  # no magnitudes this step, unless the slow path writes them
            return False
        self._check_steps.append(self.steps)
        if row is None and self.on_check is not None:
            self.on_check(self.steps, out)
        return True

    def _next_slot(self, device: torch.device) -> torch.Tensor:
        """The ring's next free slot on `device` (a () view), reducing the ring first where
        it is full or on another device. The caller notes the step once it has written it."""
        if len(self._check_steps) == _CHECK_RING:
            self._reduce_checks()
        if self._checks is None or self._checks[0].device != device:
            self._reduce_checks()
            # float64 holds a CPU L2 norm of finite float32 elements (up to 1e43); MPS has none.
            dtype = torch.float32 if device.type == "mps" else torch.float64
            ring = torch.full((_CHECK_RING,), math.nan, dtype=dtype, device=device)
            self._checks = (ring, ring.unbind(0))
        return self._checks[1][len(self._check_steps)]

    def _note_check(self, vectors: list[torch.Tensor]) -> None:
        """Write the largest of this check's gradient magnitudes (one (n,) vector per
        device) into the next slot of the ring, reducing it first where it is full."""
        slot = self._next_slot(vectors[0].device)
        assert self._checks is not None
        ring = self._checks[0]
        self._check_steps.append(self.steps)
        # detach: after backward(create_graph=True) the gradients, and their norms by
        # `_foreach_norm`, require grad, which an `out=` refuses.
        if len(vectors) == 1:
            vector = vectors[0].detach()
            if vector.dtype == ring.dtype:
                torch.amax(vector, 0, out=slot)  # NaN and Inf propagate
            else:  # `_foreach_norm`'s, in the gradients' dtype
                slot.copy_(vector.amax(), non_blocking=True)
            return
        largest = torch.stack([v.detach().amax().to(ring.device, ring.dtype, non_blocking=True)
                               for v in vectors])  # (devices,)
        slot.copy_(largest.amax())

    def _reduce_checks(self) -> None:
        """Fold the ring's pending checks into the first NaN/Inf step and the count of
        checks that saw one, on the device (no host sync)."""
        if not self._check_steps:
            return
        assert self._checks is not None
        ring = self._checks[0]
        n = len(self._check_steps)
        bad = ~torch.isfinite(ring[:n])  # (n,) bool
        # From pinned memory without blocking on CUDA: a pageable copy would wait for the
        # device (a sync every `_CHECK_RING` steps); torch's pinned allocator keeps the
        # buffer until the copy has run.
        steps = torch.tensor(self._check_steps, dtype=torch.int64,
                             pin_memory=ring.is_cuda).to(ring.device, non_blocking=True)  # (n,)
        self._check_steps.clear()
        if self._nonfinite is None:
            self._nonfinite = (torch.full((), -1, dtype=torch.int64, device=ring.device),
                               torch.zeros((), dtype=torch.int64, device=ring.device))
        first, count = self._nonfinite
        count.add_(bad.sum().to(count.device))
        found = torch.where(bad, steps, _NO_STEP).amin().to(first.device)  # () earliest bad
        first.copy_(torch.where((first < 0) & (found < _NO_STEP), found, first))

    def _sample(self, index: int, build: Callable[[], GradFlow]) -> Callable[[], GradFlow]:
        """Count step `index` as sampled. Its records are built when read, or when the next
        sampled step comes (callbacks want them at once), so that the loop does not wait
        for the device at the end of a sampled step."""
        self.samples += 1
        self._last_index = index
        self._untaken.append(build)
        if self._on_sample is not None or self._on_step is not None:
            self._settle()
        else:  # the step before: its copy arrived while this step ran
            self._settle(keep=1)
        return build

    def _settle(self, keep: int = 0) -> None:
        """Build the records of the untaken sampled steps, oldest first, but the newest
        `keep`."""
        while len(self._untaken) > keep:
            self._take(self._untaken.popleft()())

    def _take(self, flow: GradFlow) -> GradFlow:
        # A parameter that starts at zero grows from there: its update ratio is no step size.
        self._from_zero.update(p.name for p in flow.params
                               if p.requires_grad and p.weight_norm == 0.0)
        if self._from_zero:
            flow = replace(flow, from_zero=tuple(sorted(self._from_zero)))
        if self._updates:
            flow = replace(flow, optimizer=self.optimizer_name,
                           optimizer_eps=_smallest_eps(self._optimizer))
            self._meet_update(flow)
        self._last = flow
        if flow.applied_norm is not None:  # FSDP2: joined in the step's exchange
            self._keep_applied({flow.index: flow.applied_norm})
        outs = {k: v for k, v in flow.output_norms().items() if v is not None}
        params = {k: v for k, v in flow.param_norms().items() if v is not None}
        self._layers.update(dict.fromkeys([*outs, *params]))  # new layers join at the end
        self._rows.append((flow.index, outs, params, flow.total_norm))
        if self._on_sample is not None:
            self._on_sample(flow)
        return flow

    def _meet_update(self, flow: GradFlow | None) -> None:
        """Check the newest measured update against the records of its step
        (`_check_update`), where both are here: the records taken before it (`_awaiting`),
        or `flow`, taken now. Keep `flow` for its update otherwise. By now the update's copy
        to the host has arrived (it started a step ago), or `last` is being read."""
        pending = self._pending_updates
        waiting = self._awaiting
        if pending is not None and waiting is not None and pending[0] == waiting.index:
            self._check_update(waiting, pending[1]())
            waiting = None
        if flow is not None and pending is not None and pending[0] == flow.index:
            self._check_update(flow, pending[1]())
            waiting = None
        elif flow is not None:
            waiting = flow
        self._awaiting = waiting

    def _check_update(self, flow: GradFlow, updates: HostUpdates) -> None:
        """Keep the first sampled update that wrote NaN/Inf into finite weights
        (`broken_update`). A loop over the update norms on the host; the records are
        joined with them only where one is NaN/Inf."""
        self.read_update = (flow.index, updates)
        if self.broken_update is not None or \
                all(math.isfinite(v) for v in updates.norms.values()):
            return
        self.broken_update = with_updates(flow, updates).broken_update

    # ------------------------------------------------------------------ results
    @property
    def last(self) -> GradFlow | None:
        """The most recent sampled step in full (per call and per parameter), or None.

        With an optimizer, its parameters carry the update that step applied
        (`ParamGradRecord.update_norm`, `update_ratio`), read from the device when `last` is
        first read after the step.
        """
        self._settle()
        pending = self._pending_updates
        if pending is not None and self._last is not None and pending[0] == self._last.index:
            self._meet_update(None)
            self._last = with_updates(self._last, pending[1]())
            self._pending_updates = None
        if self._last is not None and self._last.applied_norm is None:
            applied = self.applied_norms.get(self._last.index)
            if applied is not None:
                self._last = replace(self._last, applied_norm=applied)
        return self._last

    @property
    def applied_norms(self) -> dict[int, float]:
        """Per sampled step whose gradients the loop changed in place before the update
        (clipping): the total norm of the gradients the update used
        (`GradFlow.applied_norm`), newest `max_samples`. Read from the device when first
        read after the step."""
        self._settle()  # FSDP2's arrive with their step's records
        if self._applied:
            pending = list(self._applied)
            self._applied.clear()
            floats = iter(_host_floats([t for _, whole, mine in pending
                                        for t in (whole, mine) if t is not None]))
            norms: dict[int, float] = {}
            for i, _, mine in pending:
                whole = next(floats)
                norms[i] = 0.0 if mine is not None and next(floats) == 0.0 else whole
            self._keep_applied(norms)
        return dict(self._applied_host)

    def _keep_applied(self, norms: dict[int, float]) -> None:
        self._applied_host.update(norms)
        for old in sorted(self._applied_host)[:-self._max_samples]:
            del self._applied_host[old]

    @property
    def skipped_steps(self) -> tuple[int, ...]:
        """Indices of the steps the GradScaler skipped (the newest 1,000; `skipped` counts
        them all)."""
        return tuple(self._skipped_steps)

    @property
    def nonfinite_steps(self) -> int | None:
        """With `check_nonfinite=True`: steps whose gradients held NaN/Inf, every step
        checked (a GradScaler's skipped steps excluded); None otherwise. Reading it copies
        one number from the device."""
        self._reduce_checks()
        return None if self._nonfinite is None else int(self._nonfinite[1])

    @property
    def first_nonfinite_step(self) -> int | None:
        """With `check_nonfinite=True`: the first step whose gradients held NaN/Inf, every
        step checked, or None. Reading it copies one number from the device."""
        self._reduce_checks()
        if self._nonfinite is None:
            return None
        first = int(self._nonfinite[0])
        return first if first >= 0 else None

    @property
    def history(self) -> GradHistory:
        """Per-layer norms of the newest `max_samples` samples."""
        self._settle()
        layers = tuple(self._layers)
        applied = self.applied_norms
        return GradHistory(
            steps=tuple(r[0] for r in self._rows),
            layers=layers,
            output_norms=tuple(tuple(r[1].get(k, math.nan) for k in layers) for r in self._rows),
            param_norms=tuple(tuple(r[2].get(k, math.nan) for k in layers) for r in self._rows),
            total_norms=tuple(r[3] for r in self._rows),
            applied_norms=tuple(applied.get(r[0]) for r in self._rows) if applied else (),
        )


# An evidence parameter's `.grad` at the last look: a weak reference to it, its version
# counter, and its local shard's (a DTensor's; None for a plain tensor).
_Evidence = tuple["weakref.ReferenceType[torch.Tensor]", int, int | None]


def _smallest_eps(optimizer: Any) -> float | None:
    """The smallest float `eps` over `optimizer`'s parameter groups (Adam's, RMSprop's:
    what the step divides by where a running statistic is 0), or None."""
    values = [e for g in getattr(optimizer, "param_groups", None) or ()
              if isinstance(e := g.get("eps"), float)]
    return min(values) if values else None


def _held(optimizer: Any) -> set[int]:
    """The identities of the parameters in `optimizer`'s param groups."""
    return {id(p) for group in optimizer.param_groups for p in group["params"]}


def _stepped_by(optimizer: Any, params: list[nn.Parameter]) -> list[nn.Parameter]:
    """Those of `params` that `optimizer` steps, in their order; all of them without an
    optimizer, or where it steps none of them."""
    if optimizer is None:
        return params
    ids = _held(optimizer)
    return [p for p in params if id(p) in ids] or params


def _stepping_scaler() -> Any:
    """The `torch.amp.GradScaler` whose `step(optimizer)` called the optimizer step in
    progress, read from the call stack (a few frames above the step hook); None when the
    loop stepped the optimizer itself. Only frames named as the scaler's stepping methods
    are looked into."""
    frame: FrameType | None = sys._getframe(2)  # above this function and the step hook
    for _ in range(_SCALER_FRAMES):
        if frame is None:
            return None
        if frame.f_code.co_name in ("step", "_maybe_opt_step"):
            owner = frame.f_locals.get("self")
            if isinstance(owner, torch.amp.GradScaler):
                return owner
        frame = frame.f_back
    return None


def _versions(g: torch.Tensor) -> tuple[int, int | None]:
    """`g`'s version counter, and its local shard's where `g` is a DTensor (FSDP2), else
    None. Autograd moves a plain gradient's counter once per accumulation, and in-place
    ops on it move it too. A DTensor's own counter moves for the loop's in-place ops
    (`zero_`, `mul_`) only: FSDP2 accumulates into the shard, whose counter moves then."""
    if type(g) is torch.Tensor:
        return g._version, None
    local = local_tensor(g)
    return g._version, (local._version if local is not g else None)


def watch_gradients(
    model: nn.Module,
    every: int = 1,
    *,
    start: int = 0,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: Any = None,
    micro_batches: int | None = None,
    manual: bool = False,
    select: Selector = None,
    depth: int | None = None,
    inputs_grad: bool = True,
    max_samples: int = 1000,
    check_nonfinite: bool = False,
    on_sample: Callable[[GradFlow], None] | None = None,
    on_step: Callable[[int, GradFlow | None], None] | None = None,
    updates: bool = True,
) -> GradWatch:
    """Watch gradient flow in your own training loop, sampling one step in `every`.

    A sample holds the gradients the optimizer step uses: accumulated over every
    micro-batch, before the update. What counts as a step:

    - `optimizer=`: each `optimizer.step()`. With `step(closure)` (LBFGS, Lightning's
      automatic optimization), the closure runs forward and backward inside the step, so
      the sample is read when the closure's first evaluation returns; later evaluations
      (LBFGS' line search) are at other parameters and are not recorded.
    - `micro_batches=N` (no optimizer): every N backward passes.
    - neither: inferred from the gradients. A backward that accumulates into the
      gradients the previous one left (no `zero_grad()` in between) continues the step;
      one into zeroed gradients (set to None or zeroed in place) starts the next. A
      step's end is known only when the next begins, so the step before a due one is
      recorded too (and dropped): about twice the cost of `optimizer=`. Pass
      `micro_batches=` where that cannot work: `backward(create_graph=True)`, or code that
      replaces `.grad` between backward passes.
    - `manual=True`: each `watch.end_step()` (what framework callbacks call).

    Unsampled steps cost one Python call per hook and no device work. Only norms are kept:
    the last sample in full and a history of per-layer norms bounded by `max_samples`.
    Nothing waits for the device: a sampled step's norms leave it by one copy per device
    that does not block (into pinned memory on CUDA), and its records are built when read
    (`watch.last`, `watch.history`, findings) or when the next sample comes, by which time
    the copy has arrived. `on_sample` and `on_step` want each step's records when it ends,
    so with either of them that step waits for its norms.

    On a DDP or FSDP2 model (inside torchrun), the last sample also holds every rank's
    per-parameter norms (`flow.ranks`; DDP: before and after the all-reduce; FSDP2: the
    global norms from the shards), and the end of the block joins every rank's last sample
    on rank 0 (`watch.gathered`). Under FSDP2 each sampled step exchanges them at its
    optimizer step (its global norms need every shard); under DDP they are kept on each rank
    and joined once, when the block ends, so a sample read during the block has `ranks`
    None (its norms, the synchronised ones, are every rank's). Under FSDP2 the
    update ratios of sharded parameters are the whole parameters' too, joined from the
    shards' updates by a second exchange just after the update.

    Args:
        model: the model (a DDP wrapper or an FSDP2-sharded model too).
        every: sample steps start, start + every, start + 2*every, ...; a due step
            without any backward (or one the GradScaler skipped) passes its sample to
            the next step.
        start: the first sampled step (0; `every - 1` samples the steps after which a
            1-based step count is a multiple of `every`, as the HF Trainer logs).
        optimizer: the optimizer whose `step()` calls define steps (with `manual=True`,
            only used to tell which steps the GradScaler skipped); required on a DDP or
            FSDP2 model unless `manual=True`.
        scaler: the `torch.amp.GradScaler` of the loop; its scale is divided out, so the
            norms are those of the unscaled gradients. With `optimizer=`, a step the
            scaler skips (inf/NaN; its `update()` ran without an optimizer step) is
            counted as a step and in `watch.skipped` / `watch.skipped_steps`, and not sampled.
            Not given, with `optimizer=`, the scaler whose `step(optimizer)` steps it is
            found at its first step and taken as if given (`watch.scaler`); with
            `manual=True` that step has ended already, and the next ones are unscaled.
        micro_batches: backward passes per step, for a loop without `optimizer=`.
        manual: steps end only at `watch.end_step()`.
        select: modules recorded per call (see `select_modules`); default the layers.
        depth: limit the selection depth.
        inputs_grad: also measure grad_input of each call (on the autograd nodes of the
            call that consume each input; nothing is put into the graph).
        max_samples: how many samples the history keeps (the newest).
        check_nonfinite: check every step, not only sampled ones, whether any parameter
            gradient is NaN/Inf: one fused norm per step on the device, read only through
            `watch.first_nonfinite_step` and `watch.nonfinite_steps`.
        on_sample: called with each sampled `GradFlow` (e.g. a TensorBoard logger); it sees
            the step before its update, so without `update_norm`.
        on_step: called at the end of every step, before the update, with the step's
            index and its sample (None when it was not sampled).
        updates: with an optimizer, also measure each sampled step's update `‖Δw‖` per
            parameter (`watch.last.params[i].update_ratio`). It copies the trainable
            parameters just before a sampled step's update and frees the copy right after
            it: one more parameter-sized buffer for the duration of `optimizer.step()`, on
            sampled steps only. On a CUDA device where that copy would take more than half
            of the free memory, the step's update is not measured instead (its update
            ratios read None), so that watching never runs the device out of memory.

    Returns:
        A `GradWatch` for a `with` block; its hooks come off at the block's end.

    Raises:
        TorchscopeError: `every`, `max_samples` or `micro_batches` is below 1, or
            `micro_batches` was given with `optimizer=` or `manual=True`.

    Example:
        >>> with torchscope.watch_gradients(model, every=10, optimizer=opt) as watch:
        ...     for x, y in loader:
        ...         F.cross_entropy(model(x), y).backward()
        ...         opt.step(); opt.zero_grad()
        >>> watch.history.series("fc")
    """
    return GradWatch(model, every=every, start=start, optimizer=optimizer, scaler=scaler,
                     micro_batches=micro_batches, manual=manual, select=select, depth=depth,
                     inputs_grad=inputs_grad, max_samples=max_samples,
                     check_nonfinite=check_nonfinite, on_sample=on_sample, on_step=on_step,
                     updates=updates)
