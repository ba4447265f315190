"""The `gradients` section: adapter over `torchscope.grads.gradient_flow`.

One forward and backward through `gradient_flow`; the findings are `torchscope.grads.diagnose`'s
and the vanishing ratio is read from `torchscope.grads.layer_norms`, the norms `diagnose`
judges. Without the capability `run` raises `CapabilityMissingError` and the doctor shows the
section as not available. The record below is what the report, `diff` and the renderers read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from torchscope.doctor.section import DoctorOptions, Metric, Section, load_capability
from torchscope.doctor.sections._adapt import num
from torchscope.errors import TorchscopeError
from torchscope.findings import Finding
from torchscope.models.target import ModelInputs

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["CAPABILITY", "GradLayer", "GradientsResult", "GradientsSection", "analyze_gradients"]

CAPABILITY = "torchscope.grads.gradient_flow"


@dataclass(frozen=True)
class GradLayer:
    """Gradient reaching one module in one backward, every call of it combined.

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
    """The gradient step as the report shows it.

    Attributes:
        layers: reached modules in backward order (nearest the loss first).
        total_norm: the norm `clip_grad_norm_` would return.
        norms: `(module, grad_output norm)` of the layers `diagnose` compares (modules that
            own parameters, finite and positive norms), nearest the loss first.
        findings: `torchscope.grads.diagnose`'s findings.
    """

    layers: tuple[GradLayer, ...]
    total_norm: float | None
    norms: tuple[tuple[str, float], ...] = ()
    findings: tuple[Finding, ...] = ()

    def ratio(self) -> tuple[str, str, float] | None:
        """(nearest, farthest, nearest norm / farthest norm) over `norms`."""
        if len(self.norms) < 2:
            return None
        (near, n_near), (far, n_far) = self.norms[0], self.norms[-1]
        return near, far, n_near / n_far


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
    """`torchscope.grads.GradFlow` → the section's record."""
    from torchscope.grads.records import combine_norms

    diagnose = load_capability("torchscope.grads.diagnose")
    layer_norms = load_capability("torchscope.grads.layer_norms")
    outputs = raw.output_norms()  # per module, every call combined
    params = raw.param_norms()
    inputs: dict[str, list[float | None]] = {}
    for r in raw.modules:
        inputs.setdefault(r.module, []).append(r.input_norm)
    reached = {r.module for r in raw.modules if r.reached}
    layers = tuple(
        GradLayer(m, num(outputs.get(m)), num(combine_norms(inputs[m])), num(params.get(m)))
        for m in raw.layers() if m in reached)
    norms = tuple((m, float(n)) for m, n in layer_norms(raw))
    return GradientsResult(layers, num(raw.total_norm), norms, tuple(diagnose(raw)))


def analyze_gradients(result: GradientsResult) -> list[Finding]:
    """`torchscope.grads.diagnose`'s findings (vanishing, exploding, dead, NaN, unreached)."""
    return list(result.findings)


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
            nearest = result.norms[0][1]
            for module, norm in result.norms[1:]:
                out[f"gradients.ratio:{module}"] = Metric(
                    nearest / norm, "lower", "ratio", f"{ratio[0]} / {module} grad norm")
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
