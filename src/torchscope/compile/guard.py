"""Make torchscope's own captures safe on compiled models.

Hooks on a compiled module are traced into the graph at the first call; hooks added later
never fire, and hooks that append to Python lists recompile every call. So while torchscope
captures (activations, gradient flow), compiled parts run eagerly via
`torch.compiler.set_stance("force_eager")`: every hook fires, nothing is recompiled, and the
compiled code cached by Dynamo is left as it was.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from types import TracebackType
from typing import Literal

import torch
from torch import nn

from torchscope.compile.records import CompiledCheck
from torchscope.compile.watch import RecompileWatcher
from torchscope.errors import CompileError

__all__ = ["CompiledCapture", "check_compiled", "compiled_capture", "compiled_parts",
           "unwrap_compiled"]

Policy = Literal["eager", "refuse"]


def compiled_parts(model: nn.Module) -> tuple[str, ...]:
    """Qualified names of compiled modules inside `model`: `torch.compile` wrappers and
    modules compiled in place with `module.compile()` (`""` is the root)."""
    opt = torch._dynamo.eval_frame.OptimizedModule
    return tuple(name for name, m in model.named_modules()
                 if isinstance(m, opt) or getattr(m, "_compiled_call_impl", None) is not None)


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """The original module behind (nested) `torch.compile` wrappers; `model` otherwise."""
    opt = torch._dynamo.eval_frame.OptimizedModule
    while isinstance(model, opt):
        model = model._orig_mod
    return model


def check_compiled(model: nn.Module, *, policy: Policy = "eager", what: str = "capture"
                   ) -> CompiledCheck:
    """Say whether `model` holds compiled parts, and refuse when they cannot be captured.

    Args:
        model: the model a torchscope entry point is about to hook.
        policy: `eager` runs compiled parts eagerly during the capture (use
            `compiled_capture`); `refuse` raises on any compiled part.
        what: the entry point's name, for the message.

    Raises:
        CompileError: compiled parts and `policy="refuse"`, or this torch has no
            `torch.compiler.set_stance` to run them eagerly.
    """
    parts = compiled_parts(model)
    if parts:
        names = ", ".join(p or "<root>" for p in parts)
        if policy == "refuse":
            raise CompileError(
                f"{what} got a compiled model ({names} compiled): hooks registered after "
                "the first compiled call never fire, so the capture would record nothing.",
                fix="pass the original module (compiled._orig_mod), or allow eager capture "
                    "(policy='eager').")
        if not hasattr(torch.compiler, "set_stance"):
            raise CompileError(
                f"{what} got a compiled model ({names} compiled) and this torch "
                f"{torch.__version__} cannot run it eagerly (no torch.compiler.set_stance).",
                fix="pass the original module (compiled._orig_mod) instead.")
    return CompiledCheck(parts, policy)


class CompiledCapture:
    """Context manager: compiled parts of the model run eagerly while torchscope captures.

    Keep it open across forward and backward. On exit `check.compiles` holds the Dynamo
    compiles seen inside (0 normally); more than `max_compiles` raises `CompileError`
    rather than reporting a capture that disturbed the compiled model.

    Attributes:
        check: the `CompiledCheck`, with `compiles` filled in on exit.
    """

    def __init__(self, model: nn.Module, *, policy: Policy = "eager", what: str = "capture",
                 max_compiles: int = 0) -> None:
        self.check = check_compiled(model, policy=policy, what=what)
        self._what = what
        self._max = max_compiles
        self._stack = contextlib.ExitStack()
        self._watcher: RecompileWatcher | None = None

    def __enter__(self) -> CompiledCapture:
        if self.check.is_compiled:
            try:
                self._stack.enter_context(torch.compiler.set_stance("force_eager"))
                self._watcher = self._stack.enter_context(RecompileWatcher())
            except BaseException:
                # `with` never calls __exit__ when __enter__ raises: restore the stance here.
                self._stack.close()
                raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stack.close()
        if self._watcher is None:
            return
        n = self._watcher.compiles
        self.check = replace(self.check, compiles=n)
        if n > self._max and exc_type is None:
            raise CompileError(
                f"{self._what} on a compiled model made Dynamo compile {n} frame(s) (allowed "
                f"{self._max}) even with compiled parts forced eager.",
                fix="capture on the original module (compiled._orig_mod).")


def compiled_capture(model: nn.Module, *, policy: Policy = "eager", what: str = "capture",
                     max_compiles: int = 0) -> CompiledCapture:
    """Wrap a torchscope capture of `model` so that compiled parts are captured correctly.

    Args:
        model: the model, compiled as a whole, in parts, or not at all.
        policy: `eager` runs compiled parts eagerly while open (hooks fire, nothing is
            recompiled); `refuse` raises on a compiled model.
        what: the capture's name in messages.
        max_compiles: Dynamo compiles allowed while open before `CompileError` on exit.

    Example:
        >>> with compiled_capture(model, what="capture_activations") as cc:
        ...     model(x)                 # hooks fire, no recompile
        >>> cc.check.compiled, cc.check.compiles
        (('',), 0)
    """
    return CompiledCapture(model, policy=policy, what=what, max_compiles=max_compiles)
