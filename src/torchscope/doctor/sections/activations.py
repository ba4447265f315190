"""The `activations` section: one forward with `torchscope.capture`, then pure analysis.

It records every module's output (leaf modules are what the tables and plots show; the
containers are captured too so that `trace_nonfinite` can tell a producer from a carrier),
and flags what an experienced user looks for first: the module that makes the first NaN/Inf,
dead ReLU channels, outputs that do not vary, all-zero ReLU outputs, values near the dtype's
overflow, and activation scale drifting across depth.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torchscope.capture import (
    ActivationRecord,
    NonFiniteTrace,
    capture_activations,
    trace_nonfinite,
)
from torchscope.capture.records import TensorStats
from torchscope.doctor.section import DoctorOptions, Metric, Section
from torchscope.findings import Finding, Severity
from torchscope.models.target import ModelInputs

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["ActivationThresholds", "ActivationsResult", "ActivationsSection", "analyze_activations"]

# Modules whose weights set the scale of what follows; scale drift is read between these.
_WEIGHTED = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding)


@dataclass(frozen=True)
class ActivationThresholds:
    """When an activation statistic becomes a finding.

    Attributes:
        dead_warn: fraction of dead channels from which a dead-unit finding is a warning
            (any dead channel is reported; below this it is info).
        mostly_zero: zero fraction of a ReLU-family output reported as mostly zero.
        large_abs: absolute value above which an output is reported as large.
        low_precision_headroom: fraction of a 16-bit dtype's max above which an output is
            reported as near overflow.
        scale_drift: ratio of output std between the first and last weighted layers that is
            reported as scale drift (either direction).
    """

    dead_warn: float = 0.25
    mostly_zero: float = 0.95
    large_abs: float = 1e4
    low_precision_headroom: float = 0.5
    scale_drift: float = 100.0


@dataclass(frozen=True)
class ActivationsResult:
    """What the activations section measured.

    Attributes:
        records: one record per module call of the forward (containers included).
        leaves: qualified names of the leaf modules (what tables and plots show).
        weighted: leaf modules with weights (Linear, Conv, Embedding), in forward order.
        trace: where NaN/Inf first appeared.
        forward_ms: wall time of the captured forward, hooks included.
    """

    records: tuple[ActivationRecord, ...]
    leaves: frozenset[str]
    weighted: tuple[str, ...]
    trace: NonFiniteTrace
    forward_ms: float

    @property
    def leaf_records(self) -> tuple[ActivationRecord, ...]:
        """Leaf-module calls in the order they finished."""
        return tuple(r for r in self.records if r.module in self.leaves)

    @property
    def output_bytes(self) -> int:
        """Bytes of every leaf output tensor (what `store="tensors"` would have to keep)."""
        return sum(s.nbytes for r in self.leaf_records for s in r.outputs)

    @property
    def dead_units(self) -> int:
        """Dead channels over every ReLU-family output."""
        return sum(s.dead_units or 0 for r in self.leaf_records for s in r.outputs)


def _run(model: nn.Module, inputs: ModelInputs) -> ActivationsResult:
    childless = next(model.children(), None) is None
    # Every module, containers too: trace_nonfinite needs them to tell producers from carriers.
    # A model without children is captured as its own root (select=None does that).
    leaves = frozenset({""} if childless else {
        n for n, m in model.named_modules() if n and next(m.children(), None) is None})
    t0 = time.perf_counter()
    cap = capture_activations(model, inputs, select=None if childless else (lambda n, m: True))
    forward_ms = (time.perf_counter() - t0) * 1e3
    records = cap.records
    weighted_names = {n for n, m in model.named_modules() if isinstance(m, _WEIGHTED)}
    order: list[str] = []
    for r in records:
        if r.module in weighted_names and r.module not in order:
            order.append(r.module)
    return ActivationsResult(records, leaves, tuple(order), trace_nonfinite(records), forward_ms)


def _float_stats(r: ActivationRecord) -> list[TensorStats]:
    return [s for s in r.outputs if "float" in s.dtype or "complex" in s.dtype]


def analyze_activations(
    result: ActivationsResult, thresholds: ActivationThresholds | None = None
) -> list[Finding]:
    """Findings from one captured forward (pure; no torch calls on tensors).

    Args:
        result: the section's record.
        thresholds: when a statistic becomes a finding; defaults to `ActivationThresholds()`.
    """
    th = thresholds or ActivationThresholds()
    out: list[Finding] = []
    trace = result.trace
    if trace.producer is not None:
        p = trace.producer
        nan = sum(s.nan_count or 0 for s in p.outputs)
        inf = sum(s.inf_count or 0 for s in p.outputs)
        out.append(Finding(
            "activations.nonfinite", Severity.ERROR,
            f"{p.module or '<root>'} ({p.module_type}) produces the first NaN/Inf of the forward "
            f"from finite inputs; {len(trace.passers)} later module(s) carry it on",
            {"nan": nan, "inf": inf, "call": p.call, "carried_by": len(trace.passers),
             "other_producers": len(trace.other_producers)},
            fix=f"inspect {p.module_type}'s inputs: guard log/div/sqrt with an eps or clamp, and "
                "check for fp16 overflow (run `torchscope capture` with --select on it)",
            module=p.module or "<root>"))
    elif not trace.clean:
        out.append(Finding(
            "activations.nonfinite_input", Severity.ERROR,
            f"the model's input already holds NaN/Inf; {len(trace.passers)} module(s) carry it",
            {"carried_by": len(trace.passers)},
            fix="check the data pipeline: torch.isfinite(batch).all() before the forward"))

    seen: set[str] = set()
    for r in result.leaf_records:
        if r.module in seen:  # judge each module on its first call only
            continue
        seen.add(r.module)
        for s in _float_stats(r):
            name = r.module + s.path
            all_dead = s.dead_units is not None and s.channels and s.dead_units == s.channels
            if s.dead_units and s.channels:
                frac = s.dead_units / s.channels
                out.append(Finding(
                    "activations.dead_units",
                    Severity.WARNING if frac >= th.dead_warn else Severity.INFO,
                    f"{name} ({r.module_type}): {s.dead_units} of {s.channels} channels "
                    f"({100 * frac:.0f}%) are zero for every sample and position",
                    {"dead": s.dead_units, "channels": s.channels, "fraction": frac,
                     "zero_frac": s.zero_frac},
                    fix="lower the learning rate or use LeakyReLU/GELU; check the init and the "
                        "bias of the layer before it",
                    module=r.module))
            elif (s.dead_units is not None and s.zero_frac >= th.mostly_zero):
                out.append(Finding(
                    "activations.mostly_zero", Severity.WARNING,
                    f"{name} ({r.module_type}) outputs {100 * s.zero_frac:.0f}% zeros",
                    {"zero_frac": s.zero_frac},
                    fix="check the scale of the layer before it and its bias init",
                    module=r.module))
            if s.finite and s.is_close_to_constant() and not all_dead:
                out.append(Finding(
                    "activations.constant", Severity.WARNING,
                    f"{name} ({r.module_type}) outputs the same value {s.min:.4g} everywhere",
                    {"value": s.min, "numel": s.numel},
                    fix="a constant output carries no information: check its input and weights "
                        "(zero init? saturated?)",
                    module=r.module))
            if not s.finite:
                continue
            peak = max(abs(s.min), abs(s.max))
            limit = _low_precision_max(s.dtype)
            if limit is not None and peak >= th.low_precision_headroom * limit:
                out.append(Finding(
                    "activations.near_overflow", Severity.WARNING,
                    f"{name} reaches {peak:.3g}, {100 * peak / limit:.0f}% of {s.dtype}'s max",
                    {"max_abs": peak, "dtype_max": limit},
                    fix="keep this op in float32 (autocast excludes it) or rescale its input",
                    module=r.module))
            elif peak >= th.large_abs:
                out.append(Finding(
                    "activations.large", Severity.WARNING,
                    f"{name} ({r.module_type}) outputs values up to {peak:.3g}",
                    {"max_abs": peak, "std": s.std},
                    fix="normalise the input or add a normalisation layer; large activations "
                        "overflow in fp16 and slow training",
                    module=r.module))

    drift = _scale_drift(result)
    if drift is not None:
        first, last, ratio = drift
        if ratio >= th.scale_drift or ratio <= 1 / th.scale_drift:
            grows = ratio >= 1
            out.append(Finding(
                "activations.scale_drift", Severity.WARNING,
                f"activation std {'grows' if grows else 'shrinks'} "
                f"{ratio if grows else 1 / ratio:.0f}× from {first} to {last}",
                {"first": first, "last": last, "ratio": ratio},
                fix="check weight init (kaiming/xavier for the nonlinearity) or add normalisation",
                module=last))
    return out


def _low_precision_max(dtype: str) -> float | None:
    if dtype in ("torch.float16", "torch.bfloat16"):
        return float(torch.finfo(getattr(torch, dtype.split(".")[1])).max)
    return None


def _scale_drift(result: ActivationsResult) -> tuple[str, str, float] | None:
    """(first weighted layer, last weighted layer, std_last / std_first), when measurable."""
    stds: dict[str, float] = {}
    for r in result.leaf_records:
        if r.module in result.weighted and r.module not in stds and r.output is not None:
            s = r.output
            if s.finite and s.std > 0 and math.isfinite(s.std):
                stds[r.module] = s.std
    names = [n for n in result.weighted if n in stds]
    if len(names) < 2:
        return None
    return names[0], names[-1], stds[names[-1]] / stds[names[0]]


def _stats_json(s: TensorStats) -> dict[str, Any]:
    return {
        "path": s.path, "shape": list(s.shape), "dtype": s.dtype, "device": s.device,
        "numel": s.numel, "bytes": s.nbytes, "mean": s.mean, "std": s.std, "min": s.min,
        "max": s.max, "norm": s.norm, "zero_frac": s.zero_frac, "nan": s.nan_count,
        "inf": s.inf_count, "dead_units": s.dead_units, "channels": s.channels,
    }


class ActivationsSection(Section[ActivationsResult]):
    """Activations of one forward: shapes, statistics, dead units, NaN/Inf producer."""

    name = "activations"
    title = "Activations"
    capability = "torchscope.capture.capture_activations"

    def __init__(self, thresholds: ActivationThresholds | None = None) -> None:
        self.thresholds = thresholds or ActivationThresholds()

    def run(self, model: nn.Module, inputs: ModelInputs, options: DoctorOptions
            ) -> ActivationsResult:
        return _run(model, inputs)

    def analyze(self, result: ActivationsResult) -> list[Finding]:
        return analyze_activations(result, self.thresholds)

    def metrics(self, result: ActivationsResult) -> dict[str, Metric]:
        t = result.trace
        nonfinite = (1 if t.producer is not None else 0) + len(t.passers) + len(t.other_producers)
        return {
            "activations.nonfinite_modules": Metric(float(nonfinite), "lower", "count",
                                                    "module calls with NaN/Inf output"),
            "activations.dead_units": Metric(float(result.dead_units), "lower", "count",
                                             "dead ReLU channels"),
            "activations.output_bytes": Metric(float(result.output_bytes), "lower", "bytes",
                                               "bytes of leaf outputs"),
        }

    def to_json(self, result: ActivationsResult) -> dict[str, Any]:
        t = result.trace
        return {
            "forward_ms": result.forward_ms,
            "output_bytes": result.output_bytes,
            "dead_units": result.dead_units,
            "modules": [
                {"module": r.module, "type": r.module_type, "call": r.call,
                 "leaf": r.module in result.leaves, "inputs_finite": r.inputs_finite,
                 "outputs": [_stats_json(s) for s in r.outputs]}
                for r in result.records
            ],
            "nonfinite": {
                "producer": None if t.producer is None else t.producer.key,
                "passers": [r.key for r in t.passers],
                "other_producers": [r.key for r in t.other_producers],
            },
        }

    def plots(self, result: ActivationsResult) -> dict[str, Figure]:
        from torchscope.report.plots_doctor import activation_stats_plot, activation_zeros_plot

        return {"activations-stats": activation_stats_plot(result.leaf_records),
                "activations-zeros": activation_zeros_plot(result.leaf_records)}

    def html(self, result: ActivationsResult, plots: Mapping[str, str]) -> str:
        from torchscope.report.html import activations_fragment

        return activations_fragment(result, plots)


SECTION = ActivationsSection()
