"""The training step, defined once: model, inputs, loss, target, optimizer, AMP, accumulation.

Every capability that runs backward (gradient flow, memory, profiling, compile in training
mode), the doctor, the lab, the run monitor and the framework integrations run their steps
through `Step`. So "the step" means one computation everywhere: the bytes the memory section
counts, the time the profile section measures and the gradients the gradients section reads
belong to the same loss on the same targets.

The loss (`loss_fn=`) is one of:

- `"auto"` (the default), resolved on the model's output, in this order:
    1. a target was given: an integer target means cross-entropy (binary cross-entropy
       with logits for one output column, `(N, 1)`), a floating one with as many elements
       as the output means mean squared error, other floating targets are class
       probabilities for cross-entropy;
    2. the output carries its own `.loss` (a Hugging Face model called with labels);
    3. the output is a scalar tensor: it is the loss;
    4. the main output (the output itself, its `.logits`, else its first floating tensor)
       is logits, `(N, C)` or `(N, T, C)` with `C >= 2`: cross-entropy against seeded
       class targets;
    5. any other floating output, `(N, 1)` included: mean squared error against seeded
       standard-normal targets. Cross-entropy over one class is 0 whatever the output, so
       its gradient is zero and nothing would learn.
- `"cross_entropy"`: the classes (two or more) are the main output's last dimension for
  `(N, C)` and `(N, T, C)` logits, and dim 1 for `(N, C, H, W, ...)`, as torch's
  `cross_entropy` takes a segmentation's per-pixel logits (and for `(N, C, L)` against a
  given `(N, L)` target); targets are the given ones, else seeded integers in `[0, C)`.
- `"mse"`: mean squared error against the given target, else a seeded standard-normal one.
- `"sum"`: the sum of the main output (accumulated in float32); it saves nothing for
  backward, so memory accounting sees the model's own tensors only.
- a callable: `loss_fn(output, target)`, or `loss_fn(output)` when there is no target.

Seeded targets come from a private `torch.Generator` seeded with `Step.seed` (plus the
micro-batch index), never from the global generator, so they are the same in every
capability and leave the caller's random stream alone. Every result records what the loss
resolved to (`StepInfo.loss`, e.g. "auto → cross-entropy vs seeded targets").
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
from torch import nn
from torch.nn import functional
from torch.profiler import record_function

from torchscope.errors import ModelError, TorchscopeError, describe
from torchscope.hooks.tree import iter_tensors
from torchscope.models.target import ModelInputs, call_model

__all__ = [
    "AUTOCAST",
    "LOSSES",
    "LossFn",
    "LossName",
    "LossSpec",
    "ResolvedLoss",
    "Step",
    "StepInfo",
    "autocast_dtype",
    "inner_optimizer",
    "main_output",
    "own_loss",
    "preserved",
    "synchronize",
]

LossName = Literal["auto", "cross_entropy", "mse", "sum"]
LossFn = Callable[..., torch.Tensor]
LossSpec = LossName | LossFn
LOSSES: tuple[LossName, ...] = ("auto", "cross_entropy", "mse", "sum")

LossKind = Literal["model", "scalar", "cross_entropy", "binary_cross_entropy", "mse", "sum",
                   "callable"]
TargetKind = Literal["given", "seeded", "none"]
BeforeBackward = Callable[[int, Any, torch.Tensor], None]

_HALF = (torch.float16, torch.bfloat16)
# The losses a step computes itself from logits (`_compute`).
# The precisions a step's forward and loss can run in, by the names the CLI takes.
AUTOCAST: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}
_AMP_DTYPES = tuple(AUTOCAST.values())


@dataclass(frozen=True)
class ResolvedLoss:
    """What a step's loss turned out to be for one model output.

    Attributes:
        requested: the `loss_fn` as given: `auto`, a loss name, or the callable's name.
        kind: `model` (the output's own `.loss`), `scalar` (the output is the loss),
            `cross_entropy`, `binary_cross_entropy` (with logits: `auto` on one output
            column and integer labels), `mse`, `sum` or `callable`.
        target: `given`, `seeded` or `none`.
    """

    requested: str
    kind: LossKind
    target: TargetKind

    def describe(self) -> str:
        """E.g. `auto → cross-entropy vs seeded targets`, `mse vs given targets`."""
        what = {
            "model": "the model's own loss (output.loss)",
            "scalar": "the model's scalar output",
            "cross_entropy": "cross-entropy",
            "binary_cross_entropy": "binary cross-entropy with logits",
            "mse": "mean squared error",
            "sum": "sum of the output",
            "callable": f"{self.requested}(output{', target' if self.target != 'none' else ''})",
        }[self.kind]
        if self.kind in ("cross_entropy", "binary_cross_entropy", "mse"):
            what += f" vs {self.target} targets"
        if self.kind == "callable":
            return what
        if self.requested == "auto":
            return f"auto → {what}"
        return what


@dataclass(frozen=True)
class StepInfo:
    """The training step a result was measured on, as every report states it.

    Attributes:
        loss: what the loss resolved to (`ResolvedLoss.describe()`).
        loss_value: the loss of the measurement's first step on the unchanged model: the
            mean over its micro-batches, unscaled; None when no loss was computed.
        optimizer: the optimizer's class name, or None (no optimizer step).
        autocast: the autocast dtype (`torch.bfloat16`), or None.
        scaler: whether a GradScaler scaled the loss.
        accumulate: micro-batches per optimizer step.
    """

    loss: str
    loss_value: float | None
    optimizer: str | None = None
    autocast: str | None = None
    scaler: bool = False
    accumulate: int = 1

    def describe(self) -> str:
        """One line: `loss: auto → cross-entropy vs seeded targets = 2.303 · optimizer: SGD`."""
        text = f"loss: {self.loss}"
        if self.loss_value is not None:
            text += f" = {self.loss_value:.4g}"
        parts = [text, f"optimizer: {self.optimizer or 'none'}"]
        if self.autocast:
            parts.append(f"autocast: {self.autocast}" + (" + GradScaler" if self.scaler else ""))
        elif self.scaler:
            parts.append("GradScaler")
        if self.accumulate > 1:
            parts.append(f"accumulate: {self.accumulate} micro-batches")
        return " · ".join(parts)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so host timers and peaks cover it; no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu" and hasattr(torch, "accelerator"):
        torch.accelerator.synchronize()


def autocast_dtype(device_type: str) -> str | None:
    """The dtype `torch.autocast` casts to on `device_type` here and now (`"torch.bfloat16"`),
    or None outside an autocast region: what the user's own loop runs its forward in."""
    if not torch.is_autocast_enabled(device_type):
        return None
    return str(torch.get_autocast_dtype(device_type))


def inner_optimizer(optimizer: Any) -> Any:
    """The torch optimizer behind a framework's wrapper, whose step hooks fire: accelerate's
    `AcceleratedOptimizer` holds it as `.optimizer` and has no hooks of its own (registering
    one raised AttributeError); Lightning's `LightningOptimizer` shares its hooks already.
    None stays None.

    Raises:
        TorchscopeError: no torch optimizer is found (an object without step hooks).
    """
    if optimizer is None:
        return None
    given = optimizer
    for _ in range(4):  # wrappers of wrappers, boundedly
        if hasattr(optimizer, "_optimizer_step_pre_hooks"):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
        if optimizer is None:
            break
    raise TorchscopeError(
        f"optimizer= is a {type(given).__name__}, which is no torch.optim.Optimizer and "
        "wraps none: its steps cannot be seen.",
        fix="pass the torch.optim.Optimizer the loop steps, or manual=True and end_step() "
            "where each step's gradients are final.")


def _class_dim(out: torch.Tensor, target: Any = None) -> int:
    """The dimension of `out` that holds cross-entropy's classes: the last of `(N, C)`
    logits and of a sequence model's `(N, T, C)`; dim 1 of `(N, C, d1, d2, ...)`, as
    torch's `cross_entropy` takes them (a segmentation's per-pixel logits), and of
    `(N, C, L)` where the given target is `(N, L)` class indices and not `(N, T)`."""
    if out.dim() >= 4:
        return 1
    if out.dim() == 3 and isinstance(target, torch.Tensor) and \
            not target.is_floating_point() and \
            tuple(target.shape) == (out.shape[0], out.shape[2]) != tuple(out.shape[:2]):
        return 1
    return max(out.dim() - 1, 0)


def main_output(output: Any) -> torch.Tensor:
    """The tensor a loss is computed from: the output itself, `.logits` of a transformers
    output, else its first floating-point tensor.

    Raises:
        ModelError: the output holds no floating-point tensor.
    """
    if isinstance(output, torch.Tensor):
        return output
    logits = output.get("logits") if isinstance(output, Mapping) else getattr(
        output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    for _, t in iter_tensors(output):
        if t.is_floating_point():
            return t
    raise ModelError(
        f"the model returned {type(output).__name__} with no floating-point tensor to take a "
        "loss of.",
        fix="pass loss_fn= a callable that takes the model output and returns a scalar loss.",
    )


def own_loss(output: Any) -> torch.Tensor | None:
    """The loss a model returned with its output (`output.loss`, `output["loss"]`: a
    transformers model given labels), or None."""
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None


def _scalar(loss: Any, what: str) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ModelError(f"{what} is {shape}, not a scalar tensor.",
                         fix="return loss.mean() or loss.sum().")
    return loss.reshape(())


def _same_shape(out: torch.Tensor, target: Any) -> None:
    """Refuse a target that mean squared error would broadcast the output against: an
    `(N,)` target for an `(N, 1)` output compares every output with every target (the
    mistake `grads.loss_broadcast` tells in a loss the user wrote).

    Raises:
        ModelError: the broadcast shape is not the output's.
    """
    if not isinstance(target, torch.Tensor):
        return
    try:
        shape = tuple(torch.broadcast_shapes(out.shape, target.shape))
    except RuntimeError:
        return  # mse_loss raises, and says so
    if shape == tuple(out.shape):
        return
    fix = f"target.reshape{tuple(out.shape)}" if target.numel() == out.numel() else \
        "a target shaped like the output"
    raise ModelError(
        f"the target {tuple(target.shape)} and the output {tuple(out.shape)} broadcast to "
        f"{shape}: mean squared error would compare every output with every target.",
        fix=f"pass {fix}.")


def _callable_name(fn: Callable[..., Any]) -> str:
    return str(getattr(fn, "__name__", None) or type(fn).__name__)


@dataclass(frozen=True, eq=False, init=False)
class Step:
    """One training step: what it runs, and the one way it is run.

    Build it with keyword options, or let a capability build it from its `loss_fn=`,
    `target=` and `optimizer=` arguments (`Step.of`). A step object is reusable: running
    it changes the model (gradients, and parameters when it has an optimizer), never the
    step.

    Attributes:
        model: the model.
        inputs: its inputs (a tensor, tuple, dict or `ModelInputs`; stored as `ModelInputs`).
        loss_fn: `"auto"`, `"cross_entropy"`, `"mse"`, `"sum"` or a callable (see the module
            docstring for what each means).
        target: the target; None draws seeded targets for the named losses.
        optimizer: stepped by `run()`; None means no optimizer step.
        autocast: run forward and loss under `torch.autocast` with this dtype
            (`torch.bfloat16` or `torch.float16`); None runs in the model's own precision.
        scaler: a `torch.amp.GradScaler`: the loss is scaled before backward and the
            optimizer steps through it.
        accumulate: micro-batches per optimizer step. The inputs (and a given target) are
            split into this many equal chunks along dimension 0, and each micro-batch's loss
            is divided by it, so the accumulated gradient is the full batch's.
        seed: seeds the generator of synthesized targets.

    Example:
        >>> step = torchscope.Step(model, x, loss_fn="cross_entropy", target=y, optimizer=opt)
        >>> flow = torchscope.gradient_flow(step)
        >>> report = torchscope.analyze_memory(step)
        >>> flow.step.loss_value == report.step.loss_value
        True
    """

    model: nn.Module
    inputs: ModelInputs
    loss_fn: LossSpec = "auto"
    target: Any = None
    optimizer: torch.optim.Optimizer | None = None
    autocast: torch.dtype | None = None
    scaler: Any = None
    accumulate: int = 1
    seed: int = 0
    _cache: dict[Any, Any] = field(default_factory=dict, init=False, repr=False)

    def __init__(
        self,
        model: nn.Module,
        inputs: Any,
        *,
        loss_fn: LossSpec = "auto",
        target: Any = None,
        optimizer: torch.optim.Optimizer | None = None,
        autocast: torch.dtype | None = None,
        scaler: Any = None,
        accumulate: int = 1,
        seed: int = 0,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TorchscopeError(f"the model is a {type(model).__name__}, not an "
                                  "nn.Module.", fix="pass the model (an nn.Module) first.")
        if not callable(loss_fn) and loss_fn not in LOSSES:
            raise TorchscopeError(f"loss_fn={loss_fn!r} is not a known loss.",
                                  fix=f"use one of {', '.join(LOSSES)}, or a callable "
                                  "(output, target) -> scalar.")
        if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
            raise TorchscopeError(f"accumulate={accumulate!r} is not a number of "
                                  "micro-batches.", fix="pass accumulate=1 or more.")
        if autocast is not None and autocast not in _AMP_DTYPES:
            raise TorchscopeError(f"autocast={autocast!r} is not an autocast dtype.",
                                  fix="pass autocast=torch.bfloat16 or torch.float16, or None.")
        if scaler is not None and not callable(getattr(scaler, "scale", None)):
            raise TorchscopeError(f"scaler is a {type(scaler).__name__}, not a GradScaler.",
                                  fix="pass a torch.amp.GradScaler, or None.")
        values = {"model": model, "inputs": ModelInputs.of(inputs), "loss_fn": loss_fn,
                  "target": target, "optimizer": optimizer, "autocast": autocast,
                  "scaler": scaler, "accumulate": accumulate, "seed": seed, "_cache": {}}
        for name, value in values.items():
            object.__setattr__(self, name, value)

    # ------------------------------------------------------------------ construction
    @classmethod
    def of(
        cls,
        model: nn.Module | Step,
        inputs: Any = None,
        *,
        loss_fn: LossSpec = "auto",
        target: Any = None,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> Step:
        """The step a capability runs: `model` itself when it is a `Step`, else a new one.

        Every capability's one-shot function takes `(model, inputs, *, loss_fn=, target=,
        optimizer=)` or a ready `Step` (for AMP and accumulation) and builds it here.

        Raises:
            TorchscopeError: a `Step` was given together with inputs or step options, or a
                model without inputs.
        """
        if isinstance(model, Step):
            given = [name for name, is_set in (
                ("inputs", inputs is not None),
                ("loss_fn", callable(loss_fn) or loss_fn != "auto"),
                ("target", target is not None), ("optimizer", optimizer is not None)) if is_set]
            if given:
                raise TorchscopeError(
                    f"a Step was given together with {', '.join(given)}.",
                    fix="set them on the Step (Step(model, x, loss_fn=..., target=...)), or "
                    "pass the model and its inputs instead of a Step.")
            return model
        if inputs is None:
            raise TorchscopeError("a model was given without inputs.",
                                  fix="pass the inputs too: f(model, x, ...), or a Step.")
        return cls(model, inputs, loss_fn=loss_fn, target=target, optimizer=optimizer)

    def with_model(self, model: nn.Module) -> Step:
        """The same step on another model (a compiled or checkpointed copy, say)."""
        return replace(self, model=model)

    def with_autocast(self, name: str | None) -> Step:
        """This step in a mixed precision named `bf16` or `fp16` (see `AUTOCAST`), as a
        training loop in it runs: forward and loss under `torch.autocast`; float16 also with
        a `torch.amp.GradScaler` on the step's device, since its gradients underflow
        without one (bfloat16 has float32's range and gets none). None: this step as it is.

        Raises:
            TorchscopeError: an unknown name.
        """
        if name is None:
            return self
        dtype = AUTOCAST.get(name)
        if dtype is None:
            raise TorchscopeError(f"{name!r} is not a mixed precision a step runs in.",
                                  fix=f"choose {' or '.join(AUTOCAST)}.")
        scaler = torch.amp.GradScaler(self.device.type) if dtype is torch.float16 else None
        return replace(self, autocast=dtype, scaler=scaler)

    # ------------------------------------------------------------------ facts
    @property
    def device(self) -> torch.device:
        """The device of the first parameter (else of the first input tensor; else CPU)."""
        for p in self.model.parameters():
            return p.device
        for _, t in iter_tensors((self.inputs.args, dict(self.inputs.kwargs))):
            return t.device
        return torch.device("cpu")

    @property
    def resolved(self) -> ResolvedLoss | None:
        """What the loss resolved to on the last output it saw (None before any)."""
        found: ResolvedLoss | None = self._cache.get("resolved")
        return found

    def info(self, loss_value: float | torch.Tensor | None) -> StepInfo:
        """The `StepInfo` a result carries, with the loss value it measured.

        Args:
            loss_value: the loss of the first step (a 0-d tensor is read once, here).
        """
        value = None if loss_value is None else float(loss_value)
        resolved = self.resolved
        loss = resolved.describe() if resolved is not None else self._requested()
        return StepInfo(
            loss=loss, loss_value=value,
            optimizer=None if self.optimizer is None else type(self.optimizer).__name__,
            autocast=None if self.autocast is None else str(self.autocast),
            scaler=self.scaler is not None, accumulate=self.accumulate)

    def _requested(self) -> str:
        return _callable_name(self.loss_fn) if callable(self.loss_fn) else str(self.loss_fn)

    # ------------------------------------------------------------------ micro-batches
    def micro_batches(self) -> list[tuple[ModelInputs, Any]]:
        """`(inputs, target)` per micro-batch: the step's own for `accumulate=1`, else equal
        chunks along dimension 0 (tensors whose first dimension is not the batch are passed
        to every micro-batch whole).

        Raises:
            TorchscopeError: the batch does not split into `accumulate` equal chunks.
        """
        n = self.accumulate
        if n == 1:
            return [(self.inputs, self.target)]
        tensors = [t for _, t in iter_tensors((self.inputs.args, dict(self.inputs.kwargs)))]
        batch = next((t.shape[0] for t in tensors if t.dim() > 0), None)
        if batch is None or batch % n:
            raise TorchscopeError(
                f"accumulate={n} needs a batch that splits into {n} equal micro-batches; the "
                f"inputs are {self.inputs.describe()}.",
                fix=f"use a batch size divisible by {n}, or another accumulate=.")
        size = batch // n

        def chunk(v: Any, i: int) -> Any:
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == batch:
                return v[i * size:(i + 1) * size]  # (batch, ...) -> (batch / n, ...)
            return v

        out = []
        for i in range(n):
            args = tuple(chunk(a, i) for a in self.inputs.args)
            kwargs = {k: chunk(v, i) for k, v in self.inputs.kwargs.items()}
            out.append((ModelInputs(args, kwargs), chunk(self.target, i)))
        return out

    # ------------------------------------------------------------------ forward and loss
    def autocast_context(self) -> contextlib.AbstractContextManager[Any]:
        """`torch.autocast` for the step's device and dtype, or a no-op without AMP."""
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast)

    def forward(self, inputs: ModelInputs | None = None) -> Any:
        """`model(*inputs)` under the step's autocast (a failure becomes a `ModelError`)."""
        with self.autocast_context():
            return call_model(self.model, self.inputs if inputs is None else inputs)

    def resolve(self, output: Any, target: Any = None) -> ResolvedLoss:
        """What the loss is for this output (and target), without computing it.

        Raises:
            ModelError: `auto` finds nothing to take a loss of.
        """
        spec = self.loss_fn
        if callable(spec):
            return ResolvedLoss(_callable_name(spec), "callable",
                                "none" if target is None else "given")
        given: TargetKind = "none" if target is None else "given"
        if spec == "sum":
            return ResolvedLoss(spec, "sum", "none")
        if spec in ("cross_entropy", "mse"):
            return ResolvedLoss(spec, spec, "seeded" if target is None else "given")
        # auto
        if target is not None:
            out = main_output(output)
            if isinstance(target, torch.Tensor) and target.is_floating_point() and \
                    target.numel() == out.numel():
                # Shaped like the output, or laid out otherwise (`(N,)` for `(N, 1)`),
                # which `_compute` refuses rather than broadcast.
                return ResolvedLoss("auto", "mse", given)
            if out.dim() > 0 and out.shape[_class_dim(out, target)] == 1 and \
                    isinstance(target, torch.Tensor) and not target.is_floating_point() and \
                    target.numel() == out.numel():
                # One logit per sample (or per pixel) and integer labels: a binary
                # classifier (or segmentation).
                return ResolvedLoss("auto", "binary_cross_entropy", given)
            return ResolvedLoss("auto", "cross_entropy", given)
        if own_loss(output) is not None:
            return ResolvedLoss("auto", "model", "none")
        if isinstance(output, torch.Tensor) and output.dim() == 0:
            return ResolvedLoss("auto", "scalar", "none")
        out = main_output(output)
        if out.dim() in (2, 3) and out.shape[-1] >= 2:
            return ResolvedLoss("auto", "cross_entropy", "seeded")
        return ResolvedLoss("auto", "mse", "seeded")

    def loss(self, output: Any, target: Any = None, *, micro: int = 0) -> torch.Tensor:
        """The scalar loss of one micro-batch's output (not divided by `accumulate`).

        Args:
            output: what the model returned.
            target: this micro-batch's target (None: the step's own for that micro-batch,
                else a seeded one).
            micro: the micro-batch index (seeds its synthesized target).

        Raises:
            ModelError: the loss cannot be computed from this output, or `loss_fn` raised.
        """
        if target is None and self.target is not None:
            target = self.micro_batches()[micro][1]
        resolved = self.resolve(output, target)
        self._cache["resolved"] = resolved
        with self.autocast_context():
            value = self._compute(resolved, output, target, micro)
        return value

    def _compute(self, r: ResolvedLoss, output: Any, target: Any, micro: int) -> torch.Tensor:
        if r.kind == "callable":
            fn = self.loss_fn
            assert callable(fn)
            try:
                value = fn(output) if target is None else fn(output, target)
            except TorchscopeError:
                raise
            except Exception as exc:
                raise ModelError(f"loss_fn raised {type(exc).__name__}: {exc}.",
                                 fix="check that loss_fn accepts (output, target), or "
                                 "(output) without a target.") from exc
            return _scalar(value, "the value loss_fn returned")
        if r.kind == "model":
            own = own_loss(output)
            assert own is not None
            return _scalar(own, "the model's .loss")
        if r.kind == "scalar":
            return _scalar(output, "the model's output")
        out = main_output(output)
        if r.kind == "sum":
            return out.sum(dtype=torch.float32) if out.dtype in _HALF else out.sum()
        if r.kind == "cross_entropy" and out.dim() > 0 and \
                out.shape[_class_dim(out, target)] == 1:
            # log_softmax over one class is 0: the loss and its gradient would be zero.
            raise ModelError(
                f"cross-entropy over the output {tuple(out.shape)} has 1 class: it is 0 "
                "whatever the model outputs, and its gradient is zero.",
                fix="for one value per sample use loss_fn='mse', or a callable such as "
                "torch.nn.BCEWithLogitsLoss() for a binary label.")
        if target is None:
            target = self._seeded_target(r.kind, out, micro)
        if r.kind == "mse":
            _same_shape(out, target)
        try:
            if r.kind == "cross_entropy":
                if out.dim() == 0:
                    raise ValueError("cross-entropy needs a class dimension, got a scalar")
                if _class_dim(out, target) == 1 and out.dim() > 2:
                    # (N, C, d1, ...) logits against (N, d1, ...) class indices or
                    # (N, C, d1, ...) probabilities: torch's own layout.
                    return functional.cross_entropy(out, target)
                classes = out.shape[-1]
                # (..., C) logits -> (N, C) rows; (...) class indices -> (N,), or (..., C)
                # probabilities -> (N, C).
                flat_target = target.reshape(-1) if target.dim() == out.dim() - 1 else \
                    target.reshape(-1, classes)
                return functional.cross_entropy(out.reshape(-1, classes), flat_target)
            if r.kind == "binary_cross_entropy":
                return functional.binary_cross_entropy_with_logits(
                    out, target.reshape(out.shape).to(out.dtype))  # labels 0/1 as floats
            return functional.mse_loss(out, target)
        except Exception as exc:
            against = f" and target {tuple(target.shape)}" if isinstance(
                target, torch.Tensor) else ""
            raise ModelError(
                f"{r.kind} loss failed on output {tuple(out.shape)}{against}: {describe(exc)}.",
                fix="pass a target that fits the output, or another loss_fn.") from exc

    def _seeded_target(self, kind: str, out: torch.Tensor, micro: int) -> torch.Tensor:
        key = (kind, tuple(out.shape), out.device, out.dtype, micro)
        cached: torch.Tensor | None = self._cache.get(key)
        if cached is not None:
            return cached
        g = torch.Generator().manual_seed(self.seed + micro)
        if kind == "cross_entropy":
            if out.dim() == 0:
                raise ModelError("cross-entropy needs an output with a class dimension, got "
                                 "a scalar.", fix="use loss_fn='sum' or 'mse'.")
            # (..., C) logits -> (...) class indices, (N, C, d1, ...) -> (N, d1, ...);
            # drawn on the CPU for reproducibility.
            dim = _class_dim(out)
            made = torch.randint(0, out.shape[dim], tuple(out.shape[:dim] + out.shape[dim + 1:]),
                                 generator=g)
            made = made.to(out.device)
        else:
            dtype = out.dtype if out.is_floating_point() else torch.float32
            made = torch.randn(tuple(out.shape), generator=g).to(out.device, dtype)
        self._cache[key] = made
        return made

    # ------------------------------------------------------------------ running
    def zero_grad(self) -> None:
        """Set every gradient of the model (and of the optimizer's parameters) to None."""
        self.model.zero_grad(set_to_none=True)
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    def forward_backward(
        self, *, before_backward: BeforeBackward | None = None, backward: bool = True
    ) -> torch.Tensor:
        """Forward, loss and backward of every micro-batch; no optimizer step.

        The parts are labelled `forward` (model and loss) and `backward` with
        `torch.profiler.record_function`, so a profiler sees the split. Gradients accumulate
        into `.grad` as a plain loop's would (nothing is zeroed here).

        Args:
            before_backward: called as `before_backward(micro, output, loss)` between a
                micro-batch's loss and its backward (what autograd saved is alive then).
            backward: False stops after the loss (forward-only accounting).

        Returns:
            The detached mean loss over the micro-batches (0-d, on the loss's device,
            unscaled and not divided by `accumulate`).

        Raises:
            ModelError: the model, the loss or backward raised.
            TorchscopeError: the loss does not require grad (nothing to differentiate).
        """
        total: torch.Tensor | None = None
        n = self.accumulate
        for micro, (inputs, target) in enumerate(self.micro_batches()):
            with torch.enable_grad():
                with record_function("forward"):
                    output = self.forward(inputs)
                    loss = self.loss(output, target, micro=micro)
                if before_backward is not None:
                    before_backward(micro, output, loss)
                if backward:
                    self._backward(loss)
            value = loss.detach()
            total = value if total is None else total + value
            del output, loss
        assert total is not None
        return total / n if n > 1 else total

    def _backward(self, loss: torch.Tensor) -> None:
        if not loss.requires_grad:
            raise TorchscopeError(
                "the loss does not require grad: no parameter or input it depends on "
                "requires grad.",
                fix="unfreeze some parameters (requires_grad=True), run outside "
                "torch.no_grad(), and check that the output is not detached.")
        with record_function("backward"):
            scaled = loss / self.accumulate if self.accumulate > 1 else loss
            if self.scaler is not None:
                scaled = self.scaler.scale(scaled)
            try:
                scaled.backward()
            except TorchscopeError:
                raise
            except RuntimeError as exc:
                raise ModelError(f"backward raised {describe(exc)}.",
                                 fix="rerun with --debug (or without torchscope) to see the "
                                 "traceback.") from exc

    def optimizer_step(self) -> bool:
        """Step the optimizer (through the scaler when there is one), labelled `optimizer`.

        Returns:
            False when the step has no optimizer.
        """
        if self.optimizer is None:
            return False
        with record_function("optimizer"):
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
        return True

    def run(self, *, before_backward: BeforeBackward | None = None) -> torch.Tensor:
        """One whole training step, as a training loop writes it: `optimizer.zero_grad()`
        (the model's `zero_grad()` without an optimizer), forward/backward every
        micro-batch, then the optimizer step. The gradients of this step stay in `.grad`.

        Returns:
            The detached mean loss (see `forward_backward`).
        """
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.model.zero_grad(set_to_none=True)
        loss = self.forward_backward(before_backward=before_backward)
        self.optimizer_step()
        return loss

    # ------------------------------------------------------------------ state
    def input_leaves(self) -> list[tuple[str, torch.Tensor]]:
        """`(input[path], tensor)` of every leaf input tensor that requires grad, once each."""
        named = [*iter_tensors(self.inputs.args), *iter_tensors(dict(self.inputs.kwargs))]
        out: list[tuple[str, torch.Tensor]] = []
        seen: set[int] = set()
        for path, t in named:
            if t.requires_grad and t.is_leaf and id(t) not in seen:
                seen.add(id(t))
                out.append((f"input{path}", t))
        return out

    def preserved(self, *, clear_grads: bool = False) -> contextlib.AbstractContextManager[None]:
        """`preserved()` of the model, the optimizer, the scaler and the `.grad` of every
        input that requires grad: run steps inside, and nothing has changed afterwards."""
        return preserved(self.model, optimizer=self.optimizer, scaler=self.scaler,
                         tensors=[t for _, t in self.input_leaves()], clear_grads=clear_grads)


def _reshard_fsdp(model: nn.Module) -> None:
    """Put FSDP2's sharded parameters back in every `fully_shard` module of `model`.

    After a forward without backward (under `no_grad`, say), FSDP2 leaves a root module's
    parameters unsharded: the module then holds the gathered tensors, and FSDP expects to
    find them there at the next forward. Restoring the sharded parameters into the slots
    behind FSDP's back would leave it skipping the all-gather with shards in place, so FSDP
    reshards first (`FSDPModule.reshard()`, a no-op when already sharded), as it does after
    a backward.
    """
    if "torch.distributed.fsdp" not in sys.modules:  # no module can be sharded
        return
    fsdp_module = getattr(sys.modules["torch.distributed.fsdp"], "FSDPModule", None)
    if fsdp_module is None:
        return
    for m in model.modules():
        if isinstance(m, fsdp_module):
            m.reshard()


def _cuda_devices(model: nn.Module) -> list[int]:
    if not torch.cuda.is_available():
        return []
    found = {t.device.index for t in (*model.parameters(), *model.buffers())
             if t.device.type == "cuda"}
    return sorted(i for i in found if i is not None)


@contextlib.contextmanager
def preserved(
    model: nn.Module,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: Any = None,
    tensors: Iterable[torch.Tensor] = (),
    clear_grads: bool = False,
    rng: bool = True,
) -> Iterator[None]:
    """Give the model back exactly as it was, whatever runs inside.

    Restored on exit, also when the block raises: every parameter and buffer (persistent
    or not) as the same tensor object in the same module slot, with its values (a tensor
    whose shape changed is given its old storage back); `.grad` (the same tensor objects,
    with their values: backward accumulates into an existing `.grad` in place);
    `requires_grad`; every module's `training` flag; the optimizer's and the scaler's
    state; the CPU and CUDA random generators. This costs one copy of the parameters,
    buffers, gradients and optimizer state while the block runs.

    Args:
        model: the model.
        optimizer: an optimizer the block may step.
        scaler: a GradScaler the block may update.
        tensors: other leaf tensors whose `.grad` is kept too (inputs that require grad).
        clear_grads: start the block with every `.grad` (the model's and of `tensors`) set
            to None.
        rng: fork the random generators (False leaves them to the caller).
    """
    slots: list[tuple[dict[str, Any], str, torch.Tensor | None, torch.Tensor | None]] = []
    grads: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = []
    seen: set[int] = set()
    with torch.no_grad():
        for module in model.modules():
            tables: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
            for table in tables:
                for name, t in table.items():
                    slots.append((table, name, t, None if t is None else t.detach().clone()))
                    if isinstance(t, nn.Parameter) and id(t) not in seen:
                        seen.add(id(t))
                        g = t.grad
                        grads.append((t, g, None if g is None else g.detach().clone()))
        for t in tensors:
            if id(t) not in seen:
                seen.add(id(t))
                g = t.grad
                grads.append((t, g, None if g is None else g.detach().clone()))
    requires = [(p, p.requires_grad) for p in model.parameters()]
    flags = [(m, m.training) for m in model.modules()]
    opt_state = None if optimizer is None else copy.deepcopy(optimizer.state_dict())
    scaler_state = None if scaler is None else copy.deepcopy(scaler.state_dict())
    fork = torch.random.fork_rng(devices=_cuda_devices(model)) if rng else \
        contextlib.nullcontext()
    with fork:
        try:
            if clear_grads:
                for p, _, _ in grads:
                    p.grad = None
            yield
        finally:
            _reshard_fsdp(model)
            with torch.no_grad():
                for table, name, t, values in slots:
                    table[name] = t
                    if t is None or values is None:
                        continue
                    if t.shape != values.shape:
                        t.data = values
                    else:
                        t.copy_(values)
                for p, g, values in grads:
                    if g is not None and values is not None:
                        if g.shape == values.shape:
                            g.copy_(values)
                        else:
                            g.data = values
                    p.grad = g
            for p, r in requires:
                p.requires_grad_(r)
            for m, f in flags:
                m.training = f
            if optimizer is not None and opt_state is not None:
                optimizer.load_state_dict(opt_state)
            if scaler is not None and scaler_state is not None:
                scaler.load_state_dict(scaler_state)
