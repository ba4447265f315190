"""Compile in this process without disturbing what the user compiled: private code objects
for the measured model, and a fresh inductor cache.

Measuring a cold compile in a process that may hold the user's own compiled code, without
`torch._dynamo.reset()` (which would throw that code away):

- Dynamo caches compiled code per code object, and its guards accept another instance of
  the same class: compiling a copy of a model the user compiled before would reuse the
  user's graph and look free. `private_code` gives every module of the measured copy its
  own copy of its forward's code object, so Dynamo traces it afresh, its recompiles count
  against no limit of the user's, and on exit those code objects' cache entries are
  dropped (`reset_code` on the private code objects only).
- `fresh_inductor_cache` gives inductor an empty on-disk cache and empty in-memory caches
  (torch's own `torch._inductor.utils.fresh_cache`), sets Dynamo's automatic-dynamic
  state aside (it is keyed by file, line and name, which the private code shares with the
  original), and puts the environment back as it was.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from torchscope._process import kept_environment

__all__ = ["TORCH_DIR", "fresh_inductor_cache", "private_code", "private_origin"]

#: torch's own package directory: code from here is torch's, not the user's.
TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


# id of a private copy of a decorator's wrapper code -> what it wraps: the decorated
# function's qualified name, and its own code's file and first line (see `private_origin`).
_ORIGINS: dict[int, tuple[str, str, int]] = {}


def private_origin(code: types.CodeType) -> tuple[str, str, int] | None:
    """For a private copy of a decorator's wrapper (`private_code`), the function it wraps:
    `(qualified name, file, first line)`, as `LlamaForCausalLM.forward` and its place in
    `modeling_llama.py`. The wrapper's own name and place (`wrapped_func` in transformers'
    `deprecation.py`) are shared by every function that decorator wraps, and tell the user
    nothing. None for any other code object."""
    return _ORIGINS.get(id(code))


def _fresh_function(fn: types.FunctionType, codes: list[types.CodeType], *,
                    root: bool = False) -> types.FunctionType:
    """`fn` with its own copy of its code object (closure, defaults and globals shared);
    every new code object is appended to `codes`.

    A root forward from torch itself (`nn.Sequential`, say) gets a file name outside torch:
    `torch.compile` would otherwise compile it through a wrapper frame that every compiled
    torch module shares (`torch._dynamo.external_utils.wrap_inline`), not through the
    private code.

    A decorated forward (a wrapper made with `functools.wraps`, as transformers 5 puts
    around most model forwards) calls the function it closes over: that function is copied
    too, down the whole stack of decorators, and the copy gets a closure cell of its own
    that holds it. Otherwise the wrapper's code would be private and the forward's own code
    shared, and each compile would recompile it.
    """
    closure = fn.__closure__
    inner = getattr(fn, "__wrapped__", None)
    fresh_inner: types.FunctionType | None = None
    if isinstance(inner, types.FunctionType) and closure:
        held = [i for i, cell in enumerate(closure) if _holds(cell, inner)]
        if held:
            fresh_inner = _fresh_function(inner, codes)
            cells = list(closure)
            for i in held:
                cells[i] = types.CellType(fresh_inner)
            closure = tuple(cells)
    code = fn.__code__.replace()
    if root and os.path.abspath(code.co_filename).startswith(TORCH_DIR):
        code = code.replace(co_filename=f"<torchscope private copy of {fn.__qualname__}>")
    new = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, closure)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__ = fn.__qualname__
    new.__module__ = fn.__module__
    new.__doc__ = fn.__doc__
    new.__dict__.update(fn.__dict__)
    if fresh_inner is not None:
        new.__wrapped__ = fresh_inner  # type: ignore[attr-defined]
    own = getattr(inspect.unwrap(fn), "__code__", None) if inner is not None else None
    if isinstance(own, types.CodeType):
        _ORIGINS[id(code)] = (fn.__qualname__, own.co_filename, own.co_firstlineno)
    codes.append(code)
    return new


def _holds(cell: types.CellType, value: object) -> bool:
    try:
        return cell.cell_contents is value
    except ValueError:  # an empty cell
        return False


_MISSING = object()


def _release(codes: list[types.CodeType]) -> None:
    """Drop Dynamo's cache entries of these private code objects and of the resume functions
    generated from them, and Dynamo's guard-failure texts about them (a strong reference
    that would keep compiled graphs alive)."""
    try:
        from torch._C._dynamo.eval_frame import reset_code
        from torch._dynamo.resume_execution import ContinueExecutionCache
        from torch._dynamo.utils import guard_failures
    except ImportError:  # pragma: no cover - another torch: the code objects die unreleased
        return
    todo = list(codes)
    seen: set[int] = set()
    while todo:
        code = todo.pop()
        if id(code) in seen:
            continue
        seen.add(id(code))
        resumed = ContinueExecutionCache.cache.get(code)
        if isinstance(resumed, dict):
            todo.extend(c for c in resumed.values() if isinstance(c, types.CodeType))
        reset_code(code)
        guard_failures.pop(code, None)


@contextlib.contextmanager
def private_code(model: nn.Module) -> Iterator[None]:
    """Every module of `model` runs a private copy of its forward's code object while open
    (see the module docstring), the functions its decorators wrap included; on exit each
    `forward` is as it was and the private code objects' cache entries are dropped. A
    forward that is not a plain Python function (a C function, a `partial`) stays shared,
    and so do helpers a forward calls after a graph break (a loss function, an output
    class's `__init__`): those that held no compiled code when the block began are released
    on exit too, so that the next compile traces them afresh and no cache entry of ours
    stays on them; one that held the user's compiled code keeps its entries, ours included.
    """
    saved: list[tuple[nn.Module, Any]] = []
    codes: list[types.CodeType] = []
    # One private copy per function, shared by every instance that runs it, as the user's
    # model shares one code object: once a break makes Dynamo compile a block's frame on
    # its own, it compiles it once for all the blocks (four identical breaking blocks were
    # eight graphs, and twice the cold compile, with a copy per instance).
    made: dict[tuple[types.FunctionType, bool], types.FunctionType] = {}
    holding = _holding_before()
    try:
        for m in model.modules():
            own = m.__dict__.get("forward", _MISSING)
            if own is _MISSING:
                fn, bound = getattr(type(m), "forward", None), True
            elif inspect.ismethod(own) and own.__self__ is m:
                fn, bound = own.__func__, True
            else:  # a function set on the instance: called without self
                fn, bound = own, False
            if not isinstance(fn, types.FunctionType) or fn is nn.Module.forward:
                continue
            root = m is model
            new = made.get((fn, root))
            if new is None:
                new = made[(fn, root)] = _fresh_function(fn, codes, root=root)
            saved.append((m, own))
            m.__dict__["forward"] = types.MethodType(new, m) if bound else new
        yield
    finally:
        for m, own in reversed(saved):
            if own is _MISSING:
                m.__dict__.pop("forward", None)
            else:
                m.__dict__["forward"] = own
        for code in codes:
            _ORIGINS.pop(id(code), None)
        codes.extend(_ours_since(holding))
        _release(codes)


def _holding_before() -> set[int] | None:
    """Ids of the code objects Dynamo has met in this process (its `input_codes`) that hold
    compiled code now, or None on a torch without these records."""
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
        from torch._dynamo.convert_frame import input_codes
    except ImportError:  # pragma: no cover - another torch
        return None
    return {id(code) for code in _met(input_codes) if _debug_get_cache_entry_list(code)}


def _met(input_codes: Any) -> list[types.CodeType]:
    codes = (ref() for ref in list(getattr(input_codes, "seen", ())))
    return [code for code in codes if isinstance(code, types.CodeType)]


def _ours_since(holding: set[int] | None) -> list[types.CodeType]:
    """The code objects Dynamo has met that held no compiled code when
    `_holding_before()` returned `holding`: whatever they hold now, we compiled."""
    if holding is None:
        return []
    from torch._dynamo.convert_frame import input_codes

    return [code for code in _met(input_codes) if id(code) not in holding]


@contextlib.contextmanager
def fresh_inductor_cache() -> Iterator[None]:
    """Empty inductor caches (on disk and in memory) and an empty automatic-dynamic (PGO)
    state for the block; on exit the environment (inductor sets `TORCHINDUCTOR_CACHE_DIR`)
    and that state are as they were. Dynamo's compiled code is not touched (`private_code`).
    """
    from torch._dynamo import pgo
    from torch._inductor.utils import fresh_cache

    state = (pgo._CODE_STATE, pgo._INIT_CODE_STATE)
    pgo._CODE_STATE, pgo._INIT_CODE_STATE = None, None
    try:
        with kept_environment(), fresh_cache():
            yield
    finally:
        pgo._CODE_STATE, pgo._INIT_CODE_STATE = state
