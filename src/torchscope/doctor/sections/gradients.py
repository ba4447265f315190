"""The `gradients` section: one forward and backward of the step through
`torchscope.grads.gradient_flow`; the record and its findings are the capability's own."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torchscope.doctor.section import DoctorOptions, Section
from torchscope.grads import GradFlow, gradient_flow, layer_norms
from torchscope.grads.records import combine_norms
from torchscope.report.document import Metric
from torchscope.report.html import gradients_fragment
from torchscope.report.plots_grads import plot_gradient_flow

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from torchscope.step import Step

__all__ = ["GradientsSection"]


class GradientsSection(Section[GradFlow]):
    """Gradient norms per layer after one backward."""

    name = "gradients"
    title = "Gradient flow"
    capability = "torchscope.grads.gradient_flow"

    def run(self, step: Step, options: DoctorOptions) -> GradFlow:
        return gradient_flow(step)

    def metrics(self, record: GradFlow) -> dict[str, Metric]:
        # The norms `diagnose` compares: parameter-owning modules, nearest the loss first.
        norms = layer_norms(record)
        if len(norms) < 2:
            return {}
        near, n_near = norms[0]
        far, n_far = norms[-1]
        out = {"gradients.vanishing_ratio": Metric(n_near / n_far, "lower", "ratio",
                                                   f"{near} / {far} grad norm")}
        for module, norm in norms[1:]:
            out[f"gradients.ratio:{module}"] = Metric(n_near / norm, "lower", "ratio",
                                                      f"{near} / {module} grad norm")
        return out

    def to_json(self, record: GradFlow) -> dict[str, Any]:
        ratio = self.metrics(record).get("gradients.vanishing_ratio")
        outputs, params = record.output_norms(), record.param_norms()
        inputs: dict[str, list[float | None]] = {}
        for r in record.modules:
            inputs.setdefault(r.module, []).append(r.input_norm)
        reached = {r.module for r in record.modules if r.reached}
        return {
            "total_norm": record.total_norm,
            "vanishing_ratio": None if ratio is None else ratio.value,
            # Every call of a module combined, reached modules in backward order.
            "layers": [{"module": m, "grad_output_norm": outputs.get(m),
                        "grad_input_norm": combine_norms(inputs[m]),
                        "param_grad_norm": params.get(m)}
                       for m in record.layers() if m in reached],
        }

    def plots(self, record: GradFlow) -> dict[str, Figure]:
        return {"gradients-flow": plot_gradient_flow(record)} if record.layers() else {}

    def html(self, record: GradFlow, plots: Mapping[str, str]) -> str:
        return gradients_fragment(record, plots)


SECTION = GradientsSection()
