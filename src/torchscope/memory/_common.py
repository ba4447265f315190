"""Private helpers of the memory area: storage identity and the checkpoint-segment label."""

from __future__ import annotations

import sys
from contextvars import ContextVar
from typing import Any

import torch
from torch.nn import Parameter

from torchscope.hooks.tree import iter_tensors

StorageKey = tuple[str, int]

SEGMENT_LABEL: ContextVar[tuple[str, str, str] | None] = ContextVar(
    "torchscope_checkpoint_segment", default=None
)
"""Set by a checkpointed multi-block segment while `checkpoint()` saves its inputs:
(parent module name, first block name, first block type). The saved-tensor accounting
attributes those inputs to the first block rather than to the container."""


_DEVICE_NAMES: dict[torch.device, str] = {}


def device_name(device: torch.device) -> str:
    """`str(device)`, cached: formatting a device costs more than the rest of a storage key
    (a pack hook computes one per saved tensor)."""
    name = _DEVICE_NAMES.get(device)
    if name is None:
        name = _DEVICE_NAMES[device] = str(device)
    return name


def storage_of(t: torch.Tensor) -> tuple[torch.UntypedStorage, StorageKey] | None:
    """`t`'s storage and its `storage_key`; None for tensors without one.

    Metadata only: no device sync, so it may run inside hooks.
    """
    if type(t) is not torch.Tensor and type(t) is not Parameter:  # (plain ones are not)
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
    device = t.device
    name = _DEVICE_NAMES.get(device)
    return storage, (device_name(device) if name is None else name, ptr)


def storage_key(t: torch.Tensor) -> StorageKey | None:
    """Identity of `t`'s storage (device, data pointer); None for tensors without one.

    Metadata only: no device sync, so it may run inside hooks.
    """
    found = storage_of(t)
    return None if found is None else found[1]


def storage_nbytes(t: torch.Tensor) -> int:
    """Bytes of `t`'s whole storage (falls back to the view's own bytes)."""
    try:
        return int(t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError, TypeError):
        return t.numel() * t.element_size()


def storage_keys(obj: Any) -> dict[StorageKey, int]:
    """Storage key -> bytes of every tensor inside `obj` (a tensor, or a structure of them)."""
    out: dict[StorageKey, int] = {}
    for _, t in iter_tensors(obj, named=False):  # (paths unused)
        found = storage_of(t)
        if found is not None and found[1] not in out:
            out[found[1]] = int(found[0].nbytes())
    return out
