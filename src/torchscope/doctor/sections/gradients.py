"""The `gradients` section: adapter over `torchscope.grads.gradient_flow`.

Until the gradient-flow capability is installed, `run` raises `CapabilityMissingError` and the
doctor shows the section as not available. Wiring it means editing `_call` and `_convert`
only; the record below is what the report, `diff` and the renderers read.
"""

from __future__ import annotations

import math
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
from torchscope.doctor.sections._adapt import num
from torchscope.errors import TorchscopeError
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
    findings: tuple[Finding, ...] | None = None  # None: the capability gave no analysis

    def ratio(self) -> tuple[str, str, float] | None:
        """(nearest, farthest, nearest norm / farthest norm) over layers with a norm."""
        normed = [(ly.module, ly.grad_output_norm) for ly in self.layers
                  if ly.grad_output_norm is not None]
        if len(normed) < 2 or not normed[-1][1]:
            return None
        return normed[0][0], normed[-1][0], normed[0][1] / normed[-1][1]


def _call(model: nn.Module, inputs: ModelInputs, options: DoctorOptions) -> Any:
    gradient_flow = load_capability(CAPABILITY)
    # gradient_flow takes loss names itself; "auto" lets it use a scalar output or `.loss`,
    # and a classifier-shaped output falls back to cross-entropy on seeded targets.
    if options.loss != "auto":
        return gradient_flow(model, inputs, loss_fn=options.loss)
    try:
        return gradient_flow(model, inputs, loss_fn=None)
    except TorchscopeError:
        return gradient_flow(model, inputs, loss_fn="cross_entropy")


def _convert(raw: Any) -> GradientsResult:
    """`torchscope.grads.GradFlow` → the section's record (first call of each module)."""
    by_module: dict[str, list[float]] = {}
    for p in raw.params:
        if p.norm is not None:
            by_module.setdefault(p.module, []).append(p.norm)
    layers = []
    seen: set[str] = set()
    for r in raw.modules:  # backward order, nearest the loss first
        if r.module in seen or r.order is None:
            continue
        seen.add(r.module)
        own = by_module.get(r.module)
        layers.append(GradLayer(r.module, num(r.output_norm), num(r.input_norm),
                                math.sqrt(math.fsum(n * n for n in own)) if own else None))
    analyzer = optional_capability("torchscope.grads.diagnose")
    findings = None if analyzer is None else tuple(analyzer(raw))
    return GradientsResult(tuple(layers), num(raw.total_norm), findings)


def analyze_gradients(result: GradientsResult) -> list[Finding]:
    """`torchscope.grads.diagnose`'s findings when it gave any; else the vanishing ratio."""
    if result.findings is not None:
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
