"""Hook plumbing: the session that owns handles, module selection, audits and leak checks."""

from torchscope.hooks.audit import (
    HookAudit,
    HookEntry,
    HookGrowthGuard,
    HookGrowthWarning,
    audit_hooks,
)
from torchscope.hooks.leakcheck import HookLeakTracker
from torchscope.hooks.select import select_modules
from torchscope.hooks.session import HookSession
from torchscope.hooks.tree import iter_tensors

__all__ = [
    "HookAudit",
    "HookEntry",
    "HookGrowthGuard",
    "HookGrowthWarning",
    "HookLeakTracker",
    "HookSession",
    "audit_hooks",
    "iter_tensors",
    "select_modules",
]
