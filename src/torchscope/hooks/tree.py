"""Flatten nested module inputs and outputs into `(path, tensor)` leaves.

Handles tensors, tuples, lists, dicts, dataclasses and HF `ModelOutput` (a dict subclass
whose `None` fields are dropped), and skips `None` and other non-tensor leaves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch


def iter_tensors(obj: Any, path: str = "", _depth: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(path, tensor)` for every tensor inside `obj`, depth first, in order.

    Args:
        obj: a tensor, or a tuple, list, mapping or dataclass holding tensors at any depth
            (32 levels at most, which also stops a cycle).
        path: prefix of every yielded path.

    Yields:
        `(path, tensor)`; paths read like the access: `""` for a bare tensor, `"[0]"`,
        `"['logits']"`, `".hidden"`.
    """
    if _depth > 32:  # a cycle or a pathological structure: stop rather than recurse forever
        return
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from iter_tensors(value, f"{path}[{key!r}]", _depth + 1)
    elif isinstance(obj, (tuple, list)):
        for i, value in enumerate(obj):
            yield from iter_tensors(value, f"{path}[{i}]", _depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, field.name), f"{path}.{field.name}", _depth + 1)
