"""`TorchscopeCallback`: `torchscope.monitor` inside a PyTorch Lightning `Trainer` (>= 2.2).

    from torchscope.integrations.lightning import TorchscopeCallback

    trainer = pl.Trainer(max_steps=1000, callbacks=[TorchscopeCallback(every=10, out="run")])
    trainer.fit(model, loader)          # run/report.html, run/report.json at the end of fit

Lightning's hooks give the monitor its steps: a step ends at `on_before_optimizer_step` of the
optimizer that updates the watched module (with several, as in a GAN, the one that holds most
of its parameters; the others' steps are not its steps), which
Lightning calls once the gradients of every accumulated micro-batch are in `.grad`, unscaled
under 16-bit AMP and before gradient clipping, whether the optimizer steps with a closure
(automatic optimization) or not. The per-layer norms a sample reports are those gradients
(read on the device by post-accumulate-grad hooks during backward, the GradScaler's scale
divided out). Under the DDP strategy they are the synchronised gradients, the same on
every rank (each rank's own, before the all-reduce, are kept too, as for a plain loop).
The sampled steps are those after which the count of optimizer steps is a multiple of
`every` (0-based steps `every - 1`, `2 * every - 1`, ...), as for Lightning's own logging,
which logs after steps `log_every_n_steps - 1`, `2 * log_every_n_steps - 1`, ... Each
sample's scalars go straight to every configured logger (`trainer.loggers`: TensorBoard,
CSV, W&B, ...) at the step number Lightning gives the step it was taken at, so that none
waits for Lightning's next logging step (a later step's row holding an earlier sample, as
through `log_dict`) and none is dropped (`every=10` under the default
`log_every_n_steps=50`).
The report is written at `on_fit_end`, or at
`on_exception` as a partial report that says where the run stopped. Every hook is removed
then. Training is bitwise the same as without the callback.

This module imports Lightning (`pytorch_lightning`, else `lightning.pytorch`); `import
torchscope` never does. Install it with `pip install torchscope[lightning]`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchscope.errors import TorchscopeError
from torchscope.hooks.parallel import parallel_wrapper
from torchscope.hooks.select import Selector
from torchscope.monitoring import Monitor, RunRecord

try:
    import pytorch_lightning as pl
except ImportError:  # the unified `lightning` package
    try:
        import lightning.pytorch as pl  # type: ignore[no-redef]
    except ImportError as exc:
        raise ImportError(
            "torchscope.integrations.lightning needs PyTorch Lightning: pip install "
            "torchscope[lightning]") from exc

__all__ = ["TorchscopeCallback"]


def _stepping(optimizers: list[Any], module: nn.Module) -> Any:
    """The optimizer whose steps are the watched module's steps: the one that updates most
    of its parameters (a GAN's discriminator's own, not the generator's, which comes
    first); the first one when none does."""
    if not optimizers:
        return None
    own = {id(p) for p in module.parameters()}
    counts = [sum(id(p) in own for group in opt.param_groups for p in group["params"])
              for opt in optimizers]
    best = max(range(len(optimizers)), key=lambda i: (counts[i], -i))
    return optimizers[best]


def _clip_setting(trainer: Any) -> str:
    """`gradient_clip_val=V` (`, by value` for that algorithm) where the Trainer clips the
    gradients it steps with, else empty (`RunRecord.clip_setting`)."""
    value = getattr(trainer, "gradient_clip_val", None)
    if not (isinstance(value, int | float) and value > 0):
        return ""
    by_value = str(getattr(trainer, "gradient_clip_algorithm", "") or "").endswith("value")
    return f"gradient_clip_val={value:g}" + (", by value" if by_value else "")


def _log_now(trainer: Any, scalars: Mapping[str, float]) -> None:
    """Give `scalars` to each of the Trainer's loggers now, at the step number Lightning
    gives the step in progress. Not through `log_dict`: a value given to it waits in
    Lightning's results for the next step it logs (every `log_every_n_steps`), so a later
    row held it, samples between two logging steps were lost, and one logged on a logging
    step was logged again at the next. Nothing where the Trainer logs no steps
    (`log_every_n_steps=0`) or has no logger (`logger=False`)."""
    if not trainer.loggers or not getattr(trainer, "log_every_n_steps", 1):
        return
    # Lightning's step number for the loggers: batches that stepped an optimizer in this
    # fit (restored on resume), once per batch whatever the number of optimizers.
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    step = getattr(loop, "_batches_that_stepped", None)
    if not isinstance(step, int):
        step = int(trainer.global_step)
    values = dict(scalars)  # the monitor builds its scalars when they are read: only here
    if not values:
        return
    for logger in trainer.loggers:
        logger.log_metrics(values, step=step)


class TorchscopeCallback(pl.Callback):
    """Watch a Lightning fit with `torchscope.monitor`; see the module docstring.

    Args:
        every: sample one optimizer step in `every`.
        out: folder of the run report (created when fit starts); None writes nothing.
        module: the submodule of the LightningModule the training step calls (e.g.
            `"model"`), when it does not call the LightningModule itself (`self(x)`);
            default: the LightningModule if it defines `forward`, else its only child.
        select: modules to watch, inside `module` (see `select_modules`).
        depth: limit the selection depth.
        activations: sample activation statistics.
        memory: sample what the forward saves for backward.
        profile: profile this many steps with `torch.profiler` (0: none).
        history: samples kept spread over the run (see `torchscope.monitor`).
        recent: newest samples kept in full.
        name: the run's name in the report.
        log: give each sample's scalars to the Trainer's loggers.

    Attributes:
        result: the `RunRecord` once fit has ended (or raised).
        paths: (report.html, report.json) once written.
    """

    def __init__(self, every: int = 10, out: str | Path | None = "torchscope-run", *,
                 module: str | None = None, select: Selector = None, depth: int | None = None,
                 activations: bool = True, memory: bool = True, profile: int = 0,
                 history: int = 512, recent: int = 128, name: str | None = None,
                 log: bool = True) -> None:
        super().__init__()
        self._options: dict[str, Any] = {
            "every": every, "out": out, "select": select, "depth": depth,
            "activations": activations, "memory": memory, "profile": profile,
            "history": history, "recent": recent, "name": name}
        self._module_name = module
        self._log = log
        self._monitor: Monitor | None = None
        self._optimizer: Any = None
        self._pending: Mapping[str, float] | None = None
        self.result: RunRecord | None = None
        self.paths: tuple[Path, Path] | None = None

    # ------------------------------------------------------------------ fit
    def _watched(self, pl_module: nn.Module) -> nn.Module:
        if self._module_name is not None:
            try:
                return pl_module.get_submodule(self._module_name)
            except AttributeError as exc:
                raise TorchscopeError(
                    f"module={self._module_name!r} is not a submodule of "
                    f"{type(pl_module).__name__}.",
                    fix="pass the attribute path of the model your training_step calls, "
                        "e.g. module='model'.") from exc
        if type(pl_module).forward is not pl.LightningModule.forward:
            return pl_module
        children = list(pl_module.children())
        if len(children) == 1:
            return children[0]
        raise TorchscopeError(
            f"{type(pl_module).__name__} defines no forward and has {len(children)} "
            "submodules: which one does training_step call?",
            fix="pass TorchscopeCallback(module='<name of the model attribute>').")

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """Open the monitor on the model (hooks go on here)."""
        self._close(failed=True)  # a fit that raised before this one left nothing open
        watched = self._watched(pl_module)
        self._optimizer = _stepping(list(trainer.optimizers), watched)
        self._monitor = Monitor(
            watched, self._optimizer,
            scaler=getattr(trainer.precision_plugin, "scaler", None), manual=True,
            # The steps after which the step count is a multiple of `every` (0-based
            # `every - 1`, ...), as Lightning's logging steps fall.
            start=self._options["every"] - 1,
            on_sample=self._on_sample, producer="torchscope.integrations.lightning",
            parallel=parallel_wrapper(trainer.strategy.model),
            clip_setting=_clip_setting(trainer), **self._options)
        self._monitor.__enter__()

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Number the steps on from the global step a resumed fit restored (after
        `on_fit_start`), as Lightning's logs do."""
        if self._monitor is not None:
            self._monitor.number_from(int(trainer.global_step or 0))

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        """Hand the monitor the loss training_step returned, before its backward: its graph
        is read once (`Monitor.check_loss`)."""
        if self._monitor is not None and isinstance(loss, torch.Tensor):
            self._monitor.check_loss(loss)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        """End the step: the gradients are final, unscaled and not yet clipped."""
        mon = self._monitor
        if mon is None or getattr(optimizer, "_optimizer", optimizer) is not self._optimizer:
            return  # not fitting, or another optimizer (a GAN's other player's)
        mon.end_step()
        scalars, self._pending = self._pending, None
        if scalars is not None and self._log:
            _log_now(trainer, scalars)

    def _on_sample(self, _step: int, scalars: Mapping[str, float]) -> None:
        self._pending = scalars

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        """Remove every hook and write the run report."""
        self._close(failed=False)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """Remove every hook and write a partial report that says where the run stopped."""
        mon = self._monitor
        if mon is not None:
            self._monitor = None
            mon.__exit__(type(exception), exception, exception.__traceback__)
            self.result, self.paths = mon.result, mon.paths

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Make sure nothing stays hooked, whatever ended the stage."""
        self._close(failed=True)

    def _close(self, *, failed: bool) -> None:
        mon = self._monitor
        if mon is None:
            return
        self._monitor = None
        mon.close(failed=failed)
        self.result, self.paths = mon.result, mon.paths
