"""Frozen records of a profiled training step: ops, phases, modules and step timing.

Every time is in milliseconds, summed over the profiled (active) steps unless a field says
"per step". Records hold numbers only; renderers in `torchscope.report.profiling` format them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from torchscope._timing import Interval, Ratio, median_interval
from torchscope.distributed.ranked import Gatherable
from torchscope.errors import TorchscopeError
from torchscope.findings import Analyzed
from torchscope.step import StepInfo

#: The phase labels `profile_steps` opens with `record_function`, in step order.
PHASES: tuple[str, ...] = ("forward", "backward", "optimizer")

#: The range around a watch's own wait for the device at a step boundary (one
#: `cudaDeviceSynchronize` on CUDA): the host-sync finding leaves those waits out.
OWN_SYNC_RANGE = "torchscope::step_sync"

SortKey = Literal["self_cpu", "total", "self_cuda", "cuda_total", "calls"]


class ProfilingError(TorchscopeError):
    """A step could not be profiled (bad arguments, or no step inside the profiled window)."""


@dataclass(frozen=True)
class ProfileThresholds:
    """When a profile's figures become warnings (`result.findings(thresholds)`).

    Attributes:
        backward_ratio_high: backward over forward time above which something extra runs
            in backward (it usually costs about twice the forward).
        optimizer_share_high: optimizer share of the labelled step above which a fused or
            foreach optimizer pays off.
        overhead_high: step slowdown under the profiler above which absolute times are
            unreliable (only a slowdown beyond the timing noise counts).
        comm_exposed_high: share of the step spent waiting for communication (exposed
            communication) above which it is a warning.
        straggler_ratio: one rank's own work per step (step time less exposed
            communication) over the median of the other ranks' at or above which that rank
            is a straggler.
        input_wait_high: share of the step spent getting the next batch from a DataLoader
            above which it is a warning (above a quarter of it, an info).
    """

    backward_ratio_high: float = 3.5
    optimizer_share_high: float = 0.25
    overhead_high: float = 1.5
    comm_exposed_high: float = 0.3
    straggler_ratio: float = 1.3
    input_wait_high: float = 0.2


@dataclass(frozen=True)
class OpRecord:
    """One row of `key_averages()`: an operator (or a `record_function` range) over all steps.

    Attributes:
        name: the event name, e.g. `aten::addmm` or `autograd::engine::evaluate_function: ...`.
        calls: how many times it ran in the profiled steps.
        self_cpu_ms: CPU time inside it, excluding the ops it called.
        cpu_total_ms: CPU time including the ops it called.
        self_device_ms: accelerator (CUDA) kernel time it launched itself.
        device_total_ms: accelerator time including the ops it called.
        self_cpu_frac: share of all profiled self CPU time (0..1).
        self_device_frac: share of all profiled self device time (0..1; 0 without a device).
        input_shapes: the input shapes of this group, when grouped by input shape.
    """

    name: str
    calls: int
    self_cpu_ms: float
    cpu_total_ms: float
    self_device_ms: float
    device_total_ms: float
    self_cpu_frac: float
    self_device_frac: float
    input_shapes: tuple[tuple[int, ...], ...] | None = None


@dataclass(frozen=True)
class PhaseTime:
    """A labelled phase (`forward`, `backward`, `optimizer`) over all profiled steps.

    Attributes:
        name: the phase label.
        calls: how many ranges with this label closed (one per step normally).
        cpu_ms: wall time of the ranges on the host.
        device_ms: accelerator kernel time launched inside them (0 on CPU).
        derived: the loop labelled no phase, so this one was read from ranges torch opens
            itself: `forward` from the model's outermost forward calls (the loss is outside
            it), `backward` from the autograd engine's outermost node evaluations (`calls`
            counts nodes), `optimizer` from torch.optim's `Optimizer.step#` ranges, unless
            the step ran forward and backward in a closure inside them (Lightning, LBFGS):
            then there is no optimizer phase.
    """

    name: str
    calls: int
    cpu_ms: float
    device_ms: float
    derived: bool = False


@dataclass(frozen=True)
class ModuleTime:
    """Time of one `nn.Module`: its forward ranges and the backward nodes its forward created.

    Attributes:
        module: qualified name (`""` is the root model).
        module_type: class name, e.g. `Conv2d`.
        calls: forward calls in the profiled steps.
        forward_ms: host time of its forward, including its child modules.
        forward_self_ms: `forward_ms` minus the forward time of the timed modules it called.
        backward_ms: host time of the autograd nodes created by ops inside its forward
            (child modules included), matched through autograd sequence numbers.
        backward_self_ms: the part of `backward_ms` whose forward op ran in this module and in
            none of its timed children.
        forward_device_ms: accelerator time launched by its forward (children included).
        backward_device_ms: accelerator time launched by its backward nodes (children included).
        backward_nodes: how many backward nodes were matched to it (children included).
    """

    module: str
    module_type: str
    calls: int
    forward_ms: float
    forward_self_ms: float
    backward_ms: float
    backward_self_ms: float
    forward_device_ms: float
    backward_device_ms: float
    backward_nodes: int

    @property
    def total_self_ms(self) -> float:
        """Forward plus backward self time: what this module costs on its own."""
        return self.forward_self_ms + self.backward_self_ms


@dataclass(frozen=True)
class Reconciliation:
    """How the module table adds up to the phase totals.

    `forward_modules_ms + forward_outside_ms == forward_ms`, and
    `backward_modules_ms + backward_outside_ms + backward_accumulate_ms + backward_engine_ms
    == backward_ms` (the last term absorbs rounding and is never negative).

    Attributes:
        forward_ms: the forward phase total (0 when no phase was labelled).
        forward_modules_ms: sum of `forward_self_ms` over timed modules inside the phase.
        forward_outside_ms: forward-phase time outside every timed module (e.g. the loss).
        backward_ms: the backward phase total.
        backward_modules_ms: sum of `backward_self_ms` over timed modules.
        backward_outside_ms: backward nodes whose forward op ran outside every timed module.
        backward_accumulate_ms: `AccumulateGrad` nodes (writing `.grad` of parameters).
        backward_engine_ms: the rest: autograd engine work, the initial `ones_like`, hooks.
    """

    forward_ms: float
    forward_modules_ms: float
    forward_outside_ms: float
    backward_ms: float
    backward_modules_ms: float
    backward_outside_ms: float
    backward_accumulate_ms: float
    backward_engine_ms: float


@dataclass(frozen=True)
class StepTiming:
    """Step wall time with and without the profiler.

    Attributes:
        baseline_ms: median step time without any profiler (None when not measured).
        profiled_ms: median step time while the profiler recorded (with module ranges).
        profiled_total_ms: sum of the profiled steps' wall times.
        baseline_steps: how many unprofiled steps were timed.
        profiled_steps: how many profiled steps were timed.
        profiled_samples: each profiled step's wall time, in step order.
        baseline_samples: each unprofiled step's wall time, in step order: the step the
            user runs, without the profiler's cost (`baseline_interval`).
        overhead_ratio: profiled over unprofiled step time with its interval (see
            `torchscope._timing`); None without a baseline. A ratio whose interval includes 1
            is no measurable overhead, whatever its median.
    """

    baseline_ms: float | None
    profiled_ms: float
    profiled_total_ms: float
    baseline_steps: int
    profiled_steps: int
    profiled_samples: tuple[float, ...] = ()
    overhead_ratio: Ratio | None = None
    baseline_samples: tuple[float, ...] = ()

    @property
    def baseline_interval(self) -> Interval | None:
        """The median of the unprofiled steps with its confidence interval
        (`torchscope._timing.median_interval`); None when none was timed."""
        return median_interval(self.baseline_samples) if self.baseline_samples else None

    @property
    def overhead(self) -> float | None:
        """`profiled_ms / baseline_ms`: the median slowdown under the profiler (noise when
        `overhead_ratio` is not measurable)."""
        if self.baseline_ms is None or self.baseline_ms <= 0:
            return None
        return self.profiled_ms / self.baseline_ms


@dataclass(frozen=True)
class CommOp:
    """One kind of collective in the profiled steps, per step.

    Attributes:
        kind: `all_reduce`, `reduce_scatter`, `all_gather`, `broadcast`, ... or `other`.
        calls: collectives of this kind per step.
        ms: their execution time per step, the wait for the other ranks included.
    """

    kind: str
    calls: float
    ms: float


@dataclass(frozen=True)
class CommTime:
    """Computation against communication in the profiled steps, per step (see
    `torchscope.profiling.comm` for how each is measured).

    Attributes:
        compute_ms: time the rank computed (the union of its compute intervals).
        comm_ms: time a collective was running (the union of their execution intervals).
        overlap_ms: communication time during which the rank also computed.
        exposed_ms: communication time during which it did not: it waited.
        ops: per kind of collective, largest time first.
        source: `device` (NCCL kernels) or `host` (the backend's execution ranges).
        exposed_per_step: each profiled step's exposed communication (ms), in step order,
            cut where the profiler's step ranges start (they add up to `exposed_ms` times
            the steps); empty when those ranges could not be matched.
    """

    compute_ms: float
    comm_ms: float
    overlap_ms: float
    exposed_ms: float
    ops: tuple[CommOp, ...]
    source: str = "host"
    exposed_per_step: tuple[float, ...] = ()

    @property
    def overlap(self) -> float | None:
        """Share of communication hidden behind computation (HolisticTraceAnalysis'
        comm/comp overlap); None without communication."""
        return self.overlap_ms / self.comm_ms if self.comm_ms > 0 else None

    def op(self, kind: str) -> CommOp | None:
        """The record of one kind of collective, or None when none ran."""
        return next((o for o in self.ops if o.kind == kind), None)


@dataclass(frozen=True)
class HostReads:
    """Tensor values read to Python (`.item()`, `bool(t)`) and synchronising copies in the
    profiled steps, outside every DataLoader's `__next__` (`torchscope.profiling.syncs`).

    Attributes:
        reads: every read.
        device: the reads of an accelerator's tensor (the device runtime's copy and wait
            ran inside them): each stalls the host until the device has caught up. The
            others read host memory (Adam's step counters) and wait for nothing.
        waits: the runtime's stream waits and blocking copies outside a read (`.cpu()`,
            `.tolist()`, `torch.nonzero`).
        linked: the profiler nested the runtime's calls under the ops that made them; when
            it did not (no accelerator, or an older profiler), `device` cannot be told.
        optimizer: the reads of host tensors inside the step of one of torch.optim's own
            optimizers: the Adam family's step counters, kept on the host on a GPU too.
        scaler: the reads that are a GradScaler's inf check in `GradScaler.step`, one per
            step of a non-fused optimizer (of a device tensor on a GPU: among `device`).
    """

    reads: int
    device: int = 0
    waits: int = 0
    linked: bool = False
    optimizer: int = 0
    scaler: int = 0


@dataclass(frozen=True)
class InputWait:
    """The time a loop spent getting batches from a `torch.utils.data.DataLoader` over the
    profiled steps: its `__next__` ranges, which torch opens itself.

    Attributes:
        ms: wall time inside `__next__`, what it calls included (the dataset's
            `__getitem__`, transforms and collation without workers; the wait for a ready
            batch with them).
        calls: batches taken.
        workers: whether the loader runs worker processes.
    """

    ms: float
    calls: int
    workers: bool


@dataclass(frozen=True)
class ProfileResult(Analyzed, Gatherable):
    """Everything `profile_steps` (or `watch_time`) measured.

    Findings: `result.findings()` (top op, host syncs, backward ratio, optimizer share,
    costliest module, profiler overhead, missing phase labels).

    Attributes:
        steps: profiled (active) steps; every total below covers all of them.
        device: `cpu` or `cuda`.
        ops: one record per op name (and input shape, when grouped), largest self CPU
            time first.
        phases: the labelled phases, in step order; empty when the step labelled none.
        modules: one record per timed module that ran, in first-call order.
        reconciliation: how module times add up to the phase totals.
        timing: step wall time with and without profiling.
        by_module: whether per-module ranges were recorded.
        trace_path: where the Chrome/Perfetto trace was written, if asked.
        notes: caveats about the attribution (unmatched backward nodes, no phases).
        step: the training step profiled, with the loss of its first (warm-up) run on the
            unchanged model; None when torchscope did not run the step (a step function,
            or `watch_time` in your loop).
        comm: computation against communication per step, when collectives ran (DDP,
            FSDP2); None otherwise. `result.gather()` joins every rank's result on rank 0.
        input_wait: the time spent getting batches from a DataLoader in the profiled steps
            (`watch_time` in your loop); None when they took none.
        host_reads: the step's tensor reads to Python and device waits; None when not
            read from the events (then `findings` counts the op table's reads).
        compiled: the model's `torch.compile`d parts, which ran eagerly for the per-module
            ranges (hooks fire only in eager code): the times are the eager model's.
    """

    steps: int
    device: str
    ops: tuple[OpRecord, ...]
    phases: tuple[PhaseTime, ...]
    modules: tuple[ModuleTime, ...]
    reconciliation: Reconciliation
    timing: StepTiming
    by_module: bool = True
    trace_path: str | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    step: StepInfo | None = None
    comm: CommTime | None = None
    input_wait: InputWait | None = None
    host_reads: HostReads | None = None
    compiled: tuple[str, ...] = ()

    def op(self, name: str) -> OpRecord | None:
        """The record of op `name` (first one, when grouped by shape), or None."""
        return next((o for o in self.ops if o.name == name), None)

    def calls(self, name: str) -> int:
        """Total calls of op `name` over every input-shape group (0 when it never ran)."""
        return sum(o.calls for o in self.ops if o.name == name)

    def module(self, name: str) -> ModuleTime | None:
        """The record of module `name` (`""` for the root), or None."""
        return next((m for m in self.modules if m.module == name), None)

    def phase(self, name: str) -> PhaseTime | None:
        """The phase `name`, or None when the step did not label it."""
        return next((p for p in self.phases if p.name == name), None)

    @property
    def phase_total_ms(self) -> float:
        """Sum of the labelled phases' host time."""
        return sum(p.cpu_ms for p in self.phases)
