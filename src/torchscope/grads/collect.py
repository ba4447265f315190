"""Gradient collection with autograd hooks: per-call grad_output / grad_input norms and
per-parameter norms, without `register_full_backward_hook`.

Why not full backward hooks: they wrap module outputs in a custom autograd Function whose
outputs are views, so an in-place op after the module (`nn.ReLU(inplace=True)`,
`x.relu_()`) raises. Here instead:

- grad_output: a post-hook on the autograd node that produced each output, registered in
  a forward hook (a tensor hook only for an output without one, a leaf). The node keeps the
  gradient of the value the module produced even when the output is changed in place later.
- grad_input, read without putting anything into the graph, by one of two routes:
  - walking the call: a forward-pre hook notes each tensor input's edge into the graph and
    autograd's next sequence number; the forward hook walks the nodes behind the outputs
    that the call made (`_consumers`) and finds every place where each input is consumed.
    Their grad_inputs at those edges add up to exactly what the call passes down
    (`_put_part` adds them where there are several). An alias of each input would be one
    hook, but it adds the call's own uses of the input up before the input's other uses,
    where autograd adds them in the order they arrive: other float sums, and gradients off
    in the last bits (an RMSNorm uses its input twice, and the residual stream once more).
  - the graph, for a `torch.nn` leaf (Conv2d, Linear, BatchNorm2d, ReLU, ...) once one of
    its walked calls has shown that each input is consumed at exactly one autograd node
    behind its outputs, with nothing but parameters besides (`_entry_points`): later calls
    take no pre-hook, and that node's grad_input at that edge is read by the same post-hook
    as the output, so one hook serves a call. Each call is checked again; one that does
    not fit leaves its input unmeasured (`NOT_MEASURED`) and sends the module back to
    walking. A module of the user's code is walked at every call. A use of an input outside
    the call (kept on the module for a later loss term) is not the call's.

  Inside the root module's forward, a graph-read call's forward hook only notes what its
  tensors are; its nodes are hooked when the root returns, all together, where Python runs
  at a fraction of the cost it has right after a layer (`_read_simple_calls`).

  A module that changes its input in place (`inplace=True`, or the input's version moved
  during the call) is measured instead on the autograd node that the in-place op put in
  front of the original producer.
- parameters: post-accumulate-grad hooks, which see `.grad` after accumulation, mark the
  parameter; when the backward ends, one call measures every marked `.grad` (one for the
  whole model instead of one reduction per parameter: see `_norms`).

Every hook only enqueues a device reduction, one read of each gradient: the fused `norm`
kernel of `torchscope._kernels` (float32 spans summed in float64 on CPU float32, float64
sums elsewhere) once it is ready, `vector_norm`
before that and wherever it cannot run. `finish()` stacks those 0-d tensors and copies them
to the host once per step.

On a DDP or FSDP2 model (`_RankAware`) the parameter hooks see what this rank holds: under
DDP its own accumulated gradient, before DDP's all-reduce (torch runs a tensor's
post-accumulate-grad hooks before the reducer's hook on the same accumulator); under FSDP2
the local shard of the reduce-scattered gradient (FSDP2 runs these hooks itself, after the
reduce-scatter; a `register_hook` on its DTensor parameters would never fire). Under DDP
the synchronised gradients are read at the very end of backward, in an autograd callback
queued after DDP's own (the one that writes the averaged gradients into `.grad`), so that
a loop that clips before `opt.step()` does not have its clipped gradients reported.
`finish()` exchanges every rank's numbers in one all_gather: the only communication, once
per sampled step; or, with `hold_ranks` under DDP (a watch's), keeps them for one all_gather
at the watch's end (`HeldRanks`), the step's records taking this rank's own meanwhile.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Literal, NamedTuple

import torch
from torch import nn

from torchscope import _kernels
from torchscope.distributed.comm import (
    all_gather_tensor,
    all_gather_tensor_later,
    comm_device,
)
from torchscope.distributed.world import (
    fsdp1_module,
    is_dtensor,
    local_tensor,
    strategy_of,
    world,
)
from torchscope.errors import TorchscopeError
from torchscope.grads.loss import OutputEdge, output_edges
from torchscope.grads.records import (
    FROZEN,
    INPUT_NO_GRAD,
    NO_GRAD,
    NOT_MEASURED,
    NOT_REACHED,
    NOT_RUN,
    OUTPUT_NO_GRAD,
    PASSES_UNSUMMED,
    RAN_IN_REENTRANT_CHECKPOINT,
    RAN_NO_GRAD,
    GradFlow,
    ModuleGradRecord,
    ParamGradRecord,
    RankGrads,
    TensorGrad,
    combine_norms,
)
from torchscope.hooks.checkpoints import in_backward, in_reentrant_forward
from torchscope.hooks.lifecycle import HookedContext
from torchscope.hooks.parallel import parallel_wrapper
from torchscope.hooks.select import (
    Selector,
    holds_parameters,
    parametrization_owners,
    select_modules,
)
from torchscope.hooks.session import HookSession
from torchscope.hooks.tree import iter_tensors, nested_values
from torchscope.step import StepInfo

__all__ = ["GradCollector", "HostUpdates", "Updates", "updates_later", "with_updates"]

_HALF = (torch.float16, torch.bfloat16)
_MAX_WALK = 256  # nodes followed back from an in-place op to the input's producer
_MAX_PLAN = 16  # nodes followed behind a call's outputs to find where its inputs enter
_MAX_CALL_NODES = 100_000  # nodes of one call walked to find where its inputs enter
_NATIVE_LIST_MEAN = 16384  # elements per tensor, on average, for the native list norms
# Frozen parameters up to this many elements are checked for being all zero, once per read.
_FROZEN_READ = 1 << 20
# A leaf's node, where a walk ends (torch's stubs do not declare the class).
_ACCUMULATE_GRAD: type = torch._C._functions.AccumulateGrad  # type: ignore[attr-defined]
# Nodes of reshapes and (un)squeezes: every element, in the same order, so that they pass
# the gradient on as it is, in the same memory, with the same norm to the bit.
_RESHAPES = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0",
                       "SqueezeBackward0", "SqueezeBackward1", "SqueezeBackward2",
                       "UnsqueezeBackward0"})


# The sequence number autograd gives the next node made on this thread: nodes made during a
# call have this number or more. -1 where a torch lacks the query (every node then counts).
_next_sequence_nr: Callable[[], int] = getattr(
    torch._C._autograd, "_get_sequence_nr", lambda: -1)


# Whether the backward pass running now keeps its graph (`retain_graph`, `create_graph`);
# where a torch lacks the query, every pass is taken to keep it (exact, more memory held).
_KEEPS_GRAPH: Callable[[], bool] = getattr(
    torch._C._autograd, "_get_current_graph_task_keep_graph", lambda: True)


class _Slot:
    """One tensor of one call; the hook fills `val`, the index of its norm in `_vals`."""

    __slots__ = ("acc", "dtype", "got", "held", "parts", "path", "reason", "same_as", "shape",
                 "val")

    def __init__(self, path: str, t: torch.Tensor | tuple[torch.Size, torch.dtype],
                 reason: str | None = None) -> None:
        self.path = path
        # A tensor, or its (shape, dtype) as read when the call ran; a plain tuple and a
        # string when the step's records are built.
        self.shape, self.dtype = (_shape(t), t.dtype) if isinstance(t, torch.Tensor) else t
        self.val: int | None = None  # -1: reached by passes whose sum is not measured
        self.reason = reason
        # The gradient itself, kept while a later backward pass may add to it (`_put`).
        self.held: torch.Tensor | None = None
        self.same_as: _Slot | None = None  # the same tensor passed again: one measurement
        # An input that the call consumes at several autograd nodes: what each passes down
        # is added up here, and measured once all `parts` have run (`_put_part`).
        self.parts = 1
        self.got = 0
        self.acc: torch.Tensor | None = None

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


@dataclass(slots=True)
class _PendingInput:
    """An input between the pre-hook and the forward hook of one call."""

    slot: _Slot
    tensor: torch.Tensor  # the input itself
    producer: Any  # the input's grad_fn before the call (an autograd Node or None)
    nr: int  # the input's output_nr before the call: its edge is (producer, nr)
    version: int


@dataclass(slots=True)
class _Intake:
    """Inputs of one call between its pre-hook and its forward hook."""

    call: _Call
    pending: list[_PendingInput] = field(default_factory=list)
    seen: dict[int, _Slot] = field(default_factory=dict)


# What a hooked module's calls share: its name, its type's name, whether it owns parameters,
# and what to do when a call read on the graph does not fit (`to_walk`).
_ModuleInfo = tuple[str, str, bool, Callable[[list["_Slot"]], None]]
# A call of one tensor in and one out, read on the graph, as its forward hook saw it (see
# `GradCollector._read_simple_call`): its module; its micro-batch, call count and sequence
# number; its output's node, output_nr, shape and dtype; its input's shape and dtype; and
# either the input's edge into the graph or why it has none (INPUT_NO_GRAD, NOT_MEASURED,
# or "" when the call returned its input as it came). A plain tuple: it is made where every
# Python step is dear.
_SimpleCall = tuple[_ModuleInfo, int, int, int, Any, int, torch.Size, torch.dtype,
                    torch.Size, torch.dtype, "tuple[Any, int] | str"]


@dataclass(slots=True)
class _NodeReads:
    """The gradients one post-hook on one autograd node reads for one call."""

    outs: list[tuple[_Slot, int]] = field(default_factory=list)  # (slot, index in grad_outputs)
    ins: list[tuple[_Slot, int]] = field(default_factory=list)  # (slot, index in grad_inputs)


def _shape(t: torch.Tensor) -> torch.Size:
    """The shape a record keeps: a nested tensor's is its element count, which its norm's
    RMS needs exactly (its ragged lengths are no plain ints)."""
    return torch.Size((nested_values(t).numel(),)) if t.is_nested else t.shape


def _is_plain(t: torch.Tensor) -> bool:
    return t.layout == torch.strided and (type(t) is torch.Tensor or isinstance(t, nn.Parameter))


def _host_floats(vals: list[torch.Tensor]) -> list[float]:
    """0-d device tensors as floats: one stack and one host copy per device and dtype."""
    return _host_floats_later(vals)()


def _host_floats_later(vals: list[torch.Tensor]) -> Callable[[], list[float]]:
    """`_host_floats`, with the copies started now and waited for only when the returned
    function is called: each group is stacked at once (its values as they are now, in
    stream order) and copied as `_host_later` copies.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, v in enumerate(vals):
        groups.setdefault((v.device, v.dtype), []).append(i)
    copies = [(idx, _host_later(torch.stack([vals[i] for i in idx])))  # (n,) each
              for idx in groups.values()]

    def read() -> list[float]:
        out = [math.nan] * len(vals)
        for idx, values in copies:
            for i, x in zip(idx, values(), strict=True):
                out[i] = float(x)
        return out

    return read


def _host_later(t: torch.Tensor) -> Callable[[], list[float]]:
    """The elements of `t` (1-D, as they are now in stream order) as host floats, when the
    returned function is called: on CUDA copied without blocking into pinned memory behind
    an event (the call waits for that copy only), on the CPU read as they are."""
    done = None
    if t.is_cuda:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)  # on t's device's current stream
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(t.device))
    else:
        host = t.cpu()  # CPU: no copy; others: a blocking one

    def read() -> list[float]:
        if done is not None:
            done.synchronize()
        values: list[float] = host.tolist()
        return values

    return read


# A sampled step's copy of the weights (`snapshot_weights`) is taken only where it needs at
# most this share of what the device has free (the driver's free memory and the blocks
# torch's allocator holds unused): the optimizer's own step needs room too.
_SNAPSHOT_SHARE = 0.5


def copy_fits(need: int, free: int, cached: int) -> bool:
    """Whether a copy of `need` bytes leaves the device room: at most `_SNAPSHOT_SHARE` of
    its `free` bytes plus the `cached` bytes torch's allocator holds unused."""
    return need <= _SNAPSHOT_SHARE * (free + cached)


def _tight_devices(weights: list[torch.Tensor]) -> list[torch.device]:
    """The CUDA devices where a copy of `weights` would not fit (`copy_fits`): host-side
    counters only, no sync. The CPU's memory is not checked."""
    need: dict[torch.device, int] = {}
    for w in weights:
        if w.is_cuda:
            need[w.device] = need.get(w.device, 0) + w.numel() * w.element_size()
    tight = []
    for device, n in need.items():
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        if not copy_fits(n, free, cached):
            tight.append(device)
    return tight


def _stale(grad: torch.Tensor, after: torch.Tensor, before: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Of a half-precision parameter's elements with a nonzero gradient, how many an update
    left exactly as they were, and how many there are: two 0-d counts, on the device.
    Without master weights, a step under half the spacing of bfloat16 numbers at a weight
    (1/512 to 1/256 of it; float16: 1/4096 to 1/2048) rounds back to the weight."""
    moving = grad != 0  # the elements the optimizer was given a direction for
    kept = (moving & (after == before)).sum()  # ()
    return kept, moving.sum()


def _norm(t: torch.Tensor) -> torch.Tensor:
    """L2 norm as a 0-d tensor on t's device; half precision is summed in float32 so it
    cannot overflow. One read of `t`, no host sync."""
    n: torch.Tensor = torch.linalg.vector_norm(t, dtype=torch.float32) if t.dtype in _HALF \
        else torch.linalg.vector_norm(t)  # ()
    return n


def _norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """`_norm` of each tensor, in order, by one call per (device, half or not) group: one
    call for a model's parameters instead of one per parameter. A group of plain
    contiguous float32 CPU tensors of 64 kB or more on average goes to the native kernel
    (`_kernels.norms`: float64 sums, 2.5 times as fast as foreach on llama-tiny's 26 MiB of
    weights), the others to `torch._foreach_norm`, the very numbers `clip_grad_norm_`
    computes. Sparse and other non-strided tensors, which neither takes, go one by one."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    groups: dict[tuple[torch.device, bool], list[int]] = {}
    for i, t in enumerate(tensors):
        if t.layout != torch.strided:
            out[i] = _norm(t.coalesce().values() if t.is_sparse else t)
        else:
            groups.setdefault((t.device, t.dtype in _HALF), []).append(i)
    with torch.no_grad():  # a create_graph backward leaves .grad requiring grad
        for (_, half), idx in groups.items():
            group = [tensors[i] for i in idx]
            # The native call checks each tensor in Python first (about a microsecond
            # each): it pays where the tensors are large, as a language model's are, and
            # loses to foreach on many small ones (resnet-deep's: 11 kB on average).
            big = not half and sum(t.numel() for t in group) >= _NATIVE_LIST_MEAN * len(group)
            norms = _kernels.norms(group) if big else None  # () each
            if norms is None:
                norms = list(torch._foreach_norm(group, 2,  # () each
                                                 dtype=torch.float32 if half else None))
            for i, n in zip(idx, norms, strict=True):
                out[i] = n
    return [n for n in out if n is not None]


def total_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm over `tensors` together, as `clip_grad_norm_` computes it, as a 0-d
    float64 tensor on the first tensor's device (no host sync): `_norms` of each, joined.
    `tensors` must not be empty."""
    norms = _norms(tensors)
    device = norms[0].device
    with torch.no_grad():
        joined = torch.stack([n.to(device, torch.float64, non_blocking=True)
                              for n in norms])  # (len(tensors),)
        out: torch.Tensor = torch.linalg.vector_norm(joined)  # ()
    return out


class Updates(NamedTuple):
    """What `GradCollector.measure_updates` read of one optimizer update, on the device.

    Attributes:
        norms: parameter name -> `‖w_after - w_before‖` (0-d).
        stale: for bfloat16 and float16 parameters with a gradient, parameter name ->
            (elements the update left as they were though their gradient was nonzero,
            elements whose gradient was nonzero), 0-d counts each.
    """

    norms: dict[str, torch.Tensor]
    stale: dict[str, tuple[torch.Tensor, torch.Tensor]]


class HostUpdates(NamedTuple):
    """`Updates` on the host: parameter name -> update norm, and -> (kept, moving)."""

    norms: dict[str, float]
    stale: dict[str, tuple[int, int]]


def updates_later(updates: Updates) -> Callable[[], HostUpdates]:
    """`updates` on their way to the host: the copy starts now (`_host_floats_later`: no
    wait on CUDA) and the returned function waits for it, once, when first called."""
    names = list(updates.norms)
    stale = list(updates.stale)
    read = _host_floats_later([updates.norms[n] for n in names]
                              + [c for n in stale for c in updates.stale[n]])
    done: list[HostUpdates] = []

    def host() -> HostUpdates:
        if not done:
            vals = read()
            done.append(HostUpdates(
                dict(zip(names, vals[:len(names)], strict=True)),
                {n: (int(vals[len(names) + 2 * k]), int(vals[len(names) + 2 * k + 1]))
                 for k, n in enumerate(stale)}))
        return done[0]

    return host


def with_updates(flow: GradFlow, updates: HostUpdates) -> GradFlow:
    """`flow` with each parameter's `update_norm` (and `update_stale`) filled from
    `updates`, as `GradCollector.measure_updates` measured them (`updates_later`). A tied
    parameter's second name gets its first name's update."""
    params = tuple(replace(p, update_norm=updates.norms.get(p.tied_to or p.name),
                           update_stale=updates.stale.get(p.tied_to or p.name))
                   for p in flow.params)
    return replace(flow, params=params)


def _entry_points(roots: list[Any], edges: list[tuple[Any, int]]) -> list[tuple[Any, int]] | None:
    """Where each input edge `(producer, output_nr)` enters the autograd graph behind a
    call's outputs (`roots`, their grad_fns): per edge the one (node, index in its
    `next_functions`) that consumes it, or the one past its reshape (`_past_reshape`). None
    unless each edge is consumed exactly once and everything else behind the roots ends,
    within `_MAX_PLAN` nodes, at leaves (parameters' AccumulateGrad nodes): then that
    node's grad_input at that index is the whole gradient the call passes to the input.

    Runs once per call of a module read this way, so it scans plain lists (a call has few
    inputs) rather than building dicts and sets.

    Args:
        roots: the grad_fns of the call's outputs.
        edges: the input edges, as recorded before the call.
    """
    found: list[tuple[Any, int] | None] = [None] * len(edges)
    todo: list[Any] = []
    for root in roots:
        for producer, _ in edges:
            if root is producer:
                return None  # the call returned an input as it was
        if all(root is not r for r in todo):
            todo.append(root)
    followed = todo[:]
    for _ in range(_MAX_PLAN):
        if not todo:
            break
        node = todo.pop()
        for k, (nxt, nr) in enumerate(node.next_functions):
            if nxt is None:
                continue  # no gradient flows there
            hit = -1
            for i, (producer, pnr) in enumerate(edges):
                if nxt is producer:
                    if pnr != nr:
                        hit = -2  # another output of an input's producer, not passed in
                        continue
                    hit = i
                    break
            if hit >= 0:  # an input (a leaf input's edge is its AccumulateGrad node)
                if found[hit] is not None:
                    return None  # consumed twice: no single node holds its gradient
                found[hit] = (node, k)
            elif hit == -2:
                return None
            elif type(nxt) is _ACCUMULATE_GRAD:
                continue  # a leaf that is no input: a parameter
            elif all(nxt is not f for f in followed):
                followed.append(nxt)
                todo.append(nxt)
    if todo:
        return None  # too large to follow: walk the module's calls
    points = [f for f in found if f is not None]
    if len(points) != len(found):
        return None  # an input went unused
    return [_past_reshape(p, roots, followed) for p in points]


def _consumers(roots: list[Any], edges: list[tuple[Any, int]], start: int
               ) -> list[list[tuple[Any, int]]] | None:
    """Every place where a call consumes each input edge `(producer, output_nr)`: the
    (node, index in its `next_functions`) pairs among the call's own autograd nodes, those
    behind its outputs (`roots`) made during the call (sequence number `start` or more).
    Their grad_inputs at those indices add up to exactly what the call passes to the input,
    read without putting anything into the graph. None when the call made more than
    `_MAX_CALL_NODES` nodes.

    Why not an alias of each input, which one hook would read: autograd adds up the
    gradients of a tensor used several times in the order they arrive. An alias adds the
    call's own uses up first, and the sum joins the tensor's other uses afterwards: a
    different order of float additions, so different gradients in the last bits wherever a
    call uses its input twice and the input is also used elsewhere (an RMSNorm squares its
    input and scales it, and the residual stream adds it).

    Args:
        roots: the grad_fns of the call's outputs.
        edges: the input edges, as recorded before the call.
        start: the autograd sequence number when the call began (`_next_sequence_nr`);
            -1 where torch cannot tell it, and then every node behind the outputs counts.
    """
    found: list[list[tuple[Any, int]]] = [[] for _ in edges]
    todo = [r for r in dict.fromkeys(roots) if type(r) is not _ACCUMULATE_GRAD and
            r._sequence_nr() >= start]
    seen = {id(r) for r in todo}
    steps = 0
    while todo:
        steps += 1
        if steps > _MAX_CALL_NODES:
            return None
        node = todo.pop()
        for k, (nxt, nr) in enumerate(node.next_functions):
            if nxt is None:
                continue  # no gradient flows there
            for i, (producer, pnr) in enumerate(edges):
                if nxt is producer and nr == pnr:
                    found[i].append((node, k))
                    break
            else:
                # A parameter's accumulator, a node already seen, or one made before the
                # call (what it computed from is none of the call's inputs' business).
                if type(nxt) is _ACCUMULATE_GRAD or id(nxt) in seen or \
                        nxt._sequence_nr() < start:
                    continue
                seen.add(id(nxt))
                todo.append(nxt)
    return found


def _past_reshape(point: tuple[Any, int], roots: list[Any], followed: list[Any]
                  ) -> tuple[Any, int]:
    """Where an input's gradient is read when the call reshapes it first (a Linear on 3-D
    input flattens it for its addmm): at the one node behind the outputs that consumes the
    reshape, which holds the same gradient in the reshaped shape (the same memory, the same
    norm). That node is usually the outputs' own, so one hook reads the whole call. Else
    `point`, the reshape itself.

    Args:
        point: (node, index) where the input enters the graph.
        roots: the outputs' nodes.
        followed: every node behind them, as `_entry_points` walked.
    """
    node, k = point
    if k != 0 or type(node).__name__ not in _RESHAPES or any(node is r for r in roots):
        return point
    user: tuple[Any, int] | None = None
    for f in followed:
        for j, (n, _) in enumerate(f.next_functions):
            if n is node:
                if user is not None:
                    return point  # consumed twice: only the reshape holds the sum
                user = (f, j)
    return point if user is None else user


def _edge(t: torch.Tensor) -> tuple[Any, int]:
    """`t`'s edge into the autograd graph, (node, output_nr): a leaf's node is its gradient
    accumulator."""
    if t.grad_fn is not None:
        return t.grad_fn, t.output_nr
    edge = torch.autograd.graph.get_gradient_edge(t)
    return edge.node, edge.output_nr


def _past_output_reshape(node: Any, nr: int, inputs: list[Any]) -> tuple[Any, int]:
    """Where a torch.nn leaf's output, made by `node` at `nr`, is read: when the leaf's last
    op reshapes a tensor it made (a Linear on 3-D input views or unsafe-views its addmm's
    or mm's result), on that tensor's producer, else on `node`.

    Why: the producer receives the same gradient, in the same memory (`_RESHAPES`). It is
    also where the leaf's input is read (`_past_reshape`), so one hook serves the call;
    and an in-place op on a view output (`fc(h).relu_()`) rebases the view and takes its
    own node out of the graph, where a hook would never run, while the producer stays.
    Not when the reshaped tensor is an input's (nn.Flatten: its gradient has other uses).

    Args:
        node: the output's grad_fn, as the call left it.
        nr: the output's output_nr.
        inputs: the nodes of the call's inputs (their producers, and what an in-place op
            put in front of them).
    """
    source = _reshape_source(node)
    if source is None or type(source[0]) is _ACCUMULATE_GRAD or \
            any(source[0] is n for n in inputs):
        return node, nr
    return source


def _reshape_source(node: Any) -> tuple[Any, int] | None:
    """The edge a reshape node (`_RESHAPES`) reads from, or None for any other node."""
    if type(node).__name__ not in _RESHAPES:
        return None
    edges = node.next_functions
    if len(edges) != 1 or edges[0][0] is None:
        return None
    source: tuple[Any, int] = edges[0]
    return source


def _reads_at(reads: list[tuple[Any, _NodeReads]], node: Any) -> _NodeReads:
    """The reads of `node` in `reads` (a call touches few nodes: a list), added if new."""
    for n, r in reads:
        if n is node:
            return r
    r = _NodeReads()
    reads.append((node, r))
    return r


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


def _inplace_reader(start: Any, producer: Any) -> Any:
    """The node that reads what a call which changed its input in place passes down: the
    one in front of the input's producer, walking back from the input's node now (`start`).

    An input that is a reshape of all of a tensor (a Linear's output on 3-D input) is a
    view, and the in-place op rebased it: its own node (`producer`) left the graph, and a
    CopySlices node now stands in front of the reshaped tensor's producer. That node passes
    down the whole tensor's gradient, which is this input's, reshaped (the same norm)."""
    node = _find_inplace_node(start, producer)
    if node is None:
        source = _reshape_source(producer)
        if source is not None:
            node = _find_inplace_node(start, source[0])
    return node


def _shard_ranks(p: torch.Tensor) -> tuple[int, ...]:
    """The global ranks whose shards make up DTensor `p` (this rank's shard group: on HSDP's
    (replicate, shard) mesh only the shard dimension); () for a tensor held whole."""
    if not is_dtensor(p):
        return ()
    mesh = p.device_mesh  # type: ignore[attr-defined]
    coord = mesh.get_coordinate()
    if coord is None:
        return ()
    index = tuple(slice(None) if placement.is_shard() else c
                  for c, placement in zip(coord, p.placements, strict=True))  # type: ignore[attr-defined]
    return tuple(int(r) for r in mesh.mesh[index].flatten().tolist())


def _holds_experts(name: str, module: nn.Module) -> bool:
    """Whether `module` holds a mixture of experts' experts: a class name ending in
    `Experts` (transformers'), or an `nn.ModuleList` named `experts`."""
    return type(module).__name__.endswith("Experts") or \
        (isinstance(module, nn.ModuleList) and name.rpartition(".")[2] == "experts")


def _split_experts(modules: dict[str, nn.Module]) -> Iterator[tuple[str, tuple[str, ...]]]:
    """The mixtures of experts kept as separate modules: per experts module (a class name
    ending in `Experts`, or an `nn.ModuleList` named `experts`), its children that hold
    trainable parameters, two or more, in order."""
    for name, module in modules.items():
        if not _holds_experts(name, module):
            continue
        if any(p.ndim == 3 for p in module.parameters(recurse=False)):
            continue  # fused: read per expert from the weights (`expert_norms`)
        members = tuple(f"{name}.{child}" if name else child
                        for child, sub in module.named_children()
                        if any(p.requires_grad for p in sub.parameters()))
        if len(members) > 1:
            yield name, members


class HeldRanks(NamedTuple):
    """A DDP step's ranks' numbers, kept for a join at the end (`_RankAware.hold`).

    Attributes:
        own: this rank's numbers alone, as a one-row `RankGrads` (no collective).
        join: every rank's, from one all_gather: a collective, so every rank calls it at
            the same point (a watch's end).
    """

    own: Callable[[], RankGrads]
    join: Callable[[], RankGrads]


def _end_fingerprint(params: list[nn.Parameter], device: torch.device) -> torch.Tensor:
    """Each parameter's norm, then each one's position-weighted sum (`_weighted_sum`), as a
    (2n,) float64 tensor on `device`; NaN for one that is not a plain strided tensor. Plain
    torch reductions on every rank, so that equal weights give equal numbers whichever
    kernels a rank has."""
    nan = torch.full((), math.nan, dtype=torch.float64, device=device)
    norms: list[torch.Tensor] = []
    sums: list[torch.Tensor] = []
    with torch.no_grad():
        for p in params:
            if type(p.data) is not torch.Tensor or p.layout != torch.strided:
                norms.append(nan)
                sums.append(nan)
                continue
            w = p.detach()
            norms.append(torch.linalg.vector_norm(w, dtype=torch.float64).to(device))  # ()
            sums.append(_weighted_sum(w).to(device))  # ()
        return torch.cat([torch.stack(norms), torch.stack(sums)])


def _weighted_sum(w: torch.Tensor) -> torch.Tensor:
    """sum_i (i + 1) * (the sum of row i), over the rows of `w`'s last dim (a 1-d tensor's
    elements are its rows), in float64: 0-d. A plain sum cancels where the rows do: a
    softmax classifier's gradient sums to 0 over its classes, so two replicas of a head
    stepped by -u and +u would agree on it."""
    rows = w.reshape(-1, w.shape[-1]).sum(dim=1, dtype=torch.float64) if w.dim() >= 2 \
        else w.reshape(-1).double()  # (rows,)
    return torch.dot(rows, torch.arange(1, rows.numel() + 1, dtype=torch.float64,
                                        device=rows.device))


class _RankAware:
    """The rank-aware part of a collector on a DDP or FSDP2 model (see the module docstring).

    Args:
        strategy: `ddp` or `fsdp2`.
        group: the process group DDP synchronises over; None for the default group.
        params: the collector's parameters, in its order.
    """

    def __init__(self, strategy: str, group: Any, params: list[nn.Parameter]) -> None:
        import torch.distributed as dist

        self.strategy = strategy
        self.group = group
        self.ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else \
            tuple(range(dist.get_world_size()))
        self.shards = [_shard_ranks(p) for p in params]

    @classmethod
    def of(cls, model: nn.Module | Literal["ddp"], params: list[nn.Parameter]
           ) -> _RankAware | None:
        """The rank-aware part for `model` (as the user passed it, wrappers included; or
        `"ddp"`: DDP over the default process group), or None outside a distributed job or
        for a model that is neither DDP nor FSDP2."""
        if not world().distributed:
            return None
        if isinstance(model, str):
            return cls(model, None, params)
        strategy = strategy_of(model)
        if strategy == "none":
            return None
        group = getattr(parallel_wrapper(model), "process_group", None) \
            if strategy == "ddp" else None
        return cls(strategy, group, params)

    @staticmethod
    def read_synced(params: list[nn.Parameter]
                    ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """Each whole gradient's 0-d norm and float64 element sum (None: no gradient, or a
        DTensor shard), on the device."""
        synced: list[torch.Tensor | None] = []
        sums: list[torch.Tensor | None] = []
        # CPU gradients' norms by one `_foreach_norm` per (half or not) group: on the CPU it
        # runs `vector_norm` on each, so the numbers are `_norm`'s to the bit, without a
        # Python call per parameter. Other devices keep `_norm` (a fused foreach kernel
        # rounds otherwise).
        cpu: dict[bool, list[int]] = {}
        for i, p in enumerate(params):
            g = p.grad
            if g is None or is_dtensor(g) or g.layout != torch.strided:
                synced.append(None)
                sums.append(None)
                continue
            g = g.detach()
            if g.is_cpu:
                cpu.setdefault(g.dtype in _HALF, []).append(i)
                synced.append(None)  # filled below
            else:
                synced.append(_norm(g))
            sums.append(g.sum(dtype=torch.float64))
        with torch.no_grad():  # a create_graph backward leaves .grad requiring grad
            for half, idx in cpu.items():
                grads = [params[i].grad.detach() for i in idx]  # type: ignore[union-attr]
                for i, n in zip(idx, torch._foreach_norm(
                        grads, 2, dtype=torch.float32 if half else None), strict=True):
                    synced[i] = n  # ()
        return synced, sums

    def finish(self, names: list[str], params: list[nn.Parameter],
               local: list[torch.Tensor | None], weights: list[torch.Tensor | None],
               inv: float, read: tuple[list[torch.Tensor | None],
                                       list[torch.Tensor | None]] | None = None,
               applied: dict[int, torch.Tensor] | None = None
               ) -> Callable[[], tuple[RankGrads, float | None]]:
        """Exchange every rank's numbers (one all_gather, started now) and return a function
        that waits for it and joins them; `local` holds
        this rank's 0-d local gradient norms (None: no gradient), `weights` its 0-d local
        weight norms (of its shard, under FSDP2), and `read` the synchronised gradients'
        norms and sums as `read_synced` took them at the end of backward (None: read now).

        Under FSDP2 the same exchange joins `applied` (parameter index -> this rank's 0-d
        shard norm of the gradient the update uses, from `GradCollector.note_applied`; None
        where none was taken) into the total norm the update used, returned second: None
        unless every rank took it and it differs from the total of the backward's
        gradients (`local`), as they were or unscaled. Its columns are in every FSDP2
        exchange, so that each rank gathers the same size whatever it took."""
        vector = self._vector(params, local, weights, read, applied)
        # Started now, waited for when the step's records are built (a step later in a
        # watched loop, where the ranks have long finished it).
        rows_later = all_gather_tensor_later(vector, group=self.group,
                                             what="the gradient-norm exchange")
        return lambda: self._join(rows_later().cpu().tolist(), names, inv,
                                  applied is not None, self.ranks)

    def hold(self, names: list[str], params: list[nn.Parameter],
             local: list[torch.Tensor | None], weights: list[torch.Tensor | None],
             inv: float, read: tuple[list[torch.Tensor | None],
                                     list[torch.Tensor | None]] | None = None
             ) -> HeldRanks:
        """`finish` under DDP without the exchange: this rank's numbers are kept (on their
        way to the host) for a join at the end (`HeldRanks.join`, a collective every rank
        calls at the same point), and `HeldRanks.own` gives them as a one-row `RankGrads`
        for the step's records meanwhile (the synchronised norms and the weights are every
        rank's under DDP)."""
        import torch.distributed as dist

        assert self.strategy == "ddp"
        vector = self._vector(params, local, weights, read, None)
        host = _host_later(vector)
        rank = dist.get_rank()
        n = len(params)

        def join() -> RankGrads:
            # The weights as they are now, after the last update, join the same exchange:
            # a change on one rank at the last step, or one that keeps the norm (a
            # zero-initialised weight stepped by -u on one rank and +u on the other), shows.
            end = _end_fingerprint(params, vector.device)  # (2n,) float64
            rows = all_gather_tensor(torch.cat([vector, end]), group=self.group,
                                     what="the gradient-norm exchange").cpu().tolist()
            at = vector.numel()  # each row: this step's numbers, then the end's norms, sums
            joined = self._join([r[:at] for r in rows], names, inv, False, self.ranks)[0]

            def block(lo: int) -> tuple[tuple[float | None, ...], ...]:
                return tuple(tuple(None if math.isnan(v) else v for v in r[lo:lo + n])
                             for r in rows)

            return replace(joined, end_norms=block(at), end_sums=block(at + n))

        return HeldRanks(own=lambda: self._join([host()], names, inv, False, (rank,))[0],
                         join=join)

    def _vector(self, params: list[nn.Parameter], local: list[torch.Tensor | None],
                weights: list[torch.Tensor | None],
                read: tuple[list[torch.Tensor | None], list[torch.Tensor | None]] | None,
                applied: dict[int, torch.Tensor] | None) -> torch.Tensor:
        """This rank's row of the exchange, on the group's device: (6n,) float64 (local
        norms, synced norms, synced element sums, local weight norms, then 0/1 presence
        flags of the local and the synced gradient: a NaN norm is a measurement); FSDP2
        adds n + 1: the applied shard norms and their 0/1 flag."""
        device = comm_device(self.group)
        n = len(params)
        synced, sums = read if read is not None else self.read_synced(params)
        zero = torch.zeros((), dtype=torch.float64, device=device)

        def column(values: list[torch.Tensor | None]) -> torch.Tensor:
            # (n,) float64, one stack per column: a conversion per number cost a
            # millisecond a step on a small Llama's 57 parameters.
            filled = [zero if v is None else v for v in values]
            try:
                return torch.stack(filled).to(device, torch.float64)
            except RuntimeError:  # numbers on several devices
                return torch.stack([v.to(device, torch.float64) for v in filled])

        def flags(values: list[Any]) -> torch.Tensor:  # (len(values),) float64 0/1
            return torch.tensor([float(v is not None) for v in values], dtype=torch.float64,
                                device=device)

        parts = [column(c) for c in (local, synced, sums, weights)]
        parts.extend(flags(c) for c in (local, synced))
        if self.strategy == "fsdp2":
            got = applied or {}
            parts.append(column([got.get(i) for i in range(n)]))
            parts.append(flags([applied]))
        return torch.cat(parts)

    def _join(self, rows: list[list[float]], names: list[str], inv: float, took: bool,
              ranks: tuple[int, ...]) -> tuple[RankGrads, float | None]:
        """`RankGrads` from the exchange's `rows` (one per rank of `ranks`, `_vector`'s
        layout) and, under FSDP2 where every rank `took` the applied norms, the total norm
        the update used (see `finish`)."""
        import torch.distributed as dist

        n = len(names)
        rank = dist.get_rank()
        sharded = self.strategy == "fsdp2"

        def block(k: int, scale: float) -> tuple[tuple[float | None, ...], ...]:
            # A weight norm is there whenever the parameter is: flag it with the
            # gradient's.
            flag = 4 + (k if k < 2 else 1 if k == 2 else 0)
            return tuple(tuple(row[k * n + i] * scale if row[flag * n + i] else None
                               for i in range(n)) for row in rows)

        row_of = {r: i for i, r in enumerate(ranks)}
        shard_rows = tuple(tuple(row_of[r] for r in s if r in row_of) for s in self.shards)
        total: float | None = None
        if sharded and took and all(row[7 * n] for row in rows):
            me = rows[row_of[rank]]

            def joined(at: int, flags: int | None = None) -> float:
                # A sharded parameter's squared norm sums over its shard group only
                # (HSDP's replicas hold the same shards); one held whole is this rank's.
                return math.sqrt(sum(
                    sum(rows[r][at + i] ** 2 for r in shard if flags is None or
                        rows[r][flags + i]) if shard else me[at + i] ** 2
                    for i, shard in enumerate(shard_rows)))

            used, backward = joined(6 * n), joined(0, 4 * n)
            # Unchanged gradients read the same (the same kernel on the same shards);
            # an unscale_ alone divides them by the scale. Neither is a change by the
            # loop.
            if all(abs(used - b) > 1e-6 * max(used, b)
                   for b in (backward, backward * inv)):
                total = used
        return RankGrads(
            strategy=self.strategy, rank=rank, ranks=ranks, names=tuple(names),
            local=block(0, inv), synced=block(1, inv), fingerprints=block(2, inv),
            weights=tuple(tuple(row[3 * n + i] for i in range(n)) for row in rows),
            shard_rows=shard_rows), total

    def _row_of(self) -> dict[int, int]:
        """Global rank -> its row in an exchange over `group`."""
        return {r: i for i, r in enumerate(self.ranks)}

    def whole_updates(self, indices: list[int], local: list[torch.Tensor]
                      ) -> list[torch.Tensor]:
        """The update norm of each whole parameter from this rank's (0-d each; `indices`:
        the parameters', in the collector's order). A sharded parameter's is the root of the
        summed squares of its shards' over its shard group, from one all_gather of every
        rank's numbers; a parameter held whole keeps this rank's. Without a sharded
        parameter (DDP) nothing is exchanged: `local` comes back as it is."""
        if not any(self.shards[i] for i in indices):
            return local
        device = comm_device(self.group)
        rows = all_gather_tensor(torch.stack([v.to(device, torch.float64) for v in local]),
                                 group=self.group,
                                 what="the update-norm exchange").cpu()  # (ranks, len(local))
        row_of = self._row_of()
        out = []
        for k, (i, mine) in enumerate(zip(indices, local, strict=True)):
            shard = [row_of[r] for r in self.shards[i] if r in row_of]
            out.append(rows[shard, k].square().sum().sqrt() if shard else mine)  # ()
        return out


class GradCollector(HookedContext):
    """Collects gradient norms while its `HookSession` is open.

    Set `active` to False to make every hook return at once (unsampled steps). Call
    `finish(index)` after the step's backward(s) to get its `GradFlow` and reset.

    Args:
        model: the model.
        select: modules to record per call (see `select_modules`); default the layers.
        depth: limit the selection depth.
        inputs: also measure grad_input (see the module docstring; set False to skip).
        scaler: a `torch.amp.GradScaler` whose scale is divided out of every norm.
        parallel: the `DistributedDataParallel` wrapper `model` trains through, when `model`
            is the module inside it (a framework callback's view), or `"ddp"` for a wrapper
            over the default process group that the framework keeps out of sight; None:
            `model` itself says (see `_RankAware.of`).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        select: Selector = None,
        depth: int | None = None,
        inputs: bool = True,
        scaler: Any = None,
        parallel: nn.Module | Literal["ddp"] | None = None,
    ) -> None:
        wrapped: nn.Module | Literal["ddp"] = model if parallel is None else parallel
        for m in (model, parallel):
            fsdp1 = fsdp1_module(m) if isinstance(m, nn.Module) else None
            if fsdp1 is not None:
                # Its hooks would see no parameter gradient at all (a total of 0.0 on two
                # gloo ranks), and its layers' `.grad` are views of shards after backward.
                raise TorchscopeError(
                    f"the model is wrapped in FullyShardedDataParallel (FSDP1) at "
                    f"{fsdp1 or '<root>'}: FSDP1 trains flattened, sharded copies of the "
                    "parameters, so per-layer gradient norms cannot be read from it; "
                    "torchscope reads DDP and FSDP2 (fully_shard) models.",
                    fix="shard with torch.distributed.fsdp.fully_shard (FSDP2; in Lightning, "
                    "ModelParallelStrategy), or train with DDP.")
        self._session = HookSession(model)
        model = self._session.model  # compile and DDP wrappers are unwrapped: plain names
        self._targets = select_modules(model, select, depth=depth)
        self._inputs = inputs
        self._scaler = scaler
        self.active = True
        # Backward passes that added to no trainable parameter (`_undo_pass`), ever.
        self.passes_without_update = 0
        self.on_backward_end: Callable[[], None] | None = None
        # Called once DDP has written the averaged gradients into `.grad` (`_read_synced`).
        self.on_synced: Callable[[], object] | None = None
        self._params: list[tuple[str, str, nn.Parameter]] = []
        # Every parameter name in module order: (name, module, index in `_params`, tied to).
        self._names: list[tuple[str, str, int, str | None]] = []
        first: dict[int, int] = {}
        # A parametrized weight's parameters (`0.parametrizations.weight.original`) are
        # its module's (`0`).
        owners = parametrization_owners(model)
        for name_at, module in model.named_modules():
            mname = owners.get(name_at, name_at)
            for pname, p in module.named_parameters(recurse=False):
                name = f"{name_at}.{pname}" if name_at else pname
                i = first.get(id(p))
                if i is None:
                    # Hooked and counted once (as clip_grad_norm_ counts tied weights).
                    i = first[id(p)] = len(self._params)
                    self._params.append((name, mname, p))
                    self._names.append((name, mname, i, None))
                else:
                    self._names.append((name, mname, i, self._params[i][0]))
        self._rank_aware: _RankAware | None = _RankAware.of(
            wrapped, [p for _, _, p in self._params])
        # A mixture of experts' fused expert weights, (experts, ...) each: their gradient is
        # read per expert too (an expert no token reached has a zero slice). Not under
        # FSDP2, whose shards split the experts between ranks.
        modules = dict(model.named_modules())
        self._experts = set() if self._rank_aware is not None and \
            self._rank_aware.strategy == "fsdp2" else \
            {i for i, (_, mname, p) in enumerate(self._params)
             if p.ndim == 3 and p.shape[0] > 1 and mname in modules and
             _holds_experts(mname, modules[mname])}
        # Experts kept as modules of their own: whether each got a gradient is read from its
        # parameters' (`GradFlow.idle_experts`).
        self._split_experts = tuple(_split_experts(modules))
        self._bw_queued = False
        self._before: list[tuple[int, str, nn.Parameter, torch.Tensor]] = []
        # Per hooked module: its calls between pre-hook and forward hook.
        self._in_flight: list[list[tuple[_Call, list[_PendingInput], int] | None]] = []
        self._held: list[_Slot] = []  # the slots holding a gradient (`_put`)
        self._partial: list[_Slot] = []  # inputs with some of their parts in (`_put_part`)
        # The model's floating outputs of its last forward with gradients, kept only while
        # `keep_outputs` (a watch that awaits the loss, `GradWatch.check_loss`): holding
        # their nodes holds that forward's graph until the watch reads the loss.
        self.keep_outputs = False
        self.outputs: tuple[OutputEdge, ...] | None = None
        # Called with the output of the model's next forward with gradients, then dropped
        # (`GradWatch`: a model that returns its own loss has it read at once).
        self.on_output: Callable[[Any], None] | None = None
        # DDP: keep each finished step's ranks' numbers for one exchange at the end (a
        # watch's), not one per step; `held` is the newest step's (index, HeldRanks).
        self.hold_ranks = False
        self.held: tuple[int, HeldRanks] | None = None
        # Sampled steps whose weights were not copied: the copy would not fit on the device.
        self.snapshot_skipped = 0
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
        s.forward_hook(s.model, self._on_root_forward_end, always_call=True)
        for name, module in self._targets:
            self._hook_module(name, module)
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
        self._names = []
        self._before = []
        self._rank_aware = None
        self._in_flight = []
        self.keep_outputs, self.outputs, self.on_output = False, None, None
        self._reset()

    def _reset(self) -> None:
        self._vals: list[torch.Tensor] = []  # 0-d norms on the gradients' devices
        self._calls: list[_Call] = []
        self._param_vals: dict[int, int] = {}  # param index -> index in _vals
        self._param_due: dict[int, torch.Tensor] = {}  # accumulated, not measured yet
        # param index -> 0-d weight norm taken with this step's snapshot (`finish` reuses it)
        self._weight_vals: dict[int, torch.Tensor] = {}
        for slot in self._held:
            slot.held = None
        self._held = []
        for slot in self._partial:
            slot.acc, slot.got = None, 0
        self._partial = []
        # DDP: the synchronised gradients' norms and sums, read when the last backward's
        # all-reduce had landed (`_read_synced`); None: read them when the step ends.
        self._synced: tuple[list[torch.Tensor | None], list[torch.Tensor | None]] | None = None
        # FSDP2: this rank's shard norms of the gradients the update uses (`note_applied`).
        self._applied: dict[int, torch.Tensor] | None = None
        # Selected modules that ran with gradients disabled inside a root forward with them
        # (`_note_no_grad`): name -> whether inside a reentrant checkpoint's forward.
        self._no_grad_calls: dict[str, bool] = {}
        self._simple: list[_SimpleCall] = []  # read on the graph when the root returns
        self._reset_counters()

    def _measured(self) -> bool:
        """Whether the current step holds any measurement (`_reset`'s containers)."""
        return bool(self._vals or self._calls or self._held or self._partial or self._simple
                    or self._param_vals or self._param_due or self._weight_vals
                    or self._no_grad_calls or self._synced is not None
                    or self._applied is not None)

    def _reset_counters(self) -> None:
        """The step's counters and marks (all of a step that measured nothing)."""
        self._fused_norms = 0
        self._eager_norms = 0
        self._order = 0
        self._seq = 0
        self._micro = -1
        self._counts: dict[str, int] = {}
        self._step_handles: list[Any] = []
        self._backwards = 0
        # Where the backward in progress began: the call order it started from, and the
        # parameters it measured (`restart_at_last_backward`).
        self._bw_mark = 0
        self._bw_params: set[int] = set()
        # Where the pass in progress began in `_vals`; whether it keeps its graph (None:
        # not read yet); the slots measured again in it (`_put`).
        self._val_mark = 0
        self._hold: bool | None = None
        self._bw_updates = False  # a parameter accumulated a gradient in this pass
        self._side: set[int] = set()  # micro-batches reached by an undone pass
        self._rewritten: list[tuple[_Slot, int | None, torch.Tensor | None, str | None]] = []
        self._in_root = False  # inside the root module's forward
        self._root_grad = False  # ...which runs with gradients enabled
        # The previous gradient: a weak reference to it, its data pointer, version and
        # element count, and the index of its norm.
        self._last: tuple[weakref.ReferenceType[torch.Tensor], int, int, int, int] | None \
            = None

    # ------------------------------------------------------------------ hooks
    def _on_root_forward(self, _m: nn.Module, _args: tuple[Any, ...]) -> None:
        where = in_backward()
        if where != "no":
            # The root's own recomputation: a replay records nothing; a reentrant one is
            # this micro-batch's only forward with grad (its first ran under no_grad).
            if where == "reentrant" and self.active:
                self._in_root = True
                self._micro += 1
                self._counts = {}
            return
        self._bw_queued = False  # a backward that raised never ran its end callback
        for stack in self._in_flight:
            # torch runs no forward hook after a KeyboardInterrupt: drop the calls (and the
            # inputs, which hold their graph) that an interrupted forward left here.
            stack.clear()
        # A forward interrupted before the root's forward hook ran (KeyboardInterrupt): its
        # finished calls stay, as those read at once do.
        self._read_simple_calls()
        self._in_root = True
        self._root_grad = torch.is_grad_enabled()
        if self.active and self._root_grad:  # eval forwards are no micro-batch
            self._micro += 1
            self._counts = {}

    def _on_root_forward_end(self, _m: nn.Module, _args: tuple[Any, ...], out: Any) -> None:
        if self._root_grad:
            if self.on_output is not None:
                once, self.on_output = self.on_output, None
                once(out)
            if self.keep_outputs:
                self.outputs = output_edges(out)
        self._in_root = self._root_grad = False
        self._read_simple_calls()

    def _note_no_grad(self, name: str) -> None:
        """Module `name` ran with gradients disabled: note it when that happened inside a
        forward with them, where its parameters then get no gradient for a reason the
        records can name (`RAN_NO_GRAD`, `RAN_IN_REENTRANT_CHECKPOINT`). Only on the path of
        a call that is not recorded, once per module and step."""
        if self.active and self._root_grad and self._in_root and \
                not torch.is_grad_enabled() and name not in self._no_grad_calls:
            self._no_grad_calls[name] = in_reentrant_forward()

    def _read_simple_calls(self) -> None:
        """Read the simple calls the forward put off (`_read_simple_call`), in their order.

        Why later: a leaf's forward hook runs just after its output went through the caches,
        where each Python step costs three to five times what it costs among other Python
        steps (measured on resnet-deep, CPU: 66 µs a call there, 18 µs with warm caches).
        The hook only notes what the call's tensors are now (an in-place op later may move
        an output to another node), and the nodes are hooked here, together. They are always
        hooked before backward, which needs the root's output; and before any hook that
        another path registers (`post`), so that hooks sharing a node keep the order of
        their calls.
        """
        pending, self._simple = self._simple, []
        for call in pending:
            self._read_simple_call(call)

    def _push(self, g: torch.Tensor) -> int:
        t = g.detach() if g.requires_grad else g  # requires grad under create_graph only
        if t.is_sparse:  # one property read: `layout`, a Python object, costs more here
            t = t.coalesce().values()
        elif t.is_nested:  # its elements (a jagged tensor's own values: the reuse holds)
            t = g = nested_values(t)
        # The gradient a layer passes down usually reaches the layer below as the same
        # tensor, or a view of its memory (through a reshape): reuse its norm. A weak
        # reference to the gradient proves that its memory was not freed and reused in
        # between (torch keeps a tensor's Python object while the tensor lives), and the
        # shared version counter that nothing wrote to it. A strong reference would stop
        # autograd from accumulating into that buffer in place, and so would a weak
        # reference to its storage (measured: one more out-of-place add per residual
        # merge, 2.5 % of a narrow ResNet's step). The cheap half of the comparison comes
        # first: this runs for every gradient, just after megabytes went through the caches.
        ptr, version, numel = t.data_ptr(), t._version, t.numel()
        last = self._last
        if last is not None and last[1] == ptr and last[2] == version and last[3] == numel \
                and numel > 0:
            prev = last[0]()
            if prev is not None and prev.layout == torch.strided and \
                    prev.dtype == t.dtype and prev.device == t.device and (
                        (prev.shape == t.shape and prev.stride() == t.stride())
                        or (prev.is_contiguous() and t.is_contiguous())):
                return last[4]
        # One read of the gradient: the fused kernel, or eager `vector_norm`
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
        self._last = (weakref.ref(g), ptr, version, numel, index)
        return index

    def _put(self, slot: _Slot, g: torch.Tensor) -> None:
        """Measure gradient `g` into `slot`, in the backward pass running now."""
        if slot.val is not None and slot.val < self._val_mark:
            self._put_again(slot, g)
            return
        slot.val = self._push(g)
        if self._keeps_graph():
            slot.held = g.detach()
            self._held.append(slot)

    def _put_part(self, slot: _Slot, g: torch.Tensor | None) -> None:
        """One of the places where a call consumes an input (`_Slot.parts`) passed `g` down
        (None: nothing): added to the others, and the sum measured once all have run, or
        when the pass ends (`_flush_parts`). The parts are held until then."""
        if slot.got == 0:
            self._partial.append(slot)
        slot.got += 1
        if g is not None:
            g = g.detach()
            slot.acc = g if slot.acc is None else slot.acc + g  # same shape as g
        if slot.got == slot.parts:
            self._flush_part(slot)

    def _flush_part(self, slot: _Slot) -> None:
        acc, slot.acc, slot.got = slot.acc, None, 0
        if acc is not None:
            self._put(slot, acc)

    def _flush_parts(self) -> None:
        """Measure what the inputs read in parts got in this pass, where some of their
        parts did not run (a branch the pass did not reach)."""
        partial, self._partial = self._partial, []
        for slot in partial:
            if slot.got:
                self._flush_part(slot)

    def _put_again(self, slot: _Slot, g: torch.Tensor) -> None:
        """`slot` was measured by an earlier backward pass over the same graph (two losses,
        each with its own `backward`, the first with `retain_graph=True`): the update sums
        both gradients, so its norm is the sum's. That pass kept its graph, so it kept the
        gradient too (`_put`); when it did not, the sum is not measured. What the slot held
        before is logged, for `_undo_pass`."""
        self._rewritten.append((slot, slot.val, slot.held, slot.reason))
        keep = self._keeps_graph()
        if slot.held is None:
            slot.val, slot.reason = -1, PASSES_UNSUMMED
            return
        total = slot.held + g.detach()  # same shape as g
        slot.val = self._push(total)
        slot.held = total if keep else None
        if keep:
            self._held.append(slot)

    def _keeps_graph(self) -> bool:
        """Whether the backward pass running now keeps its graph, read at its first write:
        a later pass may then add to its gradients, so they are held (`_put_again`)."""
        if self._hold is None:
            self._hold = _KEEPS_GRAPH()
        return self._hold

    def _queue_end(self) -> None:
        if self._bw_queued:
            return
        self._bw_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        self._bw_queued = False
        # A reentrant checkpoint's nested backward ends inside its node: the pass it is
        # part of goes on (an input's parts may lie on both sides of it).
        outermost = torch._C._current_autograd_node() is None
        if outermost and self._partial:
            self._flush_parts()
        if self._param_due:
            self._measure_params()
        self._last = None
        if outermost:
            updates, self._bw_updates = self._bw_updates, False
            if not updates and any(p.requires_grad for _, _, p in self._params):
                # No trainable parameter accumulated a gradient: `torch.autograd.grad` (a
                # gradient penalty's, an adversarial input's) or `backward(inputs=...)`.
                # Those gradients feed no update: the pass is none of the step's.
                self.passes_without_update += 1
                self._undo_pass()
                return
        self._backwards += 1
        if self.active and self._rank_aware is not None and self._rank_aware.strategy == "ddp":
            # DDP writes the averaged gradients into `.grad` in a callback of its own,
            # queued when its last bucket was ready, after this one: read them in one
            # queued now, which runs after it, before anything (clipping) changes them.
            torch.autograd.Variable._execution_engine.queue_callback(self._read_synced)
        if self.on_backward_end is not None:
            self.on_backward_end()
        self._bw_mark, self._bw_params = self._order, set()
        if outermost:
            self._end_pass(keep=bool(self._hold))

    def _end_pass(self, *, keep: bool) -> None:
        """A backward pass is over: later writes are another pass's. What it held goes,
        unless it kept its graph (a later pass may then add to the same gradients)."""
        self._val_mark = len(self._vals)
        self._hold = None
        self._rewritten = []
        if not keep:
            for slot in self._held:
                slot.held = None
            self._held = []

    def _undo_pass(self) -> None:
        """Forget what the backward pass that just ended measured: its slots go back to
        what earlier passes left, its calls to unreached, and its norms are dropped."""
        mark = self._val_mark
        for c in self._calls:
            if c.order is not None and c.order >= self._bw_mark:
                c.order = None
                self._side.add(c.micro)
            for slot in (*c.outs, *c.ins):
                if slot.val is not None and slot.val >= mark:
                    slot.val, slot.held = None, None
        for slot, val, held, reason in reversed(self._rewritten):
            slot.val, slot.held, slot.reason = val, held, reason
        del self._vals[mark:]
        self._order = self._bw_mark
        self._bw_params = set()
        self._held = [s for s in self._held if s.held is not None]
        self._end_pass(keep=True)

    def restart_at_last_backward(self) -> None:
        """Keep only what the backward that just ended measured, and the forwards it
        reached: the gradients were set to None before it (`zero_grad()` between two
        backward passes of one optimizer step), so the earlier passes feed no update. A
        GAN's generator step backpropagates through the discriminator, whose gradients are
        then zeroed before its own step: that pass is none of the discriminator's step."""
        this = {c.micro for c in self._calls if c.order is not None and c.order >= self._bw_mark}
        if not this:
            return
        self._drop_micro_batches(set(range(min(this))))
        self._param_vals = {i: v for i, v in self._param_vals.items() if i in self._bw_params}
        self._backwards = 1

    def _read_synced(self) -> None:
        assert self._rank_aware is not None
        self._synced = self._rank_aware.read_synced([p for _, _, p in self._params])
        if self.on_synced is not None:
            self.on_synced()

    def _measure_params(self) -> None:
        """The norms of every parameter gradient accumulated in this backward: one call per
        dtype group (`_norms`; half precision summed in float32)."""
        due, self._param_due = self._param_due, {}
        # A DTensor gradient (FSDP2): this rank's shard; `finish` combines the shards.
        grads = [(index, local_tensor(p.grad)) for index, p in due.items()
                 if p.grad is not None]
        for (index, _), n in zip(grads, _norms([g for _, g in grads]), strict=True):
            self._vals.append(n)
            self._param_vals[index] = len(self._vals) - 1
            self._bw_params.add(index)

    def _make_param_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            if not self._bw_queued:  # inline: every parameter runs this at every backward
                self._queue_end()
            self._bw_updates = True
            if self.active and p.grad is not None:
                if self._rank_aware is not None:
                    # DDP: this rank's own gradient exists only now, before the reducer's
                    # hook all-reduces it; FSDP2: this rank's shard. Measured at once.
                    self._param_vals[index] = self._push(local_tensor(p.grad))
                    self._bw_params.add(index)
                else:
                    self._param_due[index] = p  # measured with the others when backward ends

        return hook

    def _output_hook(self, slot: _Slot, call: _Call) -> Callable[[torch.Tensor], None]:
        # Only for an output without a grad_fn (a leaf that requires grad): the others are
        # read by a post-hook on the node that produced them.
        def hook(g: torch.Tensor) -> None:
            self._put(slot, g)
            if call.order is None:
                call.order = self._order
                self._order += 1
            self._queue_end()

        return hook

    def _node_hook(self, call: _Call, reads: _NodeReads) -> Callable[[Any, Any], None]:
        """One post-hook per autograd node and call: the node's grad_outputs that are the
        call's outputs' gradients, then its grad_inputs that are what the call passes to its
        inputs (in that order, so that the layer below reuses the last norm)."""
        outs, ins = reads.outs, reads.ins

        def hook(grad_inputs: tuple[torch.Tensor | None, ...],
                 grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
            if outs:
                for slot, nr in outs:
                    g = grad_outputs[nr]
                    if g is not None:
                        self._put(slot, g)
                if call.order is None:
                    call.order = self._order
                    self._order += 1
                self._queue_end()
            for slot, k in ins:
                g = grad_inputs[k]
                if slot.parts > 1:
                    self._put_part(slot, g)
                elif g is not None:
                    self._put(slot, g)

        return hook

    def _number_call(self, name: str) -> tuple[int, int]:
        """A new call of module `name`: its count among that module's calls this forward,
        and its sequence number in the step."""
        count = self._counts.get(name, 0)
        self._counts[name] = count + 1
        self._seq += 1
        return count, self._seq - 1

    def _note_simple_call(self, info: _ModuleInfo, x: torch.Tensor, out: torch.Tensor,
                          node: Any, root: bool) -> None:
        """Note a call of one tensor in and one out, to be read on the graph: when the root
        module returns (`_read_simple_calls`), or now when no root forward is running.

        Args:
            info: the module's `_ModuleInfo`.
            x: the call's input.
            out: its output; `node` is its grad_fn.
            root: the module is the root.
        """
        count, seq = self._number_call(info[0])
        how: tuple[Any, int] | str = INPUT_NO_GRAD if not x.requires_grad else \
            "" if x is out else NOT_MEASURED if not _is_plain(x) else _edge(x)
        seen = (info, max(self._micro, 0), count, seq, node, out.output_nr,
                _shape(out), out.dtype, _shape(x), x.dtype, how)
        if self._in_root and not root:
            self._simple.append(seen)
        else:
            self._read_simple_call(seen)

    def _read_simple_call(self, seen: _SimpleCall) -> None:
        """A call of one tensor in and one out, read on the graph: most calls of a torch.nn
        leaf. The general path's steps, without its containers."""
        info, micro, count, seq, node, nr, oshape, odtype, ishape, idtype, how = seen
        name, type_name, owns, misfit = info
        if not isinstance(how, str):
            node, nr = _past_output_reshape(node, nr, [how[0]])
        call = _Call(name, type_name, micro, count, seq, owns)
        oslot = _Slot("", (oshape, odtype))
        call.outs.append(oslot)
        here = _NodeReads([(oslot, nr)])
        elsewhere: tuple[Any, _NodeReads] | None = None
        if self._inputs:
            islot = _Slot("[0]", (ishape, idtype))
            call.ins.append(islot)
            if how == "":  # returned as it came (Dropout in eval)
                islot.same_as = oslot
            elif isinstance(how, str):
                islot.reason = how
            else:
                points = _entry_points([node], [how])
                if points is None:
                    misfit([islot])
                elif points[0][0] is node:  # one node: one hook reads both
                    here.ins.append((islot, points[0][1]))
                else:  # its input enters at another node (a reshape used twice)
                    elsewhere = (points[0][0], _NodeReads(ins=[(islot, points[0][1])]))
        self._hook_nodes(call, [(node, here)] if elsewhere is None else [(node, here), elsewhere])
        self._calls.append(call)

    @staticmethod
    def _read_entries(reads: list[tuple[Any, _NodeReads]], roots: list[Any],
                      direct_in: list[_PendingInput],
                      misfit: Callable[[list[_Slot]], None]) -> None:
        """Add to `reads` the nodes where `direct_in` enter the graph behind `roots`, or
        call `misfit` when they do not enter as the module's earlier calls showed."""
        points = _entry_points(roots, [(p.producer, p.nr) for p in direct_in])
        if points is None:
            misfit([p.slot for p in direct_in])
            return
        for p, (node, k) in zip(direct_in, points, strict=True):
            _reads_at(reads, node).ins.append((p.slot, k))

    def _hook_nodes(self, call: _Call, reads: list[tuple[Any, _NodeReads]]) -> None:
        """One post-hook per autograd node that holds gradients of this call."""
        for node, r in reads:
            self._step_handles.append(self._session.track(
                node.register_hook(self._node_hook(call, r))))

    def _take_input(self, intake: _Intake, path: str, t: torch.Tensor) -> None:
        """Record one tensor input and its edge into the graph, as it is before the call."""
        slot = _Slot(path, t)
        intake.call.ins.append(slot)
        hit = intake.seen.get(id(t))
        if hit is not None:
            # The same tensor again (self-attention's query is key is value): one edge, so
            # one measurement of everything the call passes to it.
            slot.same_as = hit
            return
        if not t.requires_grad:
            slot.reason = INPUT_NO_GRAD
        elif not _is_plain(t):
            slot.reason = NOT_MEASURED
        else:
            node, nr = _edge(t)
            intake.pending.append(_PendingInput(slot, t, node, nr, t._version))
        intake.seen[id(t)] = slot

    def _take_inputs(self, intake: _Intake, args: tuple[Any, ...], kwargs: dict[str, Any]
                     ) -> None:
        """Record a call's tensor inputs (the module receives them as they are)."""
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                self._take_input(intake, f"[{i}]", a)
        for k, v in kwargs.items():
            if isinstance(v, torch.Tensor):
                self._take_input(intake, f"[{k!r}]", v)

    def _hook_module(self, name: str, module: nn.Module) -> None:
        """Hook one selected module: a forward hook always, and a forward-pre hook while its
        calls' inputs are found by walking the call's own autograd nodes (`_consumers`).

        A torch.nn leaf uses its inputs only in the ops that make its outputs: once one of
        its calls is seen to consume each input at exactly one autograd node, its later
        calls are read on those nodes (see `_entry_points`), and its forward hook alone
        records them: the pre-hook comes off, one Python call per forward less. A call that
        does not fit puts the pre-hook back. A module of the user's code is walked at every
        call: it may use an input at several nodes (an RMSNorm squares it and scales it).
        """
        s = self._session
        stack: list[tuple[_Call, list[_PendingInput], int] | None] = []
        self._in_flight.append(stack)
        type_name = type(module).__name__
        owns = holds_parameters(module)
        builtin = getattr(module, "inplace", False) is not True and \
            next(module.children(), None) is None and \
            type(module).__module__.startswith("torch.nn.modules.")
        pre_handle: list[Any] = [None]  # the pre-hook's handle; None: read on the graph

        def skipped() -> bool:
            # Unsampled steps, eval forwards, and a non-reentrant checkpoint's replay
            # (forward again, inside backward; see `in_backward`).
            return not self.active or not torch.is_grad_enabled() or \
                in_backward() == "replay"

        def new_call() -> _Call:
            count, seq = self._number_call(name)
            return _Call(name, type_name, max(self._micro, 0), count, seq, owns)

        def pre(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if skipped():
                if self.active and self._root_grad:  # not on unsampled steps: one check
                    self._note_no_grad(name)
                stack.append(None)
                return
            # The call's own autograd nodes are numbered from here (`_consumers`).
            intake = _Intake(new_call())
            stack.append((intake.call, intake.pending, _next_sequence_nr()))
            if self._inputs:
                self._take_inputs(intake, args, kwargs)

        def to_graph() -> None:
            handle, pre_handle[0] = pre_handle[0], None
            if handle is not None:
                s.release([handle])

        def to_walk(slots: list[_Slot]) -> None:
            # This call does not fit what earlier calls showed: its inputs go unmeasured,
            # and the module's next calls are walked again.
            for slot in slots:
                slot.reason = NOT_MEASURED
            if pre_handle[0] is None:
                pre_handle[0] = s.forward_pre_hook(module, pre, with_kwargs=True)

        info: _ModuleInfo = (name, type_name, owns, to_walk)

        def post(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 output: Any) -> None:
            graph = pre_handle[0] is None
            start = -1
            if graph:
                if skipped():
                    if self.active and self._root_grad:
                        self._note_no_grad(name)
                    return
                if type(output) is torch.Tensor and output.requires_grad and not kwargs and \
                        len(args) == 1 and isinstance(args[0], torch.Tensor):
                    node = output.grad_fn
                    if node is not None:
                        self._note_simple_call(info, args[0], output, node, _m is s.model)
                        return
                self._read_simple_calls()  # hooks on a shared node keep the calls' order
                intake = _Intake(new_call())
                if self._inputs:
                    self._take_inputs(intake, args, kwargs)
                call, pending = intake.call, intake.pending
            else:
                entry = stack.pop() if stack else None
                if entry is None:
                    return
                call, pending, start = entry
                self._read_simple_calls()  # hooks on a shared node keep the calls' order
            grad = torch.is_grad_enabled()
            reads: list[tuple[Any, _NodeReads]] = []
            outs: dict[int, _Slot] = {}
            roots: list[Any] = []
            tensors = (("", output),) if type(output) is torch.Tensor else iter_tensors(output)
            for path, t in tensors:
                if t.requires_grad and grad:
                    slot = _Slot(path, t)
                    node, nr = t.grad_fn, t.output_nr
                    if builtin and node is not None:
                        node, nr = _past_output_reshape(
                            node, nr, [n for p in pending for n in (p.producer,
                                                                    p.tensor.grad_fn)])
                    if node is None:  # a leaf: only a tensor hook sees its gradient
                        self._step_handles.append(
                            self._session.tensor_hook(t, self._output_hook(slot, call)))
                    else:
                        _reads_at(reads, node).outs.append((slot, nr))
                        roots.append(node)
                else:
                    slot = _Slot(path, t, OUTPUT_NO_GRAD)
                call.outs.append(slot)
                outs.setdefault(id(t), slot)
            walked: list[_PendingInput] = []
            for p in pending:
                same = outs.get(id(p.tensor))
                if same is not None and p.tensor._version == p.version:
                    p.slot.same_as = same  # returned as it came (Dropout in eval)
                elif graph or p.tensor._version == p.version:
                    walked.append(p)
                else:
                    # Changed in place during this call: read on the node that the
                    # in-place op put in front of the input's producer.
                    node = _inplace_reader(p.tensor.grad_fn, p.producer) \
                        if p.producer is not None else None
                    if node is None:
                        p.slot.reason = NOT_MEASURED
                    else:
                        _reads_at(reads, node).ins.append((p.slot, 0))
            if walked and graph:
                self._read_entries(reads, roots, walked, to_walk)
            elif walked:
                edges = [(p.producer, p.nr) for p in walked]
                found = _consumers(roots, edges, start)
                for i, p in enumerate(walked):
                    if found is None:
                        p.slot.reason = NOT_MEASURED
                        continue
                    p.slot.parts = len(found[i])  # none: the call's outputs do not use it
                    for node, k in found[i]:
                        _reads_at(reads, node).ins.append((p.slot, k))
                if builtin and found is not None and len(walked) == len(pending) and \
                        _entry_points(roots, edges) is not None:
                    to_graph()  # its next calls are read where these inputs entered
            self._hook_nodes(call, reads)
            self._calls.append(call)

        pre_handle[0] = s.forward_pre_hook(module, pre, with_kwargs=True)
        s.forward_hook(module, post, always_call=True, with_kwargs=True)

    def set_scaler(self, scaler: Any) -> None:
        """Divide `scaler`'s scale out of the norms from the step in progress on (a
        GradScaler found stepping the optimizer, not given)."""
        self._scaler = scaler

    # ------------------------------------------------------------------ results
    def _scale(self) -> float | None:
        """The GradScaler's scale on the host (a read from the device), or None."""
        scale = self._scale_tensor()
        return None if scale is None else float(scale)

    def _scale_tensor(self) -> torch.Tensor | None:
        """The GradScaler's scale as it is on the device (no host read), or None."""
        scaler = self._scaler
        if scaler is None or not getattr(scaler, "is_enabled", lambda: True)():
            return None
        scale = getattr(scaler, "_scale", None)  # GradScaler's own tensor; None before use
        if not isinstance(scale, torch.Tensor):
            return torch.tensor(float(scaler.get_scale()), dtype=torch.float64)
        return scale

    def zero_parameters(self) -> set[str]:
        """Names of the trainable parameters that are all zero now (this rank's shard under
        FSDP2): one norm per parameter, read with one host copy per device."""
        kept = [(name, p) for name, _, p in self._params if p.requires_grad]
        if not kept:
            return set()
        with torch.no_grad():  # to_local() records no graph
            norms = _norms([local_tensor(p).detach() for _, p in kept])
        return {name for (name, _), n in zip(kept, _host_floats(norms), strict=True)
                if n == 0.0}

    def snapshot_weights(self, updated: set[int] | None = None) -> None:
        """Copy every trainable parameter, just before an optimizer update (sampled steps
        only: it costs one more copy of the trainable parameters until `measure_updates`).
        The copies' norms are the step's weight norms (`finish` reuses them): one read.
        On a CUDA device where the copy would take more than half of the memory free
        (`copy_fits`), nothing is copied and the step's update is not measured
        (`snapshot_skipped` counts them; not under FSDP2, whose ranks must all copy).

        Under FSDP2 each rank copies its shard of a sharded parameter (`measure_updates`
        joins the shards' updates).

        Args:
            updated: the `id()`s of the parameters this update writes (the optimizer's);
                the others (another optimizer's, stepped after it) get no update measured.
                None: every trainable parameter.
        """
        kept = [(i, name, p) for i, (name, _, p) in enumerate(self._params)
                if p.requires_grad and (updated is None or id(p) in updated)]
        self._before = []
        self._weight_vals = {}
        if not kept:
            return
        # Not under FSDP2, whose ranks then join their updates in a collective: every rank
        # must take its copy (a shard: a fraction of the weights).
        sharded = self._rank_aware is not None and self._rank_aware.strategy == "fsdp2"
        if not sharded and _tight_devices([p for _, _, p in kept]):
            # No copy where it could run the device out of memory in the user's step: this
            # step's update goes unmeasured (`snapshot_skipped`), the rest of it is read.
            self.snapshot_skipped += 1
            return
        with torch.no_grad():  # to_local() records no graph
            weights = [local_tensor(p).detach() for _, _, p in kept]
        made = _kernels.copy_norms(weights)
        if made is None:
            with torch.no_grad():
                copies = list(torch._foreach_mul(weights, 1.0))  # one call; times one is exact
        else:
            copies, norms = made
            self._weight_vals = {i: n for (i, _, _), n in zip(kept, norms, strict=True)}
        self._before = [(i, name, p, c) for (i, name, p), c in zip(kept, copies, strict=True)]

    def measure_updates(self) -> Updates:
        """Right after the update: `‖w_after - w_before‖` per parameter snapshotted by
        `snapshot_weights`, as 0-d tensors, and for bfloat16 and float16 parameters how many
        elements with a nonzero gradient the update left as they were; the copies are freed.
        Empty without a snapshot.

        On one process and under DDP they stay on the device (no host sync). Under FSDP2 a
        sharded parameter's update is the root of the summed squares of its shards' updates:
        every rank's numbers are exchanged at once (one all_gather, as for the gradients),
        and those of the sharded parameters come back on the host.
        """
        if not self._before:
            return Updates({}, {})
        self._weight_vals = {}  # the weights moved: their snapshot norms are not theirs now
        indices = [i for i, _, _, _ in self._before]
        names = [name for _, name, _, _ in self._before]
        with torch.no_grad():
            after = [local_tensor(p).detach() for _, _, p, _ in self._before]
            stale = {name: _stale(local_tensor(p.grad).detach(), now, before)
                     for (_, name, p, before), now in zip(self._before, after, strict=True)
                     if before.dtype in _HALF and p.grad is not None
                     and p.grad.layout == torch.strided}
        befores = [before for _, _, _, before in self._before]
        self._before = []
        diffs = _kernels.diff_norms(after, befores)
        if diffs is None:
            with torch.no_grad():
                torch._foreach_sub_(befores, after)  # in place
            diffs = _norms(befores)
        if self._rank_aware is not None:
            diffs = self._rank_aware.whole_updates(indices, diffs)
        return Updates(dict(zip(names, diffs, strict=True)), stale)

    def discard(self) -> None:
        """Drop whatever the current step measured, and its hooks."""
        if self._step_handles:
            self._session.release(self._step_handles)
        if self._measured():
            self._reset()
        else:
            self._reset_counters()  # a step that measured nothing (not sampled)

    def finish(self, index: int, *, step: StepInfo | None = None) -> GradFlow:
        """Turn the current step's measurements into a `GradFlow` and start a new step.

        Args:
            index: the step's index, as `GradFlow.index`.
            step: the training step torchscope ran, when it ran one.
        """
        return self.finish_later(index, step=step)()

    def finish_later(self, index: int, *, step: StepInfo | None = None
                     ) -> Callable[[], GradFlow]:
        """`finish` without waiting for the device: the step's numbers start on their way
        to the host (one batched copy per device, into pinned memory on CUDA), the
        collector starts a new step, and the returned function builds the `GradFlow`,
        waiting for that copy only then. Call it a step later and the copy has long
        arrived: the training loop never waits for the device on torchscope's account.
        (The ranks' exchange is a collective, started at once on every rank: under DDP
        waited for when the records are built, so that a loop does not stop at it; under
        FSDP2 at once, for the update's own exchange that follows.)

        Args:
            index: the step's index, as `GradFlow.index`.
            step: the training step torchscope ran, when it ran one.
        """
        self._read_simple_calls()  # a forward whose root never returned: record its calls
        self._flush_parts()  # a backward that raised never ran its end callback
        self._measure_params()
        # The weights' norms join the same host copy: one read of each trainable parameter
        # (this rank's shard under FSDP2), taken when the gradients are final and (in a
        # watched loop) before the update.
        trainable = [i for i, (_, _, p) in enumerate(self._params) if p.requires_grad]
        known = self._weight_vals  # from a snapshot taken just before (update ratios)
        rest = [i for i in trainable if i not in known]
        weights: dict[int, int] = {}
        for i, wn in zip(rest, _norms([local_tensor(self._params[i][2]).detach()
                                        for i in rest]), strict=True):
            weights[i] = len(self._vals)
            self._vals.append(wn)
        for i in trainable:
            if i in known:
                weights[i] = len(self._vals)
                self._vals.append(known[i])
        # Frozen parameters that are all zero can never change (transformers 5's ViT-MAE
        # zeroes its decoder's fixed position table): one count each, small ones only,
        # read with the rest; not across ranks, where each holds part of them.
        frozen: dict[int, int] = {}  # param index -> index in `_vals` of its count
        if self._rank_aware is None:
            for i, (name, _, p) in enumerate(self._params):
                if not p.requires_grad and p.layout == torch.strided and \
                        0 < p.numel() <= _FROZEN_READ and not name.endswith("bias"):
                    frozen[i] = len(self._vals)
                    self._vals.append(torch.count_nonzero(p.detach()))  # ()
        # Per expert, the norm of its slice of each fused expert weight's gradient.
        experts: dict[int, int] = {}  # param index -> index in `_vals` of its first expert
        for i in sorted(self._experts):
            g = self._params[i][2].grad
            if g is not None and g.layout == torch.strided:
                experts[i] = len(self._vals)
                with torch.no_grad():  # half precision summed in float32, as `_norm` does
                    flat = g.detach().flatten(1)  # (experts, rest)
                    per = torch.linalg.vector_norm(flat, dim=1, dtype=torch.float32) \
                        if flat.dtype in _HALF else torch.linalg.vector_norm(flat, dim=1)
                self._vals.extend(per.unbind())
        split_experts = self._split_experts
        ranks = None
        applied: float | None = None
        scale_at: int | None = None
        scale: float | None = None
        exchange = None
        own: Callable[[], RankGrads] | None = None
        if self._rank_aware is not None and self.hold_ranks and \
                self._rank_aware.strategy == "ddp":
            # Kept for one exchange at the watch's end (`held`): no collective per step.
            scale = self._scale()
            held = self._exchange_args(1.0 / scale if scale else 1.0, weights)
            kept = self._rank_aware.hold(*held)
            self.held = (index, kept)
            own = kept.own
        elif self._rank_aware is not None:  # a collective: every rank starts it now
            scale = self._scale()
            exchange = self._exchange(1.0 / scale if scale else 1.0, weights)
            if self._rank_aware.strategy != "ddp":  # FSDP2: joined at once
                ranks, applied = exchange()
                exchange = None
        else:
            scale_t = self._scale_tensor()
            if scale_t is not None:  # read with the norms, not by its own `.item()`
                scale_at = len(self._vals)
                self._vals.append(scale_t.detach().reshape(()).double())
        values = _host_floats_later(self._vals)
        idle = self._drop_unreached()
        forwards = self._micro + 1
        calls = sorted(self._calls, key=lambda c: (c.order is None, c.order or 0, c.seq))
        called = {c.module for c in self._calls}
        # A hooked module with no call while others had theirs did not run in the forward.
        skipped = {n for n, _ in self._targets} - called if called else set()
        shapes = [(tuple(p.shape), str(p.dtype), p.requires_grad) for _, _, p in self._params]
        owners = [owner for _, owner, _ in self._params]
        names, param_vals = list(self._names), dict(self._param_vals)
        no_grad = dict(self._no_grad_calls)
        micro_batches = max(forwards, 1 if self._calls else 0)
        backwards, fused, eager = self._backwards, self._fused_norms, self._eager_norms
        self.discard()

        def build() -> GradFlow:
            host = values()
            nonlocal scale, ranks, applied
            if exchange is not None:  # DDP: waited for only now, a step later in a loop
                ranks, applied = exchange()
            numbers = ranks if own is None else own()  # held: this rank's row alone
            if scale_at is not None:
                scale = host[scale_at]
            inv = 1.0 / scale if scale else 1.0

            def norm_of(val: int | None) -> float | None:
                return None if val is None or val < 0 else host[val] * inv

            def tensor_grad(s: _Slot) -> TensorGrad:
                n = norm_of(s.root().val)
                reason = None if n is not None else (s.reason or s.root().reason or
                                                     NOT_REACHED)
                return TensorGrad(s.path, tuple(s.shape), str(s.dtype), n, reason)

            modules = tuple(
                ModuleGradRecord(
                    c.module, c.module_type, index, c.micro, c.call, c.order,
                    tuple(tensor_grad(s) for s in c.outs),
                    tuple(tensor_grad(s) for s in c.ins),
                    c.owns_params,
                )
                for c in calls
            )
            params = []
            for pname, mname, i, tied_to in names:
                shape, dtype, requires_grad = shapes[i]
                n = norm_of(param_vals.get(i)) if numbers is None else numbers.norm(i)
                if not requires_grad:
                    reason: str | None = FROZEN
                elif n is None:
                    owner = mname if mname in no_grad else owners[i]
                    reason = NOT_REACHED if mname in called or owners[i] in called \
                        else (NOT_RUN if mname in skipped else NO_GRAD) \
                        if owner not in no_grad \
                        else RAN_IN_REENTRANT_CHECKPOINT if no_grad[owner] else RAN_NO_GRAD
                else:
                    reason = None
                w = (numbers.weight_norm(i) if numbers is not None else host[weights[i]]) \
                    if i in weights else None
                at = experts.get(i)
                per_expert = None if at is None else \
                    tuple(host[at + e] * inv for e in range(shape[0]))
                params.append(ParamGradRecord(pname, mname, shape, dtype, requires_grad, n,
                                              reason, weight_norm=w, tied_to=tied_to,
                                              expert_norms=per_expert))
            frozen_zero = tuple(pname for pname, _, i, tied_to in names
                                if tied_to is None and i in frozen and host[frozen[i]] == 0)
            # Each tensor once, as clip_grad_norm_ counts tied weights.
            total = combine_norms(p.norm for p in params if p.tied_to is None) or 0.0
            return GradFlow(index, modules, tuple(params), total, scale,
                            micro_batches=micro_batches, backward_calls=backwards, step=step,
                            ranks=ranks, fused_norms=fused, eager_norms=eager,
                            idle_forwards=idle, applied_norm=applied,
                            experts=split_experts, frozen_zero=frozen_zero)

        return functools.cache(build)  # built once, however often it is asked for

    def _drop_unreached(self) -> int:
        """Leave out the forwards of this step that no backward reached, when another one
        was reached; how many. Such a forward ran with gradients on but its output was
        dropped (an evaluation pass without `torch.no_grad`, a forward for logging): it is
        no micro-batch of the step, and its calls would read as unreached. A forward that
        only a pass feeding no update reached (`_undo_pass`: an adversarial attack's) is
        left out too, but not counted. The micro-batches left are numbered again from 0."""
        reached = {c.micro for c in self._calls if c.order is not None}
        unreached = {c.micro for c in self._calls} - reached
        if not reached or not unreached or not self._backwards:
            return 0
        idle = unreached - self._side  # the others fed a backward that fed no update
        self._drop_micro_batches(unreached)
        return len(idle)

    def _drop_micro_batches(self, drop: set[int]) -> None:
        """Leave out the calls of micro-batches `drop`, and number the others again from 0
        in their order (`_micro` is then the last one's number)."""
        kept = sorted((set(range(self._micro + 1)) | {c.micro for c in self._calls}) - drop)
        renumber = {m: i for i, m in enumerate(kept)}
        self._calls = [c for c in self._calls if c.micro not in drop]
        for c in self._calls:
            c.micro = renumber[c.micro]
        self._side = {renumber[m] for m in self._side if m in renumber}
        self._micro = len(kept) - 1

    def _exchange(self, inv: float, weights: dict[int, int]
                  ) -> Callable[[], tuple[RankGrads | None, float | None]]:
        """Start the exchange of every rank's per-parameter norms of this step (DDP, FSDP2);
        the function returned waits for it and gives them, and under FSDP2 the total norm
        the update used when the loop changed the gradients (`note_applied`); (None, None)
        on one process.

        Args:
            inv: one over the GradScaler's scale.
            weights: parameter index -> index in `_vals` of its (local) weight norm.
        """
        if self._rank_aware is None:
            return lambda: (None, None)
        return self._rank_aware.finish(*self._exchange_args(inv, weights), self._applied)

    def _exchange_args(self, inv: float, weights: dict[int, int]) -> tuple[
            list[str], list[nn.Parameter], list[torch.Tensor | None],
            list[torch.Tensor | None], float,
            tuple[list[torch.Tensor | None], list[torch.Tensor | None]] | None]:
        """This step's numbers for the ranks' exchange (`_RankAware.finish`'s and `hold`'s
        first six arguments): names, parameters, local gradient norms, weight norms, `inv`
        and the synchronised gradients' reads (taken now: the step's are dropped)."""
        n = len(self._params)
        local = [self._vals[self._param_vals[i]] if i in self._param_vals else None
                 for i in range(n)]
        w = [self._vals[weights[i]] if i in weights else None for i in range(n)]
        read, self._synced = self._synced, None
        return ([name for name, _, _ in self._params], [p for _, _, p in self._params], local,
                w, inv, read)

    def note_applied(self) -> None:
        """Under FSDP2, at a sampled step whose update is about to use the gradients: take
        this rank's shard norm of each parameter's gradient (one fused read, no host sync).
        The step's exchange in `finish` joins every rank's into `GradFlow.applied_norm`
        where it differs from the backward's."""
        at: list[int] = []
        grads: list[torch.Tensor] = []
        for i, (_, _, p) in enumerate(self._params):  # a tied weight is there once
            if (g := p.grad) is not None:
                at.append(i)
                grads.append(local_tensor(g).detach())
        self._applied = dict(zip(at, _norms(grads), strict=True))
