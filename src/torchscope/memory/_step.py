"""Private helpers shared by the memory area: the loss, storage identity, state that a
measurement must leave exactly as it found it (grads, buffers, RNG), and device sync."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn

from torchscope.errors import ModelError
from torchscope.hooks.tree import iter_tensors
from torchscope.models.target import ModelInputs, call_model

LossFn = Callable[[Any], torch.Tensor]
StorageKey = tuple[str, int]


def default_loss(output: Any) -> torch.Tensor:
    """The scalar a step backpropagates when no `loss_fn` is given.

    A `loss` entry of a dict-like output (Hugging Face models called with labels) when there
    is one; otherwise the sum of every floating-point output that requires grad. `sum` and
    `float` save nothing for backward, so this loss adds no saved tensors of its own.

    Raises:
        ModelError: the output holds no floating-point tensor that requires grad.
    """
    if isinstance(output, Mapping):
        loss = output.get("loss")
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            return loss
    leaves = [t for _, t in iter_tensors(output) if t.is_floating_point() and t.requires_grad]
    if not leaves:
        raise ModelError(
            "the model's output holds no floating-point tensor that requires grad, so there "
            "is no backward to measure.",
            fix="check that parameters require grad and grad mode is on, or pass loss_fn=.",
        )
    total = leaves[0].float().sum()
    for t in leaves[1:]:
        total = total + t.float().sum()
    return total


def storage_key(t: torch.Tensor) -> StorageKey | None:
    """Identity of `t`'s storage (device, data pointer); None for tensors without one."""
    fake = sys.modules.get("torch._subclasses.fake_tensor")
    if fake is not None and isinstance(t, fake.FakeTensor):
        return None  # torch.compile's shape-only tensors: no memory behind them
    try:
        storage = t.untyped_storage()
        # Functional tensors (also left alive by torch.compile) refuse data_ptr().
        ptr = storage.data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    if ptr == 0 and storage.nbytes() > 0:
        return None  # a meta or fake tensor: no memory behind it
    return (str(t.device), ptr)


def storage_nbytes(t: torch.Tensor) -> int:
    """Bytes of `t`'s whole storage (falls back to the view's own bytes)."""
    try:
        return int(t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError, TypeError):
        return t.numel() * t.element_size()


def state_keys(model: nn.Module) -> tuple[dict[StorageKey, str], dict[StorageKey, str]]:
    """Storage keys of the model's parameters and of its buffers, with their names."""
    params: dict[StorageKey, str] = {}
    for name, p in model.named_parameters():
        key = storage_key(p)
        if key is not None:
            params.setdefault(key, name)
    buffers: dict[StorageKey, str] = {}
    for name, b in model.named_buffers():
        key = storage_key(b)
        if key is not None and key not in params:
            buffers.setdefault(key, name)
    return params, buffers


def model_device(model: nn.Module, inputs: ModelInputs | None = None) -> torch.device:
    """The device of the first parameter (or input tensor); CPU when there is none."""
    for p in model.parameters():
        return p.device
    if inputs is not None:
        for _, t in iter_tensors((inputs.args, dict(inputs.kwargs))):
            return t.device
    return torch.device("cpu")


def sync(device: torch.device) -> None:
    """Wait for queued kernels, so that host timers and peaks cover them."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def preserved_state(model: nn.Module) -> Iterator[None]:
    """Run a measurement that leaves the model and the global RNG as it found them.

    Inside, every parameter's `.grad` starts as None; on exit the user's gradients (the very
    same tensor objects) are put back, buffers (BatchNorm running stats, counters) are
    restored in place, and the CPU and CUDA RNG streams continue as if nothing had run.
    """
    params = list(model.parameters())
    grads = [p.grad for p in params]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = _cuda_devices(model)
    with torch.random.fork_rng(devices=devices):
        try:
            for p in params:
                p.grad = None
            yield
        finally:
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)


def restore_buffers(model: nn.Module, saved: list[torch.Tensor]) -> None:
    """Copy `saved` (from `snapshot_buffers`) back into the model's buffers, in place."""
    with torch.no_grad():
        for b, s in zip(model.buffers(), saved, strict=True):
            b.copy_(s)


def snapshot_buffers(model: nn.Module) -> list[torch.Tensor]:
    """Copies of every buffer, in `model.buffers()` order."""
    return [b.detach().clone() for b in model.buffers()]


def _cuda_devices(model: nn.Module) -> list[int]:
    if not torch.cuda.is_available():
        return []
    found = {p.device.index for p in model.parameters() if p.device.type == "cuda"}
    return sorted(i for i in found if i is not None)


def seed_all(seed: int) -> None:
    """Seed CPU and every CUDA device (the same seed a comparison run will use)."""
    torch.manual_seed(seed)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)


def forward_backward(
    model: nn.Module, inputs: ModelInputs, loss_fn: LossFn | None = None
) -> torch.Tensor:
    """One forward + loss + backward under grad mode; returns the detached loss."""
    with torch.enable_grad():
        out = call_model(model, inputs)
        loss = (loss_fn or default_loss)(out)
        loss.backward()
    return loss.detach()


def timed_steps(
    model: nn.Module, inputs: ModelInputs, loss_fn: LossFn | None, repeats: int
) -> float:
    """Best forward + backward time in milliseconds over `repeats` (after one warm-up)."""
    device = model_device(model, inputs)
    best = float("inf")
    with preserved_state(model):
        for i in range(repeats + 1):
            for p in model.parameters():
                p.grad = None
            sync(device)
            t0 = time.perf_counter()
            forward_backward(model, inputs, loss_fn)
            sync(device)
            if i > 0:  # the first run pays one-time costs (allocator, lazy init)
                best = min(best, (time.perf_counter() - t0) * 1e3)
    return best


SEGMENT_LABEL: ContextVar[tuple[str, str, str] | None] = ContextVar(
    "torchscope_checkpoint_segment", default=None
)
"""Set by a checkpointed multi-block segment while `checkpoint()` saves its inputs:
(parent module name, first block name, first block type). The saved-tensor accounting
attributes those inputs to the first block rather than to the container."""
