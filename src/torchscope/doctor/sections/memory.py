"""The `memory` section: the step's memory through `torchscope.memory.analyze_memory`.

Saved activations per module, the step's totals, the measured peak and, when the model has a
sequence of blocks, checkpoint plans measured and verified bitwise (`checkpoint="auto"`).
The record and its findings are the capability's own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torchscope.doctor.section import DoctorOptions, Fallback, Section
from torchscope.errors import BudgetError, SelectionError, TorchscopeError, VerificationError
from torchscope.findings import Finding, Severity
from torchscope.memory import MemoryReport, analyze_memory
from torchscope.report.document import Metric
from torchscope.report.html import memory_fragment, plan_rows
from torchscope.report.plots_memory import plot_plans, plot_saved

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from torchscope.step import Step

__all__ = ["MemorySection"]


class MemorySection(Section[MemoryReport]):
    """What autograd keeps for backward, per module, and what checkpointing would save."""

    name = "memory"
    title = "Memory"
    capability = "torchscope.memory.analyze_memory"

    def run(self, step: Step, options: DoctorOptions
            ) -> MemoryReport | Fallback[MemoryReport]:
        if options.fast:
            return analyze_memory(step, checkpoint="none", repeats=1)
        try:
            # The least-recompute plan within what √L segments keep, verified bitwise.
            return analyze_memory(step, checkpoint="auto")
        except (BudgetError, SelectionError, VerificationError) as exc:
            # No block sequence, no plan that fits, or a plan that does not recompute
            # exactly (a model that mutates state in forward): a different request, the
            # step's memory without a plan, still stands.
            return Fallback(analyze_memory(step, checkpoint="none"), exc, "no checkpoint plan")

    def fallback_findings(self, error: TorchscopeError) -> list[Finding]:
        if not isinstance(error, VerificationError):
            return []  # no block sequence or no plan that fits: nothing is wrong
        return [Finding("memory.checkpoint_failed", Severity.WARNING,
                        "checkpointing failed its verification: "
                        f"{' '.join(error.message.split())}", {"plan": "auto"},
                        fix=error.fix)]

    def metrics(self, record: MemoryReport) -> dict[str, Metric]:
        return {"memory.saved_bytes": Metric(float(record.saved.total_bytes), "lower", "bytes",
                                             "activations saved for backward"),
                "memory.peak_estimate_bytes": Metric(float(record.totals.peak_estimate),
                                                     "lower", "bytes", "estimated step peak")}

    def to_json(self, record: MemoryReport) -> dict[str, Any]:
        t, plans = record.totals, record.plans
        base = None if plans is None else plans.measurement("none")
        return {
            "saved_bytes": record.saved.total_bytes, "param_bytes": t.parameters,
            "grad_bytes": t.gradients, "optimizer_bytes": t.optimizer_state,
            "peak_estimate_bytes": t.peak_estimate,
            "measured_peak_bytes": None if record.measured is None else record.measured.peak_bytes,
            "step_ms": None if base is None else base.step_ms,
            "modules": [{"module": m.module, "type": m.module_type, "saved_bytes": m.bytes,
                         "tensors": m.storages} for m in record.saved.modules],
            "plans": [{"name": p.name, "blocks": list(p.checkpointed),
                       "saved_bytes": p.saved_bytes, "recompute_ms": ms, "verified": ok}
                      for p, ms, ok in ([] if plans is None else plan_rows(plans))],
        }

    def plots(self, record: MemoryReport) -> dict[str, Figure]:
        out: dict[str, Figure] = {}
        if record.saved.modules:
            out["memory-saved"] = plot_saved(record.saved)
        if record.plans is not None and record.plans.plans:
            out["memory-plans"] = plot_plans(record.plans)
        return out

    def html(self, record: MemoryReport, plots: Mapping[str, str]) -> str:
        return memory_fragment(record, plots)


SECTION = MemorySection()
