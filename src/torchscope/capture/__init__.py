"""Activation capture: forward hooks that record per-call statistics, and their analysis."""

from torchscope.capture.activations import ActivationCapture, activations, capture_activations
from torchscope.capture.nonfinite import NonFiniteTrace, trace_nonfinite
from torchscope.capture.records import ActivationRecord, TensorStats

__all__ = [
    "ActivationCapture",
    "ActivationRecord",
    "NonFiniteTrace",
    "TensorStats",
    "activations",
    "capture_activations",
    "trace_nonfinite",
]
