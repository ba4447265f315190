"""Per-module profiler ranges: a forward-pre hook opens one, a forward hook closes it.

Every hook goes through a `HookSession`. The closing hook is registered with
`always_call=True`, so a forward that raises still closes its range (and those of the
modules it was inside) and never leaves a dangling range in the trace.
"""

from __future__ import annotations

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
        # Per module: the ranges it has open (a module re-entered by recursion nests them).
        self._open: dict[int, list[Any]] = {}

    @property
    def session(self) -> HookSession:
        """The session owning the hooks."""
        return self._session

    def open(self) -> None:
        """Register the hooks (as a context manager: those added before a failure come off)."""
        for name, module in self._targets:
            label = range_label(name, type(module).__name__)
            self.labels[label] = (name, type(module).__name__)
            stack: list[Any] = self._open.setdefault(id(module), [])
            self._session.forward_pre_hook(module, self._make_pre(label, stack))
            self._session.forward_hook(module, self._make_post(stack), always_call=True)

    def close(self, *, failed: bool = False) -> None:
        """Remove the hooks and close any range a crash left open."""
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
