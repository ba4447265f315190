"""torchscope: see inside any PyTorch model's training step, safely.

The public API is what `__all__` lists; everything else is private implementation.
"""

from torchscope.capture import (
    ActivationCapture,
    ActivationRecord,
    TensorStats,
    activations,
    capture_activations,
    trace_nonfinite,
)
from torchscope.errors import (
    BudgetError,
    CompileError,
    InputSpecError,
    ModelError,
    SelectionError,
    TargetError,
    TorchscopeError,
    VerificationError,
)
from torchscope.hooks import (
    HookAudit,
    HookGrowthGuard,
    HookGrowthWarning,
    HookSession,
    audit_hooks,
    select_modules,
)
from torchscope.profiling import (
    ModuleTime,
    OpRecord,
    PhaseTime,
    ProfileResult,
    ProfilingError,
    profile_findings,
    profile_steps,
)

__version__ = "0.1.0"

__all__ = [
    "ActivationCapture",
    "ActivationRecord",
    "BudgetError",
    "CompileError",
    "HookAudit",
    "HookGrowthGuard",
    "HookGrowthWarning",
    "HookSession",
    "InputSpecError",
    "ModelError",
    "ModuleTime",
    "OpRecord",
    "PhaseTime",
    "ProfileResult",
    "ProfilingError",
    "SelectionError",
    "TargetError",
    "TensorStats",
    "TorchscopeError",
    "VerificationError",
    "__version__",
    "activations",
    "audit_hooks",
    "capture_activations",
    "profile_findings",
    "profile_steps",
    "select_modules",
    "trace_nonfinite",
]
