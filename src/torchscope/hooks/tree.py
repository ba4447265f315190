"""Flatten nested module inputs and outputs into `(path, tensor)` leaves.

Handles tensors, tuples, lists, dicts, dataclasses and HF `ModelOutput` (a dict subclass
whose `None` fields are dropped), and skips `None` and other non-tensor leaves. On request
it also enters other objects' attributes, where state such as a Hugging Face `Cache` keeps
its tensors.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

# What `objects=True` does not enter: modules (their parameters are no output), and
# classes, Python modules and functions (their attributes are code, not state).
_NOT_ENTERED = (nn.Module, type, types.ModuleType, types.FunctionType, types.MethodType)


def iter_tensors(obj: Any, path: str = "", _depth: int = 0, *,
                 objects: bool = False, named: bool = True
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(path, tensor)` for every tensor inside `obj`, depth first, in order.

    Args:
        obj: a tensor, or a tuple, list, mapping or dataclass holding tensors at any depth
            (32 levels at most, which also stops a cycle).
        path: prefix of every yielded path.
        objects: also enter the attributes (`vars()`) of other objects, such as a KV cache
            a model returns; modules, classes and functions are not entered, and each
            object is entered once.
        named: build the paths; with False every path is `path` as given (for a caller
            that wants only the tensors: a forward's inputs and outputs, at every call).

    Yields:
        `(path, tensor)`; paths read like the access: `""` for a bare tensor, `"[0]"`,
        `"['logits']"`, `".hidden"`.
    """
    yield from _walk(obj, path, _depth, set() if objects else None, named)


def _walk(obj: Any, path: str, depth: int, entered: set[int] | None, named: bool
          ) -> Iterator[tuple[str, torch.Tensor]]:
    if depth > 32:  # a cycle or a pathological structure: stop rather than recurse forever
        return
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _walk(value, f"{path}[{key!r}]" if named else path, depth + 1,
                             entered, named)
    elif isinstance(obj, (tuple, list)):
        for i, value in enumerate(obj):
            yield from _walk(value, f"{path}[{i}]" if named else path, depth + 1, entered,
                             named)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from _walk(getattr(obj, field.name),
                             f"{path}.{field.name}" if named else path, depth + 1, entered,
                             named)
    elif entered is not None and not isinstance(obj, _NOT_ENTERED) and id(obj) not in entered:
        attrs = getattr(obj, "__dict__", None)
        if isinstance(attrs, dict):
            entered.add(id(obj))
            for name, value in list(attrs.items()):
                yield from _walk(value, f"{path}.{name}" if named else path, depth + 1,
                                 entered, named)


def nested_values(t: torch.Tensor) -> torch.Tensor:
    """A nested tensor's elements as one dense tensor, its padding left out: a jagged
    tensor's `values()` (the same memory, `(sum of lengths, *rest)`), or the older kind's
    components (`nn.TransformerEncoder`'s fast path) joined along their first dim, or flat
    where other dims are ragged too; outside autograd. No host-device sync."""
    t = t.detach()
    if t.layout == torch.jagged:
        values: torch.Tensor = t.values()
        return values
    parts = t.unbind()  # sizes are host metadata for this kind
    if not parts:
        return t.new_zeros((0,))
    if parts[0].dim() >= 1 and all(p.shape[1:] == parts[0].shape[1:] for p in parts):
        return torch.cat(parts)
    return torch.cat([p.reshape(-1) for p in parts])


def nested_shape(t: torch.Tensor) -> tuple[int, ...]:
    """A nested tensor's shape in plain ints, -1 for each ragged dim (its lengths differ
    per component; reading them would wait for the device under a jagged layout)."""
    if t.layout == torch.jagged:
        rest = list(t.values().shape[1:])
        rest.insert(getattr(t, "_ragged_idx", 1) - 1, -1)
        return (t.size(0), *rest)
    sizes = t._nested_tensor_size()  # (components, dims), on the host
    if sizes.numel() == 0:
        return (t.size(0),)
    return (t.size(0), *(int(col[0]) if bool((col == col[0]).all()) else -1
                         for col in sizes.T))
