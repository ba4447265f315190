"""The `activations` section: one forward of the step through `torchscope.capture`.

It captures every module's output (leaf modules are what the tables and plots show; the
containers are captured too, so that `trace_nonfinite` can tell a producer from a carrier);
the findings are the capture's own (`torchscope.capture.analyze`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torchscope.capture import ActivationCapture, TensorStats, capture_activations, trace_nonfinite
from torchscope.doctor.section import DoctorOptions, Section
from torchscope.report.document import Metric
from torchscope.report.html import activations_fragment, leaf_records
from torchscope.report.plots_doctor import activation_stats_plot, activation_zeros_plot

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from torchscope.step import Step

__all__ = ["ActivationsSection"]


def _stats_json(s: TensorStats) -> dict[str, Any]:
    return {
        "path": s.path, "shape": list(s.shape), "dtype": s.dtype, "device": s.device,
        "numel": s.numel, "bytes": s.nbytes, "mean": s.mean, "std": s.std, "min": s.min,
        "max": s.max, "norm": s.norm, "zero_frac": s.zero_frac, "nan": s.nan_count,
        "inf": s.inf_count, "dead_units": s.dead_units, "channels": s.channels,
    }


def _totals(record: ActivationCapture) -> tuple[int, int]:
    """(bytes of every leaf output, dead channels over every leaf output)."""
    stats = [s for r in leaf_records(record) for s in r.outputs]
    return sum(s.nbytes for s in stats), sum(s.dead_units or 0 for s in stats)


class ActivationsSection(Section[ActivationCapture]):
    """Activations of one forward: shapes, statistics, dead units, NaN/Inf producer."""

    name = "activations"
    title = "Activations"
    capability = "torchscope.capture.capture_activations"

    def run(self, step: Step, options: DoctorOptions) -> ActivationCapture:
        childless = next(step.model.children(), None) is None
        # Every module, containers too; a model without children is captured as its own root.
        return capture_activations(step, select=None if childless else (lambda n, m: True))

    def metrics(self, record: ActivationCapture) -> dict[str, Metric]:
        t = trace_nonfinite(record.records)
        nonfinite = (1 if t.producer is not None else 0) + len(t.passers) + len(t.other_producers)
        output_bytes, dead = _totals(record)
        return {
            "activations.nonfinite_modules": Metric(float(nonfinite), "lower", "count",
                                                    "module calls with NaN/Inf output"),
            "activations.dead_units": Metric(float(dead), "lower", "count",
                                             "dead ReLU channels"),
            "activations.output_bytes": Metric(float(output_bytes), "lower", "bytes",
                                               "bytes of leaf outputs"),
        }

    def to_json(self, record: ActivationCapture) -> dict[str, Any]:
        t = trace_nonfinite(record.records)
        leaf_names = {r.module for r in leaf_records(record)}
        output_bytes, dead = _totals(record)
        return {
            "output_bytes": output_bytes,
            "dead_units": dead,
            "modules": [
                {"module": r.module, "type": r.module_type, "call": r.call,
                 "leaf": r.module in leaf_names, "inputs_finite": r.inputs_finite,
                 "outputs": [_stats_json(s) for s in r.outputs]}
                for r in record.records
            ],
            "nonfinite": {
                "producer": None if t.producer is None else t.producer.key,
                "passers": [r.key for r in t.passers],
                "other_producers": [r.key for r in t.other_producers],
            },
        }

    def plots(self, record: ActivationCapture) -> dict[str, Figure]:
        leaves = leaf_records(record)
        return {"activations-stats": activation_stats_plot(leaves),
                "activations-zeros": activation_zeros_plot(leaves)}

    def html(self, record: ActivationCapture, plots: Mapping[str, str]) -> str:
        return activations_fragment(record, plots)


SECTION = ActivationsSection()
