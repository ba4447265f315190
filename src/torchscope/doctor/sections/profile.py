"""The `profile` section: adapter over `torchscope.profiling.profile_steps`.

Until the profiling capability is installed, `run` raises `CapabilityMissingError` and the doctor
shows the section as not available. Wiring it means editing `_call` and `_convert` only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from torchscope.doctor.section import (
    DoctorOptions,
    Metric,
    Section,
    load_capability,
    optional_capability,
)
from torchscope.doctor.sections._adapt import named_loss, num, trainable_sgd
from torchscope.findings import Finding, Severity
from torchscope.models.target import ModelInputs

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["CAPABILITY", "ModuleTime", "OpTime", "ProfileResult", "ProfileSection",
           "analyze_profile"]

CAPABILITY = "torchscope.profiling.profile_steps"
TOP_OP_SHARE = 0.25  # an op taking this share of self CPU time is reported


@dataclass(frozen=True)
class OpTime:
    """One op over the profiled steps (times in microseconds, as torch.profiler gives)."""

    name: str
    calls: int
    self_cpu_us: float
    total_cpu_us: float
    self_device_us: float | None


@dataclass(frozen=True)
class ModuleTime:
    """Forward and backward time attributed to one module over the profiled steps."""

    module: str
    calls: int
    forward_ms: float
    backward_ms: float | None


@dataclass(frozen=True)
class ProfileResult:
    """Top ops and time per module over the profiled steps; step and phase times per step."""

    steps: int
    ops: tuple[OpTime, ...]
    modules: tuple[ModuleTime, ...]
    step_ms: float | None
    forward_ms: float | None
    backward_ms: float | None
    optimizer_ms: float | None
    findings: tuple[Finding, ...] | None = None  # None: the capability gave no analysis

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
    """`torchscope.profiling.ProfileResult` → the section's record (phases per step)."""
    ops = tuple(OpTime(o.name, int(o.calls), o.self_cpu_ms * 1e3, o.cpu_total_ms * 1e3,
                       o.self_device_ms * 1e3 if o.self_device_ms else None) for o in raw.ops)
    modules = tuple(ModuleTime(m.module, int(m.calls), m.forward_ms, m.backward_ms)
                    for m in raw.modules)
    steps = int(raw.steps)

    def phase(name: str) -> float | None:
        ph = raw.phase(name)
        return None if ph is None else ph.cpu_ms / max(steps, 1)

    analyzer = optional_capability("torchscope.profiling.profile_findings")
    findings = None if analyzer is None else tuple(analyzer(raw))
    return ProfileResult(steps, tuple(sorted(ops, key=lambda o: -o.self_cpu_us)), modules,
                         num(raw.timing.profiled_ms), phase("forward"), phase("backward"),
                         phase("optimizer"), findings)


def analyze_profile(result: ProfileResult) -> list[Finding]:
    """The capability's findings when it gives any; else the top op and the phase split."""
    if result.findings is not None:
        return list(result.findings)
    out: list[Finding] = []
    total = result.self_cpu_total_us
    if result.ops and total > 0:
        top = result.ops[0]
        share = top.self_cpu_us / total
        if share >= TOP_OP_SHARE:
            out.append(Finding(
                "profile.top_op", Severity.INFO,
                f"{top.name} takes {100 * share:.0f}% of self CPU time "
                f"({top.calls} calls over {result.steps} steps)",
                {"op": top.name, "share": share, "calls": top.calls,
                 "self_cpu_us": top.self_cpu_us},
                fix="look at the modules that call it (--by module); a bigger batch or fused op "
                    "amortises per-call cost"))
    if result.forward_ms and result.backward_ms:
        ratio = result.backward_ms / result.forward_ms
        out.append(Finding(
            "profile.backward_forward", Severity.INFO,
            f"backward takes {ratio:.1f}× the forward time",
            {"forward_ms": result.forward_ms, "backward_ms": result.backward_ms,
             "ratio": ratio}))
    return out


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
