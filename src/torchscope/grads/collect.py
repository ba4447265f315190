"""Gradient collection with tensor hooks: per-call grad_output / grad_input norms and
per-parameter norms, without `register_full_backward_hook`.

Why not full backward hooks: they wrap module outputs in a custom autograd Function whose
outputs are views, so an in-place op after the module (`nn.ReLU(inplace=True)`,
`x.relu_()`) raises. Here instead:

- grad_output: a tensor hook on each output, registered in a forward hook. A hook
  registered before an in-place change still receives the gradient of the value the module
  produced (autograd keeps it on the original node).
- grad_input: each tensor input that requires grad is replaced by `x.view_as(x)` in a
  forward-pre hook, and a hook on that alias sees exactly the gradient this call passes
  down (other consumers of `x` do not flow through the alias). A module that changes its
  input in place (`inplace=True`, or the alias' version moved during forward) is measured
  instead on the autograd node that the in-place op put in front of the original producer.
- parameters: post-accumulate-grad hooks, which see `.grad` after accumulation, mark the
  parameter; when the backward ends, one `torch._foreach_norm` measures every marked
  `.grad` (one call for the whole model instead of one reduction per parameter).

Every hook only enqueues a device reduction, one read of each gradient: the fused `norm`
kernel of `torchscope._kernels` (float64 accumulation) once it is ready, `vector_norm`
before that and wherever it cannot run. `finish()` stacks those 0-d tensors and copies them
to the host once per step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from torchscope import _kernels
from torchscope.grads.records import (
    FROZEN,
    INPUT_NO_GRAD,
    NO_GRAD,
    NOT_MEASURED,
    NOT_REACHED,
    OUTPUT_NO_GRAD,
    GradFlow,
    ModuleGradRecord,
    ParamGradRecord,
    TensorGrad,
    combine_norms,
)
from torchscope.hooks.lifecycle import HookedContext
from torchscope.hooks.select import Selector, select_modules
from torchscope.hooks.session import HookSession
from torchscope.hooks.tree import iter_tensors
from torchscope.step import StepInfo

__all__ = ["GradCollector"]

_HALF = (torch.float16, torch.bfloat16)
_MAX_WALK = 256  # nodes followed back from an in-place op to the input's producer


class _Slot:
    """One tensor of one call; the hook fills `val`, the index of its norm in `_vals`."""

    __slots__ = ("dtype", "path", "reason", "same_as", "shape", "use_node", "val")

    def __init__(self, path: str, t: torch.Tensor, reason: str | None = None) -> None:
        self.path = path
        self.shape = tuple(t.shape)
        self.dtype = str(t.dtype)
        self.val: int | None = None
        self.reason = reason
        self.use_node = False  # measured on an autograd node; ignore the alias hook
        self.same_as: _Slot | None = None  # the same tensor passed again: one measurement

    def root(self) -> _Slot:
        """The slot that holds the measurement, following `same_as`."""
        s = self
        while s.same_as is not None:
            s = s.same_as
        return s


@dataclass(slots=True, eq=False)
class _Call:
    """Bookkeeping of one module call during a sampled step (no tensors kept)."""

    module: str
    module_type: str
    micro: int
    call: int
    seq: int
    owns_params: bool
    order: int | None = None
    ins: list[_Slot] = field(default_factory=list)
    outs: list[_Slot] = field(default_factory=list)


@dataclass
class _PendingInput:
    """An input between the pre-hook and the forward hook of one call."""

    slot: _Slot
    tensor: torch.Tensor  # the alias, or the input itself for in-place modules
    producer: Any  # the input's grad_fn before the call (an autograd Node or None)
    version: int
    aliased: bool


@dataclass
class _Intake:
    """Inputs of one call between its pre-hook and its forward hook."""

    call: _Call
    inplace: bool
    pending: list[_PendingInput] = field(default_factory=list)
    seen: dict[int, tuple[torch.Tensor, _Slot]] = field(default_factory=dict)


def _is_plain(t: torch.Tensor) -> bool:
    return t.layout == torch.strided and (type(t) is torch.Tensor or isinstance(t, nn.Parameter))


def _find_inplace_node(start: Any, producer: Any) -> Any:
    """The node whose first edge leads to `producer`, walking back along first edges."""
    node = start
    for _ in range(_MAX_WALK):
        if node is None or not node.next_functions:
            return None
        nxt = node.next_functions[0][0]
        if nxt is producer:
            return node
        node = nxt
    return None


class GradCollector(HookedContext):
    """Collects gradient norms while its `HookSession` is open.

    Set `active` to False to make every hook return at once (unsampled steps). Call
    `finish(index)` after the step's backward(s) to get its `GradFlow` and reset.

    Args:
        model: the model.
        select: modules to record per call (see `select_modules`); default the leaves.
        depth: limit the selection depth.
        inputs: also measure grad_input (aliases each input; set False to skip).
        scaler: a `torch.amp.GradScaler` whose scale is divided out of every norm.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        select: Selector = None,
        depth: int | None = None,
        inputs: bool = True,
        scaler: Any = None,
    ) -> None:
        self._session = HookSession(model)
        model = self._session.model  # a torch.compile wrapper is unwrapped: plain names
        self._targets = select_modules(model, select, depth=depth)
        self._inputs = inputs
        self._scaler = scaler
        self.active = True
        self.on_backward_end: Callable[[], None] | None = None
        self._params: list[tuple[str, str, nn.Parameter]] = []
        seen: set[int] = set()
        for mname, module in model.named_modules():
            for pname, p in module.named_parameters(recurse=False):
                if id(p) in seen:
                    continue  # tied weights: counted once, as clip_grad_norm_ does
                seen.add(id(p))
                self._params.append((f"{mname}.{pname}" if mname else pname, mname, p))
        self._bw_queued = False
        # Per hooked module: its calls between pre-hook and forward hook.
        self._in_flight: list[list[tuple[_Call, list[_PendingInput]] | None]] = []
        self._reset()

    # ------------------------------------------------------------------ lifecycle
    @property
    def session(self) -> HookSession:
        """The session that owns every hook of this collector."""
        return self._session

    @property
    def backward_calls(self) -> int:
        """Backward passes seen in the current step."""
        return self._backwards

    def open(self) -> None:
        """Register the hooks (module hooks, one post-accumulate hook per parameter)."""
        s = self._session
        s.forward_pre_hook(s.model, self._on_root_forward, prepend=True)
        for name, module in self._targets:
            pre, post = self._make_module_hooks(name, module)
            s.forward_pre_hook(module, pre, with_kwargs=True)
            s.forward_hook(module, post, always_call=True)
        for i, (_, _, p) in enumerate(self._params):
            if p.requires_grad:
                s.post_accumulate_grad_hook(p, self._make_param_hook(i))

    def close(self, *, failed: bool = False) -> None:
        """Remove every hook; step state is dropped.

        The modules and parameters are forgotten too, so that a collector (or a `GradWatch`)
        kept for its results does not keep the model's weights alive.
        """
        self._session.close(failed=failed)
        self._targets = []
        self._params = []
        self._in_flight = []
        self._reset()

    def _reset(self) -> None:
        self._vals: list[torch.Tensor] = []  # 0-d norms on the gradients' devices
        self._calls: list[_Call] = []
        self._param_vals: dict[int, int] = {}  # param index -> index in _vals
        self._param_due: dict[int, torch.Tensor] = {}  # accumulated, not measured yet
        self._fused_norms = 0
        self._eager_norms = 0
        self._order = 0
        self._seq = 0
        self._micro = -1
        self._counts: dict[str, int] = {}
        self._step_handles: list[Any] = []
        self._backwards = 0
        # The previous gradient: weak ref to its storage, identity key, index of its norm.
        self._last: tuple[StorageWeakRef, tuple[Any, ...], int] | None = None

    # ------------------------------------------------------------------ hooks
    def _on_root_forward(self, _m: nn.Module, _args: tuple[Any, ...]) -> None:
        self._bw_queued = False  # a backward that raised never ran its end callback
        for stack in self._in_flight:
            # torch runs no forward hook after a KeyboardInterrupt: drop the calls (and the
            # input aliases, which hold their graph) that an interrupted forward left here.
            stack.clear()
        if self.active and torch.is_grad_enabled():  # eval forwards are no micro-batch
            self._micro += 1
            self._counts = {}

    def _push(self, g: torch.Tensor) -> int:
        t = g.detach()
        if t.is_sparse:
            t = t.coalesce().values()
        # The gradient a layer passes down usually reaches the layer below as a view of the
        # same memory (through the input alias): reuse its norm. A weak reference to the
        # storage proves the memory was not freed and reused in between, and the shared
        # version counter that nothing wrote to it; a strong reference would instead stop
        # autograd from accumulating into that buffer in place.
        key = (t.data_ptr(), t.numel(), t.dtype, t.device, t._version,
               tuple(t.shape), t.stride(), t.is_contiguous())
        last = self._last
        if last is not None and t.numel() > 0:
            ref, prev, index = last
            if (key[:5] == prev[:5] and (key[5:7] == prev[5:7] or (key[7] and prev[7]))
                    and not ref.expired()):
                return index
        # One read of the gradient: the fused kernel (float64 sums), or eager `vector_norm`
        # with half precision summed in float32 so that it cannot overflow.
        n = _kernels.run("norm", t)  # () on g.device
        if n is not None:
            self._fused_norms += 1
        else:
            self._eager_norms += 1
            n = torch.linalg.vector_norm(t, dtype=torch.float32) if t.dtype in _HALF else \
                torch.linalg.vector_norm(t)  # () on g.device
        self._vals.append(n)
        index = len(self._vals) - 1
        self._last = (StorageWeakRef(t.untyped_storage()), key, index)
        return index

    def _queue_end(self) -> None:
        if self._bw_queued:
            return
        self._bw_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        self._bw_queued = False
        self._measure_params()
        self._last = None
        self._backwards += 1
        if self.on_backward_end is not None:
            self.on_backward_end()

    def _measure_params(self) -> None:
        """The norms of every parameter gradient accumulated in this backward: one
        `torch._foreach_norm` per dtype group (half precision summed in float32)."""
        due, self._param_due = self._param_due, {}
        groups: dict[bool, list[tuple[int, torch.Tensor]]] = {}
        for index, p in due.items():
            g = p.grad
            if g is None:
                continue
            if g.is_sparse or g.layout != torch.strided:
                self._param_vals[index] = self._push(g)  # foreach takes strided tensors only
                continue
            groups.setdefault(g.dtype in _HALF, []).append((index, g))
        with torch.no_grad():  # a create_graph backward leaves .grad requiring grad
            for half, items in groups.items():
                norms = torch._foreach_norm([g for _, g in items], 2,  # () each
                                            dtype=torch.float32 if half else None)
                for (index, _), n in zip(items, norms, strict=True):
                    self._vals.append(n)
                    self._param_vals[index] = len(self._vals) - 1

    def _make_param_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            self._queue_end()
            if self.active and p.grad is not None:
                self._param_due[index] = p  # measured with the others when backward ends

        return hook

    def _output_hook(self, slot: _Slot, call: _Call) -> Callable[[torch.Tensor], None]:
        def hook(g: torch.Tensor) -> None:
            slot.val = self._push(g)
            if call.order is None:
                call.order = self._order
                self._order += 1
            self._queue_end()

        return hook

    def _input_hook(self, slot: _Slot) -> Callable[[torch.Tensor], None]:
        def hook(g: torch.Tensor) -> None:
            if not slot.use_node:
                slot.val = self._push(g)

        return hook

    def _node_hook(self, slot: _Slot) -> Callable[[Any, Any], None]:
        def hook(grad_inputs: tuple[torch.Tensor | None, ...], _grad_outputs: Any) -> None:
            if grad_inputs and grad_inputs[0] is not None:
                slot.val = self._push(grad_inputs[0])

        return hook

    def _take_input(self, intake: _Intake, path: str, t: torch.Tensor) -> torch.Tensor:
        """Record one tensor input; return what the module should receive instead."""
        slot = _Slot(path, t)
        intake.call.ins.append(slot)
        hit = intake.seen.get(id(t))
        if hit is not None:
            # The same tensor again (self-attention's query is key is value): hand out the
            # same alias so identity checks inside the module still hold.
            slot.same_as = hit[1]
            return hit[0]
        given = t
        if not t.requires_grad:
            slot.reason = INPUT_NO_GRAD
        elif not _is_plain(t):
            slot.reason = NOT_MEASURED
        elif intake.inplace:
            intake.pending.append(_PendingInput(slot, t, t.grad_fn, t._version, aliased=False))
        else:
            given = t.view_as(t)  # same storage; its gradient is this call's share only
            self._step_handles.append(self._session.tensor_hook(given, self._input_hook(slot)))
            intake.pending.append(
                _PendingInput(slot, given, t.grad_fn, given._version, aliased=True))
        intake.seen[id(t)] = (given, slot)
        return given

    def _make_module_hooks(self, name: str, module: nn.Module) -> tuple[Any, Any]:
        stack: list[tuple[_Call, list[_PendingInput]] | None] = []
        self._in_flight.append(stack)
        type_name = type(module).__name__
        owns = next(module.parameters(recurse=False), None) is not None
        inplace = getattr(module, "inplace", False) is True

        def pre(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            # Skip checkpoint recomputation: it runs forward again inside backward.
            if not self.active or not torch.is_grad_enabled() or \
                    torch._C._current_autograd_node() is not None:
                stack.append(None)
                return None
            count = self._counts.get(name, 0)
            self._counts[name] = count + 1
            call = _Call(name, type_name, max(self._micro, 0), count, self._seq, owns)
            self._seq += 1
            intake = _Intake(call, inplace)
            changed = False
            new_args = list(args)
            new_kwargs = dict(kwargs)
            if self._inputs:
                for i, a in enumerate(args):
                    if isinstance(a, torch.Tensor):
                        new_args[i] = self._take_input(intake, f"[{i}]", a)
                        changed = changed or new_args[i] is not a
                for k, v in kwargs.items():
                    if isinstance(v, torch.Tensor):
                        new_kwargs[k] = self._take_input(intake, f"[{k!r}]", v)
                        changed = changed or new_kwargs[k] is not v
            stack.append((call, intake.pending))
            return (tuple(new_args), new_kwargs) if changed else None

        def post(_m: nn.Module, _args: tuple[Any, ...], output: Any) -> None:
            entry = stack.pop() if stack else None
            if entry is None:
                return
            call, pending = entry
            untouched: list[_PendingInput] = []
            for p in pending:
                if p.tensor._version == p.version:
                    if not p.aliased:
                        untouched.append(p)
                    continue
                # Changed in place during this call: the alias' own node left the graph.
                base = p.tensor._base if p.aliased and p.tensor._base is not None else p.tensor
                node = _find_inplace_node(base.grad_fn, p.producer) \
                    if p.producer is not None else None
                if node is None:
                    p.slot.reason = NOT_MEASURED
                    p.slot.use_node = True
                    continue
                p.slot.use_node = True
                self._step_handles.append(self._session.track(
                    node.register_hook(self._node_hook(p.slot))))
            outs: dict[int, _Slot] = {}
            for path, t in iter_tensors(output):
                if t.requires_grad and torch.is_grad_enabled():
                    slot = _Slot(path, t)
                    self._step_handles.append(
                        self._session.tensor_hook(t, self._output_hook(slot, call)))
                else:
                    slot = _Slot(path, t, OUTPUT_NO_GRAD)
                call.outs.append(slot)
                outs.setdefault(id(t), slot)
            for p in untouched:
                # An in-place module that left its input alone (Dropout in eval) and returned
                # it: what it passes down is what it receives.
                same = outs.get(id(p.tensor))
                if same is not None:
                    p.slot.same_as = same
                else:
                    p.slot.reason = NOT_MEASURED
            self._calls.append(call)

        return pre, post

    # ------------------------------------------------------------------ results
    def _to_host(self) -> list[float]:
        """Every pending norm as a float: one stack and one host copy per device/dtype."""
        out = [math.nan] * len(self._vals)
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, v in enumerate(self._vals):
            groups.setdefault((v.device, v.dtype), []).append(i)
        for idx in groups.values():
            host = torch.stack([self._vals[i] for i in idx]).cpu().tolist()  # (n,) -> host
            for i, x in zip(idx, host, strict=True):
                out[i] = float(x)
        return out

    def _scale(self) -> float | None:
        scaler = self._scaler
        if scaler is None or not getattr(scaler, "is_enabled", lambda: True)():
            return None
        return float(scaler.get_scale())

    def discard(self) -> None:
        """Drop whatever the current step measured, and its hooks."""
        self._session.release(self._step_handles)
        self._reset()

    def finish(self, index: int, *, step: StepInfo | None = None) -> GradFlow:
        """Turn the current step's measurements into a `GradFlow` and start a new step.

        Args:
            index: the step's index, as `GradFlow.index`.
            step: the training step torchscope ran, when it ran one.
        """
        self._measure_params()  # a backward that raised never ran its end callback
        host = self._to_host()
        scale = self._scale()
        inv = 1.0 / scale if scale else 1.0

        def norm_of(val: int | None) -> float | None:
            return None if val is None else host[val] * inv

        def tensor_grad(s: _Slot) -> TensorGrad:
            n = norm_of(s.root().val)
            reason = None if n is not None else (s.reason or s.root().reason or NOT_REACHED)
            return TensorGrad(s.path, s.shape, s.dtype, n, reason)

        calls = sorted(self._calls, key=lambda c: (c.order is None, c.order or 0, c.seq))
        modules = tuple(
            ModuleGradRecord(
                c.module, c.module_type, index, c.micro, c.call, c.order,
                tuple(tensor_grad(s) for s in c.outs),
                tuple(tensor_grad(s) for s in c.ins),
                c.owns_params,
            )
            for c in calls
        )
        called = {c.module for c in self._calls}
        params = []
        for i, (pname, mname, p) in enumerate(self._params):
            n = norm_of(self._param_vals.get(i))
            if not p.requires_grad:
                reason: str | None = FROZEN
            elif n is None:
                reason = NOT_REACHED if mname in called else NO_GRAD
            else:
                reason = None
            params.append(ParamGradRecord(pname, mname, tuple(p.shape), str(p.dtype),
                                          p.requires_grad, n, reason))
        total = combine_norms(p.norm for p in params) or 0.0
        flow = GradFlow(index, modules, tuple(params), total, scale,
                        micro_batches=max(self._micro + 1, 1 if self._calls else 0),
                        backward_calls=self._backwards, step=step,
                        fused_norms=self._fused_norms, eager_norms=self._eager_norms)
        self.discard()
        return flow
