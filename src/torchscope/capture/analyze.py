"""Analysis of captured activations: pure functions from records to `Finding`s.

`analyze_activations` is the analyzer of `ActivationCapture`; read it as
`capture.findings()`. It works on any capture: a selection of modules, containers included
or not, one forward or many. It flags what an experienced user looks for first: the module
that makes the first NaN/Inf (in the first forward that had one), and, in the last forward,
dead ReLU units, saturated tanh and sigmoid units, model inputs never normalised, outputs
that do not vary, all-zero ReLU outputs, values near the dtype's overflow or merely large,
and activation scale drifting across the weighted layers.

Severity says how sure the finding is; docs/diagnosis.md gives each criterion and why the
thresholds sit where they do (checked against healthy initialisations of real
architectures in tests/zoo).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from torchscope._util import common_parent, fit_line, fmt_names, fmt_times, is_norm_type
from torchscope.capture.activations import ActivationCapture
from torchscope.capture.nonfinite import trace_nonfinite
from torchscope.capture.records import ActivationRecord, ActivationRecords, TensorStats
from torchscope.catalogue import entry
from torchscope.findings import Finding, Severity, analyzer, rank
from torchscope.hooks.compiled import ran_eagerly, unseen_forward

__all__ = ["ActivationThresholds", "analyze_activations", "before_weighted", "leaf_modules",
           "weighted_order"]

# Every finding made here, from its catalogue entry (torchscope.catalogue._activations).
_BATCH_STATS = entry("activations.batch_stats")
_COMPILED_EAGER = entry("activations.compiled_eager")
_CONSTANT = entry("activations.constant")
_DEAD_UNITS = entry("activations.dead_units")
_FROZEN_BATCH_NORM = entry("activations.frozen_batch_norm")
_INPUT_SCALE = entry("activations.input_scale")
_LARGE = entry("activations.large")
_MOSTLY_ZERO = entry("activations.mostly_zero")
_NEAR_OVERFLOW = entry("activations.near_overflow")
_NONFINITE = entry("activations.nonfinite")
_NONFINITE_BETWEEN = entry("activations.nonfinite_between")
_NONFINITE_INPUT = entry("activations.nonfinite_input")
_SATURATED = entry("activations.saturated")
_SCALE_DRIFT = entry("activations.scale_drift")
_UNSEEN_FORWARD = entry("activations.unseen_forward")


@dataclass(frozen=True)
class ActivationThresholds:
    """When an activation statistic becomes a finding.

    Attributes:
        dead_warn: fraction of dead channels from which a dead-unit finding is a warning
            (any dead channel is reported; below this it is info). Where a layer's input
            has shrunk to its biases (a deep ReLU stack under PyTorch's default init), each
            unit's sign is set by its bias and about half the units never fire: only well
            beyond that half is a layer likely dying.
        dead_min_observations: values per channel (samples × positions) a warning needs: a
            healthy unit that fires half the time is all-zero on n values with probability
            2**-n, so fewer than 8 values say little.
        mostly_zero: zero fraction of a ReLU-family output reported as mostly zero.
        large_abs: absolute value above which an output is reported as large.
        low_precision_headroom: fraction of a 16-bit dtype's max above which an output is
            reported as near overflow.
        scale_drift: ratio of output std between the first and last weighted layers
            (embeddings left out) that is reported as scale drift, either direction.
        consistency: smallest R² of the log-linear fit of std against depth for a drift
            across three or more layers to be a likely (warning) one; a drift between the
            ends without a steady trend is possible (info).
        saturated_warn: fraction of a bounded activation's values in its saturated tails
            (`TensorStats.saturated_frac`) from which it is a warning. A tanh layer under
            Kaiming's tanh gain (5/3) on unit-variance inputs has about 20 % there; with
            the pre-activations three times that wide, about 65 %.
        saturated_info: the fraction from which it is reported as info.
        input_rms: root mean square of a model input that a Linear or convolution takes as
            it is (`ActivationRecord.model_input`) from which it is reported as not
            normalised (a warning). Their default inits expect inputs of about unit scale;
            0-255 pixels have an RMS of about 140, standardised data of 1, and pixels in
            [0, 1] of about 0.5.
        batch_norm_values: values per channel (batch × positions) at or below which a
            BatchNorm normalising with the batch's statistics is reported (a warning):
            over 2 values its output is +a and -a per channel (a = γ, less where the two
            values lie within its eps), whatever they were; over a few, nearly so.
    """

    dead_warn: float = 0.75
    dead_min_observations: int = 8
    mostly_zero: float = 0.95
    large_abs: float = 1e4
    low_precision_headroom: float = 0.5
    scale_drift: float = 100.0
    consistency: float = 0.75
    saturated_warn: float = 0.5
    saturated_info: float = 0.25
    input_rms: float = 10.0
    batch_norm_values: int = 8


def leaf_modules(records: Iterable[ActivationRecord]) -> frozenset[str]:
    """The recorded modules with no recorded module inside them, and those with
    parameters of their own (`ActivationRecord.owns_params`): the layers of what was
    captured, which are judged (a container's output repeats its last child's; a module that
    computes with its own weights, such as `nn.MultiheadAttention` or a mixture of experts'
    expert weights, makes its output itself).

    A capture of every module gives the model's layers (those that ran); a capture of a
    selection gives the selection's innermost modules and its modules with parameters. A
    module with parameters that returns what its last child returned (`_passes_on`) is
    judged at that child, once.
    """
    records = list(records)
    holders: set[str] = set()
    by_order: dict[tuple[int, int], ActivationRecord] | None = None
    for r in records:
        if r.owns_params:
            if by_order is None:
                by_order = {(q.step, q.order): q for q in records}
            if not _passes_on(r, by_order.get((r.step, r.order - 1))):
                holders.add(r.module)
    leaves = _innermost(frozenset([r.module for r in records]))
    return leaves | holders if holders else leaves


@functools.lru_cache(maxsize=64)
def _innermost(names: frozenset[str]) -> frozenset[str]:
    """The `names` with no other of `names` inside them (the root "" holds every named
    one). Cached: a run monitor asks at every sampled step, for the same modules."""
    inner: set[str] = set()
    for name in names:
        if name:
            inner.add("")
            parts = name.split(".")
            inner.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return names - inner


def _passes_on(r: ActivationRecord, before: ActivationRecord | None) -> bool:
    """Whether module call `r` returned what the call that finished just before it, one of
    its children, returned: the same statistics (ViT's embeddings add their own position
    parameters, then return their dropout's output). Its output is then that child's, and
    judged there once."""
    if before is None or not r.module or not before.module.startswith(r.module + ".") or \
            len(before.outputs) != len(r.outputs) or not r.outputs:
        return False
    return all(_same_stats(a, b) for a, b in zip(before.outputs, r.outputs, strict=True))


def _same_stats(a: TensorStats, b: TensorStats) -> bool:
    def same(x: float | int | None, y: float | int | None) -> bool:
        return x == y or (isinstance(x, float) and isinstance(y, float) and
                          math.isnan(x) and math.isnan(y))

    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and all(
        same(getattr(a, f), getattr(b, f))
        for f in ("numel", "mean", "std", "min", "max", "norm", "zero_frac", "nan_count",
                  "inf_count"))


def weighted_order(records: Iterable[ActivationRecord], weighted: Iterable[str]
                   ) -> tuple[str, ...]:
    """The `weighted` modules (see `ActivationCapture.weighted`) in the order their first
    call finished."""
    wanted = set(weighted)
    return tuple(dict.fromkeys(r.module for r in records if r.module in wanted))


@analyzer(ActivationRecords)
@analyzer(ActivationCapture)
def analyze_activations(
    capture: ActivationCapture | ActivationRecords,
    thresholds: ActivationThresholds | None = None,
) -> list[Finding]:
    """Findings from a capture (pure: no torch calls on tensors), most severe first.

    Args:
        capture: a finished (or open) `ActivationCapture`, or its `result()`.
        thresholds: when a statistic becomes a finding; defaults to `ActivationThresholds()`.
    """
    th = thresholds or ActivationThresholds()
    records = capture.records
    if not records:
        if isinstance(capture, ActivationCapture) and not capture.forwards:
            return [unseen_forward(
                _UNSEEN_FORWARD, "no forward of the watched modules ran "
                "through the activation capture's hooks while it was open: nothing was "
                "recorded, which is no sign of health", {"forwards": 0})]
        return []
    out = _nonfinite(records)
    last = [r for r in records if r.step == records[-1].step]
    leaves = leaf_modules(last)
    judged = [r for r in last if r.module in leaves]
    out += _per_module(judged, th, capture.zero_init)
    out += _saturated(judged, capture.weighted, th)
    out += _input_scale(last, th)
    out += _batch_stats(judged, th)
    out += _frozen_batch_norm(judged)
    out += _scale_drift(judged, weighted_order(judged, capture.weighted), th)
    if isinstance(capture, ActivationCapture):
        out += ran_eagerly(_COMPILED_EAGER, capture.compiled,
                           "the activation capture")
    return rank(out)


def before_weighted(records: Iterable[ActivationRecord], weighted: Iterable[str]
                    ) -> frozenset[str]:
    """The modules of one forward's `records` whose first call finished before a `weighted`
    module's last call: those whose output a weighted layer may still take in, as a hidden
    layer's is. A model's last activation (a classifier's sigmoid, a generator's tanh) is
    not among them."""
    records = list(records)
    wanted = set(weighted)
    last = max((r.order for r in records if r.module in wanted), default=-1)
    return frozenset(r.module for r in records if r.call == 0 and r.order < last)


def _saturated(judged: Sequence[ActivationRecord], weighted: Iterable[str],
               th: ActivationThresholds) -> list[Finding]:
    """`activations.saturated`: bounded activations (tanh, sigmoid) whose values sit in the
    tails where they pass almost no gradient back. Only those a weighted layer follows in
    the forward (`before_weighted`): a model's last sigmoid or tanh saturates as its
    predictions grow sure (and a loss on its logits gets the gradient anyway)."""
    hidden = before_weighted(judged, weighted)
    out: list[Finding] = []
    seen: set[str] = set()
    for r in judged:
        if r.module in seen or r.module not in hidden:
            continue
        seen.add(r.module)
        # One finding per module, at its most saturated output (an nn.RNN's sequence and
        # final state are both its tanh's).
        measured = [s for s in r.outputs if s.saturated_frac is not None and s.numel]
        if not measured:
            continue
        s = max(measured, key=lambda s: s.saturated_frac or 0.0)
        frac = s.saturated_frac or 0.0
        per_unit = s.numel // s.channels if s.channels else 0
        units = s.saturated_units if per_unit >= th.dead_min_observations else 0
        unit_frac = units / s.channels if units and s.channels else 0.0
        if frac < th.saturated_info and not units:
            continue
        warn = frac >= th.saturated_warn or unit_frac >= th.dead_warn
        name = (r.module or "<root>") + s.path
        out.append(_SATURATED.finding(
            Severity.WARNING if warn else Severity.INFO,
            f"{name} ({r.module_type}): {100 * frac:.0f}% of its values sit where its "
            "gradient is below 5% of its peak"
            + (f"; {units} of {s.channels} units do in every sample and position"
               if units else ""),
            {"saturated_frac": frac, "saturated_units": units, "channels": s.channels,
             "unit_dim": s.unit_dim, "values_per_unit": per_unit},
            fix=_saturated_fix(r.module_type),
            module=r.module))
    return out


def _input_scale(records: Sequence[ActivationRecord], th: ActivationThresholds
                 ) -> list[Finding]:
    """`activations.input_scale`: a model input far from unit scale that a Linear or
    convolution takes as it is (not one the model rescales itself first): over all its
    values, or in one of its features (a column of a table, a channel of an image) whose
    RMS alone is that far, beside others at unit scale."""
    out = []
    for r in records:
        s = r.model_input
        if s is None or r.call or not s.finite or s.numel < 2:
            continue
        # The population mean square from the unbiased std: (n - 1) / n of its square.
        rms = math.sqrt(s.mean ** 2 + s.std ** 2 * (s.numel - 1) / s.numel)
        top = s.feature_rms_max
        wild = top is not None and math.isfinite(top) and top >= th.input_rms
        if rms < th.input_rms and not wild:
            continue
        evidence: dict[str, float | int | str | bool | None] = {
            "mean": s.mean, "std": s.std, "min": s.min, "max": s.max, "rms": rms,
            "shape": "x".join(map(str, s.shape))}
        if s.feature_dim is not None:
            evidence.update(feature_dim=s.feature_dim, feature=s.feature_max_index,
                            feature_rms=top, median_feature_rms=s.feature_rms_median)
        what = "column" if s.feature_dim == -1 else "channel"
        median = s.feature_rms_median
        if not wild or median is None or median >= th.input_rms:  # all of it, not one
            summary = (f"{r.module} ({r.module_type}) takes the model's input as it is, at "
                       f"mean {s.mean:.3g} and std {s.std:.3g} (from {s.min:.3g} to "
                       f"{s.max:.3g}): its default init expects inputs of about unit scale")
        else:
            count = s.shape[s.feature_dim] if s.feature_dim is not None and s.shape else 0
            summary = (f"{r.module} ({r.module_type}) takes the model's input as it is, "
                       f"whose {what} {s.feature_max_index} (of {count}) has RMS {top:.3g} "
                       f"while the median {what}'s is {median:.3g}: its default "
                       "init expects every input feature at about unit scale")
        out.append(_INPUT_SCALE.finding(Severity.WARNING, summary, evidence, module=r.module))
    return out


def _batch_stats(judged: Sequence[ActivationRecord], th: ActivationThresholds
                 ) -> list[Finding]:
    """`activations.batch_stats`: BatchNorm layers that normalised each channel with the
    batch's own statistics over `batch_norm_values` values or fewer (the batch times the
    positions). Their outputs lie within ±sqrt(n - 1) of zero before γ and β, and their
    gradients are large: transformers' MobileNetV2 on 32-pixel images in batches of 4
    reaches a 1×1 map in its last stages, where each channel is normalised over 4 values,
    and its gradient grows 32× toward the input. One finding for all of them, named by
    the fewest values."""
    few: list[tuple[int, ActivationRecord]] = []
    seen: set[str] = set()
    for r in judged:
        s = r.output
        if not r.batch_stats or r.module in seen or s is None or len(s.shape) < 2 or \
                not s.shape[1]:
            continue
        seen.add(r.module)
        # Per channel: N × positions, on every rank a SyncBatchNorm gathers (each rank's
        # batch taken as this one's size).
        values = s.numel // s.shape[1] * r.batch_ranks
        if 0 < values <= th.batch_norm_values:
            few.append((values, r))
    if not few:
        return []
    few.sort(key=lambda vr: vr[0])
    values, r = few[0]
    names = [x.module for _, x in few]
    batch = r.output.shape[0] if r.output is not None else 0
    ranks = r.batch_ranks
    positions = values // (batch * ranks) if batch else 0
    # n values normalised by their own mean and (biased) deviation lie within ±sqrt(n - 1)
    # of zero, whatever they were: ±1 exactly for two.
    bound = "±1 exactly" if values == 2 else f"±{math.sqrt(values - 1):.2g}"
    # After a pool to one position only the batch counts: larger inputs cannot help there.
    more = "a larger batch per device (or nn.SyncBatchNorm across devices); larger " \
        "inputs do not help, as it sees one position per sample" if positions == 1 else \
        "a larger batch per device (or nn.SyncBatchNorm across devices), or larger inputs"
    return [_BATCH_STATS.finding(
        Severity.WARNING,
        f"{r.module} ({r.module_type}) normalises each channel over {values} values "
        f"(a batch of {batch} × {positions} positions"
        + (f" × {ranks} ranks" if ranks > 1 else "") + ")"
        + (f", and {len(few) - 1} more BatchNorm layer(s) over {th.batch_norm_values} or "
           "fewer" if len(few) > 1 else "")
        + f": batch statistics over so few values leave each normalised value within "
        f"{bound} of zero (times γ, plus β), whatever the input, and make its gradients "
        "large",
        {"values": values, "batch": batch, "ranks": ranks, "layers": len(few),
         "modules": ", ".join(names)},
        fix=f"give BatchNorm more values per channel: {more}; or replace it with "
            "GroupNorm/LayerNorm, which do not depend on the batch; when fine-tuning with "
            "small batches, keep BatchNorm in eval mode (its running statistics)",
        module=r.module)]


def _frozen_batch_norm(judged: Sequence[ActivationRecord]) -> list[Finding]:
    """`activations.frozen_batch_norm`: BatchNorm layers whose weights are frozen but that
    ran in training mode (`ActivationRecord.frozen`). `requires_grad=False` stops their
    weights, not their running statistics, which move toward each batch's (momentum 0.1),
    while their outputs use the batch's own: a backbone frozen this way still changes, and
    behaves differently in training and in evaluation. The usual cause: `model.train()`
    (which the HF Trainer calls at every step, and Lightning at every epoch) puts back into
    training mode a backbone the user set to eval once."""
    names = list(dict.fromkeys(r.module for r in judged if r.frozen))
    if not names:
        return []
    where = common_parent(names) if len(names) > 1 else names[0]
    return [_FROZEN_BATCH_NORM.finding(
        Severity.WARNING,
        f"{len(names)} BatchNorm layer(s) with frozen weights"
        + (f" under {where}" if where and len(names) > 1 else "")
        + f" ran in training mode ({fmt_names(names)}): requires_grad=False stops their "
        "weights, not their running statistics, which move with every batch, and their "
        "outputs use each batch's own statistics: the frozen part of the model still "
        "changes",
        {"layers": len(names), "modules": ", ".join(names), "under": where},
        module=where or names[0])]


def _saturated_fix(module_type: str) -> str:
    if module_type in ("RNN", "RNNCell"):
        # Its own weights make its pre-activations: the input's and the recurrent one's.
        return ("shrink its pre-activations: initialise weight_hh with nn.init.orthogonal_ "
                "and weight_ih for tanh (nn.init.xavier_uniform_ with "
                "gain=nn.init.calculate_gain('tanh')), or lower the learning rate; "
                "saturated units pass almost no gradient back through time")
    gain = "tanh" if "tanh" in module_type.lower() or module_type == "Softsign" \
        else "sigmoid"
    return ("shrink the pre-activations: initialise the layer before it for this "
            f"nonlinearity (nn.init.xavier_uniform_ with "
            f"gain=nn.init.calculate_gain('{gain}')), put a normalisation layer before it, "
            "or lower the learning rate; saturated units pass almost no gradient back")


def _nonfinite(records: Sequence[ActivationRecord]) -> list[Finding]:
    """The NaN/Inf producer of the first forward whose outputs held NaN/Inf."""
    first = next((r.step for r in records if not r.finite), None)
    if first is None:
        return []
    trace = trace_nonfinite(records, step=first)
    if trace.producer is not None:
        p = trace.producer
        nan = sum(s.nan_count or 0 for s in p.outputs)
        inf = sum(s.inf_count or 0 for s in p.outputs)
        return [_NONFINITE.finding(
            Severity.ERROR,
            f"{p.module or '<root>'} ({p.module_type}) produces the first NaN/Inf of the forward "
            f"from finite inputs; {len(trace.passers)} later module(s) carry it on",
            {"nan": nan, "inf": inf, "call": p.call, "carried_by": len(trace.passers),
             "other_producers": len(trace.other_producers), "step": first},
            fix=f"inspect {p.module_type}'s inputs: guard log/div/sqrt with an eps or clamp, and "
                "check for fp16 overflow (run `torchscope capture` with --select on it)",
            module=p.module or "<root>")]
    if trace.made_between:
        # The input was finite and no recorded call made it: code between them did.
        carrier, after = trace.passers[0], trace.entered_after
        parent = carrier.module.rpartition(".")[0]
        where = f"after {after.label} and before {carrier.label}" if after is not None \
            else f"before {carrier.label}"
        return [_NONFINITE_BETWEEN.finding(
            Severity.ERROR,
            f"NaN/Inf first appears {where}, in code no captured module covers (the "
            f"model's input is finite): {carrier.label}, a {carrier.module_type}, takes it in "
            f"and {len(trace.passers) - 1} later module(s) carry it on",
            {"carried_by": len(trace.passers), "first_carrier": carrier.module,
             "after": None if after is None else after.module, "step": first},
            fix=f"look at the plain tensor code in {parent or 'the model'}'s forward between "
                "those calls (log, sqrt, division, exp, a softmax over an all-masked row): "
                "guard it with an eps or clamp; or capture with select= covering any module "
                "left out there",
            module=carrier.module)]
    known = trace.inputs_finite is False
    return [_NONFINITE_INPUT.finding(
        Severity.ERROR,
        ("the model's input already holds NaN/Inf" if known else
         "NaN/Inf reaches the captured modules from outside them (the model's input, or "
         "code before them)") + f"; {len(trace.passers)} module(s) carry it",
        {"carried_by": len(trace.passers), "step": first, "input_checked": known})]


def _per_module(judged: Sequence[ActivationRecord], th: ActivationThresholds,
                zero_init: frozenset[str] = frozenset()) -> list[Finding]:
    out: list[Finding] = []
    seen: set[str] = set()
    large: list[tuple[str, ActivationRecord, float, float]] = []  # (name, record, peak, std)
    zeroed: list[tuple[str, ActivationRecord, float]] = []  # (name, record, value)
    constants: list[tuple[ActivationRecord, Finding]] = []
    for r in judged:
        if r.module in seen:  # judge each module on its first call only
            continue
        seen.add(r.module)
        for s in (o for o in r.outputs if "float" in o.dtype or "complex" in o.dtype):
            name = (r.module or "<root>") + s.path
            all_dead = s.dead_units is not None and s.channels and s.dead_units == s.channels
            frac = s.dead_units / s.channels if s.dead_units and s.channels else 0.0
            seen_per_channel = s.numel // s.channels if s.channels else 0
            few = seen_per_channel < th.dead_min_observations
            if frac and (frac >= th.dead_warn or not few):  # a few units on a few values: chance
                likely = frac >= th.dead_warn and not few
                out.append(_DEAD_UNITS.finding(
                    Severity.WARNING if likely else Severity.INFO,
                    f"{name} ({r.module_type}): {s.dead_units} of {s.channels} "
                    + ("units (the last dim; " if s.unit_dim == -1 else "channels (")
                    + f"{100 * frac:.0f}%) are zero for every sample and position"
                    + ("" if likely else
                       f" (only {seen_per_channel} values per channel: may be chance)" if few
                       else ": possibly a loss of capacity"),
                    {"dead": s.dead_units, "channels": s.channels, "unit_dim": s.unit_dim,
                     "fraction": frac,
                     "zero_frac": s.zero_frac, "values_per_channel": seen_per_channel},
                    module=r.module))
            elif s.dead_units is not None and s.zero_frac >= th.mostly_zero:
                out.append(_MOSTLY_ZERO.finding(
                    Severity.WARNING,
                    f"{name} ({r.module_type}) outputs {100 * s.zero_frac:.0f}% zeros",
                    {"zero_frac": s.zero_frac},
                    module=r.module))
            constant = s.finite and s.is_close_to_constant() and not all_dead
            if constant and r.module in zero_init:
                zeroed.append((name, r, s.min))
            elif constant:
                constants.append((r, _constant(name, r, s)))
            if not s.finite:
                continue
            peak = max(abs(s.min), abs(s.max))
            limit = _low_precision_max(s.dtype)
            if limit is not None and peak >= th.low_precision_headroom * limit:
                out.append(_NEAR_OVERFLOW.finding(
                    Severity.WARNING,
                    f"{name} reaches {peak:.3g}, {100 * peak / limit:.0f}% of {s.dtype}'s max",
                    {"max_abs": peak, "dtype_max": limit},
                    module=r.module))
            elif peak >= th.large_abs:
                large.append((name, r, peak, s.std))
    if zeroed:
        out.append(_zero_init_constants(zeroed))
    out += _same_constants(constants)
    if large:
        # One finding where the values first get large (forward order); the modules after it
        # that carry them on are counted, not repeated.
        name, r, peak, std = large[0]
        top = max(p for _, _, p, _ in large)
        out.append(_LARGE.finding(
            Severity.WARNING,
            f"{name} ({r.module_type}) outputs values up to {peak:.3g}"
            + (f"; {len(large) - 1} later module(s) too, up to {top:.3g}" if len(large) > 1
               else ""),
            {"max_abs": peak, "std": std, "later_modules": len(large) - 1, "largest": top},
            module=r.module))
    return out


def _constant(name: str, r: ActivationRecord, s: TensorStats) -> Finding:
    """`activations.constant` for one output. A value of exactly 1/N over a last dimension
    of N is a softmax with all scores equal (attention probabilities): over N > 1 it mixes
    every position alike and still passes gradient to the scores, as at an init whose scores
    are near zero (info); over one element it is 1 whatever the scores, which then get no
    gradient (warning)."""
    evidence: dict[str, float | int | str | bool | None] = {"value": s.min, "numel": s.numel}
    n = s.shape[-1] if s.shape else 0
    # Where attention probabilities show: a Softmax module, the dropout after one, or a
    # module of an attention (a sigmoid stuck at 0.5 over a last dimension of 2 is no softmax).
    probs = r.module_type in ("Softmax", "Dropout") or re.search(
        r"(^|[._])att", r.module.lower()) is not None  # attention, self_attn; not flatten
    if probs and n and abs(s.min * n - 1) < 1e-4:
        evidence["softmax_over"] = n
        if n > 1:
            return _CONSTANT.finding(
                Severity.INFO,
                f"{name} ({r.module_type}) outputs {s.min:.4g} = 1/{n} everywhere, uniform "
                f"over its last dimension of {n}: a softmax whose scores are all equal (an "
                "attention that weighs every position alike)",
                evidence,
                fix="usual at init while the scores are near zero, and their projections still "
                    "learn; if it stays uniform in training, check the scale of what the "
                    "scores are computed from.",
                module=r.module)
        return _CONSTANT.finding(
            Severity.WARNING,
            f"{name} ({r.module_type}) outputs 1 everywhere over a last dimension of 1: a "
            "softmax over one element is 1 whatever its scores, which get no gradient",
            evidence,
            fix="check the length of what it attends over: an attention over a sequence of "
                "length 1 (an input smaller than the model expects, one patch left) trains "
                "no query or key.",
            module=r.module)
    at_zero = _AT_ZERO.get(r.module_type)
    if at_zero is not None and abs(s.min - at_zero) <= 1e-6:
        # What the activation gives for an input of 0: its input is 0, or has collapsed.
        evidence["at_zero_input"] = True
        return _CONSTANT.finding(
            Severity.WARNING,
            f"{name} ({r.module_type}) outputs the same value {s.min:.4g} everywhere, its "
            "value at 0", evidence,
            fix="its input is zero everywhere, or vanishingly small: the activations "
                "before it have collapsed (see activations.scale_drift) or a layer feeding "
                "it outputs zeros",
            module=r.module)
    return _CONSTANT.finding(
        Severity.WARNING,
        f"{name} ({r.module_type}) outputs the same value {s.min:.4g} everywhere", evidence,
        module=r.module)


# What an elementwise activation gives for an input of 0.
_AT_ZERO: dict[str, float] = {
    "Sigmoid": 0.5, "Hardsigmoid": 0.5, "Tanh": 0.0, "Softsign": 0.0, "SiLU": 0.0,
    "GELU": 0.0, "Mish": 0.0, "Hardswish": 0.0, "ELU": 0.0, "SELU": 0.0, "CELU": 0.0,
    "LeakyReLU": 0.0, "Hardtanh": 0.0,
}


def _same_constants(constants: Sequence[tuple[ActivationRecord, Finding]]) -> list[Finding]:
    """The `activations.constant` warnings, with two or more of one module type and one
    value made one finding: EfficientNet's seven squeeze-excitation gates at sigmoid(0)
    are one cause, not seven."""
    groups: dict[tuple[str, float | None, str], list[tuple[ActivationRecord, Finding]]] = {}
    out: list[Finding] = []
    for r, f in constants:
        value = f.evidence.get("value")
        if f.severity < Severity.WARNING or not isinstance(value, float) or \
                "softmax_over" in f.evidence:
            out.append(f)
            continue
        groups.setdefault((r.module_type, value, f.fix), []).append((r, f))
    for (module_type, value, fix), members in groups.items():
        if len(members) == 1:
            out.append(members[0][1])
            continue
        names = [r.module or "<root>" for r, _ in members]
        first = members[0][1]
        out.append(_CONSTANT.finding(
            Severity.WARNING,
            f"{len(members)} {module_type} modules ({fmt_names(names, 2)}) output the "
            f"same value {value:.4g} everywhere"
            + (", their value at 0" if first.evidence.get("at_zero_input") else ""),
            {**first.evidence, "modules": ", ".join(names), "count": len(members)},
            fix=fix,
            module=members[0][0].module))
    return out


def _zero_init_constants(zeroed: Sequence[tuple[str, ActivationRecord, float]]) -> Finding:
    """One finding for the outputs that are constant because their module's own parameters
    are all zero: a peft model has one LoRA B per adapted projection."""
    name, r, value = zeroed[0]
    names = [n for n, _, _ in zeroed]
    values = {v for _, _, v in zeroed}
    what = f"{name} ({r.module_type}) outputs {value:.4g}" if len(zeroed) == 1 else \
        f"{len(zeroed)} modules ({fmt_names(names)}) output " \
        + (f"{value:.4g}" if len(values) == 1 else "a constant")
    own = "its own parameters are" if len(zeroed) == 1 else "their own parameters are"
    return _CONSTANT.finding(
        Severity.INFO,
        f"{what} everywhere: {own} all zero, a deliberate zero init (LoRA's B, a residual "
        "branch's last norm gain, a position-bias table)",
        {"value": value if len(values) == 1 else None, "modules": ", ".join(names),
         "count": len(zeroed), "zero_init": True},
        fix="",
        module=r.module)


def _low_precision_max(dtype: str) -> float | None:
    if dtype in ("torch.float16", "torch.bfloat16"):
        return float(torch.finfo(getattr(torch, dtype.split(".")[1])).max)
    return None


def _scale_drift(judged: Sequence[ActivationRecord], weighted: Sequence[str],
                 th: ActivationThresholds) -> list[Finding]:
    """Output std of the last weighted layer over that of the first, when measurable.

    Embeddings are left out: a lookup's output scale is its init's, unrelated to depth. A
    drift between two layers, or a steady one (a log-linear fit with R² >= `consistency`)
    across more, is a warning; a drift between the ends with scatter in between is info.
    """
    stds: dict[str, float] = {}
    for r in judged:
        if r.module in weighted and r.module not in stds and r.output is not None and \
                "Embedding" not in r.module_type:
            s = r.output
            if s.finite and s.std > 0 and math.isfinite(s.std):
                stds[r.module] = s.std
    names = [n for n in weighted if n in stds]
    if len(names) < 2:
        return []
    first, last = names[0], names[-1]
    ratio = stds[last] / stds[first]
    if 1 / th.scale_drift < ratio < th.scale_drift:
        return []
    _, r2 = fit_line(range(len(names)), [math.log10(stds[n]) for n in names])
    steady = len(names) == 2 or r2 >= th.consistency
    grows = ratio >= 1
    small, norms = _small_norm_gains(judged, first, last)
    if grows:
        small = []  # a gain far above 1 is no growth: the next norm layer undoes it
    fix = "check weight init (kaiming/xavier for the nonlinearity) or add normalisation"
    if small:
        # The layers meant to hold the scale at 1 set it. The first one is the cause; later
        # ones read smaller still once their input variance falls below their eps.
        onset, std = small[0]
        fix = (f"{len(small)} of the {norms} normalization layers between them output std "
               f"below {_NORM_GAIN_SMALL:g}, from {onset} ({std:.2g}) on: while a norm layer "
               "normalizes, its output std is the RMS of its weight (γ), so these gains start "
               "near zero, not at 1; initialise them with nn.init.ones_(norm.weight) (zero "
               "only a residual branch's last norm)")
    return [_SCALE_DRIFT.finding(
        Severity.WARNING if steady else Severity.INFO,
        f"{'' if steady else 'possible drift: '}activation std "
        f"{'grows' if grows else 'shrinks'} {fmt_times(ratio if grows else 1 / ratio)} "
        f"from {first} to {last}" + ("" if len(names) == 2 else
                                     f" over {len(names)} weighted layers (fit R² {r2:.2f})"),
        {"first": first, "last": last, "ratio": ratio, "layers": len(names), "r2": r2,
         "norms_small": len(small), "norms": norms,
         "norm_onset": small[0][0] if small else None},
        fix=fix,
        module=last)]


# A normalization layer whose output std is below this has a gain near zero. (A gain far
# above 1 is no drift: the next norm layer takes its scale back out.)
_NORM_GAIN_SMALL = 0.1


def _small_norm_gains(judged: Sequence[ActivationRecord], first: str, last: str
                      ) -> tuple[list[tuple[str, float]], int]:
    """The normalization layers between `first` and `last` (in `judged` order) whose output
    std is below `_NORM_GAIN_SMALL`, with that std, and how many normalization layers lie
    there. Below their eps (EfficientNet's is 1e-3) norm layers pass a shrinking input on
    shrunk further by their gains, so such gains compound into a drift across depth. A
    constant output (a residual branch's zero-initialised last norm) is a deliberate zero,
    not counted."""
    order = [r.module for r in judged]
    lo, hi = order.index(first), order.index(last)
    seen: dict[str, float | None] = {}
    for r in judged[lo:hi + 1]:
        s = r.output
        if r.module in seen or not is_norm_type(r.module_type) or s is None:
            continue
        seen[r.module] = s.std if s.finite and s.std > 0 and math.isfinite(s.std) else None
    small = [(n, std) for n, std in seen.items() if std is not None and std < _NORM_GAIN_SMALL]
    return small, len(seen)
