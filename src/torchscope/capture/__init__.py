"""Activation capture: forward hooks that record per-call statistics, and their analysis.

    capture = capture_activations(model, x)         # one forward (or a Step's, under AMP)
    with watch_activations(model) as capture: ...   # every forward of your own loop
    capture.records, capture.get("conv1"), capture.findings()
    capture.gather()                                # every rank's records on rank 0 (torchrun)
"""

from torchscope.capture.activations import (
    ActivationCapture,
    capture_activations,
    watch_activations,
)
from torchscope.capture.analyze import ActivationThresholds
from torchscope.capture.nonfinite import NonFiniteTrace, trace_nonfinite
from torchscope.capture.records import ActivationRecord, ActivationRecords, TensorStats

__all__ = [
    "ActivationCapture",
    "ActivationRecord",
    "ActivationRecords",
    "ActivationThresholds",
    "NonFiniteTrace",
    "TensorStats",
    "capture_activations",
    "trace_nonfinite",
    "watch_activations",
]
