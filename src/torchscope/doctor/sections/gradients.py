"""The `gradients` section: adapter over `torchscope.grads.gradient_flow`.

Until the gradient-flow capability is installed, `run` raises `CapabilityMissingError` and the
doctor shows the section as not available. Wiring it means editing `_call` and `_convert`
only; the record below is what the report, `diff` and the renderers read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from torchscope.doctor.section import DoctorOptions, Metric, Section, load_capability
from torchscope.doctor.sections._adapt import first_attr, num, seq
from torchscope.findings import Finding, Severity
from torchscope.models.target import ModelInputs

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["CAPABILITY", "GradLayer", "GradientsResult", "GradientsSection", "analyze_gradients"]

CAPABILITY = "torchscope.grads.gradient_flow"
VANISHING_RATIO = 10.0  # nearest/farthest grad norm ratio reported as vanishing


@dataclass(frozen=True)
class GradLayer:
    """Gradient reaching one module call in one backward.

    Attributes:
        module: qualified name.
        grad_output_norm: norm of the gradient arriving from above.
        grad_input_norm: norm of the gradient passed down; None when torch gave None.
        param_grad_norm: norm over the module's own parameter gradients; None without any.
    """

    module: str
    grad_output_norm: float | None
    grad_input_norm: float | None
    param_grad_norm: float | None


@dataclass(frozen=True)
class GradientsResult:
    """Layers in backward order (nearest the loss first), the total norm and the
    capability's own findings."""

    layers: tuple[GradLayer, ...]
    total_norm: float | None
    findings: tuple[Finding, ...] = ()

    def ratio(self) -> tuple[str, str, float] | None:
        """(nearest, farthest, nearest norm / farthest norm) over layers with a norm."""
        normed = [(ly.module, ly.grad_output_norm) for ly in self.layers
                  if ly.grad_output_norm is not None]
        if len(normed) < 2 or not normed[-1][1]:
            return None
        return normed[0][0], normed[-1][0], normed[0][1] / normed[-1][1]


def _call(model: nn.Module, inputs: ModelInputs, options: DoctorOptions) -> Any:
    gradient_flow = load_capability(CAPABILITY)
    loss = None if options.loss == "auto" else options.loss
    return gradient_flow(model, inputs, loss_fn=loss)


def _convert(raw: Any) -> GradientsResult:
    records = seq(first_attr(raw, "records", "layers", default=raw))
    layers = []
    for r in records:
        gi = [num(first_attr(g, "norm", default=g)) for g in
              seq(first_attr(r, "grad_input_norms", "grad_input", default=()))]
        params = [num(first_attr(p, "norm", default=p)) for p in
                  seq(first_attr(r, "param_norms", "param_grad_norms", default=()))]
        known = [p for p in params if p is not None]
        layers.append(GradLayer(
            str(first_attr(r, "module", "name", default="?")),
            num(first_attr(r, "grad_output_norm", "grad_output", default=None)),
            next((g for g in gi if g is not None), None),
            (sum(p * p for p in known) ** 0.5) if known else None))
    findings = tuple(f for f in seq(first_attr(raw, "findings", default=()))
                     if isinstance(f, Finding))
    return GradientsResult(tuple(layers), num(first_attr(raw, "total_norm", default=None)),
                           findings)


def analyze_gradients(result: GradientsResult) -> list[Finding]:
    """The capability's findings when it gives any; else the vanishing-gradient ratio."""
    if result.findings:
        return list(result.findings)
    ratio = result.ratio()
    if ratio is None or ratio[2] < VANISHING_RATIO:
        return []
    near, far, r = ratio
    return [Finding("grads.vanishing", Severity.WARNING,
                    f"{far} receives {r:.0f}× less gradient than {near}",
                    {"nearest": near, "farthest": far, "ratio": r},
                    fix="use a residual path or normalisation, or check the init of the layers "
                        "in between", module=far)]


class GradientsSection(Section[GradientsResult]):
    """Gradient norms per layer after one backward."""

    name = "gradients"
    title = "Gradient flow"
    capability = CAPABILITY

    def run(self, model: nn.Module, inputs: ModelInputs, options: DoctorOptions
            ) -> GradientsResult:
        return _convert(_call(model, inputs, options))

    def analyze(self, result: GradientsResult) -> list[Finding]:
        return analyze_gradients(result)

    def metrics(self, result: GradientsResult) -> dict[str, Metric]:
        out: dict[str, Metric] = {}
        ratio = result.ratio()
        if ratio is not None:
            out["gradients.vanishing_ratio"] = Metric(
                ratio[2], "lower", "ratio", f"{ratio[0]} / {ratio[1]} grad norm")
            nearest = result.layers[0].grad_output_norm
            for ly in result.layers[1:]:
                if nearest and ly.grad_output_norm:
                    out[f"gradients.ratio:{ly.module}"] = Metric(
                        nearest / ly.grad_output_norm, "lower", "ratio",
                        f"{ratio[0]} / {ly.module} grad norm")
        return out

    def to_json(self, result: GradientsResult) -> dict[str, Any]:
        ratio = result.ratio()
        return {
            "total_norm": result.total_norm,
            "vanishing_ratio": None if ratio is None else ratio[2],
            "layers": [{"module": ly.module, "grad_output_norm": ly.grad_output_norm,
                        "grad_input_norm": ly.grad_input_norm,
                        "param_grad_norm": ly.param_grad_norm} for ly in result.layers],
        }

    def plots(self, result: GradientsResult) -> dict[str, Figure]:
        from torchscope.report.plots_doctor import gradient_flow_plot

        return {"gradients-flow": gradient_flow_plot(result.layers)} if result.layers else {}

    def html(self, result: GradientsResult, plots: Mapping[str, str]) -> str:
        from torchscope.report.html import gradients_fragment

        return gradients_fragment(result, plots)


SECTION = GradientsSection()
