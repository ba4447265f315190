"""Write gradient-flow norms to TensorBoard through `torch.utils.tensorboard.SummaryWriter`.

Scalars, per sampled step:
    `{prefix}/total_norm`
    `{prefix}/grad_output/{layer}`   norm of the gradient arriving at the layer
    `{prefix}/params/{layer}`        norm of the layer's own parameter gradients

Example:
    >>> from torch.utils.tensorboard import SummaryWriter
    >>> writer = SummaryWriter("runs/exp1")
    >>> with torchscope.watch_gradients(model, every=10, optimizer=opt,
    ...                                 on_sample=grad_logger(writer)):
    ...     train()
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from torchscope.errors import TorchscopeError
from torchscope.grads.records import GradFlow, GradHistory

__all__ = ["grad_logger", "log_grad_history", "log_gradient_flow", "open_writer"]


def open_writer(log_dir: str | Path, **kwargs: Any) -> Any:
    """A `torch.utils.tensorboard.SummaryWriter` on `log_dir` (kwargs passed through).

    Raises:
        TorchscopeError: the `tensorboard` package is not installed.
    """
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:  # torch raises ImportError when tensorboard is missing
        raise TorchscopeError(
            f"TensorBoard logging needs the tensorboard package ({exc}).",
            fix="pip install tensorboard.",
        ) from exc
    return SummaryWriter(log_dir=str(log_dir), **kwargs)


def _write(writer: Any, prefix: str, step: int, total: float,
           outputs: Mapping[str, float | None], params: Mapping[str, float | None]) -> int:
    """Add one step's scalars, skipping missing and non-finite norms; returns the count."""
    scalars: list[tuple[str, float | None]] = [(f"{prefix}/total_norm", total)]
    scalars += [(f"{prefix}/grad_output/{k or '<root>'}", v) for k, v in outputs.items()]
    scalars += [(f"{prefix}/params/{k or '<root>'}", v) for k, v in params.items()]
    n = 0
    for tag, value in scalars:
        if value is not None and math.isfinite(value):
            writer.add_scalar(tag, value, global_step=step)
            n += 1
    return n


def log_gradient_flow(writer: Any, flow: GradFlow, *, step: int | None = None,
                      prefix: str = "grads") -> int:
    """Add one step's per-layer norms as scalars; returns how many scalars were written.

    Args:
        writer: a `torch.utils.tensorboard.SummaryWriter`.
        flow: the step's records.
        step: the global step written (default `flow.index`).
        prefix: tag prefix.

    Non-finite and missing norms are skipped (TensorBoard cannot plot them on a log axis).
    """
    return _write(writer, prefix, flow.index if step is None else step, flow.total_norm,
                  flow.output_norms(), flow.param_norms())


def log_grad_history(writer: Any, history: GradHistory, *, prefix: str = "grads") -> int:
    """Write a whole `GradHistory` (e.g. after training); returns the scalar count.

    Args:
        writer: a `torch.utils.tensorboard.SummaryWriter`.
        history: the sampled steps; each is written at its own step number.
        prefix: tag prefix.
    """
    return sum(
        _write(writer, prefix, step, history.total_norms[i],
               dict(zip(history.layers, history.output_norms[i], strict=True)),
               dict(zip(history.layers, history.param_norms[i], strict=True)))
        for i, step in enumerate(history.steps))


def grad_logger(writer: Any, *, prefix: str = "grads") -> Callable[[GradFlow], None]:
    """An `on_sample` callback for `watch_gradients` that logs each sample to `writer`."""

    def log(flow: GradFlow) -> None:
        log_gradient_flow(writer, flow, prefix=prefix)

    return log
