"""Gradient flow: per-call gradient norms from tensor hooks, their history, and diagnosis."""

from torchscope.grads.analyze import (
    GradThresholds,
    diagnose,
    diagnose_history,
    find_dead,
    find_exploding,
    find_nonfinite,
    find_unreached,
    find_vanishing,
    layer_norms,
)
from torchscope.grads.collect import GradCollector
from torchscope.grads.flow import GradWatch, gradient_flow, watch_gradients
from torchscope.grads.records import (
    GradFlow,
    GradHistory,
    ModuleGradRecord,
    ParamGradRecord,
    TensorGrad,
)

__all__ = [
    "GradCollector",
    "GradFlow",
    "GradHistory",
    "GradThresholds",
    "GradWatch",
    "ModuleGradRecord",
    "ParamGradRecord",
    "TensorGrad",
    "diagnose",
    "diagnose_history",
    "find_dead",
    "find_exploding",
    "find_nonfinite",
    "find_unreached",
    "find_vanishing",
    "gradient_flow",
    "layer_norms",
    "watch_gradients",
]
