"""Find modules created in a block of code and report hooks left on them.

Uses torch's own module- and parameter-registration hooks to learn which modules were built,
so nothing is patched. Backs the test-suite fixture and the `torchscope` pytest plugin.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.nn.modules import module as _module_mod

from torchscope.hooks.audit import HookEntry, audit_hooks, global_hook_counts


@dataclass
class HookLeakTracker:
    """Track modules created inside a `with` block and report hooks still on them at exit.

    Modules are seen when a submodule or parameter is registered on them, which covers every
    model built from layers. Process-wide hooks added in the block are reported too.
    """

    _modules: weakref.WeakSet[nn.Module] = field(default_factory=weakref.WeakSet)
    _handles: list[Any] = field(default_factory=list)
    _globals_before: dict[str, int] = field(default_factory=dict)

    def __enter__(self) -> HookLeakTracker:
        # Read before registering our own registration hooks, which are excluded.
        self._globals_before = global_hook_counts()
        self._handles.append(_module_mod.register_module_module_registration_hook(self._see))
        self._handles.append(_module_mod.register_module_parameter_registration_hook(self._see))
        return self

    def _see(self, module: nn.Module, _name: str, _value: Any) -> None:
        self._modules.add(module)

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def track(self, module: nn.Module) -> None:
        """Also check `module` (and its submodules) at the end."""
        self._modules.add(module)

    def leaks(self) -> list[HookEntry]:
        """Hooks left on tracked modules, and process-wide hooks added since `__enter__`."""
        modules = list(self._modules)
        inner = {id(sub) for module in modules for sub in module.modules() if sub is not module}
        found: list[HookEntry] = []
        for root in (m for m in modules if id(m) not in inner):
            for entry in audit_hooks(root, include_global=False).entries:
                if entry.kind.startswith(("state_dict", "load_state_dict")):
                    continue  # torch and libraries install these on construction by design
                owner = f"{type(root).__name__}:{entry.owner}"
                found.append(HookEntry(owner, entry.kind, entry.count))
        now = global_hook_counts()
        for kind, before in self._globals_before.items():
            if now.get(kind, 0) > before:
                found.append(HookEntry("<global>", kind, now[kind] - before))
        return found
