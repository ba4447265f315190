"""Activation capture: forward hooks that record per-call statistics, and their analysis.

    capture = capture_activations(model, x)         # one forward (or a Step's, under AMP)
    with watch_activations(model) as capture: ...   # every forward of your own loop
    capture.records, capture.get("conv1"), capture.findings()
"""

from torchscope.capture.activations import (
    ActivationCapture,
    capture_activations,
    watch_activations,
)
from torchscope.capture.analyze import ActivationThresholds
from torchscope.capture.nonfinite import NonFiniteTrace, trace_nonfinite
from torchscope.capture.records import ActivationRecord, TensorStats

__all__ = [
    "ActivationCapture",
    "ActivationRecord",
    "ActivationThresholds",
    "NonFiniteTrace",
    "TensorStats",
    "capture_activations",
    "trace_nonfinite",
    "watch_activations",
]
