"""Memory: what autograd keeps for backward, layer by layer; measured memory; gradient
checkpointing planned under a budget and verified; live tensors."""

from torchscope.memory.analysis import (
    analyze_live,
    analyze_plans,
    analyze_saved,
    analyze_totals,
    describe_segments,
)
from torchscope.memory.api import CheckpointChoice, analyze_memory
from torchscope.memory.checkpoint import Blocks, BlockSpec, CheckpointHandle, apply, resolve_blocks
from torchscope.memory.live import live_tensors
from torchscope.memory.measure import measure_step, memory_totals, optimizer_state_bytes
from torchscope.memory.planner import apply_plan, parse_bytes, plan_checkpointing
from torchscope.memory.records import (
    BlockProfile,
    CheckpointPlan,
    GradComparison,
    LiveTensor,
    LiveTensors,
    MeasuredMemory,
    MemoryReport,
    MemoryTotals,
    ModuleSaved,
    PlanMeasurement,
    PlanReport,
    SavedActivations,
    SavedStorage,
    Verification,
)
from torchscope.memory.saved import default_loss, saved_activations
from torchscope.memory.verify import check, verify

__all__ = [
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
    "MemoryReport",
    "MemoryTotals",
    "ModuleSaved",
    "PlanMeasurement",
    "PlanReport",
    "SavedActivations",
    "SavedStorage",
    "Verification",
    "analyze_live",
    "analyze_memory",
    "analyze_plans",
    "analyze_saved",
    "analyze_totals",
    "apply",
    "apply_plan",
    "check",
    "default_loss",
    "describe_segments",
    "live_tensors",
    "measure_step",
    "memory_totals",
    "optimizer_state_bytes",
    "parse_bytes",
    "plan_checkpointing",
    "resolve_blocks",
    "saved_activations",
    "verify",
]
