"""Time per module from profiler events: forward ranges, and backward through sequence numbers.

Forward: each timed module's forward ran inside a range named by `range_label`. Its time is
the range's duration; its self time subtracts the timed modules nested in it.

Backward: when an op runs in forward with autograd recording, the profiler stores the
sequence number of the autograd node it creates. The engine later runs that node inside
`autograd::engine::evaluate_function: <Node>`, an event that carries the same sequence number
and the forward thread (`fwd_thread`). Matching `(fwd_thread, sequence_nr)` leads from the
backward node back to the forward op, hence to the innermost module range around it.
Nodes whose forward op ran outside every module (the loss) or before profiling began, and
`AccumulateGrad` (which has no sequence number), are reported separately so that module,
outside and engine times add up to the backward phase.

A reentrant checkpoint (`torch.utils.checkpoint` with `use_reentrant=True`) ran its first
forward under no_grad: its layers made no node then. Its one node,
`CheckpointFunctionBackward`, runs their forward again and a backward of its own inside
itself. That node is opened up: the recomputation's module ranges and ops are read as a
forward would be (not counted as calls), its nested nodes are attributed through them, and
what is left of it, the recomputation, is backward time of the checkpointed module.

A non-reentrant checkpoint (`use_reentrant=False`, transformers' gradient checkpointing)
keeps the original nodes and runs the checkpointed region's forward again inside the first
node that unpacks one of its saved tensors: the region's module ranges then open inside
that node. They are taken out of it, and each recomputed module's self time is its own
backward time; otherwise the whole recomputation read as backward work of the region's
last layer (a Llama decoder layer's `down_proj`, 2.4 ms of backward against 0.2 ms).

Communication is no module's own work: collectives (`is_comm`) and FSDP2's own ranges
(`FSDP::pre_forward`, `FSDP::post_backward_reduce`, ...) that run inside a module's range or
backward node are taken out of its self time and counted outside modules, so that on a
sharded model the root, whose hooks all-gather every parameter, is not the costliest module
for waiting on the other ranks.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torchscope.profiling.comm import is_comm
from torchscope.profiling.records import PHASES, ModuleTime, PhaseTime, Reconciliation

__all__ = ["EVALUATE_PREFIX", "Attribution", "attribute"]

EVALUATE_PREFIX = "autograd::engine::evaluate_function: "
# The range every torch.optim optimizer opens around its own `step()`.
OPTIMIZER_STEP_PREFIX = "Optimizer.step#"
_ACCUMULATE = "AccumulateGrad"
_REENTRANT = "CheckpointFunctionBackward"


@dataclass
class _Acc:
    module: str
    module_type: str
    order: int
    calls: int = 0
    fwd_us: float = 0.0
    fwd_self_us: float = 0.0
    fwd_dev_us: float = 0.0
    bwd_us: float = 0.0
    bwd_self_us: float = 0.0
    bwd_dev_us: float = 0.0
    nodes: int = 0


@dataclass
class _Ctx:
    """What encloses an event: its timed-module chain, backward node and phase."""

    modules: tuple[tuple[str, int], ...] = ()  # (module name, range event id), outermost first
    in_backward: bool = False
    phase: str | None = None
    in_comm: bool = False  # inside a collective or an FSDP range already counted
    recompute: int | None = None  # inside a reentrant checkpoint's node: that event's id
    optimizer: bool = False  # inside torch.optim's own step range (derived phases)
    node: int | None = None  # inside an outermost backward node: that event's id
    replay: int | None = None  # inside a module range run again in that node: its id


@dataclass(frozen=True)
class Attribution:
    """Result of `attribute`: module rows, phase totals and the reconciliation."""

    modules: tuple[ModuleTime, ...]
    phases: tuple[PhaseTime, ...]
    reconciliation: Reconciliation
    notes: tuple[str, ...] = field(default_factory=tuple)


def _dur(e: Any) -> float:
    return float(e.time_range.end - e.time_range.start)


def _dev(e: Any) -> float:
    try:
        return float(e.device_time_total)
    except (AttributeError, TypeError):  # async or device-side events have no total
        return 0.0


def _add(slot: list[float], ev: Any) -> None:
    """One more range in a phase's [calls, host us, device us]."""
    slot[0] += 1
    slot[1] += _dur(ev)
    slot[2] += _dev(ev)


def _is_comm(name: str) -> bool:
    """A collective, or a range of FSDP2's own (its all-gathers and reduce-scatters)."""
    return name.startswith("FSDP::") or is_comm(name)


def _comm_us(ev: Any, before: float | None = None, skip: set[int] | None = None) -> float:
    """Time of the outermost communication events under `ev`; only those that start
    before `before`, and not under the events of ids `skip`, where given."""
    total = 0.0
    stack = list(ev.cpu_children)
    while stack:
        e = stack.pop()
        if skip is not None and e.id in skip:
            continue
        if _is_comm(e.name):
            if before is None or e.time_range.start < before:
                total += _dur(e)
        else:
            stack.extend(e.cpu_children)
    return total


def _enclosing(module: str, timed: Mapping[str, Any]) -> list[str]:
    """`module` and the timed modules around it by name (the root is ""), outermost
    first."""
    parts = module.split(".") if module else []
    names = ["", *(".".join(parts[:i]) for i in range(1, len(parts) + 1))]
    return [n for n in dict.fromkeys(names) if n in timed]


def _around(modules: list[str], timed: Mapping[str, Any]) -> str:
    """The innermost timed module whose name encloses every one of `modules` (itself, for
    one); "" (the root) when none does."""
    split = [m.split(".") if m else [] for m in modules]
    common: list[str] = []
    for parts in zip(*split, strict=False):  # to the shortest name
        if len(set(parts)) > 1:
            break
        common.append(parts[0])
    inner = _enclosing(".".join(common), timed)
    return inner[-1] if inner else ""


def _is_host(e: Any) -> bool:
    return str(getattr(e.device_type, "name", e.device_type)).upper() == "CPU" and not getattr(
        e, "is_async", False
    )


def attribute(events: Iterable[Any], labels: Mapping[str, tuple[str, str]]) -> Attribution:
    """Attribute profiler events to modules and phases.

    Args:
        events: `prof.events()` (`FunctionEvent`s with `cpu_children` populated).
        labels: range name -> (qualified module name, type name), from `ModuleRanges.labels`.
            Empty when modules were not timed: only phases are reported then.

    Returns:
        An `Attribution` whose module self times plus the outside/engine terms add up to
        the phase totals.
    """
    host = [e for e in events if _is_host(e)]
    roots = [e for e in host if e.cpu_parent is None]
    acc: dict[str, _Acc] = {}
    phase_us: dict[str, list[float]] = {p: [0, 0.0, 0.0] for p in PHASES}  # calls, host, device
    # The same, derived for a loop that labels no phase (see `PhaseTime.derived`).
    auto_us: dict[str, list[float]] = {p: [0, 0.0, 0.0] for p in PHASES}
    # The model's outermost forward calls and torch.optim's step ranges, as time spans: a
    # closure's forward runs inside a step range. (By time: a step boundary the watch cuts
    # inside the step range, at the closure's forward, leaves it out of the event tree.)
    forwards: list[tuple[float, float]] = []
    steps: list[tuple[float, float]] = []
    # (forward thread, sequence number) -> chain of timed modules around the forward op.
    seq_owner: dict[tuple[int, int], tuple[str, ...]] = {}
    nodes: list[Any] = []  # backward node events, outermost ones only
    fwd_modules_in_phase = 0.0
    # Reentrant checkpoints' nodes: event id -> (event, the module chain its recomputation
    # runs in, its nested nodes' time); their nested nodes are in `nodes`.
    recomputes: dict[int, tuple[Any, tuple[str, ...], list[float]]] = {}
    checkpointed: set[int] = set()  # those whose checkpointed module was found

    # Module ranges run inside a backward node (a non-reentrant checkpoint's recomputation):
    # range event id -> (event, module, the node's id, the enclosing such range's id).
    replays: dict[int, tuple[Any, str, int, int | None]] = {}

    # Depth-first walk with an explicit stack: models nest deep enough to hit recursion limits.
    stack: list[tuple[Any, _Ctx]] = [(r, _Ctx()) for r in reversed(roots)]
    # Self-time bookkeeping: duration of nested timed ranges, keyed by the enclosing range id.
    child_us: dict[int, float] = {}
    ranges: dict[int, tuple[Any, str, str | None]] = {}
    while stack:
        ev, ctx = stack.pop()
        name: str = ev.name
        new = ctx
        if name.startswith(EVALUATE_PREFIX) and not ctx.in_backward and \
                ctx.recompute is None and ctx.phase is None:
            _add(auto_us["backward"], ev)  # an outermost node: the engine's own work
        if name in PHASES and not ctx.in_backward and ctx.phase is None:
            # Only outermost phase ranges count, so nested labels never double-count.
            _add(phase_us[name], ev)
            new = _Ctx(ctx.modules, ctx.in_backward, name, optimizer=ctx.optimizer)
        elif name in labels and ctx.recompute is not None and not ctx.in_backward:
            # A module range in a reentrant checkpoint's recomputation: no call of its own.
            mod = labels[name][0]
            if mod in acc:
                node, target, nested = recomputes[ctx.recompute]
                if ctx.modules == tuple((m, -1) for m in target) and \
                        ctx.recompute not in checkpointed:  # the checkpointed module itself
                    checkpointed.add(ctx.recompute)
                    recomputes[ctx.recompute] = (node, (*target, mod), nested)
                new = _Ctx((*ctx.modules, (mod, -1)), False, ctx.phase, recompute=ctx.recompute,
                           optimizer=ctx.optimizer)
        elif name in labels and ctx.in_backward and ctx.node is not None and \
                not ctx.in_comm:
            # A module's forward run again inside a backward node: a non-reentrant
            # checkpoint's recomputation, which the first node to unpack a saved tensor of
            # the checkpointed region runs. It is no call, and no work of that node's
            # module: each recomputed module's own backward work.
            replays[ev.id] = (ev, labels[name][0], ctx.node, ctx.replay)
            new = _Ctx(ctx.modules, True, ctx.phase, optimizer=ctx.optimizer, node=ctx.node,
                       replay=ev.id)
        elif name in labels:
            mod, mtype = labels[name]
            if not ctx.in_backward:
                if mod == "" and not ctx.modules and ctx.phase is None:  # the model's call
                    _add(auto_us["forward"], ev)
                    forwards.append((ev.time_range.start, ev.time_range.end))
                a = acc.get(mod)
                if a is None:
                    a = acc[mod] = _Acc(mod, mtype, len(acc))
                a.calls += 1
                a.fwd_us += _dur(ev)
                a.fwd_dev_us += _dev(ev)
                ranges[ev.id] = (ev, mod, ctx.phase)
                if ctx.modules:
                    parent_id = ctx.modules[-1][1]
                    child_us[parent_id] = child_us.get(parent_id, 0.0) + _dur(ev)
                new = _Ctx((*ctx.modules, (mod, ev.id)), ctx.in_backward, ctx.phase,
                           optimizer=ctx.optimizer)
        elif name.startswith(OPTIMIZER_STEP_PREFIX) and not ctx.in_backward and \
                ctx.phase is None and not ctx.optimizer:
            _add(auto_us["optimizer"], ev)
            steps.append((ev.time_range.start, ev.time_range.end))
            new = _Ctx(ctx.modules, ctx.in_backward, ctx.phase, optimizer=True)
        elif name.startswith(EVALUATE_PREFIX) and not ctx.in_backward and \
                name.endswith(_REENTRANT):
            owner = seq_owner.get((int(ev.fwd_thread), int(ev.sequence_nr))) \
                if ev.fwd_thread is not None and ev.sequence_nr is not None else None
            base = owner or ()
            recomputes[ev.id] = (ev, base, [])
            if ctx.recompute is not None:
                recomputes[ctx.recompute][2].append(_dur(ev))
            new = _Ctx(tuple((m, -1) for m in base), False, ctx.phase, recompute=ev.id,
                       optimizer=ctx.optimizer)
        elif name.startswith(EVALUATE_PREFIX):
            if not ctx.in_backward:
                nodes.append(ev)
                if ctx.recompute is not None:
                    recomputes[ctx.recompute][2].append(_dur(ev))
            new = _Ctx(ctx.modules, True, ctx.phase, optimizer=ctx.optimizer,
                       node=ctx.node if ctx.in_backward else ev.id, replay=ctx.replay)
        elif _is_comm(name) and not ctx.in_backward and not ctx.in_comm:
            if ctx.modules and ctx.recompute is None:  # out of the enclosing module's self time
                parent_id = ctx.modules[-1][1]
                child_us[parent_id] = child_us.get(parent_id, 0.0) + _dur(ev)
            new = _Ctx(ctx.modules, ctx.in_backward, ctx.phase, in_comm=True,
                       recompute=ctx.recompute, optimizer=ctx.optimizer, node=ctx.node,
                       replay=ctx.replay)
        elif not ctx.in_backward and ev.sequence_nr is not None and ev.sequence_nr >= 0:
            # Every op records the thread's next sequence number, but only an op that
            # creates an autograd node moves it on: ops that create none (`loss.detach()`,
            # the optimizer's updates) record the number the next node will take. So the
            # last op to record a number is the one whose node carries it (the walk is in
            # time order).
            seq_owner[(int(ev.thread), int(ev.sequence_nr))] = tuple(m for m, _ in ctx.modules)
        for child in reversed(ev.cpu_children):
            stack.append((child, new))

    derived = not any(slot[0] for slot in phase_us.values()) and \
        any(slot[0] for slot in auto_us.values())
    closure = derived and any(a <= f0 and f1 <= b for a, b in steps for f0, f1 in forwards)
    if derived:
        if closure:
            # A closure ran forward and backward inside the optimizer's step (Lightning,
            # LBFGS), and the framework's own code with them: the update cannot be told
            # apart from the rest of the range.
            auto_us["optimizer"] = [0, 0.0, 0.0]
        phase_us = auto_us
    for rid, (ev, mod, phase) in ranges.items():
        a = acc[mod]
        self_us = _dur(ev) - child_us.get(rid, 0.0)
        a.fwd_self_us += self_us
        if phase == "forward" or (derived and phase is None):
            fwd_modules_in_phase += self_us

    def credit(chain: tuple[str, ...], d: float, dev: float) -> None:
        """Backward time `d` of one node: self time of the innermost module, and time of
        each module around it (one re-entered by recursion, twice in the chain, once)."""
        acc[chain[-1]].bwd_self_us += d
        for mod in dict.fromkeys(chain):
            a = acc[mod]
            a.bwd_us += d
            a.bwd_dev_us += dev
            a.nodes += 1

    bwd_modules = bwd_outside = bwd_accum = 0.0
    unmatched = 0
    node_by_id = {ev.id: ev for ev in nodes}
    # Recomputed module ranges: each one's self time (less the ranges and communication
    # nested in it) is its module's backward time; the outermost ones leave their node.
    # The checkpoint's own work around them (unpacking, the RNG state put back, the ops of
    # a region's forward outside its modules) runs from the node's start to the last
    # range's end: the backward work of the module around all of them (a decoder layer
    # whose forward the checkpoint calls without its range: transformers' layers).
    replayed: dict[int, float] = {}  # node event id -> time of the recomputation in it
    nested_us: dict[int, tuple[float, float]] = {}  # range id -> nested ranges' (time, comm)
    outermost: dict[int, list[Any]] = {}  # node event id -> its outermost ranges
    for ev, _mod, node, parent in replays.values():
        if parent is None:
            outermost.setdefault(node, []).append(ev)
        else:
            t, c = nested_us.get(parent, (0.0, 0.0))
            nested_us[parent] = (t + _dur(ev), c + _comm_us(ev))
    credits: list[tuple[str, float]] = []  # (module, recomputation time that is its own)
    for node, outer in outermost.items():
        start = node_by_id[node].time_range.start
        end = max(e.time_range.end for e in outer)
        # FSDP2 all-gathers a recomputed module's parameters before its range opens: that
        # communication stays outside modules, as the node's own `comm` counts it.
        gap_comm = _comm_us(node_by_id[node], before=end, skip={e.id for e in outer})
        own = max(end - start - sum(_dur(e) for e in outer) - gap_comm, 0.0)
        credits.append((_around([replays[e.id][1] for e in outer], acc), own))
        replayed[node] = own + sum(_dur(e) - _comm_us(e) for e in outer)
    for rid, (ev, mod, _node, _parent) in replays.items():
        t, c = nested_us.get(rid, (0.0, 0.0))
        credits.append((mod, max(_dur(ev) - t - (_comm_us(ev) - c), 0.0)))
    for mod, d in credits:
        if mod not in acc:  # no forward of it in the window to time it by
            bwd_outside += d
            continue
        bwd_modules += d
        acc[mod].bwd_self_us += d
        for outer_mod in _enclosing(mod, acc):
            acc[outer_mod].bwd_us += d
    for ev, where, nested in recomputes.values():
        # What its nested nodes do not cover: the recomputation, the checkpointed module's.
        comm = _comm_us(ev)
        d = max(_dur(ev) - sum(nested) - comm, 0.0)
        bwd_outside += comm
        if not where:
            bwd_outside += d
            continue
        bwd_modules += d
        credit(where, d, 0.0)  # the nested nodes carry the device time
    recorded: dict[int, list[int]] = {}  # per forward thread, its recorded numbers in order
    for thread, number in sorted(seq_owner):
        recorded.setdefault(thread, []).append(number)
    for ev in nodes:
        comm = _comm_us(ev)
        d = _dur(ev) - comm - replayed.get(ev.id, 0.0)
        bwd_outside += comm
        seq = ev.sequence_nr
        fwd_thread = ev.fwd_thread
        chain = None
        if seq is not None and seq >= 0 and fwd_thread is not None:
            chain = seq_owner.get((int(fwd_thread), int(seq)))
            numbers = recorded.get(int(fwd_thread), [])
            below = bisect.bisect_right(numbers, int(seq)) - 1
            if chain is None and below >= 0 and int(seq) - numbers[below] == 1:
                # An in-place write into a view (`h[:, :k] = ...`): its `copy_` records
                # the number its CopyBackwards takes, and the CopySlices node over it takes
                # the next, which no op records. It is that op's.
                chain = seq_owner[(int(fwd_thread), numbers[below])]
        if chain is None:
            if ev.name.endswith(_ACCUMULATE):
                bwd_accum += d
            else:
                unmatched += 1
                bwd_outside += d
            continue
        if not chain:
            bwd_outside += d
            continue
        bwd_modules += d
        credit(chain, d, _dev(ev))

    phases = tuple(
        PhaseTime(p, int(phase_us[p][0]), phase_us[p][1] / 1e3, phase_us[p][2] / 1e3,
                  derived=derived)
        for p in PHASES if phase_us[p][0]
    )
    fwd_total = phase_us["forward"][1]
    bwd_total = phase_us["backward"][1]
    engine = max(bwd_total - bwd_modules - bwd_outside - bwd_accum, 0.0)
    rec = Reconciliation(
        forward_ms=fwd_total / 1e3,
        forward_modules_ms=fwd_modules_in_phase / 1e3,
        forward_outside_ms=max(fwd_total - fwd_modules_in_phase, 0.0) / 1e3,
        backward_ms=bwd_total / 1e3,
        backward_modules_ms=bwd_modules / 1e3,
        backward_outside_ms=bwd_outside / 1e3,
        backward_accumulate_ms=bwd_accum / 1e3,
        backward_engine_ms=engine / 1e3,
    )
    modules = tuple(
        ModuleTime(
            module=a.module, module_type=a.module_type, calls=a.calls,
            forward_ms=a.fwd_us / 1e3, forward_self_ms=a.fwd_self_us / 1e3,
            backward_ms=a.bwd_us / 1e3, backward_self_ms=a.bwd_self_us / 1e3,
            forward_device_ms=a.fwd_dev_us / 1e3, backward_device_ms=a.bwd_dev_us / 1e3,
            backward_nodes=a.nodes,
        )
        for a in sorted(acc.values(), key=lambda a: a.order)
    )
    notes: list[str] = []
    if derived:
        notes.append(
            "the loop labelled no phase: forward is the model's own forward (the loss "
            "outside it), backward the autograd engine's nodes"
            + (", and the optimizer's update is not told apart: the step ran forward and "
               "backward in a closure inside it." if closure else
               ", optimizer torch.optim's step ranges."))
    if unmatched:
        notes.append(
            f"{unmatched} backward node(s) had no forward op in the profiled window "
            "(graph built before profiling, or on another thread); counted as outside modules."
        )
    return Attribution(modules, phases, rec, tuple(notes))

