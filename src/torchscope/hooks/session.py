"""`HookSession`: the one owner of every hook handle torchscope creates.

A session registers hooks through its own methods, keeps each handle, and on exit removes
exactly those handles (never the user's), restores every `training` flag it changed, and
keeps only weak references to the model so that it never extends the model's life.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Literal, Protocol

import torch
from torch import nn

from torchscope.errors import TorchscopeError
from torchscope.hooks.compiled import (
    CompiledCapture,
    CompiledCheck,
    compiled_capture,
    compiled_parts,
    unwrap_compiled,
)
from torchscope.hooks.parallel import unwrap_parallel
from torchscope.hooks.select import hookable_modules
from torchscope.hooks.tree import iter_tensors


class _Removable(Protocol):
    def remove(self) -> None: ...


CompiledPolicy = Literal["eager", "refuse", "as_is"]

# Each with or without the call's keyword arguments (`with_kwargs=True`).
ForwardHook = Callable[[nn.Module, tuple[Any, ...], Any], Any] | \
    Callable[[nn.Module, tuple[Any, ...], dict[str, Any], Any], Any]
ForwardPreHook = Callable[[nn.Module, tuple[Any, ...]], Any] | \
    Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], Any]
TensorHook = Callable[[torch.Tensor], torch.Tensor | None]


def check_not_scripted(model: nn.Module) -> None:
    """Raise when `model` is a TorchScript module: it runs compiled code that calls no
    Python hook, and refuses to take one. (A scripted submodule is only left out: see
    `hookable_modules`.)

    Raises:
        TorchscopeError: `model` is a `torch.jit.ScriptModule`.
    """
    if isinstance(model, torch.jit.ScriptModule):
        raise TorchscopeError(
            f"the model is a TorchScript module ({type(model).__name__}, from "
            "torch.jit.script or torch.jit.trace): it runs compiled code that calls no "
            "Python hook, so nothing inside it can be measured.",
            fix="pass the eager module you scripted; to make it faster, torch.compile it "
            "instead (torchscope sees through torch.compile).")


class HookSession:
    """Owns the hooks torchscope puts on one model, and takes them all off again.

    Use it as a context manager. It stays open across `forward()` and `backward()`, so
    backward hooks fire while it is open. On exit, even through an exception or a
    `KeyboardInterrupt`, it removes exactly the hooks it added, in reverse order, and
    restores each `training` flag it changed. Nested sessions on the same model each remove
    only their own hooks.

    The session holds the model by weak reference: a model dropped by the user is garbage
    collected even while a session object is still alive.

    A `DistributedDataParallel` (or `DataParallel`) wrapper is seen through: hooks go on the
    module it wraps, under the same names as on one process, while the wrapper's forward (and
    its gradient synchronisation) still runs. FSDP2 modules are hooked as they are.

    A `torch.compile`d model (or one with compiled parts) is handled here, once for every
    capability: the session works on the original module behind the wrapper, and while it
    holds hooks the compiled parts run eagerly (`torch.compiler.set_stance("force_eager")`),
    because hooks added after the first compiled call would never fire. Dynamo compiles
    seen meanwhile are counted in `compiled_check`; more than none raises `CompileError`.
    With `compiled="refuse"` a compiled model raises `CompileError` instead; `"as_is"` hooks
    exactly the modules given, wrappers included, and changes nothing about compilation.

    Example:
        >>> with HookSession(model) as s:
        ...     s.forward_hook(model.fc, lambda m, i, o: None)
        ...     model(x).sum().backward()
    """

    def __init__(self, model: nn.Module, *, compiled: CompiledPolicy = "eager") -> None:
        self._compiled_guard: CompiledCapture | None = None
        self.compiled_check: CompiledCheck | None = None  # set when the model is compiled
        # torch.compile imports torch._dynamo: without it nothing can be compiled.
        if compiled != "as_is":
            if "torch._dynamo" in sys.modules and compiled_parts(model):
                self._compiled_guard = compiled_capture(model, policy=compiled, what="torchscope")
                self.compiled_check = self._compiled_guard.check
            # Hook the module itself, not a DDP or compile wrapper: the same names as on one
            # process, and hooks that fire (compiled parts run eagerly, see above).
            model = unwrap_parallel(model)
            if "torch._dynamo" in sys.modules:
                model = unwrap_compiled(model)
        check_not_scripted(model)
        self._model_ref: weakref.ReferenceType[nn.Module] = weakref.ref(model)
        self._guard_entered = False
        self._handles: list[_Removable] = []
        self._saved_flags: list[tuple[weakref.ReferenceType[nn.Module], bool]] = []
        # Parameters whose post-accumulate-grad hook dict this session made (see
        # `post_accumulate_grad_hook`).
        self._made_dicts: list[weakref.ReferenceType[torch.Tensor]] = []
        self._closed = False
        self._stack: list[str] | None = None
        # Forward hooks taken off the submodules by `suspend`: (hook dict, key order, the
        # hooks taken out by key), put back by `resume`.
        self._suspended: list[tuple[dict[int, Any], list[int], dict[int, Any]]] = []
        # Set by `suspend` even where it took nothing (hooks only on the model itself), so
        # that a watch suspended at every unsampled step does not walk the model each time.
        self._asleep = False

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> HookSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(failed=exc[0] is not None)

    def close(self, *, failed: bool = False) -> None:
        """Remove every hook this session added and restore changed state. Safe to call twice.

        Args:
            failed: the caller is unwinding an exception; a compile-count check must not
                replace it.
        """
        try:
            self._suspended.clear()  # their handles are removed below: nothing to put back
            while self._handles:
                self._handles.pop().remove()
            while self._made_dicts:
                param = self._made_dicts.pop()()
                if param is not None and not param._post_accumulate_grad_hooks:
                    # torch types it as a dict, but None is what it holds before any hook.
                    param._post_accumulate_grad_hooks = None  # type: ignore[assignment]
        finally:
            while self._saved_flags:
                ref, flag = self._saved_flags.pop()
                module = ref()
                if module is not None:
                    module.training = flag
            self._closed = True
            guard = self._compiled_guard
            if self._guard_entered and guard is not None:
                self._guard_entered = False
                try:
                    guard.__exit__(RuntimeError if failed else None, None, None)
                finally:
                    self.compiled_check = guard.check

    @property
    def closed(self) -> bool:
        """True once `close()` has run."""
        return self._closed

    @property
    def compiled(self) -> tuple[str, ...]:
        """The model's compiled parts (qualified names, `""` the root), which run eagerly
        while this session holds hooks; empty for a model with none."""
        return self.compiled_check.compiled if self.compiled_check is not None else ()

    @property
    def model(self) -> nn.Module:
        """The model, while it is alive.

        Raises:
            ReferenceError: the model was garbage collected.
        """
        model = self._model_ref()
        if model is None:
            raise ReferenceError("the model of this HookSession was garbage collected")
        return model

    @property
    def handle_count(self) -> int:
        """How many hooks this session currently owns."""
        return len(self._handles)

    # ------------------------------------------------------------------ state
    def set_training(self, mode: bool) -> None:
        """Put the model in train or eval mode; the old flag of every module is restored on exit.

        Raises:
            TorchscopeError: the session is closed, so nothing would restore the flags.
        """
        self._check_open()
        for module in self.model.modules():
            self._saved_flags.append((weakref.ref(module), module.training))
        self.model.train(mode)

    # ------------------------------------------------------------------ registration
    def track(self, handle: _Removable) -> _Removable:
        """Take ownership of a handle created elsewhere; it is removed on exit."""
        self._check_open()
        self._handles.append(handle)
        if self._compiled_guard is not None and not self._guard_entered:
            # From the first hook on, compiled parts must run eagerly for hooks to fire.
            self._compiled_guard.__enter__()
            self._guard_entered = True
        return handle

    def release(self, handles: Iterable[_Removable]) -> None:
        """Remove these handles now and stop owning them.

        For hooks that live one step (tensor hooks on a step's activations): releasing them
        each step keeps a long-running session from accumulating handles.
        """
        doomed = {id(h): h for h in handles}
        if not doomed:
            return
        for h in doomed.values():
            h.remove()
        self._handles = [h for h in self._handles if id(h) not in doomed]

    def forward_hook(
        self,
        module: nn.Module,
        fn: ForwardHook,
        *,
        always_call: bool = False,
        with_kwargs: bool = False,
        prepend: bool = False,
    ) -> _Removable:
        """Register a forward hook on `module`, owned by this session."""
        self._check_open()
        return self.track(
            module.register_forward_hook(
                fn, always_call=always_call, with_kwargs=with_kwargs, prepend=prepend
            )
        )

    def forward_pre_hook(
        self,
        module: nn.Module,
        fn: ForwardPreHook,
        *,
        with_kwargs: bool = False,
        prepend: bool = False,
    ) -> _Removable:
        """Register a forward-pre hook on `module`, owned by this session."""
        self._check_open()
        return self.track(
            module.register_forward_pre_hook(fn, with_kwargs=with_kwargs, prepend=prepend)
        )

    def full_backward_hook(
        self, module: nn.Module, fn: Callable[..., Any], *, prepend: bool = False
    ) -> _Removable:
        """Register a full backward hook on `module`, owned by this session."""
        self._check_open()
        return self.track(module.register_full_backward_hook(fn, prepend=prepend))

    def backward_pre_hook(
        self, module: nn.Module, fn: Callable[..., Any], *, prepend: bool = False
    ) -> _Removable:
        """Register a full backward-pre hook on `module`, owned by this session."""
        self._check_open()
        return self.track(module.register_full_backward_pre_hook(fn, prepend=prepend))

    def tensor_hook(self, tensor: torch.Tensor, fn: TensorHook) -> _Removable:
        """Register a gradient hook on a tensor (for example a module output), owned here."""
        self._check_open()
        return self.track(tensor.register_hook(fn))

    def post_accumulate_grad_hook(
        self, param: torch.Tensor, fn: Callable[[torch.Tensor], None]
    ) -> _Removable:
        """Register a post-accumulate-grad hook on a leaf tensor (a parameter), owned here."""
        self._check_open()
        if param._post_accumulate_grad_hooks is None:
            # torch makes the dict on the first registration and keeps it, with a C++ hook
            # that calls into Python at every accumulation; `close` puts None back.
            self._made_dicts.append(weakref.ref(param))
        return self.track(param.register_post_accumulate_grad_hook(fn))

    # ------------------------------------------------------------------ suspension
    @property
    def suspended(self) -> bool:
        """Whether `suspend` has taken hooks off the submodules that `resume` has not put
        back."""
        return bool(self._suspended)

    def suspend(self) -> None:
        """Take this session's forward and forward-pre hooks off every submodule of the
        model (not the model's own), keeping them here: a module without hooks runs
        torch's fast path, a hooked one pays a Python call per hook and torch's slow path
        at every call. For the steps a watch does not sample. `resume` puts them back, in
        their places among any other hooks. Safe to call twice."""
        if self._asleep or self._closed:
            return
        self._asleep = True
        root = self.model
        dicts: dict[int, dict[int, Any]] = {}
        for module in root.modules():
            if module is not root:
                for d in (module._forward_pre_hooks, module._forward_hooks):
                    dicts[id(d)] = d
        taken: dict[int, tuple[dict[int, Any], list[int], dict[int, Any]]] = {}
        for h in self._handles:
            ref = getattr(h, "hooks_dict_ref", None)
            found = ref() if ref is not None else None
            key = getattr(h, "id", None)
            if found is None or id(found) not in dicts or not isinstance(key, int) or \
                    key not in found:
                continue
            d = dicts[id(found)]
            entry = taken.get(id(d))
            if entry is None:
                entry = taken[id(d)] = (d, list(d), {})
            entry[2][key] = d.pop(key)
        self._suspended = list(taken.values())

    def resume(self) -> None:
        """Put back the hooks `suspend` took off, each where it was among the module's
        hooks (hooks added meanwhile come after them), but those whose handle this session
        no longer holds (released meanwhile)."""
        self._asleep = False
        if not self._suspended:
            return
        held = {getattr(h, "id", None) for h in self._handles}
        for d, order, hooks in self._suspended:
            for key, fn in hooks.items():
                if key in held:
                    d[key] = fn
            newer = [k for k in d if k not in hooks and k not in order]
            for key in [*order, *newer]:
                if key in d:
                    d.move_to_end(key)  # type: ignore[attr-defined]  # an OrderedDict
        self._suspended = []

    def backward_updates(self) -> bool:
        """Whether the backward pass running now accumulates a gradient into a trainable
        parameter of the model, as autograd has planned it: not `torch.autograd.grad` (a
        gradient penalty's, an adversarial attack's input gradient), nor `backward(inputs=)`
        that leaves the parameters out. Call it from an autograd hook.

        Also True when the model has no trainable parameter, and for FSDP2's sharded
        parameters, which are not the tensors autograd accumulates into.
        """
        trainable = False
        for p in self.model.parameters():
            if not p.requires_grad:
                continue
            if type(p).__name__ == "DTensor":  # FSDP2 (torch.distributed is a layer up)
                return True
            trainable = True
            # The parameter's AccumulateGrad node: one in this pass's graph, or a new one
            # (dropped at once) that no pass will run.
            if torch._C._will_engine_execute_node(
                    torch.autograd.graph.get_gradient_edge(p).node):
                return True
        return not trainable

    def when_reached(self, output: Any, fn: Callable[[], None]) -> list[_Removable] | None:
        """Call `fn` once, when a backward that updates the model's parameters
        (`backward_updates`) first reaches a tensor of `output` (a module's output: a
        forward whose graph is dropped, or that only an attack's `autograd.grad` reaches,
        never gets there).

        Pre-hooks on the tensors' autograd nodes, owned here, come off when it fires.

        Returns:
            Their handles (`release` them to stop waiting), or None when no tensor of
            `output` has an autograd node, so that no backward can reach it.
        """
        self._check_open()
        nodes = {id(t.grad_fn): t.grad_fn for _, t in iter_tensors(output)
                 if t.grad_fn is not None}
        if not nodes:
            return None
        handles: list[_Removable] = []

        def reached(_grad_outputs: Any) -> None:
            # The first node an updating backward reaches; the others are let go.
            if handles and self.backward_updates():
                self.release(handles)
                handles.clear()
                fn()

        handles += [self.track(node.register_prehook(reached)) for node in nodes.values()]
        return handles

    # ------------------------------------------------------------------ module stack
    def enable_module_stack(self) -> list[str]:
        """Keep a stack of the qualified names of the modules currently in `forward`.

        Returns the live list (innermost module last). Pops use `always_call=True`, so the
        stack unwinds even when a forward raises an `Exception`; torch runs no forward hook
        after a `KeyboardInterrupt`, so the root's next forward starts the stack afresh.
        """
        if self._stack is not None:
            return self._stack
        stack: list[str] = []
        self._stack = stack
        for name, module in hookable_modules(self.model):

            def push(_m: nn.Module, _a: tuple[Any, ...], _n: str = name) -> None:
                if not _n:
                    stack.clear()  # names an interrupted forward never popped
                stack.append(_n)

            def pop(_m: nn.Module, _a: tuple[Any, ...], _o: Any, _n: str = name) -> None:
                # Pop down to this module: a child that raised never popped itself.
                while stack:
                    if stack.pop() == _n:
                        break

            self.forward_pre_hook(module, push)
            self.forward_hook(module, pop, always_call=True)
        return stack

    def _check_open(self) -> None:
        if self._closed:
            raise TorchscopeError(
                "this HookSession is closed; it removed its hooks on exit.",
                fix="open a new session (a `with` block) for each capture.",
            )
