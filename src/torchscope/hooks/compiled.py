"""Compiled models under torchscope's hooks: find the compiled parts, run them eagerly while
hooks are held, and count the Dynamo compiles that happen meanwhile.

Hooks on a compiled module are traced into the graph at the first call; hooks added later
never fire, and hooks that append to Python lists recompile every call. So while torchscope
holds hooks on a model with compiled parts (`HookSession` does this for every capability),
those parts run eagerly via `torch.compiler.set_stance("force_eager")`: every hook fires,
nothing is recompiled, and the compiled code cached by Dynamo is left as it was.

This module imports only torch at load time: `torch._dynamo` loads on first use.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
from torch import nn

from torchscope.catalogue import entry
from torchscope.errors import CompileError
from torchscope.findings import Entry, Finding, Severity

__all__ = [
    "CompileCounter",
    "CompiledCapture",
    "CompiledCheck",
    "check_compiled",
    "compiled_capture",
    "compiled_parts",
    "eager_stance",
    "ran_eagerly",
    "unseen_forward",
    "unwrap_compiled",
]

Policy = Literal["eager", "refuse"]


@dataclass(frozen=True)
class CompiledCheck:
    """Whether a model contains compiled parts, and how a torchscope capture handles them.

    Attributes:
        compiled: qualified names of compiled modules inside the model (`""` is the root):
            `torch.compile(module)` wrappers and modules compiled in place with
            `module.compile()`.
        policy: `eager` (compiled parts run eagerly while torchscope captures, through
            `torch.compiler.set_stance("force_eager")`) or `refuse`.
        compiles: Dynamo compiles seen during the capture (0 when nothing was recompiled).
    """

    compiled: tuple[str, ...]
    policy: str
    compiles: int = 0

    @property
    def is_compiled(self) -> bool:
        """True when any part of the model is compiled."""
        return bool(self.compiled)


def compiled_parts(model: nn.Module) -> tuple[str, ...]:
    """Qualified names of compiled modules inside `model` (`""` is the root): `torch.compile`
    wrappers, modules compiled in place with `module.compile()`, and modules with a compiled
    method set on the instance (`m.forward = torch.compile(m.forward)`; Lightning does so to
    the module of a compiled model given to `fit`, for `forward` and `training_step`)."""
    opt = torch._dynamo.eval_frame.OptimizedModule
    return tuple(name for name, m in model.named_modules()
                 if isinstance(m, opt) or getattr(m, "_compiled_call_impl", None) is not None
                 or _compiled_method(m))


def _compiled_method(module: nn.Module) -> bool:
    """Whether a method of `module` was replaced on the instance by a `torch.compile`d
    function (Dynamo marks those with the callable they wrap; a `torch._dynamo.disable`d
    one is marked too, and as disabled)."""
    return any(callable(v) and hasattr(v, "_torchdynamo_orig_callable")
               and not getattr(v, "_torchdynamo_disable", False)
               for v in vars(module).values())


def ran_eagerly(code: str | Entry, parts: tuple[str, ...], what: str, *, also: str = "",
                severity: Severity = Severity.INFO, fix: str | None = None) -> list[Finding]:
    """The finding that the model's compiled `parts` ran eagerly while `what` (a watch, the
    monitor, a per-module profile) held its hooks: at eager speed and with eager numerics.
    Empty when nothing was compiled.

    Args:
        code: the finding's catalogue entry, or its declared code (`grads.compiled_eager`,
            ...).
        parts: qualified names of the compiled modules (`CompiledCheck.compiled`).
        what: what held the hooks, as the sentence names it ("the gradient watch").
        also: a clause to add (what else was eager).
        severity: info, unless what was measured is itself the eager model's (a profile).
        fix: the fix; by default, open `what` around a stretch of the run only.
    """
    if not parts:
        return []
    where = ", ".join(n or "<root>" for n in parts[:3]) + (", ..." if len(parts) > 3 else "")
    of = entry(code) if isinstance(code, str) else code
    return [of.finding(
        severity,
        f"the model's compiled parts ({where}) ran eagerly while {what} was open: "
        "torchscope's hooks fire only in eager code, so the steps it saw ran at eager speed "
        "and with eager numerics (eager gradients differ from compiled ones in the last "
        f"bits){also}",
        {"compiled": len(parts)},
        fix=fix or f"to train at compiled speed, open {what} around a stretch of the run "
            "only (its findings cover that stretch).")]


def unseen_forward(code: str | Entry, summary: str, evidence: dict[str, int | None]) -> Finding:
    """The warning that a watch's hooks saw no forward of the model while the model, as far
    as the watch can tell, did run: its parameters got gradients, or the watch was open and
    recorded nothing. A `torch.compile` wrapper built before the watch opened runs its
    graph without the hooks added later, and an empty record reads as a healthy one.

    Args:
        code: the finding's catalogue entry, or its declared code (`grads.unseen_forward`,
            ...).
        summary: what the watch saw, in one sentence.
        evidence: the finding's evidence.
    """
    of = entry(code) if isinstance(code, str) else code
    return of.finding(
        Severity.WARNING, summary, dict(evidence),
        fix="give torchscope the module that the loop calls: a torch.compile wrapper made "
            "before the watch opened never runs hooks added later (pass the compiled module, "
            "which then runs eagerly while watched); check that `select` names modules that "
            "run.")


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """The original module behind (nested) `torch.compile` wrappers; `model` otherwise."""
    opt = torch._dynamo.eval_frame.OptimizedModule
    while isinstance(model, opt):
        inner = model._orig_mod
        assert isinstance(inner, nn.Module)
        model = inner
    return model


class CompileCounter:
    """Count Dynamo frame compiles while open (first compiles and recompiles alike), through
    a start callback of `torch._dynamo.callback.callback_handler`; lazy backward compiles
    and autotuning are not frame compiles. Subclasses get every counted compile in
    `_on_compile(args)` (`torchscope.compile.RecompileWatcher` records recompiles there).

    Attributes:
        compiles: frame compiles seen while open.
    """

    def __init__(self) -> None:
        self.compiles = 0
        self._lock = threading.Lock()
        self._installed = False

    def __enter__(self) -> CompileCounter:
        self.install()
        return self

    def __exit__(self, *_: object) -> None:
        self.uninstall()

    @staticmethod
    def _callbacks() -> Any:
        import torch._dynamo.callback

        return torch._dynamo.callback.callback_handler

    def install(self) -> None:
        """Start counting (idempotent)."""
        if self._installed:
            return
        self._callbacks().register_start_callback(self._on_start)
        self._installed = True

    def uninstall(self) -> None:
        """Stop counting; the count stays readable."""
        if not self._installed:
            return
        with contextlib.suppress(ValueError):  # torch._dynamo.reset() already cleared it
            self._callbacks().remove_start_callback(self._on_start)
        self._installed = False

    def reinstall(self) -> None:
        """Register again after `torch._dynamo.reset()`, which drops every compile callback."""
        self.uninstall()
        self.install()

    def _on_start(self, args: Any) -> None:
        trigger = getattr(args, "callback_trigger", None)
        if getattr(trigger, "name", "DYNAMO") != "DYNAMO":
            return
        with self._lock:
            self.compiles += 1
            self._on_compile(args)

    def _on_compile(self, args: Any) -> None:
        """Called (under the lock) for every counted compile; nothing by default."""


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


class _SharedEagerStance:
    """`torch.compiler.set_stance("force_eager")`, held while any capture needs it.

    Several captures can be open on one model at once (the run monitor opens one per watch)
    and close in any order. Each entering the stance context on its own restored, on exit,
    the stance it had found, which for all but the first was `force_eager`: closed first to
    last, they left the process eager for good. The first to acquire enters the stance and
    the last to release leaves it, whatever the order in between.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0
        self._held: contextlib.ExitStack | None = None

    def acquire(self) -> None:
        with self._lock:
            if self._count == 0:
                stack = contextlib.ExitStack()
                stack.enter_context(torch.compiler.set_stance("force_eager"))
                self._held = stack
            self._count += 1

    def release(self) -> None:
        with self._lock:
            self._count -= 1
            if self._count == 0 and self._held is not None:
                held, self._held = self._held, None
                held.close()


_EAGER = _SharedEagerStance()


@contextlib.contextmanager
def eager_stance(what: str = "torchscope") -> Iterator[None]:
    """Run every `torch.compile`d function eagerly while open, sharing the stance with the
    other open captures (`CompiledCapture` holds it through this too). The monitor holds it
    for a model that the loop calls through a compile wrapper torchscope is not given (the
    HF Trainer's `torch_compile=True`), whose hooks Dynamo would otherwise trace into its
    graph and recompile on.

    Raises:
        CompileError: this torch has no `torch.compiler.set_stance`.
    """
    if not hasattr(torch.compiler, "set_stance"):
        raise CompileError(
            f"{what} runs a compiled model, and this torch {torch.__version__} cannot run "
            "it eagerly (no torch.compiler.set_stance): hooks would be traced into its graph.",
            fix="turn compilation off while torchscope watches (torch_compile=False), or "
                "upgrade torch to 2.6 or later.")
    _EAGER.acquire()
    try:
        yield
    finally:
        _EAGER.release()


class CompiledCapture:
    """Context manager: compiled parts of the model run eagerly while torchscope captures.

    Keep it open across forward and backward. On exit `check.compiles` holds the Dynamo
    compiles seen inside (0 normally); more than `max_compiles` raises `CompileError`
    rather than reporting a capture that disturbed the compiled model. The compiler stance
    is restored on exit, also when the block raises.

    Attributes:
        check: the `CompiledCheck`, with `compiles` filled in on exit.
    """

    def __init__(self, model: nn.Module, *, policy: Policy = "eager", what: str = "capture",
                 max_compiles: int = 0) -> None:
        self.check = check_compiled(model, policy=policy, what=what)
        self._what = what
        self._max = max_compiles
        self._stack = contextlib.ExitStack()
        self._counter: CompileCounter | None = None

    def __enter__(self) -> CompiledCapture:
        if self.check.is_compiled:
            # `with` never calls __exit__ when __enter__ raises: this stack restores the
            # stance itself unless both parts started.
            with contextlib.ExitStack() as stack:
                stack.enter_context(eager_stance(self._what))
                self._counter = stack.enter_context(CompileCounter())
                self._stack = stack.pop_all()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        self._stack.close()
        if self._counter is None:
            return
        n = self._counter.compiles
        self.check = replace(self.check, compiles=n)
        if n > self._max and exc_type is None:
            raise CompileError(
                f"{self._what} on a compiled model made Dynamo compile {n} frame(s) (allowed "
                f"{self._max}) even with compiled parts forced eager.",
                fix="capture on the original module (compiled._orig_mod).")


def compiled_capture(model: nn.Module, *, policy: Policy = "eager", what: str = "capture",
                     max_compiles: int = 0) -> CompiledCapture:
    """A `CompiledCapture`: a torchscope capture of `model` that sees its compiled parts.

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
