"""Losses for one-step gradient readings: pick the model's main output, make a seeded target."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
from torch.nn import functional

from torchscope.errors import ModelError, TorchscopeError
from torchscope.hooks.tree import iter_tensors

__all__ = ["LOSSES", "LossFn", "LossName", "compute_loss", "main_output", "synthesize_target"]

LossName = Literal["cross_entropy", "mse", "sum"]
LossFn = Callable[..., torch.Tensor]
LOSSES: tuple[str, ...] = ("cross_entropy", "mse", "sum")


def main_output(output: Any) -> torch.Tensor:
    """The tensor a loss is computed from: the output itself, `.logits` of a transformers
    output, else its first floating tensor.

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
        fix="pass loss_fn= that takes the model output and returns a scalar loss.",
    )


def synthesize_target(
    kind: str, output: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor | None:
    """A seeded random target that fits `output` for loss `kind`.

    cross_entropy: integer classes in [0, C) with C the last dimension and the shape of
    the other dimensions; mse: a standard normal tensor shaped like the output; sum: None.
    """
    g = generator if generator is not None else torch.Generator().manual_seed(0)
    if kind == "cross_entropy":
        if output.dim() == 0:
            raise ModelError("cross_entropy needs an output with a class dimension, got a "
                             "scalar.", fix="use --loss sum or --loss mse.")
        classes = output.shape[-1]
        # (..., C) logits -> (...) class indices, drawn on the CPU for reproducibility.
        return torch.randint(0, classes, tuple(output.shape[:-1]), generator=g).to(output.device)
    if kind == "mse":
        return torch.randn(tuple(output.shape), generator=g).to(output.device, output.dtype)
    return None


def compute_loss(
    output: Any, loss_fn: LossName | LossFn | None, target: Any = None
) -> torch.Tensor:
    """A scalar loss from a model output.

    Args:
        output: what the model returned.
        loss_fn: "cross_entropy" (last dimension is classes), "mse", "sum", a callable
            `loss_fn(output, target)` (or `loss_fn(output)` when `target` is None), or None:
            then a scalar output or a transformers `.loss` is used as is.
        target: the target; for the named losses None synthesises a seeded one.

    Raises:
        TorchscopeError: unknown loss name, or no loss can be derived.
        ModelError: the loss function raised.
    """
    if callable(loss_fn):
        try:
            loss = loss_fn(output) if target is None else loss_fn(output, target)
        except Exception as exc:
            raise ModelError(f"loss_fn raised {type(exc).__name__}: {exc}.",
                             fix="check that loss_fn accepts (output, target).") from exc
        return _check_scalar(loss)
    if loss_fn is None:
        hf_loss = output.get("loss") if isinstance(output, Mapping) else getattr(
            output, "loss", None)
        if isinstance(hf_loss, torch.Tensor):
            return _check_scalar(hf_loss)
        if isinstance(output, torch.Tensor) and output.dim() == 0:
            return output
        if target is None:
            raise TorchscopeError(
                "no loss given and the model output is not a scalar.",
                fix="pass loss_fn='cross_entropy' (or 'mse', 'sum', or a callable) and target=.",
            )
        loss_fn = "cross_entropy" if not torch.is_floating_point(target) else "mse"
    if loss_fn not in LOSSES:
        raise TorchscopeError(f"unknown loss {loss_fn!r}.",
                              fix=f"use one of {', '.join(LOSSES)} or a callable.")
    out = main_output(output)
    if target is None:
        target = synthesize_target(loss_fn, out)
    try:
        if loss_fn == "cross_entropy":
            # (..., C) logits against (...) class indices or (..., C) probabilities.
            flat_target = target.reshape(-1) if target.dim() == out.dim() - 1 else \
                target.reshape(-1, out.shape[-1])
            return functional.cross_entropy(out.reshape(-1, out.shape[-1]), flat_target)
        if loss_fn == "mse":
            return functional.mse_loss(out, target)
        return out.sum()
    except Exception as exc:
        raise ModelError(
            f"{loss_fn} loss failed on output {tuple(out.shape)}: {type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}.",
            fix="pass a target that fits the output, or another loss.",
        ) from exc


def _check_scalar(loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ModelError(f"the loss is {type(loss).__name__}"
                         f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}, "
                         "not a scalar tensor.", fix="return loss.mean() or loss.sum().")
    return loss.reshape(())
