"""Hook audit: list every hook on a model, and warn when hook counts grow step over step."""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.nn.modules import module as _module_mod

from torchscope.errors import TorchscopeError
from torchscope.hooks.session import HookSession

# Per-module hook dicts, by the kind name torchscope reports.
_MODULE_HOOK_ATTRS: dict[str, str] = {
    "forward": "_forward_hooks",
    "forward_pre": "_forward_pre_hooks",
    "backward": "_backward_hooks",
    "backward_pre": "_backward_pre_hooks",
    "state_dict": "_state_dict_hooks",
    "state_dict_pre": "_state_dict_pre_hooks",
    "load_state_dict_pre": "_load_state_dict_pre_hooks",
    "load_state_dict_post": "_load_state_dict_post_hooks",
}
# Process-wide module hooks (`torch.nn.modules.module.register_module_*_hook`).
_GLOBAL_HOOK_ATTRS: dict[str, str] = {
    "global_forward": "_global_forward_hooks",
    "global_forward_pre": "_global_forward_pre_hooks",
    "global_backward": "_global_backward_hooks",
    "global_backward_pre": "_global_backward_pre_hooks",
    "global_buffer_registration": "_global_buffer_registration_hooks",
    "global_module_registration": "_global_module_registration_hooks",
    "global_parameter_registration": "_global_parameter_registration_hooks",
}


def global_hook_counts() -> dict[str, int]:
    """How many process-wide module hooks of each kind are registered now."""
    return {k: len(getattr(_module_mod, a, None) or ()) for k, a in _GLOBAL_HOOK_ATTRS.items()}


@dataclass(frozen=True)
class HookEntry:
    """Hooks of one kind on one module or parameter.

    Attributes:
        owner: qualified module name ("" is the root; `fc.weight` for a parameter;
            `<global>` for process-wide hooks).
        kind: `forward`, `forward_pre`, `backward` (full), `backward_legacy` (the deprecated
            `register_backward_hook`), `backward_pre`, `tensor` (a parameter's grad hook),
            `post_accumulate_grad`, `state_dict*`, or `global_*`.
        count: how many hooks of that kind.
    """

    owner: str
    kind: str
    count: int


@dataclass(frozen=True)
class HookAudit:
    """Every hook found on a model, plus the process-wide module hooks."""

    entries: tuple[HookEntry, ...]

    @property
    def total(self) -> int:
        """All hooks found, global ones included."""
        return sum(e.count for e in self.entries)

    @property
    def local_total(self) -> int:
        """Hooks on the model's own modules and parameters, global ones excluded."""
        return sum(e.count for e in self.entries if e.owner != "<global>")

    def by_kind(self) -> dict[str, int]:
        """Hook counts summed per kind."""
        out: Counter[str] = Counter()
        for e in self.entries:
            out[e.kind] += e.count
        return dict(out)

    def counts(self) -> dict[tuple[str, str], int]:
        """`{(owner, kind): count}`, for comparing two audits."""
        return {(e.owner, e.kind): e.count for e in self.entries}


def audit_hooks(model: nn.Module, *, include_global: bool = True) -> HookAudit:
    """List every hook on every submodule and parameter of `model`, by kind.

    Args:
        model: the model to inspect; nothing is changed.
        include_global: also count the process-wide module hooks.

    Returns:
        A `HookAudit` whose entries have a non-zero count.
    """
    entries: list[HookEntry] = []
    for name, module in model.named_modules():
        for kind, attr in _MODULE_HOOK_ATTRS.items():
            n = len(getattr(module, attr, None) or ())
            if not n:
                continue
            legacy = getattr(module, "_is_full_backward_hook", None) is False
            entries.append(
                HookEntry(name, "backward_legacy" if kind == "backward" and legacy else kind, n)
            )
        for pname, param in module.named_parameters(recurse=False):
            owner = f"{name}.{pname}" if name else pname
            n = len(getattr(param, "_backward_hooks", None) or ())
            if n:
                entries.append(HookEntry(owner, "tensor", n))
            n = len(getattr(param, "_post_accumulate_grad_hooks", None) or ())
            if n:
                entries.append(HookEntry(owner, "post_accumulate_grad", n))
    if include_global:
        entries += [HookEntry("<global>", k, n) for k, n in global_hook_counts().items() if n]
    return HookAudit(tuple(entries))


class HookGrowthWarning(UserWarning):
    """Hook counts grew between two training steps: hooks are being registered in the loop."""


@dataclass
class HookGrowthGuard:
    """Warn once when a model's hook counts grow from one step to the next.

    Call `step()` once per training step, or use it as a context manager, which calls
    `step()` at the start of every forward of the root module. Growth is the classic bug of
    `register_forward_hook` inside the training loop: every step adds one more hook.

    Attributes:
        model: the watched model (held strongly only while the guard lives).
        growth: after a warning, `{(owner, kind): (before, after)}` of what grew.
    """

    model: nn.Module
    growth: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)
    _last: dict[tuple[str, str], int] | None = None
    _warned: bool = False
    _handle: Any = None

    def step(self) -> dict[tuple[str, str], tuple[int, int]]:
        """Compare hook counts with the previous step; warn on the first growth.

        Returns:
            What grew since the previous call (empty when nothing did).
        """
        now = audit_hooks(self.model, include_global=True).counts()
        if self._handle is not None:
            # Our own pre-hook is not the user's growth.
            now[("", "forward_pre")] = now.get(("", "forward_pre"), 0) - 1
        last = now if self._last is None else self._last  # the first step is no growth
        grown = {k: (last.get(k, 0), n) for k, n in now.items() if n > last.get(k, 0)}
        self._last = now
        if grown and not self._warned:
            self._warned = True
            self.growth = grown
            detail = ", ".join(
                f"{owner or '<root>'} {kind} {a}→{b}" for (owner, kind), (a, b) in grown.items()
            )
            warnings.warn(
                f"hook count grew between steps ({detail}): a hook is registered inside the "
                "training loop and never removed. Register it once before the loop and call "
                "handle.remove() after, or use `with torchscope.watch_activations(model):`.",
                HookGrowthWarning,
                stacklevel=3,
            )
        return grown

    def __enter__(self) -> HookGrowthGuard:
        if self._handle is not None:
            raise TorchscopeError(
                "this HookGrowthGuard is already active: a second `with` would add a second "
                "hook.",
                fix="use one `with` block per guard.",
            )

        def pre(_m: nn.Module, _a: tuple[Any, ...]) -> None:
            self.step()

        # "as_is": the guard only counts hooks; it must not change how a compiled model runs.
        session = HookSession(self.model, compiled="as_is")
        session.forward_pre_hook(self.model, pre)
        self._handle = session
        return self

    def __exit__(self, *exc: object) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
