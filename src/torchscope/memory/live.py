"""Live tensors: the largest tensors still referenced, and what holds them.

`torch.cuda.empty_cache()` returns the caching allocator's *unused* blocks to the driver; it
cannot free a tensor that something still references. This module makes that visible: it
walks the garbage collector's objects for tensors, groups views by storage, names what refers
to each (an attribute, a module parameter, a local variable, a list...), and on CUDA reads
allocated and reserved memory before and after `empty_cache()`.

Tensors held only from C++ (saved by an autograd graph, cached by a library) have no Python
referrer to show; a tensor with a `grad_fn` is reported as keeping its graph alive.
"""

from __future__ import annotations

import gc
import inspect
import sys
import types
import warnings
from typing import Any

import torch
from torch import nn

from torchscope.memory._common import StorageKey, storage_key, storage_nbytes
from torchscope.memory.records import LiveTensor, LiveTensors


def _owner(d: dict[Any, Any], ignore: set[int]) -> Any:
    """The object whose `__dict__` is `d` (a module's globals count), or None."""
    for ref in gc.get_referrers(d):
        if id(ref) not in ignore and not isinstance(ref, type) and (
                getattr(ref, "__dict__", None) is d):
            return ref
    return None


def _key_in(container: dict[Any, Any], value: Any) -> Any:
    """The key under which `container` holds `value` (`_AS_KEY` when `value` is a key)."""
    found = next((k for k, v in container.items() if v is value), _NOT_FOUND)
    if found is _NOT_FOUND and any(k is value for k in container):
        return _AS_KEY
    return found


_NOT_FOUND = object()
_AS_KEY = object()


def _fmt_key(k: Any) -> str:
    if k is _AS_KEY:
        return "<key>"
    if k is _NOT_FOUND:
        return "?"
    return "<tensor>" if isinstance(k, torch.Tensor) else repr(k)


def _name(obj: Any) -> str:
    if isinstance(obj, types.ModuleType):
        return f"module {obj.__name__}"
    return type(obj).__name__


def _via_dict(d: dict[Any, Any], path: list[Any], ignore: set[int], depth: int = 0) -> str:
    """Describe the entry at `path` below dict `d`, by finding who holds `d` (3 levels up)."""
    owner = _owner(d, ignore)
    head, rest = path[0], "".join(f"[{_fmt_key(k)}]" for k in path[1:])
    if owner is not None:
        if isinstance(owner, types.ModuleType):
            return f"global {_fmt_key(head)}{rest} in {owner.__name__}"
        return f"attribute {_fmt_key(head)}{rest} of {_name(owner)}"
    if depth < 3:
        for ref in gc.get_referrers(d):
            if id(ref) in ignore or not isinstance(ref, dict):
                continue
            outer = _key_in(ref, d)
            holder = _owner(ref, ignore | {id(d)})
            if isinstance(holder, nn.Module) and outer in ("_parameters", "_buffers"):
                kind = "parameter" if outer == "_parameters" else "buffer"
                return f"{kind} {_fmt_key(head)} of {type(holder).__name__}"
            if outer is not _NOT_FOUND:
                return _via_dict(ref, [outer, *path], ignore | {id(d)}, depth + 1)
    return f"entry {''.join(f'[{_fmt_key(k)}]' for k in path)} of a dict"


def _describe(ref: Any, t: torch.Tensor, ignore: set[int]) -> str | None:
    if isinstance(ref, dict):
        return _via_dict(ref, [_key_in(ref, t)], ignore | {id(ref)})
    if isinstance(ref, (list, tuple)):
        where = next((i for i, v in enumerate(ref) if v is t), None)
        return f"item [{where}] of a {type(ref).__name__} of {len(ref)}"
    if isinstance(ref, torch.Tensor):
        return None  # e.g. the `.grad` of a tensor: reported through that tensor
    if isinstance(ref, types.CellType):
        return "a closure variable"
    attrs = getattr(ref, "__dict__", None)
    if isinstance(attrs, dict):  # an object whose attributes are stored inline
        key = _key_in(attrs, t)
        if key is not _NOT_FOUND:
            return f"attribute {_fmt_key(key)} of {_name(ref)}"
    return f"a {type(ref).__name__}"


def _frame_locals(t: torch.Tensor, start: types.FrameType | None, ignore: set[int]
                  ) -> list[str]:
    """Local variables of the running frames (callers of `live_tensors`) that hold `t`."""
    out = []
    frame = start
    while frame is not None:
        f_locals = frame.f_locals
        # Whether `f_locals` is the throw-away copy of an optimized function frame's locals.
        snapshot = (sys.version_info < (3, 13) and type(f_locals) is dict
                    and f_locals is not frame.f_globals
                    and bool(frame.f_code.co_flags & inspect.CO_OPTIMIZED))
        if snapshot:
            ignore.add(id(f_locals))  # the snapshot dict must not show up as a referrer
        for name, value in f_locals.items():
            if value is t:
                code = frame.f_code
                out.append(f"local {name!r} in {code.co_name}() at "
                           f"{code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}")
        if snapshot:
            # Before Python 3.13, reading f_locals of a function frame stores a dict copy of
            # its locals on the frame; clear it so that it keeps no tensor alive after a `del`
            # (the real locals are untouched; the next read rebuilds the copy).
            f_locals.clear()
        frame = frame.f_back
    return out


def _is_tensor(obj: Any) -> bool:
    try:
        return issubclass(type(obj), torch.Tensor) and obj.device.type != "meta"
    except Exception:  # proxies whose isinstance or device raise are not ours to inspect
        return False


def live_tensors(limit: int = 20, *, device: str | torch.device | None = None,
                 empty_cache: bool = True, referrers: int = 3) -> LiveTensors:
    """List the largest live tensors (by storage) and what holds each of them.

    Args:
        limit: how many storages to list.
        device: only tensors on this device (e.g. `"cuda"`, `"cuda:0"`, `"cpu"`).
        empty_cache: on CUDA, call `torch.cuda.empty_cache()` and report allocated and
            reserved memory before and after it.
        referrers: at most this many referrer descriptions per tensor.

    Returns:
        The largest tensors first, plus totals. The result holds no tensor.
    """
    gc.collect()
    want = torch.device(device) if device is not None else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance() on deprecated aliases warns
        objects = [o for o in gc.get_objects() if _is_tensor(o)]
        grad_of = {id(o.grad): o for o in objects if o.is_leaf and o.grad is not None}
    groups: dict[StorageKey, list[torch.Tensor]] = {}  # the views of each storage
    for t in objects:
        key = storage_key(t)
        if key is not None and (want is None or (
                t.device.type == want.type and want.index in (None, t.device.index))):
            groups.setdefault(key, []).append(t)
    sized = sorted(groups.values(), key=lambda g: -storage_nbytes(g[0]))
    total = sum(storage_nbytes(g[0]) for g in sized)
    ignore = {id(groups), id(sized), id(objects), id(grad_of), *map(id, groups.values())}
    frame = sys._getframe()
    ignore.add(id(frame))
    top = sized[:limit]
    views = [v for g in top for v in g]
    local_refs = {id(v): _frame_locals(v, frame.f_back, ignore) for v in views}
    # One heap scan for all listed tensors' referrers, then split them by tensor.
    referrers_of: dict[int, list[Any]] = {id(v): [] for v in views}
    ignore.update({id(views), id(top), id(referrers_of)})
    found_refs = gc.get_referrers(*views) if views else []
    ignore.add(id(found_refs))
    for ref in found_refs:
        if id(ref) in ignore or ref is frame:
            continue
        for target in gc.get_referents(ref):
            bucket = referrers_of.get(id(target))
            if bucket is not None and not any(r is ref for r in bucket):
                bucket.append(ref)
    rows: list[LiveTensor] = []
    for group in top:
        t = max(group, key=lambda v: (isinstance(v, nn.Parameter), v.numel()))
        refs: list[str] = []
        for view in group:
            texts = list(local_refs[id(view)])
            texts += [d for ref in referrers_of[id(view)]
                      if (d := _describe(ref, view, ignore)) is not None]
            refs.extend(x for x in texts if x not in refs)
        owner = grad_of.get(id(t))
        if owner is not None:
            kind = "parameter" if isinstance(owner, nn.Parameter) else "tensor"
            refs.insert(0, f".grad of a {kind} of shape {tuple(owner.shape)}")
        if t.grad_fn is not None:
            refs.append(f"keeps its autograd graph alive ({type(t.grad_fn).__name__})")
        rows.append(LiveTensor(tuple(t.shape), str(t.dtype), str(t.device), storage_nbytes(t),
                               len(group), t.requires_grad, isinstance(t, nn.Parameter),
                               tuple(refs[:referrers])))
    count = len(sized)
    del groups, sized, objects, frame, grad_of, top, views, found_refs, referrers_of
    before: tuple[int | None, int | None] = (None, None)
    after = before
    if torch.cuda.is_available() and torch.cuda.is_initialized() and (
            want is None or want.type == "cuda"):
        before = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved())
        if empty_cache:
            torch.cuda.empty_cache()
        after = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved())
    return LiveTensors(tuple(rows), total, count, before[0], before[1], after[0], after[1])
