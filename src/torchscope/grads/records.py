"""Frozen records of gradient flow. They hold numbers (and fixed reason phrases), never
formatted text."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torchscope.errors import TorchscopeError
from torchscope.findings import Analyzed

if TYPE_CHECKING:
    from torchscope.step import StepInfo

# Why a gradient is missing. Fixed phrases, so tests and renderers can match them.
INPUT_NO_GRAD = "input does not require grad"
OUTPUT_NO_GRAD = "output does not require grad"
NOT_REACHED = "the loss does not reach it"
NOT_MEASURED = "not measured (non-strided or in-place input without history)"
FROZEN = "frozen (requires_grad=False)"
NO_GRAD = "received no gradient (not run, or the loss does not reach it)"


def combine_norms(norms: Iterable[float | None]) -> float | None:
    """L2 norm of the concatenation of tensors whose L2 norms are `norms` (None skipped).

    Returns None when every entry is None.
    """
    vals = [n for n in norms if n is not None]
    if not vals:
        return None
    return math.sqrt(math.fsum(n * n for n in vals))


def _by_module(norms: Iterable[tuple[str, float | None]]) -> dict[str, float | None]:
    """`combine_norms` of each module's norms, modules in first-seen order."""
    grouped: dict[str, list[float | None]] = {}
    for module, norm in norms:
        grouped.setdefault(module, []).append(norm)
    return {k: combine_norms(v) for k, v in grouped.items()}


@dataclass(frozen=True)
class TensorGrad:
    """The gradient of one tensor leaf of a module's input or output.

    Attributes:
        path: where the tensor sits: `[0]` for the first positional input or output element,
            `['hidden_states']` for a keyword input, `""` for a bare output tensor.
        shape: shape of the tensor (the gradient has the same shape).
        dtype: the tensor's dtype, like `torch.float32`.
        norm: L2 norm of the gradient, unscaled when a GradScaler was given; None when no
            gradient exists, see `reason`.
        reason: why `norm` is None (e.g. "input does not require grad"); None otherwise.
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    norm: float | None
    reason: str | None = None

    @property
    def present(self) -> bool:
        """True when a gradient was measured."""
        return self.norm is not None

    @property
    def finite(self) -> bool:
        """False when the gradient holds NaN or Inf (its norm is not finite)."""
        return self.norm is None or math.isfinite(self.norm)

    @property
    def zero(self) -> bool:
        """True when the gradient is all zeros."""
        return self.norm == 0.0


@dataclass(frozen=True)
class ModuleGradRecord:
    """One call of one module, seen from backward.

    Attributes:
        module: qualified name ("" is the root).
        module_type: the module's class name.
        index: the sampled step (optimizer steps counted from 0) this call belongs to.
        micro: which forward of that step (micro-batch) made the call, from 0.
        call: how many times the module ran before in the same forward (0 for the first).
        order: position in backward order among the step's calls (0 is nearest the loss);
            None when no gradient reached the call's outputs.
        grad_output: gradient arriving from above, per output tensor.
        grad_input: gradient passed down through this call, per tensor input (positional
            then keyword), as `register_full_backward_hook` defines it.
        owns_params: whether the module has parameters of its own (not only in children).
    """

    module: str
    module_type: str
    index: int
    micro: int
    call: int
    order: int | None
    grad_output: tuple[TensorGrad, ...]
    grad_input: tuple[TensorGrad, ...]
    owns_params: bool = False

    @property
    def key(self) -> str:
        """`module#call`, unique within one forward."""
        return f"{self.module}#{self.call}"

    @property
    def reached(self) -> bool:
        """True when backward delivered a gradient to at least one output."""
        return any(g.present for g in self.grad_output)

    @property
    def output_norm(self) -> float | None:
        """Norm of all output gradients together (None when none arrived)."""
        return combine_norms(g.norm for g in self.grad_output)

    @property
    def input_norm(self) -> float | None:
        """Norm of all input gradients together (None when none was passed down)."""
        return combine_norms(g.norm for g in self.grad_input)

    @property
    def finite(self) -> bool:
        """False when any gradient of this call holds NaN or Inf."""
        return all(g.finite for g in self.grad_output + self.grad_input)


@dataclass(frozen=True)
class ParamGradRecord:
    """The gradient of one parameter at the end of a step (after all micro-batches).

    Attributes:
        name: qualified parameter name, e.g. `conv1.weight`.
        module: qualified name of the module that owns it.
        shape: parameter shape.
        dtype: parameter dtype.
        requires_grad: False for frozen parameters.
        norm: L2 norm of `.grad` (unscaled with a GradScaler); None when there is no grad.
        reason: why `norm` is None.
    """

    name: str
    module: str
    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool
    norm: float | None
    reason: str | None = None

    @property
    def finite(self) -> bool:
        """False when the gradient holds NaN or Inf."""
        return self.norm is None or math.isfinite(self.norm)


@dataclass(frozen=True)
class GradFlow(Analyzed):
    """Everything measured in one step: per-call module records and per-parameter norms.

    Its findings (`flow.findings()`) are `torchscope.grads.diagnose`'s.

    Attributes:
        index: the sampled step's index (optimizer steps counted from 0; backward calls
            without an optimizer); 0 for `gradient_flow`.
        modules: per-call records, in backward order (nearest the loss first); calls no
            gradient reached follow in forward order.
        params: one record per parameter of the model, in `named_parameters()` order.
        total_norm: the L2 norm over every parameter gradient, the number that
            `torch.nn.utils.clip_grad_norm_` returns; 0.0 when no parameter has a gradient.
        scale: the GradScaler scale that was divided out, or None without a scaler.
        micro_batches: forwards of the model seen in this step.
        backward_calls: backward passes that reached the parameters in this step.
        step: the training step torchscope ran (loss, its value, optimizer, AMP,
            accumulation); None for a step of the user's own loop (`watch_gradients`).
        fused_norms, eager_norms: gradients of module outputs and inputs whose norm the
            fused kernel computed (`torchscope._kernels`, one pass, float64 sums) and those
            eager `vector_norm` did (while the kernel was building, or where it cannot run);
            parameter norms come from one `torch._foreach_norm` per backward.
    """

    index: int
    modules: tuple[ModuleGradRecord, ...]
    params: tuple[ParamGradRecord, ...]
    total_norm: float
    scale: float | None = None
    micro_batches: int = 1
    backward_calls: int = 1
    step: StepInfo | None = None
    fused_norms: int = 0
    eager_norms: int = 0

    def get(self, module: str, call: int = 0, micro: int = 0) -> ModuleGradRecord:
        """The record of `module`'s `call`-th call in forward `micro`.

        Raises:
            KeyError: no such record.
        """
        for r in self.modules:
            if r.module == module and r.call == call and r.micro == micro:
                return r
        raise KeyError(f"no gradient record for {module!r} call {call} (micro-batch {micro})")

    def param(self, name: str) -> ParamGradRecord:
        """The record of parameter `name` (e.g. `fc.weight`).

        Raises:
            KeyError: no such parameter.
        """
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(f"no parameter {name!r}")

    def layers(self) -> list[str]:
        """Module names in backward order of their first reached call, then the others."""
        return list(dict.fromkeys(r.module for r in self.modules))

    def output_norms(self) -> dict[str, float | None]:
        """Per module, the norm of every output gradient of every call and micro-batch."""
        return _by_module((r.module, r.output_norm) for r in self.modules)

    def param_norms(self) -> dict[str, float | None]:
        """Per module (of the records, else every owner), the norm of its own parameters'
        gradients together; None when none of them has a gradient."""
        return _by_module((p.module, p.norm) for p in self.params)

    @property
    def finite(self) -> bool:
        """False when any recorded gradient holds NaN or Inf."""
        return math.isfinite(self.total_norm) and all(r.finite for r in self.modules) and \
            all(p.finite for p in self.params)


@dataclass(frozen=True)
class GradHistory:
    """A small time series of per-layer norms over sampled steps; never gradients.

    Attributes:
        steps: the sampled step indices, oldest first.
        layers: module names (columns), in the backward order of the first sample.
        output_norms: `[sample][layer]` grad-output norms; NaN where a layer had none.
        param_norms: `[sample][layer]` parameter-gradient norms; NaN where none.
        total_norms: per sample, the `clip_grad_norm_` total.
    """

    steps: tuple[int, ...]
    layers: tuple[str, ...]
    output_norms: tuple[tuple[float, ...], ...]
    param_norms: tuple[tuple[float, ...], ...]
    total_norms: tuple[float, ...]

    def __len__(self) -> int:
        return len(self.steps)

    def series(self, layer: str, kind: str = "output") -> list[float]:
        """One layer's norms over the samples; `kind` is "output" or "params".

        Raises:
            KeyError: unknown layer.
            TorchscopeError: `kind` is neither "output" nor "params".
        """
        if kind not in ("output", "params"):
            raise TorchscopeError(f"kind={kind!r} is not a series; expected 'output' or "
                                  "'params'.", fix="pass kind='output' or kind='params'.")
        if layer not in self.layers:
            raise KeyError(f"no layer {layer!r} in the history")
        j = self.layers.index(layer)
        return [row[j] for row in (self.output_norms if kind == "output" else self.param_norms)]
