"""torchscope: see inside any PyTorch model's training step, safely.

The public API is what `__all__` lists; everything else is private implementation. Names are
imported on first use (PEP 562), so `import torchscope` and the CLI start without loading
torch until a capability needs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from torchscope._util import __version__

# Public name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    "ActivationCapture": "torchscope.capture",
    "ActivationRecord": "torchscope.capture",
    "TensorStats": "torchscope.capture",
    "activations": "torchscope.capture",
    "capture_activations": "torchscope.capture",
    "trace_nonfinite": "torchscope.capture",
    "BudgetError": "torchscope.errors",
    "CompileError": "torchscope.errors",
    "InputSpecError": "torchscope.errors",
    "ModelError": "torchscope.errors",
    "SelectionError": "torchscope.errors",
    "TargetError": "torchscope.errors",
    "TorchscopeError": "torchscope.errors",
    "VerificationError": "torchscope.errors",
    "Finding": "torchscope.findings",
    "Severity": "torchscope.findings",
    "HookAudit": "torchscope.hooks",
    "HookGrowthGuard": "torchscope.hooks",
    "HookGrowthWarning": "torchscope.hooks",
    "HookSession": "torchscope.hooks",
    "audit_hooks": "torchscope.hooks",
    "select_modules": "torchscope.hooks",
    "ModuleTime": "torchscope.profiling",
    "OpRecord": "torchscope.profiling",
    "PhaseTime": "torchscope.profiling",
    "ProfileResult": "torchscope.profiling",
    "ProfilingError": "torchscope.profiling",
    "profile_findings": "torchscope.profiling",
    "profile_steps": "torchscope.profiling",
    "LintResult": "torchscope.lint",
    "LintViolation": "torchscope.lint",
    "lint_paths": "torchscope.lint",
    "lint_source": "torchscope.lint",
    "run_doctor": "torchscope.doctor",
    "DoctorOptions": "torchscope.doctor",
    "DoctorReport": "torchscope.doctor",
    "write_report": "torchscope.doctor",
    "run_lab": "torchscope.doctor",
    "diff_documents": "torchscope.doctor",
    "analyze_memory": "torchscope.memory",
    "saved_activations": "torchscope.memory",
    "plan_checkpointing": "torchscope.memory",
    "live_tensors": "torchscope.memory",
    "measure_step": "torchscope.memory",
    "MemoryReport": "torchscope.memory",
    "SavedActivations": "torchscope.memory",
    "CheckpointHandle": "torchscope.memory",
    "gradient_flow": "torchscope.grads",
    "watch_gradients": "torchscope.grads",
    "GradWatch": "torchscope.grads",
    "GradFlow": "torchscope.grads",
    "GradHistory": "torchscope.grads",
    "GradThresholds": "torchscope.grads",
    "ModuleGradRecord": "torchscope.grads",
    "ParamGradRecord": "torchscope.grads",
    "TensorGrad": "torchscope.grads",
    "compile_report": "torchscope.compile",
    "compile_findings": "torchscope.compile",
    "compile_once": "torchscope.compile",
    "compile_guard": "torchscope.compile",
    "audit_compiled_hooks": "torchscope.compile",
    "watch_recompiles": "torchscope.compile",
    "find_graph_breaks": "torchscope.compile",
    "check_compiled": "torchscope.compile",
    "compiled_capture": "torchscope.compile",
    "CompileReport": "torchscope.compile",
    "ModeResult": "torchscope.compile",
    "CompileLoopWarning": "torchscope.compile",
    "RecompileWarning": "torchscope.compile",
}

_SUBMODULES = {
    "checkpointing",
    "compile",
    "grads",
    "integrations",
    "memory",
    "models",
    "profiling",
    "lint",
    "capture",
    "hooks",
    "report",
    "errors",
    "findings",
    "doctor",
}

__all__ = [
    "ActivationCapture",
    "ActivationRecord",
    "BudgetError",
    "CheckpointHandle",
    "CompileError",
    "CompileLoopWarning",
    "CompileReport",
    "DoctorOptions",
    "DoctorReport",
    "Finding",
    "GradFlow",
    "GradHistory",
    "GradThresholds",
    "GradWatch",
    "HookAudit",
    "HookGrowthGuard",
    "HookGrowthWarning",
    "HookSession",
    "InputSpecError",
    "LintResult",
    "LintViolation",
    "MemoryReport",
    "ModeResult",
    "ModelError",
    "ModuleGradRecord",
    "ModuleTime",
    "OpRecord",
    "ParamGradRecord",
    "PhaseTime",
    "ProfileResult",
    "ProfilingError",
    "RecompileWarning",
    "SavedActivations",
    "SelectionError",
    "Severity",
    "TargetError",
    "TensorGrad",
    "TensorStats",
    "TorchscopeError",
    "VerificationError",
    "__version__",
    "activations",
    "analyze_memory",
    "audit_compiled_hooks",
    "audit_hooks",
    "capture_activations",
    "check_compiled",
    "compile_findings",
    "compile_guard",
    "compile_once",
    "compile_report",
    "compiled_capture",
    "diff_documents",
    "find_graph_breaks",
    "gradient_flow",
    "lint_paths",
    "lint_source",
    "live_tensors",
    "measure_step",
    "plan_checkpointing",
    "profile_findings",
    "profile_steps",
    "run_doctor",
    "run_lab",
    "saved_activations",
    "select_modules",
    "trace_nonfinite",
    "watch_gradients",
    "watch_recompiles",
    "write_report",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"torchscope.{name}")
    raise AttributeError(f"module 'torchscope' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(__all__) | _SUBMODULES)


if TYPE_CHECKING:
    from torchscope.capture import (
        ActivationCapture,
        ActivationRecord,
        TensorStats,
        activations,
        capture_activations,
        trace_nonfinite,
    )
    from torchscope.compile import (
        CompileLoopWarning,
        CompileReport,
        ModeResult,
        RecompileWarning,
        audit_compiled_hooks,
        check_compiled,
        compile_findings,
        compile_guard,
        compile_once,
        compile_report,
        compiled_capture,
        find_graph_breaks,
        watch_recompiles,
    )
    from torchscope.doctor import (
        DoctorOptions,
        DoctorReport,
        diff_documents,
        run_doctor,
        run_lab,
        write_report,
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
    from torchscope.findings import (
        Finding,
        Severity,
    )
    from torchscope.grads import (
        GradFlow,
        GradHistory,
        GradThresholds,
        GradWatch,
        ModuleGradRecord,
        ParamGradRecord,
        TensorGrad,
        gradient_flow,
        watch_gradients,
    )
    from torchscope.hooks import (
        HookAudit,
        HookGrowthGuard,
        HookGrowthWarning,
        HookSession,
        audit_hooks,
        select_modules,
    )
    from torchscope.lint import (
        LintResult,
        LintViolation,
        lint_paths,
        lint_source,
    )
    from torchscope.memory import (
        CheckpointHandle,
        MemoryReport,
        SavedActivations,
        analyze_memory,
        live_tensors,
        measure_step,
        plan_checkpointing,
        saved_activations,
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
