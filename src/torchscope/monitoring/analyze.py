"""Findings about a training run: pure functions from a `RunRecord` to `Finding`s.

`analyze_run` is the analyzer of `RunRecord` (read it as `record.findings()`). It speaks
about the run as a whole, from the sampled series: gradients that fell or grew between the
start and the end of the run (against the other layers: every gradient shrinks as a model
converges), activation scale drift, dead units that grew, where NaN/Inf first appeared,
steps the GradScaler skipped and a run that stopped. It adds the capabilities' own analyzers
on the run's data: the last sample's gradient diagnosis (`torchscope.grads.diagnose`), the
total-norm history (`diagnose_history`), the last sampled forward's activations and the
memory watch's findings.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from torchscope._util import fmt_times
from torchscope.capture.analyze import ActivationThresholds, before_weighted
from torchscope.catalogue import entry
from torchscope.errors import TorchscopeError
from torchscope.findings import Finding, Severity, analyzer, declared, rank
from torchscope.grads import GradHistory
from torchscope.grads.analyze import (
    diagnose,
    diagnose_history,
    find_broken_update,
    find_cleared,
    find_loss_broadcast,
    find_loss_on_probabilities,
    find_no_step,
    find_no_update,
    find_not_optimized,
    find_not_zeroed,
    find_padding_in_loss,
    find_update_ratio,
    layer_scaled,
    unit_name,
)
from torchscope.grads.records import NOT_REACHED, RAN_NO_GRAD, ParamGradRecord, rms
from torchscope.hooks.compiled import ran_eagerly
from torchscope.monitoring.records import LayerSeries, RunRecord

__all__ = ["RunThresholds", "analyze_run", "change", "grad_history"]

_ACTIVATION_DRIFT = entry("run.activation_drift")
_COMPILED_EAGER = entry("run.compiled_eager")
_DEAD_EXPERTS = entry("run.dead_experts")
_DEAD_UNITS = entry("run.dead_units")
_EVAL_MODE = entry("run.eval_mode")
_FP16_UNSCALED = entry("run.fp16_unscaled")
_GRAD_FELL = entry("run.grad_fell")
_GRAD_GREW = entry("run.grad_grew")
_GRAD_NORM_OVERFLOW = entry("run.grad_norm_overflow")
_GRAPH_CUT = entry("run.graph_cut")
_ACCUMULATION = entry("run.accumulation_undivided")
_LOSS_SPIKE = entry("run.loss_spike")
_LOSS_UNSEEN = entry("run.loss_unseen")
_NONFINITE = entry("run.nonfinite")
_PADDING_IN_LOSS = entry("run.padding_in_loss")
_SAME_BATCH = entry("run.same_batch")
_SATURATED = entry("run.saturated")
_SKIPPED_STEPS = entry("run.skipped_steps")
_STOPPED = entry("run.stopped")
_WEIGHT_SCALE = entry("run.weight_scale")


@dataclass(frozen=True)
class RunThresholds:
    """Where the run's findings draw their lines.

    Attributes:
        window: fraction of the samples, at the start and at the end, whose median is
            compared (at least one sample each).
        min_samples: samples a series needs before a trend is judged.
        change_ratio: a layer's gradient that changes this many times between the windows
            is reported.
        relative_ratio: ...and is a warning when it also changes this many times more than
            the median layer (the layer diverges from the rest of the model); a change the
            whole model shares is reported once, as info when it falls (training converging)
            and as a warning when it grows.
        drift_info: output std that changes this many times is reported (info); when the
            median layer's does, the whole model drifted: one finding, and a layer only
            where it went `relative_ratio` times further.
        drift_warn: ...and this many times is a warning.
        dead_warn: fraction of dead channels at the end of the run that is a warning...
        dead_growth: ...when it grew by at least this fraction since the start.
        skipped_warn: fraction of steps the GradScaler skipped that is a warning (the first
            steps of a run calibrate the scale; a few skips are normal).
        expert_samples: sampled steps in which an expert of a mixture of experts got no
            gradient, every one of them, before it is called dead (few tokens per step can
            miss an expert now and then).
        saturated_growth: growth of a bounded activation's saturated fraction (tanh,
            sigmoid) since the start of the run that is a warning, when it ends at
            `ActivationThresholds.saturated_warn` or more.
        same_batch_pairs: pairs of consecutive steps compared (`RunRecord.same_inputs`),
            every one with the same input, before the run is said to train on one batch.
    """

    window: float = 0.1
    min_samples: int = 4
    change_ratio: float = 10.0
    relative_ratio: float = 10.0
    drift_info: float = 10.0
    drift_warn: float = 100.0
    dead_warn: float = 0.25
    dead_growth: float = 0.1
    skipped_warn: float = 0.05
    expert_samples: int = 5
    saturated_growth: float = 0.25
    same_batch_pairs: int = 3


def _name(module: str | None) -> str:
    return "<root>" if module == "" else str(module)


def change(series: LayerSeries, layer: str, window: float = 0.1,
           skip_steps: frozenset[int] = frozenset()) -> tuple[int, float, int, float] | None:
    """(first step, median at the start, last step, median at the end) of one layer's finite
    positive values, or None with fewer than two of them.

    Args:
        series: the series.
        layer: the layer.
        window: fraction of the values in each window (at least one).
        skip_steps: steps left out (the GradScaler's skipped steps).
    """
    return _ends(series.steps, series.series(layer), window, skip_steps)


def _ends(steps: Sequence[int], values: Sequence[float], window: float,
          skip_steps: frozenset[int], *, positive: bool = True
          ) -> tuple[int, float, int, float] | None:
    """`change` on one series of values, one per step (with `positive=False`, zeros count
    too: a fraction that starts at 0)."""
    pairs = [(s, v) for s, v in zip(steps, values, strict=True)
             if s not in skip_steps and math.isfinite(v) and (v > 0 or not positive)]
    if len(pairs) < 2:
        return None
    n = max(1, math.floor(len(pairs) * window))
    n = min(n, len(pairs) // 2)
    head, tail = pairs[:n], pairs[-n:]
    return (head[0][0], statistics.median(v for _, v in head),
            tail[-1][0], statistics.median(v for _, v in tail))


def grad_history(record: RunRecord) -> GradHistory:
    """The run's gradient series as a `torchscope.grads.GradHistory` (the sampled steps,
    per-layer parameter and output norms, total norms), for the grads capability's own
    history analysis and heat map."""
    g, o = record.grad_param, record.grad_output
    layers = tuple(dict.fromkeys([*g.layers, *o.layers]))

    def rows(s: LayerSeries) -> tuple[tuple[float, ...], ...]:
        idx = [s.layers.index(k) if k in s.layers else None for k in layers]
        return tuple(tuple(math.nan if j is None else row[j] for j in idx) for row in s.values)

    return GradHistory(steps=g.steps, layers=layers, output_norms=rows(o),
                       param_norms=rows(g), total_norms=record.total_norms,
                       applied_norms=record.applied_norms)


# Layers whose gradient grew while the total did not, named one by one up to this many.
_GREW_NAMED = 3


def _grew_together(found: list[Finding]) -> list[Finding]:
    """`found` with the layers whose gradient grew while the total did not (info) as one
    finding when there are more than `_GREW_NAMED`: a ConvNeXt's branches behind a layer
    scale that AdamW grows from 1e-6 grow together, eight of them in two blocks."""
    grew = [f for f in found if f.code == "run.grad_grew" and f.severity == Severity.INFO]
    if len(grew) <= _GREW_NAMED:
        return found
    sizes = [float(f.evidence["ratio"] or 0) for f in grew]
    rel = [float(f.evidence["relative_to_median"] or 0) for f in grew]
    ev = grew[0].evidence
    names = [str(f.module) for f in grew]
    total = _total_clause(float(ev.get("total_change") or 1))
    one = _GRAD_GREW.finding(Severity.INFO,
        f"{len(grew)} layers' gradients grew {fmt_times(min(sizes))}–{fmt_times(max(sizes))} "
        f"between step {ev['first_step']} and step {ev['last_step']}, {fmt_times(min(rel))}–"
        f"{fmt_times(max(rel))} more than the median layer's{total} "
        f"({', '.join(names[:_GREW_NAMED])} and {len(names) - _GREW_NAMED} more)",
        {"layers": len(grew), "modules": ", ".join(names), "ratio_min": min(sizes),
         "ratio_max": max(sizes), "first_step": ev["first_step"],
         "last_step": ev["last_step"], "total_change": ev.get("total_change")},
        fix=grew[0].fix + "; layers behind a gain that starts small (a layer scale) grow "
            "with it",
        module=names[0])
    return [f for f in found if f not in grew] + [one]


def _total_did_not_grow(total: tuple[int, float, int, float],
                        evidence: dict[str, float | int]) -> str:
    """The clause for a growth the total gradient norm did not share (`total`: `_ends` of
    the totals); the total's fall goes into `evidence` as `total_change`."""
    evidence["total_change"] = total[1] / total[3]  # >= 1
    return _total_clause(total[1] / total[3])


def _total_clause(fall: float) -> str:
    """How the total gradient norm did not grow, from its fall (first / last, >= 1)."""
    return f", while the total gradient norm fell {fmt_times(fall)}" if fall >= 1.05 \
        else ", while the total gradient norm did not grow"


def _loss_unseen(record: RunRecord) -> list[Finding]:
    """Info where no loss of the run was seen, so that its checks did not run: a clean
    report is then no evidence about the loss."""
    if record.loss_seen:
        return []
    if record.producer.endswith(".hf"):
        fix = ("the Trainer computes this loss outside the model (compute_loss_func, "
               "label_smoothing_factor, or a compute_loss override): callback.install(trainer) "
               "hands each step's loss to the monitor")
    else:
        fix = ("hand each step's loss to the monitor before its backward: "
               "mon.check_loss(loss)")
    return [_LOSS_UNSEEN.finding(Severity.INFO,
        "no loss of this run was seen: whether it broadcasts the output against its target, "
        "or applies a softmax the model already applied, was not checked",
        {"steps": record.steps}, fix=fix)]


def _clip_clause(record: RunRecord) -> str:
    """"; the loop clips already ..." where the framework says the loop clips (its setting,
    even if no sampled step reached it) or the last sample was clipped (`grads.clipped`);
    empty otherwise."""
    if record.clip_setting:
        return (f"; the loop clips already ({record.clip_setting}), which bounds the update "
                "but not the cause; a lower setting bounds it more")
    factors = grad_history(record).clip_factors()
    if factors and factors[-1] > 1:
        return "; the loop clips already, which bounds the update but not the cause"
    return ""


def _with_matrices(record: RunRecord) -> set[str]:
    """Modules that own a trainable weight matrix or kernel (2+ dimensions), from the last
    sample; every module where no sample was kept."""
    if record.last is None:
        return set(record.grad_param.layers)
    return {p.module for p in record.last.params if p.requires_grad and len(p.shape) >= 2}


def _update_ratios(record: RunRecord, layer: str, t: RunThresholds
                   ) -> tuple[float, float, int] | None:
    """(the layer's largest update ratio over the last `window` of the samples whose update
    was read, the model's median update ratio over the same samples, those samples): a
    fall that lasts is one whose every sample sits low. None where no update was read."""
    u = record.update
    if layer not in u.layers:
        return None
    rows = [(i, v) for i, v in enumerate(u.series(layer)) if math.isfinite(v)]
    if len(rows) < 2:
        return None
    n = max(1, math.floor(len(rows) * t.window))
    tail = rows[-n:]
    medians = []
    for i, _ in tail:
        ups = [v for v in u.values[i] if math.isfinite(v) and v > 0]
        if ups:
            medians.append(statistics.median(ups))
    if not medians:
        return None
    return max(v for _, v in tail), statistics.median(medians), len(tail)


def _gradient_trends(record: RunRecord, t: RunThresholds) -> list[Finding]:
    # A layer's weight matrices: a bias's gradient is a sum over the batch and positions
    # and can fall 90x while the weight's does not (MobileViT's attention output).
    series = record.grad_weight if record.grad_weight.layers else record.grad_param
    skip = frozenset(record.skipped_steps)
    if len(series.steps) < t.min_samples:
        return []
    # A gradient read while the layer's weights were all zero (a zero-init class token
    # before a LayerNorm of eps 1e-12: 52, then 0.04 once AdamW moved it) is no baseline.
    # A layer no optimizer steps has gradients that only add up (`grads.not_optimized`
    # names it): their growth is that, not the model's.
    idle = {name.rpartition(".")[0] for name in record.unoptimized}
    found = {k: c for k in series.layers if k not in idle
             and (c := change(series, k, t.window, skip | _zero_weight_steps(record, k)))}
    if not found:
        return []
    falls = {k: c[1] / c[3] for k, c in found.items()}  # > 1: fell
    # The reference is the median layer outside blocks behind a layer scale: theirs follow
    # the scale as it grows from 1e-6 (ConvNeXt), not the loss, and as most of the model
    # they would make the stem's ordinary fall read 13x the median's.
    scaled = _scaled_at_start(record)
    free = [v for k, v in falls.items() if unit_name(k) not in scaled]
    median = statistics.median(free if len(free) >= _MIN_REFERENCE else falls.values())
    # The total norm over the same windows: one layer's gradient that grows while the
    # total does not is one layer gathering direction as the model fits (a final norm's
    # gain on a transformers Llama: 11x in 40 AdamW steps while the loss fell smoothly and
    # the total fell 1.6x), not a layer that drives the model's gradient up.
    total = _ends(series.steps, record.total_norms, t.window, skip) \
        if len(record.total_norms) == len(series.steps) else None
    total_grew = total is None or total[3] > total[1]
    clips = _clip_clause(record)
    matrices = _with_matrices(record)
    out: list[Finding] = []
    for k, ratio in falls.items():
        s0, v0, s1, v1 = found[k]
        fell = ratio >= 1
        size = ratio if fell else 1 / ratio
        relative = ratio / median if fell else median / ratio
        if size < t.change_ratio or relative < t.relative_ratio:
            continue
        onset = _onset(series, k, v0, t.change_ratio, not fell,
                       skip | _zero_weight_steps(record, k))
        evidence: dict[str, float | int] = {
            "onset_step": onset, "first_step": s0, "first_norm": v0, "last_step": s1,
            "last_norm": v1, "ratio": size, "relative_to_median": relative,
            "median_change": median}
        summary = (f"{_name(k)}'s gradient {'fell' if fell else 'grew'} {fmt_times(size)} "
                   f"between step {s0} and step {s1} (past {fmt_times(t.change_ratio)} from "
                   f"step {onset}), {fmt_times(relative)} more than the median layer's")
        grown = _normalised_after(record, k, t, skip) if fell else None
        if grown is not None:
            # RWKV's embedding starts at std 1e-4 before a LayerNorm and grows 55x in 35
            # AdamW steps; the LayerNorm's own output leaves its eps regime, 28x.
            severity = Severity.INFO
            summary += (f", while its {grown[0]} grew {fmt_times(grown[1])}: what follows "
                        "normalises its output, so its gradient falls as "
                        + ("they grow" if grown[0] == "weights" else "it grows"))
            evidence[f"{grown[0]}_growth"] = grown[1]
            fix = ("a small init growing into its scale (a small-init embedding, a layer "
                   "behind BatchNorm or LayerNorm) needs no action; weight decay bounds such "
                   "growth where it goes on")
        elif fell and k not in matrices:
            # Only biases and norm gains: sums over the batch, whose fall says nothing of
            # the layer's learning next to the weight matrices' median.
            severity, fix = Severity.INFO, ""
            summary += ("; it has no weight matrix (only biases or norm gains, judged "
                        "apart: their gradients are sums over the batch)")
        elif fell and (ups := _update_ratios(record, k, t)) is not None and \
                ups[0] * t.relative_ratio > ups[1]:
            # What the optimizer made of it: under AdamW a fallen gradient still moves the
            # weights (Whisper's decoder q/k: 2x below the median, not "stops learning").
            severity, fix = Severity.INFO, ""
            summary += (f"; its weights' update ratio ‖Δw‖/‖w‖ ({ups[0]:.1e}) is "
                        f"{_against(ups[0], ups[1])} the model's median ({ups[1]:.1e}): it "
                        "still learns")
            evidence.update(update_ratio=ups[0], median_update_ratio=ups[1])
        elif fell:
            severity, fix = Severity.WARNING, (
                "the layer stops learning while the rest of the model does: look for "
                "saturating activations or dying units around it, and check its learning rate "
                "and weight decay")
            if ups is not None and ups[0] > 0:
                summary += (f"; its weights' update ratio ‖Δw‖/‖w‖ stayed at or below "
                            f"{ups[0]:.1e}, {fmt_times(ups[1] / ups[0])} below the model's "
                            f"median ({ups[1]:.1e}), over the last {ups[2]} samples")
                evidence.update(update_ratio=ups[0], median_update_ratio=ups[1])
        elif total_grew:
            severity, fix = Severity.WARNING, (
                "this layer's gradient grows, and the model's total with it: "
                + ("lower the learning rate, or normalise around it" + clips
                   if clips else "clip gradients (clip_grad_norm_), lower the "
                   "learning rate, or normalise around it"))
        else:
            assert total is not None
            severity = Severity.INFO
            summary += _total_did_not_grow(total, evidence)
            fix = ("a layer whose gradient grows while the model's total falls is usually one "
                   "whose gradient gains direction as the model fits (normalisation gains, "
                   "output layers); it needs action only if the total turns up or the loss "
                   "stalls")
        out.append((_GRAD_FELL if fell else _GRAD_GREW).finding(severity, summary,
                           evidence, fix=fix, module=k))
    out = _grew_together(out)
    first = min(c[0] for c in found.values())
    last = max(c[2] for c in found.values())
    if median >= t.change_ratio:
        weights = _weight_growth(record, t)
        moved = weights is not None and not \
            1 / t.change_ratio < weights[2] < t.change_ratio
        why = "as they do while the loss falls" if weights is None or not moved else (
            f"while its weights {'grew' if weights[2] > 1 else 'shrank'} "
            f"{fmt_times(max(weights[2], 1 / weights[2]))} (run.weight_scale): no sign by "
            "itself that the loss falls")
        out.append(_GRAD_FELL.finding(Severity.INFO,
            f"the median layer's gradient fell {fmt_times(median)} between step {first} and "
            f"step {last}: the whole model's gradients shrank together, {why}",
            {"first_step": first, "last_step": last, "median_change": median,
             "layers": len(falls)},
            fix=""))
    elif 1 / median >= t.change_ratio:
        onset = _median_onset(series, t.change_ratio, True)
        evidence = {"onset_step": onset, "first_step": first, "last_step": last,
                    "median_change": median, "layers": len(falls)}
        summary = f"the median layer's gradient grew {fmt_times(1 / median)} between step " \
            f"{first} and step {last} (past {fmt_times(t.change_ratio)} from step {onset})"
        if total_grew:
            severity, fix = Severity.WARNING, (
                "the whole model's gradients grow: "
                + ("lower the learning rate, or add warm-up" + clips if clips else
                   "lower the learning rate, add warm-up, or clip gradients (clip_grad_norm_)"))
        else:
            # Most layers sit behind a gain that starts small (DINOv2's and CaiT's layer
            # scale of 1e-5): their gradients grow with it while the model's total falls.
            assert total is not None
            severity = Severity.INFO
            summary += _total_did_not_grow(total, evidence)
            fix = ("layers behind a gain that starts small (a layer scale, a zero-initialised "
                   "norm) get more gradient as it grows; it needs action only if the total "
                   "turns up or the loss stalls")
        out.append(_GRAD_GREW.finding(severity, summary, evidence, fix=fix))
    return out


def _against(value: float, median: float) -> str:
    """"3.1× above", "2.0× below" or "at": `value` against `median`."""
    if value >= median * 1.05:
        return f"{fmt_times(value / median)} above"
    if value <= median / 1.05:
        return f"{fmt_times(median / value)} below"
    return "at"


def _weight_growth(record: RunRecord, t: RunThresholds
                   ) -> tuple[int, int, float, int] | None:
    """How the median layer's own weights changed over the run, its last sample's norm over
    its first: (first step, last step, that factor, layers); None with fewer than three
    layers or `min_samples` samples. Weights are no noisy series: the first sample is their
    init, which Adam at a learning rate of 0.1 leaves 10x behind within five steps, before
    a window's median could hold it."""
    w = record.weight
    if len(w.steps) < t.min_samples:
        return None
    ends = []
    for k in w.layers:
        pairs = [(s, v) for s, v in zip(w.steps, w.series(k), strict=True)
                 if math.isfinite(v) and v > 0]
        if len(pairs) >= 2:
            ends.append((pairs[0][0], pairs[-1][0], pairs[-1][1] / pairs[0][1]))
    if len(ends) < _MIN_REFERENCE:
        return None
    return (min(e[0] for e in ends), max(e[1] for e in ends),
            statistics.median(e[2] for e in ends), len(ends))


def _weight_onset(record: RunRecord, t: RunThresholds, grew: bool) -> int:
    """The first sampled step at which the median layer's weight norm, against its first
    sample, had moved `change_ratio` times (up where `grew`, else down)."""
    return _median_onset(record.weight, t.change_ratio, grew)


def _median_onset(series: LayerSeries, factor: float, grew: bool) -> int:
    """The first sampled step at which the median layer's value, against its own first
    finite positive one, had moved `factor` times (up where `grew`, else down); the last
    step where it never did."""
    firsts: list[float | None] = []
    for k in series.layers:
        first = next((v for v in series.series(k) if math.isfinite(v) and v > 0), None)
        firsts.append(first)
    for step, row in zip(series.steps, series.values, strict=True):
        ratios = [v / f for v, f in zip(row, firsts, strict=True)
                  if f is not None and math.isfinite(v) and v > 0]
        if ratios:
            m = statistics.median(ratios)
            if (m >= factor) if grew else (m <= 1 / factor):
                return step
    return series.steps[-1]


def _onset(series: LayerSeries, layer: str, start: float, factor: float, grew: bool,
           skip: frozenset[int] = frozenset()) -> int:
    """The first sampled step at which `layer`'s value had moved `factor` times from
    `start` (its first window's median; up where `grew`, else down): a trend is dated where
    it crossed its line, not at the run's first sample."""
    for s, v in zip(series.steps, series.series(layer), strict=True):
        if s in skip or not math.isfinite(v) or v <= 0:
            continue
        if (v >= start * factor) if grew else (v <= start / factor):
            return s
    return series.steps[-1]


# Optimizers whose weight decay multiplies each weight by (1 - lr * weight_decay) a step
# (decoupled in AdamW; SGD's L2 term does the same, before momentum).
_DECAY_FACTOR = frozenset({"AdamW", "SGD"})


def _weight_scale(record: RunRecord, t: RunThresholds) -> list[Finding]:
    """`run.weight_scale`: the whole model's weights grew or shrank `change_ratio` times
    or more over the run. Healthy runs move the median layer's weight norm by at most 2x
    in a few hundred steps (GPT-2, Llama, BERT, T5, ResNet, ViT, Swin, ConvNeXt,
    EfficientNet and MobileNetV2 from transformers, AdamW at 1e-3 or SGD); AdamW at 0.1
    grew GPT-2's 26x in 150 steps while its loss stayed at chance, and a weight decay of
    50 shrank them 700x."""
    growth = _weight_growth(record, t)
    if growth is None:
        return []
    first, last, factor, layers = growth
    if 1 / t.change_ratio < factor < t.change_ratio:
        return []
    grew = factor >= 1
    onset = _weight_onset(record, t, grew)
    evidence: dict[str, float | int | str | None] = {
        "onset_step": onset, "first_step": first, "last_step": last,
        "median_change": factor, "layers": layers}
    decays = [(lr, wd) for lr, wd in record.param_groups if wd > 0 and math.isfinite(lr)]
    if grew:
        summary = (f"the median layer's weights grew {fmt_times(factor)} between step "
                   f"{first} and step {last}, past {fmt_times(t.change_ratio)} from step "
                   f"{onset}: the updates carry the whole model far from the scale it "
                   "started at")
        lrs = sorted({lr for lr, _ in record.param_groups if math.isfinite(lr)})
        opt = record.optimizer or ""
        if "Adam" in opt or opt in ("Lion", "Adafactor", "RMSprop"):
            how = (f"{opt} moves every weight by about the learning rate each step, "
                   "whatever its gradient")
        elif opt:
            how = (f"{opt} moves each weight by the learning rate times its gradient (and "
                   "momentum multiplies that), so a step too large for the weights' scale "
                   "compounds")
        else:
            how = "each step moves the weights in proportion to the learning rate"
        fix = ("lower the learning rate" + (f" (its peak is {lrs[-1]:g}; " if lrs else " (")
               + how + "), and warm it up; behind normalization layers such growth only "
               "slows learning, elsewhere it ends in overflow")
        if record.param_groups and not decays:
            # Nothing pulls back: a long run at a steady rate drifts this far too.
            usual = "SGD's usual weight_decay is 1e-4 to 5e-4" if opt == "SGD" else \
                "AdamW's usual weight_decay is 0.01 to 0.1"
            fix += ("; no parameter group has weight decay, so nothing bounds the growth: "
                    f"add some ({usual})")
    else:
        summary = (f"the median layer's weights shrank {fmt_times(1 / factor)} between step "
                   f"{first} and step {last}, past {fmt_times(t.change_ratio)} from step "
                   f"{onset}: something pulls the whole model toward zero faster than its "
                   "gradients hold it")
        if decays and record.optimizer in _DECAY_FACTOR and \
                0 < max(lr * wd for lr, wd in decays) < 1:
            lr, wd = max(decays, key=lambda d: d[0] * d[1])
            evidence.update(lr=lr, weight_decay=wd, decay_per_step=lr * wd)
            fix = (f"lower the weight decay: {record.optimizer} multiplies each weight by "
                   f"1 - lr × weight_decay = {1 - lr * wd:.4g} every step at its peak "
                   f"learning rate (lr {lr:g}, weight_decay {wd:g}), up to "
                   f"{fmt_times((1 - lr * wd) ** -(last - first))} over these steps before "
                   "the gradients push back; AdamW's usual weight_decay "
                   "is 0.01 to 0.1")
        elif decays:
            lr, wd = max(decays, key=lambda d: d[0] * d[1])
            evidence.update(lr=lr, weight_decay=wd)
            fix = (f"lower the weight decay (it is {wd:g}), or the learning rate it acts "
                   "with")
        else:
            fix = ("the optimizer decays nothing: look for a penalty on the weights in the "
                   "loss, or a loop that rescales them")
    return [_WEIGHT_SCALE.finding(Severity.WARNING, summary, evidence, fix=fix)]


def _activation_drift(record: RunRecord, t: RunThresholds) -> list[Finding]:
    """Layers whose output std drifted `drift_info` times or more. When the median layer
    drifted that far, the whole model drifted together (a diverging run): one finding
    says so, and a layer is named only when it drifted `relative_ratio` times more than the
    median, as for gradients. A layer whose output the model returns (its head) feeds no
    later layer: its scale is what the loss asks of it, and its fix says so."""
    series = record.act_std
    if len(series.steps) < t.min_samples:
        return []
    heads = set() if record.activations is None else \
        {r.module for r in record.activations.records if r.model_output}
    found = {k: c for k in series.layers if (c := change(series, k, t.window))}
    if not found:
        return []
    ratios = {k: c[3] / c[1] for k, c in found.items()}  # > 1: grew
    median = statistics.median(ratios.values())
    together = max(median, 1 / median) >= t.drift_info
    start = statistics.median(c[1] for c in found.values())
    end = statistics.median(c[3] for c in found.values())
    out = []
    named: dict[str, float] = {}  # the layers named so far, with their change
    order = _call_order(record, list(ratios))
    for i, k in enumerate(order):
        ratio = ratios[k]
        s0, v0, s1, v1 = found[k]
        size = ratio if ratio >= 1 else 1 / ratio
        if size < t.drift_info:
            continue
        prev = order[i - 1] if i else None
        if prev in named and abs(math.log(ratio / named[prev])) < math.log(1.1):
            # It only passes on the layer before it's drift (GPT-2's resid_dropout after its
            # c_proj): named once, at the layer that makes it.
            continue
        if ratio >= 1 and v0 * t.drift_warn <= start and v1 <= end:
            # It started negligible against the model and grew to no more than the median
            # layer's scale: a branch behind a layer scale (ConvNeXt's 1e-6, CaiT's) or a
            # zero init that Adam moves by the learning rate each step, not a drift.
            continue
        suffix = ""
        if together and (ratio >= 1) == (median >= 1):
            # The model's way: named only when it went much further than the median layer.
            further = ratio / median if median >= 1 else median / ratio
            if further < t.relative_ratio:
                continue
            suffix = f", {fmt_times(further)} more than the median layer's"
        named[k] = ratio
        line = t.drift_warn if size >= t.drift_warn else t.drift_info
        onset = _onset(series, k, v0, line, ratio >= 1)
        qk = ratio >= 1 and _is_query_key(k)
        if qk:
            # The attention logits are the product of queries and keys: they grow with the
            # square of this (Wortsman et al. 2023's attention-logit growth).
            suffix += (": an attention's queries or keys growing is attention-logit growth "
                       "(Wortsman et al. 2023), the logits growing as their product until "
                       "the attention's softmax saturates to one-hot")
            fix = ("normalise queries and keys (qk-layernorm: a LayerNorm on q and k before "
                   "their product, as ViT-22B and OLMo do), or lower the learning rate of the "
                   "attention's query/key projections")
        elif k in heads:
            fix = ("it is the model's output, whose scale is what the loss asks of it: targets "
                   "far from unit scale (standardise a regression's targets, and undo it on "
                   "the predictions), or logits growing as a classifier grows over-confident "
                   "(label smoothing, weight decay; for a language model's logits drifting "
                   "up, output-logit divergence in Wortsman et al. 2023, a z-loss of "
                   "1e-4 · log²Z)")
        else:
            fix = ("activations that drift this far change what every later layer sees: "
                   "check the learning rate of the layers before it, or normalise "
                   "(LayerNorm/BatchNorm)")
        out.append(_ACTIVATION_DRIFT.finding(
            Severity.WARNING if size >= t.drift_warn else Severity.INFO,
            f"{_name(k)}'s output std {'grew' if ratio >= 1 else 'shrank'} {fmt_times(size)} "
            f"between step {s0} and step {s1} (past {fmt_times(line)} from step {onset})"
            f"{suffix}",
            {"onset_step": onset, "first_step": s0, "first_std": v0, "last_step": s1,
             "last_std": v1, "ratio": ratio, "median_change": median,
             "attention_logit_growth": qk},
            fix=fix, module=k))
    if together:
        size = median if median >= 1 else 1 / median
        first = min(c[0] for c in found.values())
        last = max(c[2] for c in found.values())
        line = t.drift_warn if size >= t.drift_warn else t.drift_info
        onset = _median_onset(series, line, median >= 1)
        out.append(_ACTIVATION_DRIFT.finding(
            Severity.WARNING if size >= t.drift_warn else Severity.INFO,
            f"the median layer's output std {'grew' if median >= 1 else 'shrank'} "
            f"{fmt_times(size)} between step {first} and step {last} (past "
            f"{fmt_times(line)} from step {onset}): the whole model's activations drifted "
            f"together ({len(ratios)} layers)",
            {"onset_step": onset, "first_step": first, "last_step": last,
             "median_change": median, "layers": len(ratios)},
            fix="the whole model's scale moves: lower the learning rate or add warm-up, and "
                "check weight decay and normalisation"))
    return out


def _call_order(record: RunRecord, layers: list[str]) -> list[str]:
    """`layers` in the order the last sampled forward called them (GPT-2's MLP registers
    c_proj before the activation it calls first), those not called last; the model's order
    without a capture."""
    if record.activations is None:
        return layers
    first: dict[str, int] = {}
    for r in record.activations.records:
        first.setdefault(r.module, r.order)
    return sorted(layers, key=lambda k: first.get(k, len(first)))


def _dead_growth(record: RunRecord, t: RunThresholds) -> list[Finding]:
    """Dead channels that grew: the median fraction of the last `window` of the samples
    against that of the first, by `dead_growth` to `dead_warn` or more, and by two channels
    or more where the layer's channel count is known (one unit of a squeeze-excitation's
    eight, zero on eight samples, flips by chance). One finding for every layer it
    happened in (one cause: a learning rate too high, a bias pushed negative), in call
    order, dated at the first sampled step at which a layer crossed `dead_warn`."""
    series = record.act_dead
    grew: dict[str, tuple[int, float, int, float, int]] = {}
    for k in series.layers:
        ends = _ends(series.steps, series.series(k), t.window, frozenset(), positive=False)
        if ends is None:
            continue
        s0, v0, s1, v1 = ends
        channels = _channels(record, k)
        if v1 >= t.dead_warn and v1 - v0 >= t.dead_growth and (
                channels is None or (v1 - v0) * channels >= 2 - 1e-9):
            # Dated where it crossed the line it had to cross: 25%, and 10 points above
            # where it started.
            line = max(t.dead_warn, v0 + t.dead_growth)
            onset = next((s for s, v in zip(series.steps, series.series(k), strict=True)
                          if math.isfinite(v) and v >= line - 1e-9), s1)
            grew[k] = (s0, v0, s1, v1, onset)
    if not grew:
        return []
    # Named at the first of them in the forward (what dies there starves the layers
    # after it), dated at the first that crossed.
    names = _call_order(record, list(grew))
    onset = min(g[4] for g in grew.values())
    first = names[0]
    s0, v0, s1, v1, _ = grew[first]
    each = "; ".join(f"{_name(k)}: {100 * grew[k][1]:.0f}% → {100 * grew[k][3]:.0f}% "
                     f"(from step {grew[k][4]})" for k in names[:4])
    more = f"; and {len(names) - 4} more" if len(names) > 4 else ""
    if len(names) == 1:
        summary = (f"{_name(first)}: dead units grew from {100 * v0:.0f}% at step {s0} to "
                   f"{100 * v1:.0f}% at step {s1}, past {100 * t.dead_warn:.0f}% from step "
                   f"{onset}")
    else:
        summary = (f"dead units grew in {len(names)} layers, first past "
                   f"{100 * t.dead_warn:.0f}% at step {onset} ({each}{more})")
    return [_DEAD_UNITS.finding(
        Severity.WARNING, summary,
        {"onset_step": onset, "first_step": s0, "first_fraction": v0, "last_step": s1,
         "last_fraction": v1, "channels": _channels(record, first), "layers": len(names),
         "modules": ", ".join(_name(k) for k in names)},
        fix="units die during training: lower the learning rate, use LeakyReLU/GELU, or "
            "check the bias of the layer before it",
        module=first)]


def _saturation_growth(record: RunRecord, t: RunThresholds) -> list[Finding]:
    """Bounded activations (tanh, sigmoid) that drifted into their flat tails during the
    run: the median saturated fraction of the last `window` of the samples against that of
    the first, by `saturated_growth` to the capture's `saturated_warn` or more. Only where a
    weighted layer takes their output in (`before_weighted`: a model's last sigmoid
    saturates as its predictions grow sure). One that starts saturated is the last
    sample's `activations.saturated`."""
    series, acts = record.act_sat, record.activations
    if not series.layers or acts is None or not acts.records:
        return []
    last = [r for r in acts.records if r.step == acts.records[-1].step]
    hidden = before_weighted(last, acts.weighted)
    warn = ActivationThresholds().saturated_warn
    out = []
    for k in series.layers:
        ends = _ends(series.steps, series.series(k), t.window, frozenset(), positive=False)
        if k not in hidden or ends is None:
            continue
        s0, v0, s1, v1 = ends
        if v1 >= warn and v1 - v0 >= t.saturated_growth:
            out.append(_SATURATED.finding(Severity.WARNING,
                f"{_name(k)}: the values where its gradient is below 5% of its peak grew "
                f"from {100 * v0:.0f}% at step {s0} to {100 * v1:.0f}% at step {s1}",
                {"first_step": s0, "first_fraction": v0, "last_step": s1,
                 "last_fraction": v1},
                fix="its pre-activations grew in training until it saturated: lower the "
                    "learning rate, add weight decay, or put a normalisation layer before "
                    "it; saturated units pass almost no gradient back",
                module=k))
    return out


def _channels(record: RunRecord, layer: str) -> int | None:
    """The layer's channel count in the last sampled forward, None when not recorded."""
    if record.activations is None:
        return None
    for r in reversed(record.activations.records):
        if r.module == layer:
            return next((o.channels for o in r.outputs if o.channels), None)
    return None


def _nonfinite(record: RunRecord) -> list[Finding]:
    o = record.onset
    if o.gradient_step is None and o.forward_step is None:
        return []
    b = record.broken_update
    if b is not None and all(s is None or s > b.step for s in (o.gradient_step, o.forward_step)):
        return []  # an update wrote the NaN/Inf into the weights: its finding says so
    where = _name(o.module) + (f" ({o.module_type})" if o.module_type else "")
    if o.forward_step is not None and o.module is not None and \
            o.gradient_step in (None, o.forward_step):
        summary = f"NaN/Inf first produced by {where} at step {o.forward_step}"
    elif o.forward_step is not None and o.module is not None:
        summary = (f"the gradients first held NaN/Inf at step {o.gradient_step} (every step "
                   f"checked); the first sampled forward with NaN/Inf, at step "
                   f"{o.forward_step}, has it produced by {where}")
        if not record.scaler and o.gradient_step is not None and \
                o.gradient_step < o.forward_step:
            # No GradScaler skipped that step: the optimizer wrote NaN/Inf into weights.
            summary += (f" from finite inputs, likely from its own weights, which the update "
                        f"with step {o.gradient_step}'s gradients wrote: the cause is at or "
                        f"before step {o.gradient_step}")
    elif o.forward_step is not None and o.between is not None:
        summary = (f"NaN/Inf first appeared at step {o.forward_step} in code no watched module "
                   f"covers, before {o.between} (the model's input was finite): plain tensor "
                   "code in a parent's forward")
    elif o.forward_step is not None:
        summary = f"the model's input already held NaN/Inf at step {o.forward_step}"
    else:
        summary = (f"the gradients first held NaN/Inf at step {o.gradient_step} (every step "
                   "checked); no sampled forward showed where")
    return [_NONFINITE.finding(Severity.ERROR, summary,
        {"gradient_step": o.gradient_step, "nonfinite_steps": o.nonfinite_steps,
         "forward_step": o.forward_step, "module_type": o.module_type},
        fix=_nonfinite_fix(record), module=o.module)]


def _nonfinite_fix(record: RunRecord) -> str:
    """The NaN/Inf fix for what the run uses: float16 autocast (with or without a
    GradScaler), clipping, and its optimizer."""
    fix = ("the first step is the one to look at: rerun up to it with "
           "torch.autograd.detect_anomaly(), and guard log/div/sqrt with an eps")
    if record.modes.main_autocast == "torch.float16":
        fix += ("; the forward runs under float16 autocast, whose range ends at 65504: "
                + ("the GradScaler skips such steps, so look for a layer whose activations "
                   "grow" if record.scaler else
                   "scale the loss with a GradScaler, or autocast to bfloat16"))
    lrs = sorted({lr for lr, _ in record.param_groups if math.isfinite(lr)})
    fix += ("; check the learning rate" + (f" (its peak is {lrs[-1]:g}" if lrs else "")
            + (f", with {record.optimizer})" if lrs and record.optimizer else
               ")" if lrs else ""))
    clip = _clip_clause(record)
    return fix + (clip if clip else ", and clip gradients (clip_grad_norm_)")


def _overflowed_only(record: RunRecord, step: int) -> bool:
    """Whether step `step`'s non-finite norms are a float32 overflow of finite gradients:
    the every-step check of the elements (`NonFiniteOnset.gradient_step`, an infinity norm
    that cannot overflow) ran and found no non-finite element up to that step."""
    o = record.onset
    return o.nonfinite_steps is not None and (o.gradient_step is None or
                                              o.gradient_step > step)


def _norm_overflow(record: RunRecord) -> list[Finding]:
    """`run.grad_norm_overflow` (warning): a sampled step whose total gradient norm read as
    Inf in float32 while every gradient element was finite (a sum of squares overflows
    once an element passes about 1.8e19): a true statement about enormous gradients, not
    a NaN/Inf in them."""
    steps = record.grad_param.steps
    if len(record.total_norms) != len(steps):
        return []
    over = [s for s, n in zip(steps, record.total_norms, strict=True)
            if not math.isfinite(n) and _overflowed_only(record, s)]
    if not over:
        return []
    last = record.last
    params = 0 if last is None or last.index not in over else sum(
        1 for p in last.params if p.tied_to is None and not p.finite)
    per = f" ({params} parameters' own norms overflow too)" if params else ""
    return [_GRAD_NORM_OVERFLOW.finding(
        Severity.WARNING,
        f"gradient norm beyond float32's range at step {over[0]}{per}: every gradient "
        "element was finite (checked every step), but their sum of squares passed 3.4e38"
        + (f"; {len(over)} sampled steps read so" if len(over) > 1 else ""),
        {"first_step": over[0], "steps": len(over), "parameters": params})]


def _skipped(record: RunRecord, t: RunThresholds) -> list[Finding]:
    if not record.skipped:
        return []
    frac = record.skipped / max(record.steps, 1)
    first = ", ".join(str(s) for s in record.skipped_steps[:5])
    return [_SKIPPED_STEPS.finding(Severity.WARNING if frac >= t.skipped_warn else Severity.INFO,
        f"the GradScaler skipped {record.skipped} of {record.steps} steps "
        f"({100 * frac:.1f}%; e.g. step {first}): their gradients held inf/NaN",
        {"skipped": record.skipped, "steps": record.steps, "fraction": frac},
        fix="" if frac < t.skipped_warn else
            "many skipped steps mean the fp16 range overflows often: try bf16, a lower "
            "learning rate, or look for the layer whose activations grow (activation drift)")]


def _stopped(record: RunRecord) -> list[Finding]:
    if record.status != "stopped":
        return []
    return [_STOPPED.finding(Severity.WARNING,
        f"the run stopped in step {record.first_step + record.steps} (after "
        f"{record.steps} completed steps): "
        f"{record.error or 'an exception'}; this report covers the steps before it",
        {"steps": record.steps, "samples": record.samples, "error": record.error},
        fix="")]


def _capabilities(record: RunRecord, replaced: bool) -> list[Finding]:
    """The capabilities' own analyzers on the run's data; NaN/Inf findings give way to the
    run's onset (`replaced`), which knows the first step, and to the first update that
    wrote NaN/Inf into the weights (`grads.nonfinite_update`), which caused them."""
    found: list[Finding] = []
    if record.last is not None:
        # The step's size is judged against how far the run's gradients have fallen; the
        # run's first broken update, not the last step's, is the one to name.
        found += [f for f in diagnose(record.last)
                  if f.code not in ("grads.update_ratio", "grads.nonfinite_update")
                  and not (f.code == "grads.nonfinite" and
                           _overflowed_only(record, record.last.index))]
        found += find_update_ratio(record.last, fallen=_total_fall(record))
    found += find_broken_update(record.broken_update)
    found += find_loss_broadcast(record.loss_broadcast)
    found += find_loss_on_probabilities(record.loss_on_probabilities)
    found += _loss_unseen(record)
    history = grad_history(record)
    # A total norm that overflowed float32 over finite elements is `run.grad_norm_overflow`.
    found += [f for f in diagnose_history(history) if not (
        f.code == "grads.nonfinite" and isinstance(f.evidence.get("step"), int)
        and _overflowed_only(record, int(f.evidence["step"] or 0)))]
    found += find_no_step(record.step_by, record.steps, record.backwards, record.optimizer)
    found += find_no_update(record.backwards, record.passes_without_update, record.steps)
    found += find_not_zeroed(record.unzeroed_steps, record.first_unzeroed, record.steps,
                             history)
    found += find_cleared(record.cleared_steps, record.first_cleared, record.steps, history)
    found += find_not_optimized(record.unoptimized, record.optimizer)
    if record.activations is not None:
        found += record.activations.findings()
    if record.memory is not None:
        found += record.memory.findings()
    if record.profile is not None:
        found += record.profile.findings()
    if replaced or record.broken_update is not None:
        found = [f for f in found
                 if "nonfinite" not in f.code or f.code == "grads.nonfinite_update"]
    # The run's own finding says it once for the whole run (`_compiled`), not each watch;
    # the monitor samples its activations and memory only on sampled steps, and its
    # gradient watch tells a forward that bypassed the hooks (`grads.unseen_forward`).
    return [f for f in found if not f.code.endswith(".compiled_eager") and
            f.code not in ("activations.unseen_forward", "memory.unseen_forward")]


def section_of(finding: Finding) -> str:
    """The run report's section a finding belongs to: `grad_history`, `act_history`,
    `mem_history`, `profile` or `run`."""
    code = finding.code
    if code.startswith("profiling."):
        return "profile"
    if code.startswith(("grads.", "run.grad")):
        return "grad_history"
    if code.startswith(("activations.", "run.activation", "run.dead")):
        return "act_history"
    if code.startswith("memory."):
        return "mem_history"
    return "run"


def _total_fall(record: RunRecord, t: RunThresholds | None = None) -> float | None:
    """How many times the total gradient norm fell from the first tenth of the samples to
    the last (`_ends`); None with too few samples or no totals."""
    t = t or RunThresholds()
    steps = record.grad_param.steps
    if len(steps) < t.min_samples or len(record.total_norms) != len(steps):
        return None
    ends = _ends(steps, record.total_norms, t.window, frozenset(record.skipped_steps))
    return None if ends is None or not ends[3] > 0 else ends[1] / ends[3]


# Layers outside layer-scaled blocks needed to take the median over them alone.
_MIN_REFERENCE = 3


def _scaled_at_start(record: RunRecord) -> frozenset[str]:
    """The blocks whose branches sat behind a small layer scale at the run's first sample
    (`layer_scaled`, with each module's own weights as read then: by the last sample,
    ConvNeXt's scale of 1e-6 may have grown past the bound)."""
    flow, w = record.last, record.weight
    if flow is None or not w.steps:
        return frozenset()
    numel: dict[str, int] = {}
    for p in flow.params:
        if p.requires_grad and p.tied_to is None:
            numel[p.module] = numel.get(p.module, 0) + p.numel
    first = dict(zip(w.layers, w.values[0], strict=True))

    def scale_of(p: ParamGradRecord) -> float | None:
        norm = first.get(p.module)
        return rms(norm, numel.get(p.module, 0)) if norm is not None and \
            math.isfinite(norm) else None

    return frozenset(layer_scaled(flow, scale_of))


def _zero_weight_steps(record: RunRecord, layer: str) -> frozenset[int]:
    """The sampled steps at which `layer`'s own weights read exactly zero (a zero init)."""
    w = record.weight
    if layer not in w.layers:
        return frozenset()
    return frozenset(s for s, v in zip(w.steps, w.series(layer), strict=True) if v == 0)


def _normalised_after(record: RunRecord, layer: str, t: RunThresholds,
                      skip: frozenset[int]) -> tuple[str, float] | None:
    """Whether a layer's falling gradient is what a normalisation after it does: its
    weights, or its output, grew by `change_ratio` or more while the gradient times them
    stayed within sqrt(`change_ratio`), as when the loss sees the output only through a
    norm and the gradient scales as 1/scale. (A softmax saturating as logits grow loses its
    gradient far faster than they grow.) Returns what grew and by how much, or None."""
    band = math.sqrt(t.change_ratio)
    for what, grown, grads in (("weights", record.weight, record.grad_param),
                               ("output", record.act_std, record.grad_output)):
        if layer not in grown.layers or layer not in grads.layers:
            continue
        w, g = change(grown, layer, t.window, skip), change(grads, layer, t.window, skip)
        if w is None or g is None:
            continue
        growth, fall = w[3] / w[1], g[1] / g[3]
        if growth >= t.change_ratio and 1 / band <= fall / growth <= band:
            return what, growth
    return None


def _graph_cut(record: RunRecord) -> list[Finding]:
    """`run.graph_cut` (warning): trainable modules that ran in the last sampled step's
    forward but that no gradient reached (`NOT_REACHED`), or that ran under `no_grad`
    (`RAN_NO_GRAD`), while a module the forward called after them got one: the loss
    depends on what they computed only through a tensor cut from the graph (a stray
    `.detach()`, `.data`, a round trip through `.item()`/numpy, or `torch.no_grad()`)."""
    flow = record.last
    if flow is None:
        return []
    cut: dict[str, int] = {}
    grads: set[str] = set()
    for p in flow.params:
        if not p.requires_grad or p.tied_to is not None:
            continue
        if p.norm is None and p.reason in (NOT_REACHED, RAN_NO_GRAD):
            cut[p.module] = cut.get(p.module, 0) + 1
        elif p.norm is not None:
            grads.add(p.module)
    # A module whose other parameters got gradients is not cut off: one unused parameter
    # (DINOv2's mask_token, read only with bool_masked_pos) is `grads.unreached`'s.
    cut = {m: n for m, n in cut.items() if m not in grads}
    if not cut or not grads:
        return []
    order = _call_order(record, list(dict.fromkeys([*cut, *grads])))
    position = {m: i for i, m in enumerate(order)}
    last_cut = max(cut, key=lambda m: position[m])
    after = [m for m in order if m in grads and position[m] > position[last_cut]]
    if not after:
        return []  # nothing downstream learns: not a cut between two parts
    nxt = after[0]
    no_grad = any(p.reason == RAN_NO_GRAD for p in flow.params
                  if p.module in cut and p.requires_grad)
    names = sorted(cut, key=lambda m: position[m])
    shown = ", ".join(_name(m) for m in names[:6]) + (", ..." if len(names) > 6 else "")
    how = "ran under torch.no_grad()" if no_grad else "ran in the forward"
    return [_GRAPH_CUT.finding(
        Severity.WARNING,
        f"the graph is cut after {_name(last_cut)}: {sum(cut.values())} trainable "
        f"parameter(s) in {len(cut)} module(s) ({shown}) {how} but got no gradient at step "
        f"{flow.index}, while {_name(nxt)}, which the forward calls after them, got one: "
        "the loss sees their output only through a tensor cut from the graph",
        {"step": flow.index, "modules": len(cut), "params": sum(cut.values()),
         "cut_after": last_cut, "next_with_gradient": nxt, "no_grad": no_grad},
        fix=(f"find the torch.no_grad() block around {_name(last_cut)}" if no_grad else
             f"find the .detach() (or .data, .item(), .numpy(), a new torch.tensor(...)) "
             f"between {_name(last_cut)}'s output and {_name(nxt)}")
            + " in the model's forward and remove it, so that the loss reaches these "
              "layers; if they are meant to stay fixed, freeze them "
              "(requires_grad_(False)) so that the optimizer and DDP skip them",
        module=last_cut)]


# How near 1 a softmax cross-entropy's spread must read (`RunRecord.output_scales`), and
# how near its factor must be to 1 or 1/k.
_SPREAD = 0.99
_FACTOR_TOLERANCE = 0.05


def _accumulation(record: RunRecord) -> list[Finding]:
    """`run.accumulation_undivided`: steps that accumulate k backward passes whose loss
    is each micro-batch's own mean, not divided by k, so the update uses k times the mean
    gradient. Read from the gradient at the model's output where it is the scores of a
    softmax cross-entropy (`RunRecord.output_scales`); info where the data cannot tell.
    A plain loop's fault only: Lightning and the HF Trainer divide by their accumulation
    steps themselves."""
    last = record.last
    micro = 1 if last is None else last.backward_calls
    if micro < 2 or record.scaler or _framework(record) != "plain":
        return []
    factors = [f for f, spread in record.output_scales
               if math.isfinite(f) and math.isfinite(spread) and spread >= _SPREAD]
    evidence: dict[str, float | int | str | None] = {
        "micro_batches": micro, "step": last.index if last else None,
        "measured": len(factors)}
    if not factors:
        return [_ACCUMULATION.finding(
            Severity.INFO,
            f"each step accumulates {micro} backward passes; whether each micro-batch's loss "
            f"is divided by {micro} could not be read: the model's output is not the scores "
            "of a softmax cross-entropy, whose gradient tells the factor",
            evidence, fix="make sure each micro-batch's loss is divided by the number of "
                          f"micro-batches ({micro}) before its backward")]
    factor = statistics.median(factors)
    evidence["factor"] = factor
    if abs(factor - 1) > _FACTOR_TOLERANCE or abs(factor * micro - 1) <= _FACTOR_TOLERANCE:
        return []
    return [_ACCUMULATION.finding(
        Severity.WARNING,
        f"each of the {micro} micro-batches' losses is its own mean, not divided by "
        f"{micro}: the update uses {micro}× the mean gradient (∂loss/∂scores × counted rows "
        f"reads {factor:.3f} at the model's output over {len(factors)} sampled "
        f"forward(s); a loss divided by {micro} reads {1 / micro:.3f})",
        evidence, fix=f"divide each micro-batch's loss by {micro} before its backward "
                      f"((loss / {micro}).backward()), or lower the learning rate {micro}× "
                      "if the sum is meant")]


# Parameter names of an attention's query/key projections (transformers, timm, torch).
_QK = ("q_proj", "k_proj", "query", "key", "c_attn", "qkv", "in_proj", "Wqkv", ".q.", ".k.",
       "q_lin", "k_lin")


def _is_query_key(name: str) -> bool:
    """Whether a module or parameter name is an attention's query or key projection (or a
    fused q/k/v one)."""
    return any(k in name + "." for k in _QK)


def _spikes(record: RunRecord) -> list[Finding]:
    """`run.loss_spike` (warning): a step whose loss (or, where no loss was seen, largest
    per-parameter gradient magnitude) passed 10x the recent median, from the flight
    recorder, which holds every step between two samples; with the layer whose gradient
    rose first in the steps before it and, where that layer says which, the transformer
    instability it points at (Wortsman et al. 2023)."""
    heads = set() if record.activations is None else \
        {r.module for r in record.activations.records if r.model_output}
    out = []
    for sp in record.spikes:
        what = "the loss" if sp.kind == "loss" else \
            "the largest gradient magnitude (no loss was seen)"
        rise = f"over steps {sp.start}–{sp.step}" if sp.start < sp.step else \
            f"at step {sp.step}"
        summary = (f"{what} spiked {rise}: {sp.value:.3g} at step {sp.step}, "
                   f"{fmt_times(sp.value / sp.median)} the recent median ({sp.median:.3g})")
        module = None
        cause = ""
        if sp.first_param is not None:
            module = sp.first_param.rpartition(".")[0]
            summary += (f"; the first gradient to rise was {sp.first_param}'s, at step "
                        f"{sp.first_step}"
                        + (f" ({fmt_times(sp.first_ratio)} its own earlier level at the "
                           "spike)" if sp.first_ratio else ""))
            if _is_query_key(sp.first_param):
                cause = ("; an attention's query/key projection moving first is the "
                         "signature of attention-logit growth (Wortsman et al. 2023): "
                         "normalise queries and keys (qk-layernorm), or lower the "
                         "learning rate")
            elif module in heads or module.split(".")[-1] in ("lm_head", "classifier",
                                                               "head"):
                cause = ("; the output layer moving first is the signature of output-logit "
                         "divergence (Wortsman et al. 2023): add a z-loss (1e-4 · log²Z) "
                         "or lower the learning rate")
        clip = _clip_clause(record)
        fix = ("look at the steps from the rise on: lower the learning rate or lengthen the "
               "warm-up" + (clip if clip else ", and clip gradients (clip_grad_norm_)")
               + "; a spike on one batch only can be a bad sample: check that batch")
        out.append(_LOSS_SPIKE.finding(
            Severity.WARNING, summary + cause,
            {"onset_step": sp.start, "step": sp.step, "value": sp.value,
             "median": sp.median, "kind": sp.kind, "first_param": sp.first_param,
             "first_step": sp.first_step, "first_ratio": sp.first_ratio},
            fix=fix, module=module))
    return out


def _dead_experts(record: RunRecord, t: RunThresholds) -> list[Finding]:
    """Experts of a mixture of experts that no token reached in any sampled step: the
    router never picks them (it collapsed onto the others), and they never learn."""
    found = []
    for use in record.experts:
        dead = [e for e, n in enumerate(use.idle) if n == use.samples]
        if use.samples < t.expert_samples or not dead:
            continue
        shown = ", ".join(map(str, dead[:8])) + (", ..." if len(dead) > 8 else "")
        found.append(_DEAD_EXPERTS.finding(Severity.WARNING,
            f"{_name(use.module)}: {len(dead)} of {len(use.idle)} experts ({shown}) got no "
            f"token in any of the {use.samples} sampled steps: the router never picks them, "
            "and their weights never learn",
            {"experts": ",".join(map(str, dead)), "dead": len(dead), "of": len(use.idle),
             "samples": use.samples, "param": use.param},
            fix="keep the router from collapsing onto a few experts with a load-balancing "
                "loss (transformers: output_router_logits=True, with router_aux_loss_coef "
                "above 0) or, as DeepSeek-V3 trains, by moving each expert's routing bias "
                "(e_score_correction_bias, which transformers does not update) toward the "
                "experts that get too few tokens; look at the router's init and learning "
                "rate too.",
            module=use.module))
    return found


def _eval_mode(record: RunRecord) -> list[Finding]:
    """Steps whose forward ran with the model in eval mode, where the mode changes what it
    computes: after steps in train mode, a `model.eval()` for evaluation left in place."""
    m = record.modes
    if not m.eval or not m.sensitive:
        return []
    what = (f"its {m.sensitive} dropout and batch-norm module(s) computed as at inference "
            "(no dropout; BatchNorm normalising with running statistics, which stop "
            "updating)")
    if m.train:
        return [_EVAL_MODE.finding(Severity.WARNING,
            f"{m.eval} of {m.train + m.eval} steps, from step {m.first_eval}, trained with the "
            f"model in eval mode after steps in train mode: {what}",
            {"eval_steps": m.eval, "train_steps": m.train, "first_step": m.first_eval,
             "modules": m.sensitive},
            fix="call model.train() after evaluating, before the next training step: "
                "model.eval() for an evaluation pass was not undone.")]
    return [_EVAL_MODE.finding(Severity.INFO,
        f"every step ({m.eval}) trained with the model in eval mode: {what}",
        {"eval_steps": m.eval, "train_steps": 0, "first_step": m.first_eval,
         "modules": m.sensitive},
        fix="call model.train() before training, unless eval mode is meant (BatchNorm "
            "statistics kept frozen, no dropout).")]


def _same_batch(record: RunRecord, t: RunThresholds) -> list[Finding]:
    """`run.same_batch` (info): at every pair of consecutive steps compared (each sampled
    step and the next), the model's first training forward got the same input: the loop
    trains on one batch (a `next(iter(loader))` before the loop). Batches that repeat
    with the dataset's length are never consecutive, and a second pass over a step's own
    batch (R-Drop, micro-batches) is no step of its own. Info, not a warning: fitting one
    batch is also a deliberate check of a pipeline."""
    pairs, same = record.same_inputs
    if pairs < t.same_batch_pairs or same < pairs:
        return []
    return [_SAME_BATCH.finding(Severity.INFO,
        f"the model got the same input at consecutive steps in each of the {pairs} pairs "
        f"compared (each sampled step and the next, over {record.steps} steps): the loop "
        "trains on one batch",
        {"pairs": pairs, "same": same, "steps": record.steps},
        fix="draw a new batch at every step (for x, y in loader: ...): a batch taken once "
            "before the loop, as next(iter(loader)) does, is trained on at every step. "
            "Overfitting one batch on purpose (a check of the pipeline) reads the same.")]


def _padding_in_loss(record: RunRecord) -> list[Finding]:
    """`run.padding_in_loss` (warning): labels on padding on the sampled steps
    (`find_padding_in_loss`)."""
    return find_padding_in_loss(
        record.padded_labels, of=_PADDING_IN_LOSS, where="on the sampled steps",
        evidence={"samples": record.samples})


def _through_entries(found: list[Finding]) -> list[Finding]:
    """`found` (made by a shared helper that takes its code as an argument) remade through
    each code's catalogue entry, which checks its severity and gives it its subject."""
    return [declared(f.code).finding(f.severity, f.summary, f.evidence, fix=f.fix,
                                     module=f.module) for f in found]


def _unscaled_float16(record: RunRecord) -> list[Finding]:
    """Steps whose forward ran under float16 autocast with no GradScaler: float16's range
    ends at 6.0e-8, and the backward of a float16 op gives float16 gradients."""
    m = record.modes
    steps = dict(m.autocast).get("torch.float16", 0)  # ModeCounts keeps str(dtype)
    if not steps or record.scaler:
        return []
    return [_FP16_UNSCALED.finding(Severity.WARNING,
        f"{steps} of {m.train + m.eval} steps ran their forward under float16 autocast with "
        "no GradScaler (none was given to the monitor or stepped the optimizer): float16 "
        "gradients below 6.0e-8 "
        "round to zero and those below 6.1e-5 lose precision, so the updates they carry "
        "are lost without a sign",
        {"steps": steps, "of": m.train + m.eval},
        fix="scale the loss with torch.amp.GradScaler (scaler.scale(loss).backward(); "
            "scaler.step(optimizer); scaler.update()), or autocast to torch.bfloat16, which "
            "has float32's range and needs no scaling. A loop that scales another way "
            "(its own loss scale, or a scaler that does not step the optimizer): pass its "
            "scaler=, or the norms here are the scaled ones.")]


def _compiled(record: RunRecord) -> list[Finding]:
    return _through_entries(ran_eagerly(
        _COMPILED_EAGER.code, record.compiled, "the monitor",
        also=", for the whole run: the step times, saved bytes and profile here are the "
             "eager model's"))


@analyzer(RunRecord)
def analyze_run(record: RunRecord, thresholds: RunThresholds | None = None
                ) -> list[Finding]:
    """Every finding about a run, most severe first (`record.findings()`).

    Args:
        record: the run.
        thresholds: where the run's own findings draw their lines; the capabilities'
            analyzers use their defaults.
    """
    t = thresholds or RunThresholds()
    run = _nonfinite(record)
    return rank(_follow_causes(_one_per_cause(
        _fit_framework(record, _findings(record, t, run)))))


# Warnings of one code at this many modules or more are one finding listing them.
_GROUPED = 4


def _one_per_cause(found: list[Finding]) -> list[Finding]:
    """One cause across many modules is one finding: warnings and errors of one code and
    severity at `_GROUPED` modules or more (a learning rate that kills the units of every
    layer: `grads.dead` at each, `activations.dead_units` at each) become the first of
    them, naming the others (`modules` in its evidence)."""
    groups: dict[tuple[str, Severity], list[Finding]] = {}
    for f in found:
        if f.severity >= Severity.WARNING and f.module is not None and \
                "modules" not in f.evidence:
            groups.setdefault((f.code, f.severity), []).append(f)
    merged: dict[int, Finding] = {}
    dropped: set[int] = set()
    for same in groups.values():
        if len(same) < _GROUPED:
            continue
        head, rest = same[0], same[1:]
        names = [_name(f.module) for f in same]
        shown = ", ".join(names[1:6]) + (f" and {len(names) - 6} more" if len(names) > 6
                                         else "")
        merged[id(head)] = dataclasses.replace(
            head, summary=f"{head.summary}; the same at {len(rest)} more modules ({shown})",
            evidence={**head.evidence, "modules": ", ".join(names), "count": len(names)})
        dropped.update(id(f) for f in rest)
    return [merged.get(id(f), f) for f in found if id(f) not in dropped]


def _framework(record: RunRecord) -> str:
    """`hf`, `lightning` or `plain`: who drove the monitor (`RunRecord.producer`)."""
    for name in ("hf", "lightning"):
        if record.producer.endswith("." + name):
            return name
    return "plain"


# How to unfreeze a module's parameters, per framework.
_UNFREEZE = {
    "plain": "if {m} should learn, unfreeze it (for p in model.{m}.parameters(): "
             "p.requires_grad_(True)) before building the optimizer, and pass its "
             "parameters to the optimizer",
    "lightning": "if {m} should learn, unfreeze it in the LightningModule's __init__ (or "
                 "on_fit_start: self.{m}.requires_grad_(True)); configure_optimizers must "
                 "then pass its parameters (self.parameters() does)",
    "hf": "if {m} should learn, unfreeze it before building the Trainer "
          "(model.{m}.requires_grad_(True)); the Trainer's optimizer takes only the "
          "parameters that require grad when it is created",
}


def _fit_framework(record: RunRecord, found: list[Finding]) -> list[Finding]:
    """Findings whose fix depends on the framework the run used, given its fix (a frozen
    layer's: how to unfreeze it)."""
    framework = _framework(record)

    def fitted(f: Finding) -> Finding:
        if f.code == "grads.frozen" and f.module:
            return dataclasses.replace(f, fix=_UNFREEZE[framework].format(m=f.module))
        if f.code in _FRAMEWORK_FIXED and f.severity >= Severity.WARNING:
            fix = declared(f.code).fixes.get(framework)
            if fix:
                return dataclasses.replace(f, fix=fix)
        return f

    return [fitted(f) for f in found]


# Codes whose catalogue entry's per-framework fix replaces the plain loop's under a
# framework (the loop that needs fixing is the framework's).
_FRAMEWORK_FIXED = frozenset({"run.eval_mode", "run.fp16_unscaled"})


def _follow_causes(found: list[Finding]) -> list[Finding]:
    """Symptoms say which cause they follow: a finding whose code a present finding's
    catalogue entry `explains` (`grads.not_zeroed` explains `run.weight_scale`) gets the
    cause's code in its evidence (`follows`) and its summary; `rank` puts the cause
    first."""
    causes: dict[str, str] = {}
    present = {f.code for f in found}
    for f in found:
        for symptom in _explains(f.code):
            if symptom in present and symptom != f.code:
                causes.setdefault(symptom, f.code)
    if not causes:
        return found

    def follow(f: Finding, cause: str) -> Finding:
        return dataclasses.replace(
            f, summary=f"{f.summary} (it follows {cause}: {declared(cause).title.lower()})",
            evidence={**f.evidence, "follows": cause})

    return [follow(f, causes[f.code]) if f.code in causes and "follows" not in f.evidence
            else f for f in found]


def _explains(code: str) -> tuple[str, ...]:
    """The symptoms `code`'s catalogue entry explains (none where it is not declared)."""
    try:
        return declared(code).explains
    except TorchscopeError:
        return ()


def _findings(record: RunRecord, t: RunThresholds, run: list[Finding]) -> list[Finding]:
    """Every finding about the run, unranked."""
    found: Sequence[Finding] = [
        *_stopped(record), *run, *_norm_overflow(record), *_skipped(record, t),
        *_gradient_trends(record, t),
        *_activation_drift(record, t), *_dead_growth(record, t),
        *_saturation_growth(record, t), *_weight_scale(record, t), *_eval_mode(record),
        *_same_batch(record, t), *_graph_cut(record), *_accumulation(record),
        *_spikes(record),
        *_padding_in_loss(record),
        *_unscaled_float16(record), *_compiled(record), *_dead_experts(record, t),
        *_capabilities(record, replaced=bool(run))]
    return list(found)
