"""Profiling: top ops, the forward/backward/optimizer split and time per module."""

from torchscope.profiling.analyze import profile_findings
from torchscope.profiling.attribution import Attribution, attribute
from torchscope.profiling.module_ranges import ModuleRanges, range_label
from torchscope.profiling.ops import SORT_KEYS, op_records, sort_ops
from torchscope.profiling.records import (
    PHASES,
    ModuleTime,
    OpRecord,
    PhaseTime,
    ProfileResult,
    ProfilingError,
    Reconciliation,
    StepTiming,
)
from torchscope.profiling.steps import (
    default_loss,
    make_train_step,
    phase,
    profile_steps,
    quiet_kineto,
    random_target_loss,
)
from torchscope.profiling.trace import export_trace

__all__ = [
    "PHASES",
    "SORT_KEYS",
    "Attribution",
    "ModuleRanges",
    "ModuleTime",
    "OpRecord",
    "PhaseTime",
    "ProfileResult",
    "ProfilingError",
    "Reconciliation",
    "StepTiming",
    "attribute",
    "default_loss",
    "export_trace",
    "make_train_step",
    "op_records",
    "phase",
    "profile_findings",
    "profile_steps",
    "quiet_kineto",
    "random_target_loss",
    "range_label",
    "sort_ops",
]
