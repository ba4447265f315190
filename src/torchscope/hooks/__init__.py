"""Hook plumbing: the session that owns handles, module selection, audits, leak checks,
compiled-model handling and data-parallel wrappers."""

from torchscope.hooks.audit import (
    HookAudit,
    HookEntry,
    HookGrowthGuard,
    HookGrowthWarning,
    audit_hooks,
)
from torchscope.hooks.compiled import (
    CompiledCapture,
    CompiledCheck,
    check_compiled,
    compiled_capture,
    compiled_parts,
    unwrap_compiled,
)
from torchscope.hooks.leakcheck import HookLeakTracker
from torchscope.hooks.parallel import parallel_wrapper, unwrap_parallel
from torchscope.hooks.select import select_modules
from torchscope.hooks.session import HookSession
from torchscope.hooks.tree import iter_tensors

__all__ = [
    "CompiledCapture",
    "CompiledCheck",
    "HookAudit",
    "HookEntry",
    "HookGrowthGuard",
    "HookGrowthWarning",
    "HookLeakTracker",
    "HookSession",
    "audit_hooks",
    "check_compiled",
    "compiled_capture",
    "compiled_parts",
    "iter_tensors",
    "parallel_wrapper",
    "select_modules",
    "unwrap_compiled",
    "unwrap_parallel",
]
