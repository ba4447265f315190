"""Profiling: top ops, the forward/backward/optimizer split and time per module.

`profile_steps` runs training steps under `torch.profiler`; `watch_time` profiles steps of
your own loop. Both give a `ProfileResult`, whose `findings()` reads it. Modules not
listed here (`attribution`, `module_ranges`, `ops`, `trace`) are private.
"""

from torchscope.profiling import analyze as _analyze  # registers ProfileResult's analyzer
from torchscope.profiling.ops import SORT_KEYS, sort_ops
from torchscope.profiling.records import (
    PHASES,
    ModuleTime,
    OpRecord,
    PhaseTime,
    ProfileResult,
    ProfileThresholds,
    ProfilingError,
    Reconciliation,
    StepTiming,
)
from torchscope.profiling.steps import profile_steps
from torchscope.profiling.watch import TimeWatch, phase, watch_time

del _analyze

__all__ = [
    "PHASES",
    "SORT_KEYS",
    "ModuleTime",
    "OpRecord",
    "PhaseTime",
    "ProfileResult",
    "ProfileThresholds",
    "ProfilingError",
    "Reconciliation",
    "StepTiming",
    "TimeWatch",
    "phase",
    "profile_steps",
    "sort_ops",
    "watch_time",
]
