"""Frozen records of the memory area: numbers only, formatted by `torchscope.report.memory`.

The result types derive from `Analyzed`: `result.findings()` runs the analyzer that
`torchscope.memory.analysis` registers for them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torchscope._timing import Ratio
from torchscope.distributed.ranked import Gatherable
from torchscope.findings import Analyzed
from torchscope.step import StepInfo

StorageKind = Literal["activation", "input", "parameter", "buffer"]
PlanStatus = Literal["ok", "keeps_more", "unverified"]
OUTSIDE = "(outside modules)"
"""Module label of tensors saved while no module of the model was running (e.g. in the loss)."""


@dataclass(frozen=True)
class SavedStorage:
    """One storage that autograd kept for backward, however many views of it were saved.

    Attributes:
        module: qualified name of the module running when it was first saved (`""` is the root,
            `OUTSIDE` when none was), or its row with `select=`/`depth=` (the nearest
            selected ancestor).
        module_type: that module's class name.
        shape: shape of the first saved view.
        dtype: dtype of the first saved view, e.g. `torch.float32`.
        device: e.g. `cpu`, `cuda:0`.
        nbytes: bytes of the whole storage (what stays allocated).
        saves: how many times autograd saved a view of it.
        kind: `activation`, `input` (a tensor passed to the model), `parameter` or `buffer`.
        savers: every module that saved a view of it, in order, without repeats.
    """

    module: str
    module_type: str
    shape: tuple[int, ...]
    dtype: str
    device: str
    nbytes: int
    saves: int
    kind: StorageKind
    savers: tuple[str, ...]


@dataclass(frozen=True)
class ModuleSaved:
    """Saved activations attributed to one module (storages it saved first).

    Attributes:
        module: qualified name (`""` is the root).
        module_type: class name.
        bytes: bytes of the storages it saved first.
        storages: how many storages.
        saves: how many save events (views saved more than once count each time).
        dtypes: the dtypes among them, sorted.
    """

    module: str
    module_type: str
    bytes: int
    storages: int
    saves: int
    dtypes: tuple[str, ...]


@dataclass(frozen=True)
class SavedActivations(Analyzed, Gatherable):
    """What autograd saved during one forward (and the loss), deduplicated by storage.

    Attributes:
        storages: every saved storage, activations and model state alike, in save order.
        modules: per-module activation rows (kinds `activation` and `input`), in the order the
            modules first saved something; their `bytes` sum to `total_bytes`.
        total_bytes: saved activation bytes (inputs included), each storage once.
        input_bytes: the part of `total_bytes` that is the model's own inputs.
        state_bytes: parameters and buffers autograd saved; they are model state and are not
            part of `total_bytes`.
        output_bytes: bytes of the forward's output tensors that are not saved storages.
        saves: number of save events, all kinds.
        step: the training step it was counted on (None for a forward in the user's own
            loop, seen by `watch_memory`).
        checkpointed: what the model's own code checkpoints with `torch.utils.checkpoint`
            in this forward, in call order: module names (their inputs, which the
            checkpoint keeps, count in those modules' rows), or a function's qualified
            name where the checkpointed function is not a module of the model.
        compiled: the model's `torch.compile`d parts, which ran eagerly while it was
            counted (hooks fire only in eager code): what the eager model saves, not what
            the compiled graph keeps.
    """

    storages: tuple[SavedStorage, ...]
    modules: tuple[ModuleSaved, ...]
    total_bytes: int
    input_bytes: int
    state_bytes: int
    output_bytes: int
    saves: int
    step: StepInfo | None = None
    checkpointed: tuple[str, ...] = ()
    compiled: tuple[str, ...] = ()

    @property
    def activation_storages(self) -> tuple[SavedStorage, ...]:
        """Storages of kind `activation` or `input`."""
        return tuple(s for s in self.storages if s.kind in ("activation", "input"))


@dataclass(frozen=True)
class MemoryTotals(Analyzed, Gatherable):
    """Memory of one training step, by part, and the estimated peak.

    Attributes:
        parameters: bytes of the parameters (each storage once).
        buffers: bytes of the buffers.
        gradients: bytes the gradients of trainable parameters take.
        optimizer_state: bytes of the optimizer's state, None without an optimizer.
        optimizer_state_source: `measured` (read from `optimizer.state`), `estimated` (from
            the optimizer type, before its first step), `unknown` or `none`.
        saved_activations: bytes autograd saves for backward.
        outputs: bytes of the forward outputs that are not saved anyway.
        peak_estimate: params + buffers + optimizer state + saved activations + outputs +
            gradients: what is held when backward starts plus every gradient it writes.
            Transient buffers (intermediates that are not saved, kernel workspaces such as
            im2col) come on top; the measurement shows them.
        step_estimate: saved activations + outputs + gradients: what the forward + backward
            keeps on top of the model's state. The CPU measurement, which sees only
            allocations made during the step, compares to this.
    """

    parameters: int
    buffers: int
    gradients: int
    optimizer_state: int | None
    optimizer_state_source: str
    saved_activations: int
    outputs: int
    peak_estimate: int
    step_estimate: int = 0


@dataclass(frozen=True)
class MeasuredMemory:
    """Memory measured around one forward + backward.

    Attributes:
        device: where the model lives, e.g. `cpu` or `cuda:0`.
        method: `cuda-allocator` (`max_memory_allocated` after `reset_peak_memory_stats`) or
            `cpu-profiler` (the running sum of `torch.profiler` memory events).
        baseline_bytes: allocated before the step (CUDA); 0 on CPU, where the profiler only
            sees allocations and frees made inside the step.
        peak_bytes: highest allocated during the step (CUDA: absolute; CPU: above baseline).
        peak_above_baseline: `peak_bytes - baseline_bytes`.
        end_bytes: allocated after backward, relative like `peak_bytes`.
        reserved_bytes: CUDA caching-allocator reserved memory after the step (None on CPU).
        peak_reserved_bytes: highest reserved during the step (None on CPU).
        step: the training step measured.
    """

    device: str
    method: str
    baseline_bytes: int
    peak_bytes: int
    peak_above_baseline: int
    end_bytes: int
    reserved_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    step: StepInfo | None = None


@dataclass(frozen=True)
class BlockProfile:
    """One checkpointable block, measured during a normal forward.

    Attributes:
        index: position in the block sequence.
        name: qualified module name.
        module_type: class name.
        forward_ms: median forward time, i.e. what recomputing it costs.
        saved_bytes: bytes of activations saved inside it (first attribution).
        input_bytes: bytes of its positional tensor inputs (what a checkpoint keeps).
    """

    index: int
    name: str
    module_type: str
    forward_ms: float
    saved_bytes: int
    input_bytes: int


@dataclass(frozen=True)
class CheckpointPlan:
    """Which blocks to checkpoint, grouped into segments, with its predicted cost.

    Attributes:
        name: `none`, `all`, `sqrt` or `budget`.
        blocks: names of every block of the sequence.
        segments: `(start, stop)` index ranges (stop exclusive) run under one checkpoint each.
        saved_bytes: predicted saved-activation bytes at the end of forward.
        peak_activation_bytes: predicted activation peak: saved bytes plus the largest
            segment's recomputed activations.
        recompute_ms: predicted recompute time: the forward time of every checkpointed block.
        budget: the byte budget it was planned for, if any.
        parent: the `nn.Sequential` whose children the blocks are, when segments may span
            several blocks.
        status: `ok`; `keeps_more` when it keeps no fewer saved bytes than checkpointing
            nothing (predicted or measured; it is never applied or chosen); `unverified`
            when applying it failed its verification.
        failed: why the plan is not offered, in one line; None when `status` is `ok`.
    """

    name: str
    blocks: tuple[str, ...]
    segments: tuple[tuple[int, int], ...]
    saved_bytes: int
    peak_activation_bytes: int
    recompute_ms: float
    budget: int | None = None
    parent: str | None = None
    status: PlanStatus = "ok"
    failed: str | None = None

    @property
    def checkpointed(self) -> tuple[str, ...]:
        """Names of the checkpointed blocks."""
        return tuple(self.blocks[i] for a, b in self.segments for i in range(a, b))


@dataclass(frozen=True)
class GradComparison:
    """One gradient, with checkpointing vs without.

    Attributes:
        name: parameter name, or `input[i]` for an input.
        bitwise_equal: `torch.equal` of the two gradients (both None counts as equal).
        max_abs_diff: largest absolute difference (0.0 when equal, inf when one is missing).
        missing: the checkpointed run produced no gradient where the reference had one.
        extra: the checkpointed run produced a gradient where the reference had none.
    """

    name: str
    bitwise_equal: bool
    max_abs_diff: float
    missing: bool = False
    extra: bool = False


@dataclass(frozen=True)
class OutputChange:
    """A tensor the model returned that ended differently with checkpointing.

    Both runs are compared after their backward, when recomputation has run forward again:
    a block that appends to a cache it returns (a Hugging Face KV cache with
    `use_cache=True`) appends twice.

    Attributes:
        path: where it is in the output, as `iter_tensors` names it (micro-batch `i` of an
            accumulated step is `output[i]`).
        without: shape and dtype without checkpointing, or "absent".
        with_checkpointing: the same with checkpointing, or "absent"; equal to `without`
            when only the values differ.
    """

    path: str
    without: str
    with_checkpointing: str


@dataclass(frozen=True)
class Verification:
    """Loss and every gradient with vs without checkpointing, from identically seeded runs.

    Attributes:
        loss_equal: the two losses are bitwise equal.
        loss_abs_diff: their absolute difference.
        grads: one comparison per parameter (and input) gradient.
        bitwise_equal: loss and every gradient bitwise equal.
        max_abs_diff: the largest difference over the loss and every gradient.
        ok: no gradient missing or extra and every difference within tolerance.
        seed: the seed both runs started from.
        buffers_equal: buffers (e.g. BatchNorm running stats) ended equal; recomputation runs
            the forward again, so a module that updates buffers in forward updates them twice.
        outputs: every returned tensor (state such as a KV cache included) whose shape,
            dtype or values ended differently after backward; empty when none did.
    """

    loss_equal: bool
    loss_abs_diff: float
    grads: tuple[GradComparison, ...]
    bitwise_equal: bool
    max_abs_diff: float
    ok: bool
    seed: int
    buffers_equal: bool = True
    outputs: tuple[OutputChange, ...] = ()


@dataclass(frozen=True)
class PlanMeasurement:
    """A plan applied for real: measured saved bytes, time, peak, and its verification.

    Step times are repeated until their spread is known (`torchscope._timing`): a plan's
    steps alternate with steps of the same model with its checkpointing suspended, so the
    two are compared under the same load.

    Attributes:
        plan: the plan's name.
        saved_bytes: saved-activation bytes counted with the plan applied.
        step_ms: forward + backward time, the median of the repeats.
        recompute_ms: the step time the plan adds: `step_ms` minus the median step time
            without checkpointing measured alongside it, never below 0 (0 for `none`). A
            figure only where `recompute_measurable`; otherwise inside the noise, and the
            interval is all there is to say.
        recompute_low_ms: the low end of its interval (from `slowdown`'s, never below 0).
        recompute_high_ms: the high end.
        peak_bytes: measured peak (see `MeasuredMemory.peak_bytes`).
        verification: None for the `none` plan, which has nothing to verify.
        slowdown: step time with the plan over step time without checkpointing, with its
            interval; None for `none`. `slowdown.measurable` False means no measurable cost.
        repeats: timed steps of each kind.
    """

    plan: str
    saved_bytes: int
    step_ms: float
    recompute_ms: float
    peak_bytes: int
    verification: Verification | None
    slowdown: Ratio | None = None
    repeats: int = 0
    recompute_low_ms: float = 0.0
    recompute_high_ms: float = 0.0

    @property
    def recompute_measurable(self) -> bool:
        """Whether the plan makes the step measurably slower (its slowdown's interval lies
        above 1): only then is `recompute_ms` a cost; otherwise it is no measurable cost."""
        return self.slowdown is not None and self.slowdown.above


@dataclass(frozen=True)
class PlanReport(Analyzed):
    """The planner's output: blocks, plans and (optionally) their measurements.

    Attributes:
        blocks: per-block profile.
        groupable: True when consecutive blocks can share one checkpoint (children of an
            `nn.Sequential`); otherwise each segment is a single block.
        baseline_saved_bytes: saved-activation bytes without checkpointing.
        min_feasible_bytes: the smallest saved bytes any plan reaches.
        plans: `none`, `all`, `sqrt` and, with a budget, `budget`; only `none` when no
            block is left to checkpoint. A plan with `failed` set is not offered.
        measurements: one per plan that was measured (failed plans are not).
        search: `exact` or `dp`, how the budget plan was found.
        step: the training step the blocks were measured on.
        excluded: `(block, reason)` of the blocks left out: blocks without trainable work
            (no parameter that requires grad, no input that needs grad: checkpointing them
            saves nothing and keeps their inputs) and blocks the step never ran.
        notes: how the plans were made, e.g. that model caches were off.
    """

    blocks: tuple[BlockProfile, ...]
    groupable: bool
    baseline_saved_bytes: int
    min_feasible_bytes: int
    plans: tuple[CheckpointPlan, ...]
    measurements: tuple[PlanMeasurement, ...] = ()
    search: str = "exact"
    step: StepInfo | None = None
    excluded: tuple[tuple[str, str], ...] = ()
    notes: tuple[str, ...] = ()

    def plan(self, name: str) -> CheckpointPlan:
        """The plan called `name`.

        Raises:
            KeyError: no such plan.
        """
        for p in self.plans:
            if p.name == name:
                return p
        raise KeyError(name)

    def has(self, name: str) -> bool:
        """Whether a plan called `name` was made."""
        return any(p.name == name for p in self.plans)

    def measurement(self, name: str) -> PlanMeasurement | None:
        """The measurement of the plan called `name`, if measured."""
        return next((m for m in self.measurements if m.plan == name), None)


@dataclass(frozen=True)
class LiveTensor:
    """A live tensor, found through the garbage collector.

    Attributes:
        shape: its shape.
        dtype: e.g. `torch.float32`.
        device: e.g. `cuda:0`.
        nbytes: bytes of its storage (shared by its views, counted once).
        views: how many live tensor objects share that storage.
        requires_grad: whether it requires grad.
        is_parameter: whether it is an `nn.Parameter`.
        referrers: what holds it, e.g. `attribute 'weight' of Linear`, `local 'x' in f()`.
    """

    shape: tuple[int, ...]
    dtype: str
    device: str
    nbytes: int
    views: int
    requires_grad: bool
    is_parameter: bool
    referrers: tuple[str, ...]


@dataclass(frozen=True)
class LiveTensors(Analyzed):
    """The largest live tensors, and what `empty_cache()` could release.

    Attributes:
        tensors: the largest first.
        total_bytes: bytes of all live tensor storages found (not only the listed ones).
        count: number of distinct storages found.
        allocated_before: CUDA allocated before `empty_cache()` (None on CPU).
        reserved_before: CUDA reserved before.
        allocated_after: CUDA allocated after.
        reserved_after: CUDA reserved after.
    """

    tensors: tuple[LiveTensor, ...]
    total_bytes: int
    count: int
    allocated_before: int | None = None
    reserved_before: int | None = None
    allocated_after: int | None = None
    reserved_after: int | None = None


@dataclass(frozen=True)
class MemoryReport(Analyzed, Gatherable):
    """Everything `analyze_memory` found about one training step.

    Attributes:
        model: a label for the model.
        saved: saved-activation accounting.
        totals: memory by part and the estimated peak.
        measured: the measurement, unless `measure=False`.
        step: the training step: its loss, and the loss value of its first run (the
            accounting's).
        plans: the checkpointing plans, when checkpointing was asked for.
        chosen: the name of the plan that was asked for (applied and verified unless it
            `failed`).
        verification: the chosen plan's verification.
        no_plan: why no plan was made although one was asked for (no block sequence, no
            block with trainable work); empty otherwise.
        checkpointable: the blocks a plan may checkpoint (`blocks=` resolved; by default
            every outermost list of repeated blocks); empty when the model has none.
        proposed: the plan was made unasked, as an offer (the doctor plans one for every
            model, whose memory may be no concern): its caveats are notes, not warnings.
    """

    model: str
    saved: SavedActivations
    totals: MemoryTotals
    measured: MeasuredMemory | None
    step: StepInfo
    plans: PlanReport | None = None
    chosen: str | None = None
    verification: Verification | None = None
    no_plan: str = ""
    checkpointable: tuple[str, ...] = ()
    proposed: bool = False

    @property
    def chosen_plan(self) -> CheckpointPlan | None:
        """The chosen plan, when one was made."""
        if self.plans is None or self.chosen is None or not self.plans.has(self.chosen):
            return None
        return self.plans.plan(self.chosen)


@dataclass(frozen=True)
class MemorySample:
    """One forward that `watch_memory` sampled in the user's loop.

    Attributes:
        forward: its index among the model's grad-enabled forwards (0 is the first).
        saved: what autograd saved during it, per module (the loss, computed after the
            forward, is not in it).
        peak_bytes: on CUDA, the most memory allocated from the start of this forward until
            the model's next forward (or the watch's end); None on CPU, or until then.
    """

    forward: int
    saved: SavedActivations
    peak_bytes: int | None = None


@dataclass(frozen=True)
class MemoryHistory(Analyzed):
    """Saved bytes per module of the newest samples of a `watch_memory`.

    Attributes:
        forwards: the sampled forward indices, oldest first.
        modules: every module (row) that saved something in any of them, first seen first.
        saved_bytes: per sample, per module in `modules` (0 where it saved nothing).
        total_bytes: per sample, the saved-activation total.
        peak_bytes: per sample, the CUDA peak (see `MemorySample.peak_bytes`).
    """

    forwards: tuple[int, ...]
    modules: tuple[str, ...]
    saved_bytes: tuple[tuple[int, ...], ...]
    total_bytes: tuple[int, ...]
    peak_bytes: tuple[int | None, ...]

    def series(self, module: str) -> tuple[int, ...]:
        """Saved bytes of one module (row) across the samples.

        Raises:
            KeyError: no sample saved anything in it.
        """
        if module not in self.modules:
            raise KeyError(module)
        i = self.modules.index(module)
        return tuple(row[i] for row in self.saved_bytes)
