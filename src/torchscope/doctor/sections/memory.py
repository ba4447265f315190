"""The `memory` section: adapter over `torchscope.memory.analyze_memory`.

Saved activations per module, the step's totals, the measured peak and (when the model has a
sequence of blocks) checkpoint plans, measured and verified; the findings are the ones
`analyze_memory` draws itself. Without the capability `run` raises `CapabilityMissingError`
and the doctor shows the section as not available.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from torchscope.doctor.section import DoctorOptions, Metric, Section, load_capability
from torchscope.doctor.sections._adapt import named_loss, num, trainable_sgd
from torchscope.errors import BudgetError, SelectionError, TorchscopeError, VerificationError
from torchscope.findings import Finding, Severity
from torchscope.models.target import ModelInputs

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["CAPABILITY", "CheckpointPlan", "MemoryResult", "MemorySection", "ModuleMemory",
           "analyze_memory"]

CAPABILITY = "torchscope.memory.analyze_memory"


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
    """Saved activations per module, the step's memory totals and checkpoint plans.

    Attributes:
        modules: bytes autograd saved while each module ran.
        saved_bytes: every saved activation byte.
        param_bytes, grad_bytes, optimizer_bytes: the step's state (optimizer None: unknown).
        peak_estimate_bytes: the peak counted from tensor sizes.
        measured_peak_bytes: the measured peak (CPU: above the step's start).
        step_ms: measured step time without checkpointing (None when no plan was measured).
        plans: the checkpoint plans; empty when none could be made (see `plans_note`).
        findings: `analyze_memory`'s findings, and the checkpoint plan's failure if it failed.
        plans_note: why there are no plans (no block sequence, no plan fits, or the plan
            failed its verification); empty when there are, or when none were asked (--fast).
    """

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
    plans_note: str = ""


def _call(model: nn.Module, inputs: ModelInputs, options: DoctorOptions
          ) -> tuple[Any, TorchscopeError | None]:
    """The capability's report, and the error that stopped checkpoint planning (if any)."""
    analyze_memory = load_capability(CAPABILITY)
    loss = named_loss(options.loss, options.seed)
    # The same optimizer as the profile section's steps, so its state is counted (SGD: none).
    opt = trainable_sgd(model)
    if options.fast:
        return analyze_memory(model, inputs, optimizer=opt, loss_fn=loss, checkpoint="none",
                              repeats=1), None
    try:
        # The least-recompute plan within what √L segments keep, verified bitwise.
        return analyze_memory(model, inputs, optimizer=opt, loss_fn=loss,
                              checkpoint="auto"), None
    except (BudgetError, SelectionError, VerificationError) as exc:
        # No block sequence, no plan that fits, or a plan that does not recompute exactly
        # (e.g. a model that mutates state in forward): the rest of the analysis stands.
        return analyze_memory(model, inputs, optimizer=opt, loss_fn=loss,
                              checkpoint="none"), exc


def _convert(raw: Any, plan_error: TorchscopeError | None = None) -> MemoryResult:
    """`torchscope.memory.MemoryReport` → the section's record."""
    modules = tuple(ModuleMemory(m.module, m.module_type, int(m.bytes), int(m.storages))
                    for m in raw.saved.modules)
    t = raw.totals
    plans: list[CheckpointPlan] = []
    step_ms = None
    if raw.plans is not None:
        measured = {m.plan: m for m in raw.plans.measurements}
        base = measured.get("none")
        step_ms = num(base.step_ms) if base is not None else None
        for p in raw.plans.plans:
            m = measured.get(p.name)
            verified = None if m is None or m.verification is None else bool(m.verification.ok)
            plans.append(CheckpointPlan(
                p.name, tuple(p.checkpointed), int(p.saved_bytes),
                num(m.recompute_ms) if m is not None else num(p.recompute_ms), verified))
    return MemoryResult(
        modules, int(raw.saved.total_bytes), int(t.parameters), int(t.gradients),
        None if t.optimizer_state is None else int(t.optimizer_state), int(t.peak_estimate),
        None if raw.measured is None else int(raw.measured.peak_bytes), step_ms,
        tuple(plans), tuple(raw.findings) + _plan_failure(plan_error),
        "" if plan_error is None else f"no checkpoint plan: {plan_error.one_line()}")


def _plan_failure(exc: TorchscopeError | None) -> tuple[Finding, ...]:
    """The capability's verification verdict, when the checkpointed step failed it."""
    if not isinstance(exc, VerificationError):
        return ()
    return (Finding("memory.checkpoint_failed", Severity.WARNING,
                    f"checkpointing failed its verification: {' '.join(exc.message.split())}",
                    {"plan": "auto"}, fix=exc.fix),)


def analyze_memory(result: MemoryResult) -> list[Finding]:
    """`torchscope.memory.analyze_memory`'s findings: saved activations by module and type,
    state vs activations, estimate vs measured peak, and the checkpoint plan."""
    return list(result.findings)


class MemorySection(Section[MemoryResult]):
    """What autograd keeps for backward, per module, and what checkpointing would save."""

    name = "memory"
    title = "Memory"
    capability = CAPABILITY

    def run(self, model: nn.Module, inputs: ModelInputs, options: DoctorOptions
            ) -> MemoryResult:
        return _convert(*_call(model, inputs, options))

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
            "peak_estimate_bytes": result.peak_estimate_bytes, "plans_note": result.plans_note,
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
