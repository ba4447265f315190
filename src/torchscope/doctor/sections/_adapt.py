"""Small helpers the adapter sections share: losses by name, numbers from records."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional

__all__ = ["named_loss", "num", "trainable_sgd"]


def num(value: Any) -> float | None:
    """A finite float, or None for None/NaN/Inf/non-numbers."""
    if value is None or isinstance(value, bool):
        return None
    try:
        f = float(value)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _main_tensor(output: Any) -> torch.Tensor:
    """The tensor a loss should read: the output itself, `.logits`, or the first element."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"cannot find a tensor in the model's output ({type(output).__name__})")


def named_loss(name: str, seed: int = 0) -> Callable[..., torch.Tensor] | None:
    """A `loss(output, targets=None)` callable for `cross_entropy`, `mse` or `sum`.

    `auto` gives None: each capability then uses its own default (a scalar output, a
    transformers `.loss`, or its documented fallback). Cross-entropy reads the last dimension
    as classes and draws seeded targets; mse compares with zeros.
    """
    if name == "auto":
        return None

    def loss(output: Any, targets: Any = None) -> torch.Tensor:
        out = _main_tensor(output).float()
        if name == "sum":
            return out.sum()
        if name == "mse":
            return functional.mse_loss(out, torch.zeros_like(out))
        logits = out.reshape(-1, out.shape[-1])  # (N, classes)
        if targets is None:
            g = torch.Generator().manual_seed(seed)
            targets = torch.randint(0, out.shape[-1], (logits.shape[0],), generator=g)
        return functional.cross_entropy(logits, targets.reshape(-1).to(out.device))

    return loss


def trainable_sgd(model: torch.nn.Module) -> torch.optim.Optimizer | None:
    """Plain SGD over the trainable parameters (None when there are none)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.SGD(params, lr=1e-3) if params else None
