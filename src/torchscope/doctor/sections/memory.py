"""The `memory` section: adapter over `torchscope.memory.memory_report`.

Until the memory capability is installed, `run` raises `CapabilityMissingError` and the doctor
shows the section as not available. Wiring it means editing `_call` and `_convert` only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from torchscope.doctor.section import DoctorOptions, Metric, Section, load_capability
from torchscope.doctor.sections._adapt import first_attr, num, opt_int, seq
from torchscope.findings import Finding, Severity
from torchscope.models.target import ModelInputs

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["CAPABILITY", "CheckpointPlan", "MemoryResult", "MemorySection", "ModuleMemory",
           "analyze_memory"]

CAPABILITY = "torchscope.memory.memory_report"
DOMINANT_SHARE = 0.3  # a module type holding this share of saved bytes is reported


@dataclass(frozen=True)
class ModuleMemory:
    """Activations autograd saved while one module ran."""

    module: str
    module_type: str
    saved_bytes: int
    tensors: int


@dataclass(frozen=True)
class CheckpointPlan:
    """One checkpointing plan as measured.

    Attributes:
        name: `none`, `all`, `sqrt`, `budget`, ...
        blocks: the checkpointed blocks.
        saved_bytes: activations saved under the plan.
        recompute_ms: measured extra time per step (None when not measured).
        verified: gradients bitwise identical with and without the plan (None: not checked).
    """

    name: str
    blocks: tuple[str, ...]
    saved_bytes: int
    recompute_ms: float | None
    verified: bool | None


@dataclass(frozen=True)
class MemoryResult:
    """Saved activations per module, the step's memory totals and checkpoint plans."""

    modules: tuple[ModuleMemory, ...]
    saved_bytes: int
    param_bytes: int | None
    grad_bytes: int | None
    optimizer_bytes: int | None
    peak_estimate_bytes: int | None
    measured_peak_bytes: int | None
    step_ms: float | None
    plans: tuple[CheckpointPlan, ...] = ()
    findings: tuple[Finding, ...] = ()


def _call(model: nn.Module, inputs: ModelInputs, options: DoctorOptions) -> Any:
    memory_report = load_capability(CAPABILITY)
    loss = None if options.loss == "auto" else options.loss
    return memory_report(model, inputs, loss_fn=loss)


def _convert(raw: Any) -> MemoryResult:
    modules = tuple(
        ModuleMemory(str(first_attr(m, "module", "name", default="?")),
                     str(first_attr(m, "module_type", "type", default="")),
                     opt_int(first_attr(m, "saved_bytes", "bytes", default=0)) or 0,
                     opt_int(first_attr(m, "tensors", "count", default=0)) or 0)
        for m in seq(first_attr(raw, "modules", "per_module", default=())))
    plans = tuple(
        CheckpointPlan(str(first_attr(p, "name", default="?")),
                       tuple(str(b) for b in seq(first_attr(p, "blocks", default=()))),
                       opt_int(first_attr(p, "saved_bytes", default=0)) or 0,
                       num(first_attr(p, "recompute_ms", "measured_recompute_ms", default=None)),
                       first_attr(p, "verified", "bitwise_equal", default=None))
        for p in seq(first_attr(raw, "plans", default=())))
    saved = opt_int(first_attr(raw, "saved_bytes", "activation_bytes", default=None))
    return MemoryResult(
        modules, saved if saved is not None else sum(m.saved_bytes for m in modules),
        opt_int(first_attr(raw, "param_bytes", default=None)),
        opt_int(first_attr(raw, "grad_bytes", default=None)),
        opt_int(first_attr(raw, "optimizer_bytes", default=None)),
        opt_int(first_attr(raw, "peak_estimate_bytes", "estimated_peak", default=None)),
        opt_int(first_attr(raw, "measured_peak_bytes", "measured_peak", default=None)),
        num(first_attr(raw, "step_ms", default=None)),
        plans,
        tuple(f for f in seq(first_attr(raw, "findings", default=())) if isinstance(f, Finding)))


def analyze_memory(result: MemoryResult) -> list[Finding]:
    """The capability's findings when it gives any; else the dominant module type and the
    best verified checkpoint plan."""
    if result.findings:
        return list(result.findings)
    out: list[Finding] = []
    if result.saved_bytes > 0:
        by_type: dict[str, int] = {}
        for m in result.modules:
            by_type[m.module_type or m.module] = by_type.get(m.module_type or m.module, 0) \
                + m.saved_bytes
        if by_type:
            kind, nbytes = max(by_type.items(), key=lambda kv: kv[1])
            share = nbytes / result.saved_bytes
            if share >= DOMINANT_SHARE:
                out.append(Finding(
                    "memory.dominant", Severity.INFO,
                    f"{kind} outputs hold {100 * share:.0f}% of saved activations",
                    {"module_type": kind, "saved_bytes": nbytes, "share": share},
                    fix="checkpoint the blocks that contain them, or use in-place variants "
                        "where autograd allows"))
    for p in result.plans:
        if p.verified is False:
            out.append(Finding(
                "memory.verification_failed", Severity.ERROR,
                f"checkpoint plan {p.name} changed the gradients",
                {"plan": p.name}, fix="do not use this plan; report the model"))
    base = result.saved_bytes
    good = [p for p in result.plans if p.verified and p.saved_bytes < base and p.name != "none"]
    if good:
        best = min(good, key=lambda p: p.saved_bytes)
        extra = (None if best.recompute_ms is None or not result.step_ms
                 else best.recompute_ms / result.step_ms)
        cost = "" if extra is None else f" at +{100 * extra:.0f}% step time"
        out.append(Finding(
            "memory.checkpoint_plan", Severity.INFO,
            f"checkpointing {', '.join(best.blocks) or best.name} saves "
            f"{base - best.saved_bytes:,} B of activations{cost}, gradients verified identical",
            {"plan": best.name, "saved_before": base, "saved_after": best.saved_bytes,
             "extra_step_frac": extra},
            fix="torchscope.checkpointing.apply(model, blocks=...) when memory is the limit"))
    return out


class MemorySection(Section[MemoryResult]):
    """What autograd keeps for backward, per module, and what checkpointing would save."""

    name = "memory"
    title = "Memory"
    capability = CAPABILITY

    def run(self, model: nn.Module, inputs: ModelInputs, options: DoctorOptions
            ) -> MemoryResult:
        return _convert(_call(model, inputs, options))

    def analyze(self, result: MemoryResult) -> list[Finding]:
        return analyze_memory(result)

    def metrics(self, result: MemoryResult) -> dict[str, Metric]:
        out = {"memory.saved_bytes": Metric(float(result.saved_bytes), "lower", "bytes",
                                            "activations saved for backward")}
        if result.peak_estimate_bytes is not None:
            out["memory.peak_estimate_bytes"] = Metric(
                float(result.peak_estimate_bytes), "lower", "bytes", "estimated step peak")
        return out

    def to_json(self, result: MemoryResult) -> dict[str, Any]:
        return {
            "saved_bytes": result.saved_bytes, "param_bytes": result.param_bytes,
            "grad_bytes": result.grad_bytes, "optimizer_bytes": result.optimizer_bytes,
            "peak_estimate_bytes": result.peak_estimate_bytes,
            "measured_peak_bytes": result.measured_peak_bytes, "step_ms": result.step_ms,
            "modules": [{"module": m.module, "type": m.module_type,
                         "saved_bytes": m.saved_bytes, "tensors": m.tensors}
                        for m in result.modules],
            "plans": [{"name": p.name, "blocks": list(p.blocks), "saved_bytes": p.saved_bytes,
                       "recompute_ms": p.recompute_ms, "verified": p.verified}
                      for p in result.plans],
        }

    def plots(self, result: MemoryResult) -> dict[str, Figure]:
        from torchscope.report.plots_doctor import memory_plans_plot, memory_saved_plot

        out: dict[str, Figure] = {}
        if result.modules:
            out["memory-saved"] = memory_saved_plot(result.modules)
        if result.plans:
            out["memory-plans"] = memory_plans_plot(result.plans)
        return out

    def html(self, result: MemoryResult, plots: Mapping[str, str]) -> str:
        from torchscope.report.html import memory_fragment

        return memory_fragment(result, plots)


SECTION = MemorySection()
