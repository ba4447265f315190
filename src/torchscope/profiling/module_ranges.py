"""Per-module profiler ranges around every selected module's forward.

A module's range is opened by a thin wrapper around its forward, set as an instance
attribute for as long as the ranges are open: one Python call per module call. Forward
hooks would cost a pre-hook, a post-hook and `nn.Module`'s hook path (~4 µs per call),
which on models of many microsecond-sized modules (deep-mlp) was most of the overhead over
plain `torch.profiler`. The range closes in a `with` block, so a forward that raises (or a
`KeyboardInterrupt`) still closes it and never leaves a dangling range in the trace.

Modules whose forward cannot be wrapped that way (a TorchScript module, a forward already
replaced on the instance) get the hook pair instead: a forward-pre hook opens the range, a
forward hook registered with `always_call=True` closes it.

Every wrapper and hook is owned by a `HookSession`, which removes it on exit (the instance
attribute goes, the class's forward is back). A copy of the module made meanwhile
(`copy.deepcopy`, `pickle`) calls its own forward: the wrapper reaches the forward through
the module it is bound to, and once the ranges close it opens no range anywhere.
"""

from __future__ import annotations

import inspect
import types
import weakref
from typing import Any

import torch
from torch import nn

from torchscope.hooks.lifecycle import HookedContext
from torchscope.hooks.select import Selector, select_modules
from torchscope.hooks.session import HookSession
from torchscope.profiling.ops import MODULE_RANGE_PREFIX

__all__ = ["ModuleRanges", "range_label"]


def range_label(name: str, module_type: str) -> str:
    """The profiler range name of a module: `nn.Module: layer1.conv (Conv2d)`."""
    return f"{MODULE_RANGE_PREFIX}{name or '<root>'} ({module_type})"


class _RangedForward:
    """A module's forward wrapped in a profiler range; `remove()` puts the class's back."""

    def __init__(self, module: nn.Module, label: str, factory: Any) -> None:
        self.active = True
        self._module = weakref.ref(module)
        self._bound: types.MethodType | None = None
        self._label = label
        self._factory = factory

    def install(self) -> None:
        """Set the wrapper as the module's forward."""
        module = self._module()
        if module is None:
            return
        label, factory = self._label, self._factory
        cls_forward = type(module).forward
        enabled = torch.autograd._profiler_enabled  # type: ignore[attr-defined]

        # Bound to the module (not closed over it), so that a deepcopy or unpickled copy of
        # the module runs its own forward.
        def forward(bound: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if self.active and enabled():
                with factory(label):
                    return cls_forward(bound, *args, **kwargs)
            return cls_forward(bound, *args, **kwargs)

        forward.__doc__ = cls_forward.__doc__
        try:  # what `inspect.signature(module.forward)` reports (Hugging Face reads it)
            sig = inspect.signature(cls_forward)
            forward.__signature__ = sig  # type: ignore[attr-defined]
        except (TypeError, ValueError):
            pass
        self._bound = types.MethodType(forward, module)
        module.forward = self._bound

    @staticmethod
    def wrappable(module: nn.Module) -> bool:
        """Whether this wrapper can stand in for `module`'s forward."""
        return "forward" not in module.__dict__ and not isinstance(module, torch.jit.ScriptModule)

    def remove(self) -> None:
        self.active = False
        module = self._module()
        if module is not None and module.__dict__.get("forward") is self._bound:
            del module.__dict__["forward"]


class ModuleRanges(HookedContext):
    """Opens a profiler range around every selected module's forward while open.

    Ranges are only opened while a profiler is recording, so wait/warmup steps of a schedule
    pay one flag check per module call.

    Example:
        >>> with ModuleRanges(model) as ranges, torch.profiler.profile() as prof:
        ...     model(x)
        >>> ranges.labels  # range name -> (qualified name, type name)
    """

    def __init__(self, model: nn.Module, select: Selector = None, depth: int | None = None
                 ) -> None:
        self._session = HookSession(model)
        # No selection times every module, containers and the root included; names are the
        # session's (inside a DDP or compile wrapper: the names of one process).
        self._targets = select_modules(self._session.model,
                                       (lambda _n, _m: True) if select is None else select,
                                       depth=depth, include_root=True)
        self.labels: dict[str, tuple[str, str]] = {}
        # `_RecordFunctionFast` is the C++ context manager torch's own Inductor uses for its
        # ranges; it skips the dispatcher round trip of `record_function`, which matters when a
        # model has hundreds of modules. Fall back to the public API where it is missing.
        self._factory = getattr(torch._C._profiler, "_RecordFunctionFast", None) or \
            torch.autograd.profiler.record_function
        # Per hooked module: the ranges it has open (a module re-entered by recursion nests
        # them).
        self._open: dict[int, list[Any]] = {}

    @property
    def session(self) -> HookSession:
        """The session owning the wrappers and hooks."""
        return self._session

    def open(self) -> None:
        """Wrap each forward, or hook it (as a context manager: those added before a
        failure come off)."""
        for name, module in self._targets:
            label = range_label(name, type(module).__name__)
            self.labels[label] = (name, type(module).__name__)
            if _RangedForward.wrappable(module):
                wrapper = _RangedForward(module, label, self._factory)
                self._session.track(wrapper)  # owned before it is installed: it always comes off
                wrapper.install()
                continue
            stack: list[Any] = self._open.setdefault(id(module), [])
            self._session.forward_pre_hook(module, self._make_pre(label, stack))
            self._session.forward_hook(module, self._make_post(stack), always_call=True)

    def close(self, *, failed: bool = False) -> None:
        """Remove the wrappers and hooks, and close any range a crash left open."""
        try:
            self._session.close(failed=failed)
        finally:
            for stack in self._open.values():
                while stack:
                    rf = stack.pop()
                    if rf is not None:
                        rf.__exit__(None, None, None)

    def _make_pre(self, label: str, stack: list[Any]) -> Any:
        factory = self._factory
        enabled = torch.autograd._profiler_enabled  # type: ignore[attr-defined]

        def pre(_m: nn.Module, _args: tuple[Any, ...]) -> None:
            if enabled():
                rf = factory(label)
                rf.__enter__()
                stack.append(rf)
            else:
                stack.append(None)

        return pre

    @staticmethod
    def _make_post(stack: list[Any]) -> Any:
        def post(_m: nn.Module, _args: tuple[Any, ...], _out: Any) -> None:
            if stack:
                rf = stack.pop()
                if rf is not None:
                    rf.__exit__(None, None, None)

        return post
