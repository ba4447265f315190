"""Entry points: `gradient_flow` for one step, `watch_gradients` for a training loop."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torchscope.distributed.ranked import Ranked
from torchscope.distributed.world import strategy_of, world
from torchscope.errors import TorchscopeError
from torchscope.findings import Analyzed
from torchscope.grads.collect import GradCollector
from torchscope.grads.records import GradFlow, GradHistory
from torchscope.hooks.lifecycle import HookedContext
from torchscope.hooks.select import Selector
from torchscope.hooks.session import HookSession
from torchscope.step import LossSpec, Step


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
        select: modules to record per call (see `select_modules`); default the leaves.
        depth: limit the selection depth.
        train: put the model in train (True) or eval (False) mode; restored afterwards.
            None leaves the mode as it is.
        zero_grad: set every `.grad` to None first, so the reading is this step's alone.
        inputs_grad: also measure each call's grad_input (aliases the module inputs).

    Returns:
        The step's `GradFlow`, with `flow.step` saying which loss ran and its value. The
        parameters' `.grad` hold this step's gradients, exactly as a plain `loss.backward()`
        (per micro-batch) leaves them; every hook is already removed.

    Raises:
        ModelError: the model or the loss raised.
        TorchscopeError: the loss does not depend on anything that requires grad, or a
            `Step` was given together with inputs or step options.

    Example:
        >>> flow = torchscope.gradient_flow(model, x, loss_fn="cross_entropy", target=y,
        ...                                 select=["conv1", "conv2", "fc"])
        >>> [r.module for r in flow.modules]
        ['fc', 'conv2', 'conv1']
        >>> flow.get("conv1").grad_input[0].reason
        'input does not require grad'
        >>> flow.findings()[0].summary
        'conv1 receives 67× less gradient than fc'
    """
    step = Step.of(model, inputs, loss_fn=loss_fn, target=target, optimizer=optimizer)
    collector = GradCollector(step.model, select=select, depth=depth, inputs=inputs_grad,
                              scaler=step.scaler)
    with collector:
        if train is not None:
            collector.session.set_training(train)
        if zero_grad:
            step.zero_grad()
        loss = step.forward_backward()
        return collector.finish(0, step=step.info(loss))


class GradWatch(HookedContext, Analyzed):
    """Samples gradient flow in the user's own training loop; see `watch_gradients`.

    Its findings (`watch.findings()`) judge the last sample (as `torchscope.grads.diagnose`)
    and the history (a total norm that turns NaN/Inf or grows out of bounds).

    Attributes:
        every: sample one step in `every`.
        steps: steps counted so far (optimizer steps, or backward calls without one).
        samples: samples taken so far (unbounded count; the history keeps the newest).
        gathered: in a distributed job, every rank's last sample joined on rank 0 at the end
            of the block (`Ranked[GradFlow]`); None on the other ranks and on one process.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        every: int = 1,
        optimizer: torch.optim.Optimizer | None = None,
        scaler: Any = None,
        select: Selector = None,
        depth: int | None = None,
        inputs_grad: bool = True,
        max_samples: int = 1000,
        on_sample: Callable[[GradFlow], None] | None = None,
    ) -> None:
        if every < 1:
            raise TorchscopeError(f"every={every} samples nothing.",
                                  fix="pass every=1 or more.")
        if max_samples < 1:
            raise TorchscopeError(f"max_samples={max_samples} keeps no history.",
                                  fix="pass max_samples=1 or more.")
        if optimizer is None and world().distributed and strategy_of(model) != "none":
            raise TorchscopeError(
                "watch_gradients on a DDP or FSDP2 model needs optimizer=: the synchronised "
                "gradients exist only once backward has returned, and ranks exchange their "
                "norms at each sampled optimizer step.",
                fix="pass optimizer=your_optimizer.")
        self.every = every
        self.steps = 0
        self.samples = 0
        self.gathered: Ranked[GradFlow] | None = None
        self._optimizer = optimizer
        self._collector = GradCollector(model, select=select, depth=depth, inputs=inputs_grad,
                                        scaler=scaler)
        self._on_sample = on_sample
        self._last: GradFlow | None = None
        # Newest `max_samples` samples: (step, {layer: output norm}, {layer: param norm}, total)
        self._rows: deque[tuple[int, dict[str, float], dict[str, float], float]] = deque(
            maxlen=max_samples)
        self._layers: dict[str, None] = {}

    # ------------------------------------------------------------------ lifecycle
    def open(self) -> None:
        """Register the hooks (and the optimizer step hook when an optimizer is given)."""
        c = self._collector
        c.open()
        if self._optimizer is not None:
            c.session.track(self._optimizer.register_step_pre_hook(self._on_optimizer_step))
        else:
            c.on_backward_end = self._end_step
        c.active = self.steps % self.every == 0

    def close(self, *, failed: bool = False) -> None:
        """Sample a due step left unfinished, then remove every hook.

        Args:
            failed: the caller is unwinding an exception: the unfinished step is dropped
                rather than sampled, so that nothing can raise over the original error.
        """
        try:
            if not failed and self._collector.active and self._collector.backward_calls > 0:
                self._sample()
        finally:
            self._collector.on_backward_end = None
            self._optimizer = None  # it holds the parameters: results must not keep them
            self._collector.close(failed=failed)
        if not failed and self._last is not None and world().distributed:
            self.gathered = self._last.gather()  # after the hooks are off; rank 0 gets it

    @property
    def session(self) -> HookSession:
        """The `HookSession` owning every hook of this watch."""
        return self._collector.session

    # ------------------------------------------------------------------ stepping
    def _on_optimizer_step(self, _opt: Any, _args: Any, _kwargs: Any) -> None:
        # Before the update: `.grad` is final and not yet zeroed.
        self._end_step()

    def _end_step(self) -> None:
        if self._collector.active:
            self._sample()
        else:
            self._collector.discard()  # counters of an unsampled step
        self.steps += 1
        self._collector.active = self.steps % self.every == 0

    def _sample(self) -> None:
        flow = self._collector.finish(self.steps)
        self.samples += 1
        self._last = flow
        outs = {k: v for k, v in flow.output_norms().items() if v is not None}
        params = {k: v for k, v in flow.param_norms().items() if v is not None}
        self._layers.update(dict.fromkeys([*outs, *params]))  # new layers join at the end
        self._rows.append((flow.index, outs, params, flow.total_norm))
        if self._on_sample is not None:
            self._on_sample(flow)

    # ------------------------------------------------------------------ results
    @property
    def last(self) -> GradFlow | None:
        """The most recent sampled step in full (per call and per parameter), or None."""
        return self._last

    @property
    def history(self) -> GradHistory:
        """Per-layer norms of the newest `max_samples` samples."""
        layers = tuple(self._layers)
        return GradHistory(
            steps=tuple(r[0] for r in self._rows),
            layers=layers,
            output_norms=tuple(tuple(r[1].get(k, math.nan) for k in layers) for r in self._rows),
            param_norms=tuple(tuple(r[2].get(k, math.nan) for k in layers) for r in self._rows),
            total_norms=tuple(r[3] for r in self._rows),
        )


def watch_gradients(
    model: nn.Module,
    every: int = 1,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: Any = None,
    select: Selector = None,
    depth: int | None = None,
    inputs_grad: bool = True,
    max_samples: int = 1000,
    on_sample: Callable[[GradFlow], None] | None = None,
) -> GradWatch:
    """Watch gradient flow in your own training loop, sampling one step in `every`.

    With `optimizer`, a step is one `optimizer.step()` call, so gradient accumulation over
    several micro-batches is one step, and a sample is taken just before the update, when
    `.grad` is final. Without one, every backward is a step. Unsampled steps cost one
    Python call per hook and no device work. Only norms are kept: the last sample in full
    and a history of per-layer norms bounded by `max_samples`.

    On a DDP or FSDP2 model (inside torchrun), each sampled step also records every rank's
    per-parameter norms (`flow.ranks`; DDP: before and after the all-reduce; FSDP2: the
    global norms from the shards) through one exchange at the optimizer step, and the end of
    the block joins every rank's last sample on rank 0 (`watch.gathered`).

    Args:
        model: the model (a DDP wrapper or an FSDP2-sharded model too).
        every: sample steps 0, every, 2*every, ...
        optimizer: the optimizer whose `step()` calls define steps; required on a DDP or
            FSDP2 model.
        scaler: the `torch.amp.GradScaler` of the loop; its scale is divided out, so the
            norms are those of the unscaled gradients. A step the scaler skips (inf/NaN)
            is not an optimizer step: its gradients count with the next one.
        select: modules recorded per call (see `select_modules`); default the leaves.
        depth: limit the selection depth.
        inputs_grad: also measure grad_input of each call (aliases the module inputs).
        max_samples: how many samples the history keeps (the newest).
        on_sample: called with each sampled `GradFlow` (e.g. a TensorBoard logger).

    Returns:
        A `GradWatch` for a `with` block; its hooks come off at the block's end.

    Example:
        >>> with torchscope.watch_gradients(model, every=10, optimizer=opt) as watch:
        ...     for x, y in loader:
        ...         F.cross_entropy(model(x), y).backward()
        ...         opt.step(); opt.zero_grad()
        >>> watch.history.series("fc")
    """
    return GradWatch(model, every=every, optimizer=optimizer, scaler=scaler, select=select,
                     depth=depth, inputs_grad=inputs_grad, max_samples=max_samples,
                     on_sample=on_sample)
