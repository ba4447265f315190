"""Profiling: top ops, the forward/backward/optimizer split and time per module.

`profile_steps` runs training steps under `torch.profiler`; `watch_time` profiles steps of
your own loop. Both give a `ProfileResult`, whose `findings()` reads it. Under DDP or FSDP2
each rank profiles itself: `result.comm` splits its step into computation and communication,
traces go to one file per rank, and `result.gather()` (done by `watch_time` at the end of
its block) joins every rank's result on rank 0, whose findings name a straggler. Modules not
listed here (`attribution`, `comm`, `module_ranges`, `ops`, `trace`) are private.
"""

from torchscope.profiling import analyze as _analyze  # registers ProfileResult's analyzer
from torchscope.profiling.ops import SORT_KEYS, sort_ops
from torchscope.profiling.records import (
    PHASES,
    CommOp,
    CommTime,
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
    "CommOp",
    "CommTime",
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
