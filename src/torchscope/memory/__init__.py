"""Memory: what autograd keeps for backward, module by module; measured memory; gradient
checkpointing planned under a budget and verified; live tensors; and the same accounting
sampled in your own training loop (`watch_memory`).

Every step this package runs is a `torchscope.Step`'s `forward_backward`: pass the model and
its inputs (with `loss_fn=`, `target=`, `optimizer=`) or a ready `Step`. Findings come from
`result.findings()`.
"""

from torchscope.memory import analysis as _analysis  # registers the analyzers
from torchscope.memory.api import CheckpointChoice, analyze_memory
from torchscope.memory.checkpoint import (
    Blocks,
    BlockSpec,
    CheckpointHandle,
    apply,
    check,
    resolve_blocks,
    verify,
)
from torchscope.memory.live import live_tensors
from torchscope.memory.measure import RankBytes, measure_step, memory_totals, rank_bytes
from torchscope.memory.planner import apply_plan, parse_bytes, plan_checkpointing
from torchscope.memory.records import (
    OUTSIDE,
    BlockProfile,
    CheckpointPlan,
    GradComparison,
    LiveTensor,
    LiveTensors,
    MeasuredMemory,
    MemoryHistory,
    MemoryReport,
    MemorySample,
    MemoryTotals,
    ModuleSaved,
    OutputChange,
    PlanMeasurement,
    PlanReport,
    SavedActivations,
    SavedStorage,
    Verification,
)
from torchscope.memory.saved import saved_activations
from torchscope.memory.watch import MemoryWatch, watch_memory

del _analysis

__all__ = [
    "OUTSIDE",
    "BlockProfile",
    "BlockSpec",
    "Blocks",
    "CheckpointChoice",
    "CheckpointHandle",
    "CheckpointPlan",
    "GradComparison",
    "LiveTensor",
    "LiveTensors",
    "MeasuredMemory",
    "MemoryHistory",
    "MemoryReport",
    "MemorySample",
    "MemoryTotals",
    "MemoryWatch",
    "ModuleSaved",
    "OutputChange",
    "PlanMeasurement",
    "PlanReport",
    "RankBytes",
    "SavedActivations",
    "SavedStorage",
    "Verification",
    "analyze_memory",
    "apply",
    "apply_plan",
    "check",
    "live_tensors",
    "measure_step",
    "memory_totals",
    "parse_bytes",
    "plan_checkpointing",
    "rank_bytes",
    "resolve_blocks",
    "saved_activations",
    "verify",
    "watch_memory",
]
