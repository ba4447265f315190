"""Compile hygiene: the lesson's rule "compile once before the loop" made the easy path
(`compile_once`), its breaches warned about (`compile_guard()`: compile-in-a-loop, piling
recompiles), and hooks a compiled module skips or recompiles for (`audit_compiled_hooks`).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule
from torch.utils.hooks import RemovableHandle

from torchscope.catalogue import entry
from torchscope.compile.breaks import hook_at, iter_module_hooks
from torchscope.compile.records import Recompile
from torchscope.compile.watch import RecompileWatcher, recompile_limit
from torchscope.errors import CompileError
from torchscope.findings import Finding, Severity, rank
from torchscope.hooks.session import HookSession
from torchscope.models.target import ModelInputs

__all__ = [
    "CompileGuard",
    "CompileLoopWarning",
    "LateHook",
    "RecompileWarning",
    "audit_compiled_hooks",
    "compile_guard",
    "compile_once",
    "late_hooks",
    "track_compiled",
]

_HOOKS_UNTRACKED = entry("compile.hooks_untracked")
_LATE_HOOK = entry("compile.late_hook")
_HOOK_RECOMPILES = entry("compile.hook_recompiles")

_CACHE_ATTR = "_torchscope_compiled"
# Tracked torch.compile wrapper -> RemovableHandle.next_id at its first call (None before
# it): handles issued later belong to hooks registered after the graph was traced.
_FIRST_CALL: weakref.WeakKeyDictionary[nn.Module, int | None] = weakref.WeakKeyDictionary()


class CompileLoopWarning(UserWarning):
    """`torch.compile` was called again on a module or function it already compiled."""


class RecompileWarning(UserWarning):
    """A compiled frame keeps recompiling (or hit torch's recompile limit)."""


# ---------------------------------------------------------------------- compile_once
class _CompiledCache(dict[tuple[tuple[str, str], ...], nn.Module]):
    """Per-model cache of compiled wrappers. Lives in the model's `__dict__` so it dies with
    the model (a WeakKeyDictionary would leak: every wrapper holds its model strongly).
    Copies and pickles of the model get an empty plain dict, never a stale wrapper."""

    def __deepcopy__(self, memo: dict[int, Any]) -> dict[Any, Any]:
        return {}

    def __reduce__(self) -> tuple[type[dict[Any, Any]], tuple[()]]:
        return dict, ()


def compile_once(model: nn.Module, **options: Any) -> nn.Module:
    """`torch.compile(model, **options)`, but the same wrapper for the same model and options.

    Call it anywhere, even inside the training loop: the first call compiles, later calls
    return the wrapper they got before. The cache lives on the model object, so it goes
    away with the model; `copy.deepcopy(model)` and pickles start empty. The wrapper is
    tracked for `audit_compiled_hooks`.

    Args:
        model: the module to compile.
        **options: keyword arguments of `torch.compile` (`mode=`, `dynamic=`, `backend=`...).

    Returns:
        The `torch.compile` wrapper (an `OptimizedModule`).
    """
    if isinstance(model, OptimizedModule):
        raise CompileError(
            f"compile_once got a torch.compile wrapper of {type(model._orig_mod).__name__}.",
            fix="pass the original module: compile_once(model), not compile_once(compiled).")
    cache = model.__dict__.get(_CACHE_ATTR)
    if not isinstance(cache, _CompiledCache):
        cache = model.__dict__[_CACHE_ATTR] = _CompiledCache()
    key = tuple(sorted((k, repr(v)) for k, v in options.items()))
    hit = cache.get(key)
    if hit is not None:
        return hit
    compiled = track_compiled(cast(nn.Module, torch.compile(model, **options)))
    cache[key] = compiled
    return compiled


# ---------------------------------------------------------------------- first-call stamp
def track_compiled(compiled: nn.Module) -> nn.Module:
    """Remember when the `torch.compile` wrapper `compiled` is first called.

    Call it before the first call; `compile_once` and `compile_guard()` do it for you. A
    one-shot forward-pre hook on the wrapper (which runs eagerly, outside the compiled
    graph) notes the hook-handle counter and removes itself; `audit_compiled_hooks` then
    knows which hooks came after the graph was traced.

    Returns:
        `compiled`, for chaining.

    Raises:
        CompileError: `compiled` is not a `torch.compile` wrapper of a module.
    """
    if not isinstance(compiled, OptimizedModule):
        raise CompileError(f"track_compiled got a {type(compiled).__name__}, not the result "
                           "of torch.compile(module).",
                           fix="pass compiled = torch.compile(model).")
    if compiled in _FIRST_CALL:
        return compiled
    _FIRST_CALL[compiled] = None
    # "as_is": this hook belongs on the wrapper itself and must not change how it runs.
    session = HookSession(compiled, compiled="as_is")

    def stamp(module: nn.Module, _args: tuple[Any, ...]) -> None:
        if _FIRST_CALL.get(module) is None:
            _FIRST_CALL[module] = RemovableHandle.next_id
        session.close()  # one shot: the pre-hook loop iterates over a copy

    session.forward_pre_hook(compiled, stamp, prepend=True)
    return compiled


# ---------------------------------------------------------------------- hook audit
@dataclass(frozen=True)
class LateHook:
    """A hook registered on a compiled module after the wrapper's first call.

    Attributes:
        module: qualified name inside the original module (`""` is its root).
        kind: `forward`, `forward_pre`, `backward` or `backward_pre`.
        hook: the hook function's name.
        handle_id: its handle id (ids grow with every registration).
    """

    module: str
    kind: str
    hook: str
    handle_id: int


def late_hooks(compiled: nn.Module) -> tuple[LateHook, ...] | None:
    """Hooks registered inside the `torch.compile` wrapper `compiled` after its first call:
    `()` before that call, None when the wrapper was never tracked (`track_compiled`)."""
    if compiled not in _FIRST_CALL:
        return None
    first = _FIRST_CALL[compiled]
    if first is None:
        return ()
    orig: nn.Module = compiled._orig_mod  # type: ignore[assignment]
    return tuple(LateHook(name, kind, getattr(fn, "__name__", type(fn).__name__), hid)
                 for name, kind, hid, fn in iter_module_hooks(orig) if hid >= first)


def audit_compiled_hooks(
    model: nn.Module,
    *,
    inputs: Any = None,
    calls: int = 3,
    recompiles: Sequence[Recompile] = (),
) -> list[Finding]:
    """Flag hooks that a compiled model will silently skip or that recompile it every call.

    Args:
        model: a `torch.compile` wrapper, or a model holding some.
        inputs: when given, the model is called `calls` times on them (hooks included) while
            recompiles are watched, to catch hooks that force a recompile per call.
        calls: how many calls to make with `inputs`.
        recompiles: recompiles seen elsewhere (e.g. `RecompileWatcher.recompiles`) to explain.

    Returns:
        Findings: `compile.late_hook` (registered after the first call: never fires),
        `compile.hook_recompiles` (a hook's Python state is guarded, so every call
        recompiles until the limit, then the frame runs eagerly) and
        `compile.hooks_untracked` (first call not observed; use `compile_once`).
    """
    wrappers = [(n, m) for n, m in model.named_modules() if isinstance(m, OptimizedModule)]
    if not wrappers:
        return []
    seen = list(recompiles)
    if inputs is not None:
        mi = ModelInputs.of(inputs)
        with RecompileWatcher() as w:
            for _ in range(calls):
                model(*mi.args, **dict(mi.kwargs))
        seen.extend(w.recompiles)
    guarded = not bool(getattr(torch._dynamo.config, "skip_nnmodule_hook_guards", True))
    out: list[Finding] = []
    limit = recompile_limit()
    for wname, wrapper in wrappers:
        prefix = f"{wname}." if wname else ""
        late = late_hooks(wrapper)
        if late is None:
            out.append(_HOOKS_UNTRACKED.finding(
                Severity.INFO,
                f"{wname or 'the model'} was compiled without torchscope seeing its first "
                "call, so hooks added after it cannot be told apart.",
                {"module": wname},
                fix="compile with torchscope.compile_once(model) or call "
                    "torchscope.compile.track_compiled(compiled) before the first call.",
                module=wname or None))
        for h in late or ():
            where = prefix + (h.module or "<root>")
            effect = (": the next call recompiles to include it." if guarded else
                      " and will never fire: Dynamo does not guard on module hooks "
                      "(torch._dynamo.config.skip_nnmodule_hook_guards).")
            out.append(_LATE_HOOK.finding(
                Severity.ERROR if not guarded else Severity.WARNING,
                f"{h.kind} hook {h.hook} on {where} was registered after the first compiled "
                f"call{effect}",
                {"module": where, "kind": h.kind, "hook": h.hook, "handle_id": h.handle_id},
                fix="register hooks before the first compiled call, or call "
                    "torch._dynamo.reset() after registering; for inspection run the "
                    "model eagerly (torch.compiler.set_stance('force_eager')).",
                module=where))
        orig = wrapper._orig_mod
        counts: dict[tuple[str, str, str], list[Recompile]] = {}
        for r in seen:
            file, _, line = (r.source or "").rpartition(":")
            hit = hook_at(orig, file or None, int(line)) if line.isdigit() else None
            if hit is not None:
                counts.setdefault(hit, []).append(r)
        for (mod, kind, hook), recs in counts.items():
            where = prefix + mod
            out.append(_HOOK_RECOMPILES.finding(
                Severity.ERROR,
                f"{kind} hook {hook} on {where} forces a recompile on every call "
                f"({len(recs)} seen, limit {limit}): its Python state is part of the graph's "
                f"guards (`{recs[-1].guard}`). After {limit} recompiles torch gives up and "
                "runs the frame eagerly.",
                {"module": where, "kind": kind, "hook": hook, "recompiles": len(recs),
                 "limit": limit, "guard": recs[-1].guard},
                fix="keep hook state out of the guards: wrap the hook body with "
                    "torch.compiler.disable, store results in a preallocated tensor, or "
                    "capture with torchscope.activations on the eager model.",
                module=where))
    return rank(out)


# ---------------------------------------------------------------------- loop detector
def _key_of(fn: Any) -> tuple[Any, str]:
    """A weak-referenceable identity for what torch.compile got, and a label for it."""
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, nn.Module):  # nn.Module.compile() passes a bound _call_impl
        return owner, type(owner).__name__
    if isinstance(fn, nn.Module):
        return fn, type(fn).__name__
    func = getattr(fn, "__func__", fn)  # a bound method is a new object on every access
    return func, getattr(func, "__qualname__", type(func).__name__)


class CompileGuard:
    """Warn about the compile-in-a-loop trap and about recompiles that pile up.

    While open it wraps `torch.compile` (restored on exit) to count compiles per module or
    function, and watches every Dynamo recompile. Wrappers it sees are tracked for
    `audit_compiled_hooks`. Code that imported `compile` from torch before the block is not
    seen.

    Attributes:
        compile_calls: `{label: torch.compile calls}` for every target seen twice or more.
        recompiles: every recompile seen.
        warned: the text of every warning issued.
    """

    def __init__(self, *, repeat_warn_at: int = 2, recompile_warn_at: int | None = None) -> None:
        self._repeat_at = max(2, repeat_warn_at)
        self._recompile_at = max(1, recompile_warn_at or max(2, recompile_limit() // 2))
        self._counts: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._labels: dict[str, int] = {}
        self._per_frame: dict[tuple[str, str, int], int] = {}
        self._orig: Callable[..., Any] | None = None
        self._watcher = RecompileWatcher(on_recompile=self._on_recompile)
        self.warned: list[str] = []

    @property
    def compile_calls(self) -> dict[str, int]:
        """`{label: count}` of targets compiled at least twice."""
        return {k: v for k, v in self._labels.items() if v >= 2}

    @property
    def recompiles(self) -> list[Recompile]:
        """Every recompile seen while open."""
        return list(self._watcher.recompiles)

    def __enter__(self) -> CompileGuard:
        # First, so that a watcher that cannot start leaves torch.compile unpatched.
        self._watcher.install()
        orig = self._orig = torch.compile

        def counting_compile(model: Any = None, **kwargs: Any) -> Any:
            if model is None:  # @torch.compile(mode=...) used as a decorator factory
                return lambda fn: counting_compile(fn, **kwargs)
            self._count(model)
            out = orig(model, **kwargs)
            if isinstance(out, OptimizedModule):
                track_compiled(out)
            return out

        torch.compile = counting_compile
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if self._orig is not None:
            torch.compile = self._orig
            self._orig = None
        self._watcher.uninstall()
        if self._watcher.limit_hit and exc_type is None:
            self._warn(f"a compiled frame hit the recompile limit ({recompile_limit()}): "
                       f"{self._watcher.limit_hits[-1]}. torch now runs it eagerly.",
                       RecompileWarning, 3)

    def _warn(self, text: str, category: type[Warning], stacklevel: int) -> None:
        self.warned.append(text)
        warnings.warn(text, category, stacklevel=stacklevel)

    def _count(self, model: Any) -> None:
        key, label = _key_of(model)
        try:
            n = self._counts.get(key, 0) + 1
            self._counts[key] = n
        except TypeError:  # not weak-referenceable: count by label only
            n = self._labels.get(label, 0) + 1
        self._labels[label] = max(self._labels.get(label, 0), n)
        if n == self._repeat_at:
            self._warn(
                f"torch.compile was called {n}× on the same {label}: compile-in-a-loop. Every "
                "call builds a new wrapper and re-checks guards, and any change of options "
                "recompiles from scratch. Compile once before the loop: "
                "compiled = torchscope.compile_once(model).",
                CompileLoopWarning, 4)  # _warn, _count, counting_compile, the caller

    def _on_recompile(self, rec: Recompile) -> None:
        frame = (rec.function, rec.file, rec.line)
        n = self._per_frame.get(frame, 0) + 1
        self._per_frame[frame] = n
        if n == self._recompile_at:
            self._warn(
                f"{rec.where} recompiled {n}× (limit {recompile_limit()}); last failing "
                f"guard: {rec.guard}"
                + (f" (from {rec.source})" if rec.source else "")
                + ". At the limit torch stops compiling it and runs it eagerly.",
                RecompileWarning, 2)


def compile_guard(*, repeat_warn_at: int = 2, recompile_warn_at: int | None = None
                  ) -> CompileGuard:
    """A `CompileGuard` to wrap a training loop in.

    Example:
        >>> with torchscope.compile.compile_guard():
        ...     for x, y in loader:
        ...         loss = loss_fn(torch.compile(model)(x), y)   # warns: CompileLoopWarning
    """
    return CompileGuard(repeat_warn_at=repeat_warn_at, recompile_warn_at=recompile_warn_at)
