"""The `profile` section: adapter over `torchscope.profiling.profile_steps`.

A few real training steps (forward, loss, backward, SGD step) under `torch.profiler`; the
findings are `torchscope.profiling.profile_findings`'. Without the capability `run` raises
`CapabilityMissingError` and the doctor shows the section as not available.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from torchscope.doctor.section import DoctorOptions, Metric, Section, load_capability
from torchscope.doctor.sections._adapt import named_loss, num, trainable_sgd
from torchscope.findings import Finding
from torchscope.models.target import ModelInputs

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["CAPABILITY", "ModuleTime", "OpTime", "ProfileResult", "ProfileSection",
           "analyze_profile"]

CAPABILITY = "torchscope.profiling.profile_steps"


@dataclass(frozen=True)
class OpTime:
    """One op summed over every profiled step (microseconds, as torch.profiler gives)."""

    name: str
    calls: int
    self_cpu_us: float
    total_cpu_us: float
    self_device_us: float | None


@dataclass(frozen=True)
class ModuleTime:
    """Time of one module per step, its timed child modules excluded (so rows add up).

    Attributes:
        module: qualified name (`""` is the root).
        calls: forward calls per step.
        forward_ms: its own forward time per step.
        backward_ms: time per step of the backward nodes its own forward ops created.
    """

    module: str
    calls: int
    forward_ms: float
    backward_ms: float | None


@dataclass(frozen=True)
class ProfileResult:
    """Top ops (summed over the steps), per-step module, step and phase times, findings.

    Attributes:
        steps: profiled steps.
        ops: ops by self CPU time, largest first, summed over the steps.
        modules: per-step self time of each timed module, in first-call order.
        step_ms: median profiled step time.
        forward_ms, backward_ms, optimizer_ms: the phases, per step.
        findings: `torchscope.profiling.profile_findings`' findings.
    """

    steps: int
    ops: tuple[OpTime, ...]
    modules: tuple[ModuleTime, ...]
    step_ms: float | None
    forward_ms: float | None
    backward_ms: float | None
    optimizer_ms: float | None
    findings: tuple[Finding, ...] = ()

    @property
    def self_cpu_total_us(self) -> float:
        """Sum of self CPU time over every op."""
        return sum(o.self_cpu_us for o in self.ops)


def _call(model: nn.Module, inputs: ModelInputs, options: DoctorOptions) -> Any:
    profile_steps = load_capability(CAPABILITY)
    return profile_steps(model, inputs, loss_fn=named_loss(options.loss, options.seed),
                         optimizer=trainable_sgd(model), steps=options.profile_steps,
                         baseline_steps=0 if options.fast else None)


def _convert(raw: Any) -> ProfileResult:
    """`torchscope.profiling.ProfileResult` (totals over the steps) → the section's record."""
    profile_findings = load_capability("torchscope.profiling.profile_findings")
    steps = max(int(raw.steps), 1)
    ops = tuple(OpTime(o.name, int(o.calls), o.self_cpu_ms * 1e3, o.cpu_total_ms * 1e3,
                       o.self_device_ms * 1e3 if o.self_device_ms else None) for o in raw.ops)
    modules = tuple(ModuleTime(m.module, round(m.calls / steps), m.forward_self_ms / steps,
                               m.backward_self_ms / steps) for m in raw.modules)

    def phase(name: str) -> float | None:
        ph = raw.phase(name)
        return None if ph is None else ph.cpu_ms / steps

    return ProfileResult(int(raw.steps), tuple(sorted(ops, key=lambda o: -o.self_cpu_us)),
                         modules, num(raw.timing.profiled_ms), phase("forward"),
                         phase("backward"), phase("optimizer"), tuple(profile_findings(raw)))


def analyze_profile(result: ProfileResult) -> list[Finding]:
    """`torchscope.profiling.profile_findings`' findings: top op, host syncs, backward
    ratio, optimizer share, costliest module, profiler overhead."""
    return list(result.findings)


class ProfileSection(Section[ProfileResult]):
    """torch.profiler over a few training steps: top ops, phases, time per module."""

    name = "profile"
    title = "Time"
    capability = CAPABILITY

    def run(self, model: nn.Module, inputs: ModelInputs, options: DoctorOptions
            ) -> ProfileResult:
        return _convert(_call(model, inputs, options))

    def analyze(self, result: ProfileResult) -> list[Finding]:
        return analyze_profile(result)

    def metrics(self, result: ProfileResult) -> dict[str, Metric]:
        out: dict[str, Metric] = {}
        if result.step_ms is not None:
            out["profile.step_ms"] = Metric(result.step_ms, "lower", "ms", "training step time")
        return out

    def to_json(self, result: ProfileResult) -> dict[str, Any]:
        return {
            "steps": result.steps, "step_ms": result.step_ms, "forward_ms": result.forward_ms,
            "backward_ms": result.backward_ms, "optimizer_ms": result.optimizer_ms,
            "ops": [{"name": o.name, "calls": o.calls, "self_cpu_us": o.self_cpu_us,
                     "total_cpu_us": o.total_cpu_us, "self_device_us": o.self_device_us}
                    for o in result.ops],
            "modules": [{"module": m.module, "calls": m.calls, "forward_ms": m.forward_ms,
                         "backward_ms": m.backward_ms} for m in result.modules],
        }

    def plots(self, result: ProfileResult) -> dict[str, Figure]:
        from torchscope.report.plots_doctor import profile_modules_plot, profile_ops_plot

        out: dict[str, Figure] = {}
        if result.ops:
            out["profile-ops"] = profile_ops_plot(result.ops)
        if result.modules:
            out["profile-modules"] = profile_modules_plot(result.modules)
        return out

    def html(self, result: ProfileResult, plots: Mapping[str, str]) -> str:
        from torchscope.report.html import profile_fragment

        return profile_fragment(result, plots)


SECTION = ProfileSection()
