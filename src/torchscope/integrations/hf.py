"""`TorchscopeTrainerCallback`: `torchscope.monitor` inside a Hugging Face `Trainer`
(transformers >= 4.40).

    from torchscope.integrations.hf import TorchscopeTrainerCallback

    callback = TorchscopeTrainerCallback(every=10, out="run")
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[callback])
    with callback:                      # removes the hooks even if train() raises
        trainer.train()                 # run/report.html, run/report.json at the end

A `TrainerCallback` alone cannot see per-layer gradients before clipping: `on_pre_optimizer_step`
runs after `clip_grad_norm_` and `on_step_end` after `zero_grad()`. The callback therefore
reads them where autograd leaves them: post-accumulate-grad hooks on every parameter, owned by
a `HookSession`, fire during the backward of each micro-batch, and the last micro-batch's
reading (the accumulated gradient, before clipping; the GradScaler's scale divided out) is
the step's. The reported total norm is the one clipping returns, which the Trainer logs as
`grad_norm`. The step ends at `on_pre_optimizer_step` (at `on_step_end` before 4.44), its
scalars go into the next `on_log` (into `state.log_history` and the `logs` the later
callbacks get), and the report is written at `on_train_end`. The sampled steps are those
after which `state.global_step` is a multiple of `every`, so with `logging_steps == every`
each training log carries the scalars of its own step.

With `torch_compile=True` the Trainer calls the model through a `torch.compile` wrapper that
no callback is given. The model then runs eagerly while the callback is open, as any compiled
model does under torchscope's hooks, and the report says so: Dynamo would otherwise trace
the hooks into its graph and recompile at every step.

Under DDP (torchrun, `accelerate launch`) the norms are those of the synchronised
gradients, as the Trainer's `grad_norm` is, on every rank; each rank's own are kept too.
That holds where `fsdp` is set but accelerate trains through DDP (on CPU): accelerate's own
state says which it does, not the arguments.

The Trainer has no event for an exception: use the callback as a context manager around
`trainer.train()` (or call `callback.close()`), so that hooks come off and a partial report
is written if training raises. Reporting callbacks (TensorBoard, W&B, ...: `report_to`) come
before the user's in the Trainer's list, and a callback after them adds to `logs` after they
have written them. The callback therefore installs itself (`install`) on the Trainer whose
event calls it (at `on_init_end` for `callbacks=[callback]`, else at `on_train_begin`):
it goes first, so that `report_to`'s loggers get its scalars, and it hands the monitor each
step's loss from `trainer.compute_loss`, so that a loss the Trainer computes outside the
model (`compute_loss_func`, `label_smoothing_factor`, a `compute_loss` override) is checked
too (without it, `run.loss_unseen` says it was not). Where no Trainer can be found calling
it (events called by other code), it says so once at `on_train_begin`:
`callback.install(trainer)` then does it.

This module imports transformers; `import torchscope` never does. Install it with
`pip install torchscope[hf]`.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from collections.abc import Mapping
from pathlib import Path
from types import FrameType
from typing import Any, Literal

import torch

from torchscope.distributed.world import strategy_of
from torchscope.errors import TorchscopeError
from torchscope.hooks.select import Selector
from torchscope.monitoring import Monitor, RunRecord
from torchscope.step import inner_optimizer

try:
    from transformers import Trainer, TrainerCallback
except ImportError as exc:
    raise ImportError("torchscope.integrations.hf needs transformers: pip install "
                      "torchscope[hf]") from exc

__all__ = ["TorchscopeTrainerCallback"]


def _data_parallel(args: Any, model: Any) -> Literal["ddp"] | None:
    """`"ddp"` when the Trainer trains `model` through `DistributedDataParallel` over the
    default process group: its wrapper (`trainer.model_wrapped`) is not among a callback's
    arguments. None on one process, and for FSDP2 (its sharded modules say so themselves),
    FSDP1 and DeepSpeed (not DDP).

    `fsdp` in the arguments is no proof of FSDP: accelerate, which wraps the model, trains
    through DDP where it cannot shard (on CPU), so its own state is asked."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or strategy_of(model) != "none":
        return None
    if getattr(args, "deepspeed", None) or (getattr(args, "fsdp", None) and _sharding()):
        return None
    mode = getattr(args, "parallel_mode", None)
    return "ddp" if getattr(mode, "value", None) == "distributed" else None


def _sharding() -> bool:
    """Whether accelerate's state (the Trainer's) says it shards the model with FSDP; True
    where it cannot tell. The state is read where it is kept, never made: constructing an
    `AcceleratorState` would initialise one."""
    try:
        from accelerate.state import AcceleratorState
        from accelerate.utils import DistributedType
    except ImportError:
        return True
    shared = getattr(AcceleratorState, "_shared_state", None)
    kind = shared.get("distributed_type") if isinstance(shared, dict) else None
    return kind is None or bool(kind == DistributedType.FSDP)


# Frames between a callback's event method and the Trainer method that fired it
# (`CallbackHandler.on_*`, `call_event`), with room for a subclass's own layers.
_EVENT_DEPTH = 8


def _calling_trainer(callback: Any) -> Any:
    """The `Trainer` whose event is calling `callback` now: the `self` of a calling frame
    that is a Trainer holding `callback` among its callbacks; None where none is (the
    event was called by other code)."""
    frame: FrameType | None = sys._getframe(2)  # the caller of the event method
    for _ in range(_EVENT_DEPTH):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        handler = getattr(owner, "callback_handler", None)
        if isinstance(owner, Trainer) and \
                any(c is callback for c in getattr(handler, "callbacks", ())):
            return owner
        frame = frame.f_back
    return None


def _reporters(args: Any) -> list[str]:
    """The loggers `report_to` names (none for "none")."""
    names = getattr(args, "report_to", None) or []
    names = [names] if isinstance(names, str) else list(names)
    return [str(n) for n in names if str(n) not in ("none", "")]


def _setting(name: str, value: Any) -> str:
    """`name=value` where `value` is a positive number (the loop clips), else empty."""
    return f"{name}={value:g}" if isinstance(value, int | float) and value > 0 else ""


class TorchscopeTrainerCallback(TrainerCallback):
    """Watch a Hugging Face `Trainer` run with `torchscope.monitor`; see the module docstring.

    Args:
        every: sample one optimizer step in `every`.
        out: folder of the run report (created when training starts); None writes nothing.
        select: modules to watch (see `select_modules`).
        depth: limit the selection depth.
        activations: sample activation statistics.
        memory: sample what the forward saves for backward.
        profile: profile this many steps with `torch.profiler` (0: none).
        history: samples kept spread over the run (see `torchscope.monitor`).
        recent: newest samples kept in full.
        name: the run's name in the report.

    Attributes:
        result: the `RunRecord` once training has ended (or `close()` was called).
        paths: (report.html, report.json) once written.
    """

    def __init__(self, every: int = 10, out: str | Path | None = "torchscope-run", *,
                 select: Selector = None, depth: int | None = None,
                 activations: bool = True, memory: bool = True, profile: int = 0,
                 history: int = 512, recent: int = 128, name: str | None = None) -> None:
        self._options: dict[str, Any] = {
            "every": every, "out": out, "select": select, "depth": depth,
            "activations": activations, "memory": memory, "profile": profile,
            "history": history, "recent": recent, "name": name}
        self._monitor: Monitor | None = None
        self._trainer: weakref.ReferenceType[Any] | None = None  # from `install`
        self._pending: Mapping[str, float] = {}
        self._ended = False  # the step in progress has ended (on_pre_optimizer_step ran)
        self.result: RunRecord | None = None
        self.paths: tuple[Path, Path] | None = None

    # ------------------------------------------------------------------ wiring
    def install(self, trainer: Any) -> TorchscopeTrainerCallback:
        """Put this callback first in `trainer`'s callbacks (added if missing), so that the
        reporting callbacks see its scalars in `logs`; and, while training runs, hand each
        step's loss from `trainer.compute_loss` to the monitor, so that a loss the Trainer
        computes outside the model (`compute_loss_func`, `label_smoothing_factor`, a
        `compute_loss` override) is checked too (`Monitor.check_loss`).

        Returns:
            The callback itself.
        """
        callbacks = trainer.callback_handler.callbacks
        if self in callbacks:
            callbacks.remove(self)
        callbacks.insert(0, self)
        self._trainer = weakref.ref(trainer)
        return self

    def _wrap_compute_loss(self) -> None:
        """Put a wrapper over the installed trainer's `compute_loss` (an attribute of the
        instance, taken off again by `_finish`) that hands its loss to the monitor."""
        trainer = None if self._trainer is None else self._trainer()
        if trainer is None or "compute_loss" in vars(trainer):
            return  # not installed, or already wrapped (by us or by the user)
        original = trainer.compute_loss

        def compute_loss(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            loss = result[0] if isinstance(result, tuple) else result
            mon = self._monitor
            # Evaluation calls it under no_grad: such a loss has no graph to read.
            if mon is not None and isinstance(loss, torch.Tensor) and loss.grad_fn is not None:
                mon.check_loss(loss)
            return result

        compute_loss.__torchscope__ = True  # type: ignore[attr-defined]
        trainer.compute_loss = compute_loss

    def _unwrap_compute_loss(self) -> None:
        trainer = None if self._trainer is None else self._trainer()
        if trainer is None:
            return
        wrapper = vars(trainer).get("compute_loss")
        if wrapper is not None and getattr(wrapper, "__torchscope__", False):
            del trainer.compute_loss  # the class's method again

    def __enter__(self) -> TorchscopeTrainerCallback:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._monitor is not None:
            failed = isinstance(exc[1], BaseException)
            self._finish(exc if failed else None)

    def close(self) -> None:
        """Remove every hook and write the report now (as if training ended here)."""
        self._finish(None)

    def _finish(self, exc: tuple[object, ...] | None) -> None:
        mon, self._monitor = self._monitor, None
        self._unwrap_compute_loss()
        if mon is None:
            return
        if exc is None:
            mon.close(failed=False)
        else:
            mon.__exit__(*exc)
        self.result, self.paths = mon.result, mon.paths

    # ------------------------------------------------------------------ events
    def _install_on_caller(self) -> None:
        """`install` on the Trainer whose event calls this one, unless installed on it (a
        callback given to a second Trainer moves to it)."""
        trainer = _calling_trainer(self)
        if trainer is not None and (self._trainer is None or self._trainer() is not trainer):
            self.install(trainer)

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Install on the Trainer made with this callback (`callbacks=[callback]`): first
        in its list, before `report_to`'s loggers (see the module docstring)."""
        self._install_on_caller()

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       optimizer: Any = None, **kwargs: Any) -> None:
        """Open the monitor on the model (hooks go on here)."""
        self._finish(None)  # a train() that raised without `with` left its monitor open
        self._install_on_caller()  # added after the Trainer was made (`add_callback`)
        reporters = _reporters(args)
        if (self._trainer is None or self._trainer() is None) and reporters:
            warnings.warn(
                f"torchscope: no Trainer was found calling this callback, so report_to's "
                f"loggers ({', '.join(reporters)}) write each log before it adds its "
                "scalars and get none of them; call callback.install(trainer) before "
                "trainer.train().", UserWarning, stacklevel=2)
        if model is None:
            raise TorchscopeError("the Trainer passed no model to on_train_begin.",
                                  fix="use a transformers Trainer (>= 4.40).")
        inner = inner_optimizer(optimizer)  # accelerate's wrapper
        # Sample the steps the Trainer logs when logging_steps == every: its global_step
        # after step i (0-based) is i + 1. A run resumed from a checkpoint starts at its
        # global_step, and the steps are numbered on from there.
        self._monitor = Monitor(
            model, inner, scaler=getattr(optimizer, "scaler", None), manual=True,
            start=self._options["every"] - 1,
            on_sample=self._on_sample, producer="torchscope.integrations.hf",
            parallel=_data_parallel(args, model),
            # The Trainer calls the model through its torch.compile wrapper, which no
            # callback is given: the whole model runs eagerly while the hooks are on.
            compiled_outside=bool(getattr(args, "torch_compile", False)),
            clip_setting=_setting("max_grad_norm", getattr(args, "max_grad_norm", None)),
            first_step=int(getattr(state, "global_step", 0) or 0), **self._options)
        self._monitor.__enter__()
        self._wrap_compute_loss()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """A new optimizer step begins."""
        self._ended = False

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any,
                              **kwargs: Any) -> None:
        """End the step (after clipping, before the update; the norms were read before
        clipping)."""
        self._end()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """End the step here when the Trainer has no `on_pre_optimizer_step` (< 4.44)."""
        self._end()

    def _end(self) -> None:
        if self._monitor is not None and not self._ended:
            self._ended = True
            self._monitor.end_step()

    def _on_sample(self, step: int, scalars: Any) -> None:
        self._pending = scalars  # a lazy mapping: built when a log takes it

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               **kwargs: Any) -> None:
        """Add the newest sample's scalars to this log: to `logs` (what later callbacks
        and reporters get) and to the entry `Trainer.log` already put in
        `state.log_history`."""
        if not self._pending or logs is None or "loss" not in logs:
            return  # evaluation logs, or nothing new since the last training log
        scalars, self._pending = self._pending, {}
        logs.update(scalars)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(scalars)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Remove every hook and write the run report."""
        self._finish(None)
