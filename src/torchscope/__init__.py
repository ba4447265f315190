"""torchscope: see inside any PyTorch model's training step, safely.

The public API is the table `_API` below, and `__all__` is generated from it: per capability
a one-shot function and a context manager for your own training loop, the compositions, and
the few shared types. Everything else is reached by exactly one subpackage path (for example
`torchscope.grads.GradFlow`, `torchscope.errors.ModelError`). Names are imported on first
use (PEP 562), so `import torchscope` and the CLI start without loading torch until a
capability needs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from torchscope._util import __version__ as __version__

# Public name -> the module that defines it. docs/api.md's table lists the same names.
_API: dict[str, str] = {
    # One-shot function, then the context manager for your own loop, per capability.
    "capture_activations": "torchscope.capture",
    "watch_activations": "torchscope.capture",
    "gradient_flow": "torchscope.grads",
    "watch_gradients": "torchscope.grads",
    "analyze_memory": "torchscope.memory",
    "watch_memory": "torchscope.memory",
    "profile_steps": "torchscope.profiling",
    "watch_time": "torchscope.profiling",
    "compile_report": "torchscope.compile",
    "watch_recompiles": "torchscope.compile",
    "lint_paths": "torchscope.lint",
    # Compositions.
    "run_doctor": "torchscope.doctor",
    "run_lab": "torchscope.lab",
    "monitor": "torchscope.monitoring",
    # Shared.
    "Step": "torchscope.step",
    "Finding": "torchscope.findings",
    "Severity": "torchscope.findings",
    "HookSession": "torchscope.hooks",
    "audit_hooks": "torchscope.hooks",
    "TorchscopeError": "torchscope.errors",
}

_SUBMODULES = frozenset({
    "capture", "compile", "distributed", "doctor", "errors", "findings", "grads", "hooks",
    "integrations", "lab", "lint", "memory", "models", "monitoring", "profiling", "report",
    "step",
})

__all__ = list(_API)


def __getattr__(name: str) -> Any:
    if name in _API:
        value = getattr(importlib.import_module(_API[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"torchscope.{name}")
    raise AttributeError(f"module 'torchscope' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*__all__, *_SUBMODULES, "__version__"})


if TYPE_CHECKING:  # the same table, spelled out for type checkers (a test keeps them equal)
    from torchscope.capture import capture_activations as capture_activations
    from torchscope.capture import watch_activations as watch_activations
    from torchscope.compile import compile_report as compile_report
    from torchscope.compile import watch_recompiles as watch_recompiles
    from torchscope.doctor import run_doctor as run_doctor
    from torchscope.errors import TorchscopeError as TorchscopeError
    from torchscope.findings import Finding as Finding
    from torchscope.findings import Severity as Severity
    from torchscope.grads import gradient_flow as gradient_flow
    from torchscope.grads import watch_gradients as watch_gradients
    from torchscope.hooks import HookSession as HookSession
    from torchscope.hooks import audit_hooks as audit_hooks
    from torchscope.lab import run_lab as run_lab
    from torchscope.lint import lint_paths as lint_paths
    from torchscope.memory import analyze_memory as analyze_memory
    from torchscope.memory import watch_memory as watch_memory
    from torchscope.monitoring import monitor as monitor
    from torchscope.profiling import profile_steps as profile_steps
    from torchscope.profiling import watch_time as watch_time
    from torchscope.step import Step as Step
