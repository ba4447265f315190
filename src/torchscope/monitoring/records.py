"""Frozen records of a monitored training run. They hold numbers, never formatted text."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

from torch import nn

from torchscope.findings import Analyzed
from torchscope.monitoring.history import Bucket

if TYPE_CHECKING:
    from torchscope.capture import ActivationCapture
    from torchscope.grads import BrokenUpdate, GradFlow
    from torchscope.grads.loss import LossBroadcast, LossOnProbabilities
    from torchscope.memory import MemoryWatch
    from torchscope.profiling import ProfileResult

__all__ = ["ExpertUse", "HistoryBudget", "LayerSeries", "ModeCounts", "NonFiniteOnset",
           "RunRecord", "RunStatus", "Spike", "mode_sensitive"]

RunStatus = Literal["completed", "stopped"]


@dataclass(frozen=True)
class LayerSeries:
    """A per-layer number over the sampled steps.

    Attributes:
        name: what it measures (`grad_param`, `grad_output`, `act_std`, `act_zero`,
            `act_dead`, `weight`, `act_sat`; see `torchscope.monitoring.history.METRICS`).
        steps: the sampled steps, oldest first.
        layers: module names (columns).
        values: `[sample][layer]`; NaN where the layer had no such number in that sample.
    """

    name: str
    steps: tuple[int, ...]
    layers: tuple[str, ...]
    values: tuple[tuple[float, ...], ...]

    def series(self, layer: str) -> list[float]:
        """One layer's values over the samples.

        Raises:
            KeyError: unknown layer.
        """
        if layer not in self.layers:
            raise KeyError(f"no layer {layer!r} in the {self.name} series")
        j = self.layers.index(layer)
        return [row[j] for row in self.values]

    def present(self) -> LayerSeries:
        """The same series without the layers that never had a finite value."""
        keep = [j for j in range(len(self.layers))
                if any(math.isfinite(row[j]) for row in self.values)]
        return LayerSeries(self.name, self.steps, tuple(self.layers[j] for j in keep),
                           tuple(tuple(row[j] for j in keep) for row in self.values))


@dataclass(frozen=True)
class NonFiniteOnset:
    """Where NaN/Inf first showed in the run.

    Attributes:
        gradient_step: the first step whose parameter gradients held NaN/Inf, every step
            checked (None: none did, or unchecked: with a GradScaler, such steps are the
            scaler's skipped steps).
        nonfinite_steps: how many steps had NaN/Inf gradients (None when unchecked).
        forward_step: the first sampled step whose forward produced NaN/Inf, or None.
        module: the module that produced it there from finite inputs (None: the input
            already held NaN/Inf, or no forward did).
        module_type: that module's class name.
        between: where no module produced it though the model's input was finite, the
            first watched call that took it in: code between the watched modules made it
            (`activations.nonfinite_between`). None otherwise.
    """

    gradient_step: int | None
    nonfinite_steps: int | None
    forward_step: int | None = None
    module: str | None = None
    module_type: str | None = None
    between: str | None = None


@dataclass(frozen=True)
class Spike:
    """A step whose loss (or, where no loss was seen, largest per-parameter gradient
    magnitude) jumped far above the recent median, from the monitor's flight recorder.

    Attributes:
        step: the first step at `SPIKE_RATIO` times the median or more.
        start: the first step of the rise to it (at 3x the median or more).
        value: the loss (or gradient magnitude) at `step`.
        median: the median of the steps before the rise.
        kind: `loss` or `gradient`: what was measured.
        first_param: the parameter whose gradient magnitude rose 3x its own earlier
            median first in the steps up to the spike (None where none did, or too few
            steps were held).
        first_step: the step it did so.
        first_ratio: its magnitude at the spike over its own earlier median.
    """

    step: int
    start: int
    value: float
    median: float
    kind: str
    first_param: str | None = None
    first_step: int | None = None
    first_ratio: float | None = None


@dataclass(frozen=True)
class ModeCounts:
    """The steps of a run by the model's mode at their forward (`model.training` and the
    autocast state at the step's last forward with gradients on), and whether the train/eval
    mode changes what it computes.

    Attributes:
        train: steps whose forward ran in train mode.
        eval: steps whose forward ran in eval mode.
        first_eval: the first of those (counted from 0), or None.
        sensitive: the model's modules that compute otherwise in eval mode: dropout with
            p > 0, and norms that track running statistics (BatchNorm); 0 when the mode
            changes nothing.
        autocast: the steps whose forward ran under `torch.autocast` on the model's device,
            by its dtype: `(("torch.bfloat16", 12),)`; empty when none did.
    """

    train: int = 0
    eval: int = 0
    first_eval: int | None = None
    sensitive: int = 0
    autocast: tuple[tuple[str, int], ...] = ()

    @property
    def main_autocast(self) -> str | None:
        """The autocast dtype most steps ran under, or None when most ran without."""
        if not self.autocast:
            return None
        dtype, steps = max(self.autocast, key=lambda c: c[1])
        return dtype if 2 * steps >= self.train + self.eval else None

    def with_step(self, training: bool, index: int, autocast: str | None) -> ModeCounts:
        """These counts with one more step, `index`, whose forward ran in this mode."""
        counts = dict(self.autocast)
        if autocast is not None:
            counts[autocast] = counts.get(autocast, 0) + 1
        if training:
            return replace(self, train=self.train + 1, autocast=tuple(counts.items()))
        return replace(self, eval=self.eval + 1, autocast=tuple(counts.items()),
                       first_eval=index if self.first_eval is None else self.first_eval)


def mode_sensitive(model: nn.Module) -> int:
    """The modules of `model` whose output depends on its mode: dropout with p > 0, norms
    that track running statistics."""
    return sum(1 for m in model.modules()
               if (isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0)
               or (isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats))


@dataclass(frozen=True)
class ExpertUse:
    """How often each expert of a mixture of experts got no gradient over the run's sampled
    steps (`GradFlow.idle_experts`: no token reached it).

    Attributes:
        module: the experts module (transformers' `...Experts`, or an `nn.ModuleList`
            named `experts`).
        param: its first fused weight, whose gradient was read per expert; "" where the
            experts are modules of their own.
        samples: sampled steps that read it.
        idle: per expert, of those samples, the ones in which no gradient reached it.
    """

    module: str
    param: str
    samples: int
    idle: tuple[int, ...]


@dataclass(frozen=True)
class HistoryBudget:
    """What bounds the run's memory, as configured and as used.

    Attributes:
        capacity: rows of the whole-run (decimated) view.
        recent: rows of the ring buffer of the newest samples.
        stride: one sample in `stride` is in the whole-run view now.
        rows: rows held at the end.
        bytes: the most the rows can take for the layers seen (`SampleHistory.budget_bytes`).
        bucket_width: steps merged per bucket of the per-step series.
    """

    capacity: int
    recent: int
    stride: int
    rows: int
    bytes: int
    bucket_width: int


@dataclass(frozen=True)
class RunRecord(Analyzed):
    """Everything one monitored run measured; `findings()` are `analyze_run`'s.

    Attributes:
        model: the model's class name.
        parameters: parameter elements.
        trainable: of them, those that require grad.
        inputs: the shapes of the first forward's inputs (`ModelInputs.describe()`).
        device: where the model's parameters were.
        every: one step in `every` is sampled.
        step_by: what ended a step (`optimizer`, `micro_batches`, `inferred`, `manual`).
        steps: steps completed in this run.
        samples: steps sampled.
        status: `completed`, or `stopped` (an exception ended the run).
        error: the exception that stopped it, in one line; empty otherwise.
        seconds: wall time of the run.
        grad_param: per-layer parameter-gradient norms (modules owning parameters).
        grad_output: per-layer norms of the gradient arriving at each module.
        total_norms: per sample (the steps of `grad_param`), the total gradient norm.
        applied_norms: per sample, the total norm of the gradients the update used where the
            loop changed them before it (clipping: `GradFlow.applied_norm`), else None;
            empty where no sample's were.
        act_std: per-layer output standard deviation of the sampled forward.
        act_zero: per-layer fraction of exactly-zero outputs.
        act_dead: per-layer fraction of dead units (ReLU family), NaN elsewhere.
        step_ms: wall time between step ends, in buckets of consecutive steps.
        device_peak: the device's peak allocated memory during each step, in buckets
            (empty where the device does not report it: CPU).
        saved_bytes: per sample, activations the sampled forward saved for backward (None
            where memory was not measured: not watched, or a sampled step between two
            measured ones; see `monitor`'s `memory`).
        skipped: steps the GradScaler skipped.
        skipped_steps: the newest of them.
        onset: where NaN/Inf first showed.
        budget: the history's bounds.
        last: the last sampled step's `GradFlow` in full.
        activations: the capture of the last sampled forwards (None when not watched).
        memory: the saved-activation watch (None when not watched).
        profile: the profiled window (None when not profiled or it did not complete).
        profile_note: why there is no profile when one was asked for.
        optimizer: the optimizer's class name (None: none was given).
        scaler: whether a GradScaler scaled the loss.
        compiled: the model's `torch.compile`d parts (`""` is the root): they ran eagerly
            for the whole run, as every capability runs them while its hooks are on.
        backwards: backward passes of the model in the run (`GradWatch.backwards`).
        passes_without_update: backward passes that added to no parameter of the model,
            left out (`GradWatch.passes_without_update`).
        unzeroed_steps: optimizer steps whose gradients still held the previous step's
            (`GradWatch.unzeroed_steps`), and the first of them.
        cleared_steps: optimizer steps whose gradients the loop set to None between the
            backward and the step (`GradWatch.cleared_steps`), and the first of them.
        modes: the steps by the model's mode at their forward.
        weight: per-layer norm of the layer's own parameters, read with their gradients.
        experts: per fused experts module of a mixture of experts, how often each expert
            got no gradient over the sampled steps.
        act_sat: per-layer fraction of values in the saturated tails of bounded
            activations (tanh, sigmoid: `TensorStats.saturated_frac`), NaN elsewhere.
        grad_weight: per-layer gradient norm of the layer's own weight matrices and
            kernels (2+ dimensions; all its parameters where it has none): biases and norm
            gains are sums over the batch, on another scale (`GradFlow.layer_grads`).
        update: per-layer update ratio ‖Δw‖/‖w‖ of those weight matrices at each sampled
            step (NaN where the update was not measured: no optimizer given).
        unoptimized: trainable parameters that got gradients that no optimizer stepped
            (`GradWatch.unoptimized`).
        param_groups: the optimizer's (learning rate, weight decay) per parameter group:
            the largest learning rate read at a sampled step or at the run's end (a
            schedule's peak, not the 0 a linear decay ends at); empty without an optimizer.
        broken_update: the first sampled step's optimizer update that wrote NaN/Inf into
            finite weights (`GradWatch.broken_update`), or None.
        loss_broadcast: where the loop's loss broadcast the model's output against its
            target into every pair of the two (`GradWatch.loss_broadcast`: read from the
            loss the model returns, or from one handed to `Monitor.check_loss`, as the
            Lightning callback does), or None.
        loss_on_probabilities: where that loss applied its own softmax or sigmoid to an
            output that already went through one (`GradWatch.loss_on_probabilities`), or
            None.
        same_inputs: (pairs of consecutive steps whose inputs were compared, pairs whose
            inputs were the same): each sampled step's first training forward against the
            next step's, by fingerprint (shapes, dtypes, each tensor's sum and L2
            norm). (0, 0) where no step ended at an optimizer step or `end_step()`.
        padded_labels: (label positions that the attention mask pads and the loss reads,
            those of them whose label is not -100, so that the loss counts them), over
            the sampled steps' training forwards of a transformers model (the watched one,
            or the outermost ones inside it, as a LightningModule's `self.model`) given
            `labels` and an `attention_mask` of one shape; (0, 0) elsewhere (an encoder-decoder,
            whose labels are the decoder's, included). A causal language model's loss
            shifts its labels and never reads position 0, which is left out.
        output_scales: per read sampled training forward whose output (a tensor of
            scores, the last dim the classes) got a gradient (the first 8 such forwards,
            then one in 16: the factor is the loop's code's), the newest 32: (s × rows,
            spread),
            where a mean softmax cross-entropy times a factor gives ∂loss/∂z = s (softmax(z)
            - onehot) over its counted rows; spread is 1 for such a loss, and s × rows is
            then the factor (1 for a plain mean, 1/k for a mean divided by k micro-batches).
        spikes: loss (or gradient) spikes the flight recorder found between and at the
            samples, at most five, with the layer that moved first before each.
        first_step: the index of the run's first step: 0, or where a framework's run
            resumed from a checkpoint, its global step then. Step indices (samples,
            findings, buckets) count from it; `steps` counts this run's steps only.
        loss_seen: whether a loss of the run was read (one the model returned, or one
            handed to `check_loss`): without one, the loss's own checks did not run.
        producer: who drove the monitor (`torchscope.monitor`, or a framework callback's
            module), as report.json's options say.
        clip_setting: the framework's setting by which the loop clips gradients
            (`max_grad_norm=1.0` under the HF Trainer, `gradient_clip_val=0.5` under
            Lightning), given by its callback; empty in a plain loop or without clipping.
        resumed_at: the steps at which the run was resumed into the report it continues
            (`out`'s report of the run before: its samples before the step are the series'
            first ones), oldest first; empty for a run that continues none.
    """

    model: str
    parameters: int
    trainable: int
    inputs: str
    device: str
    every: int
    step_by: str
    steps: int
    samples: int
    status: RunStatus
    error: str
    seconds: float
    grad_param: LayerSeries
    grad_output: LayerSeries
    total_norms: tuple[float, ...]
    act_std: LayerSeries
    act_zero: LayerSeries
    act_dead: LayerSeries
    step_ms: tuple[Bucket, ...]
    device_peak: tuple[Bucket, ...]
    saved_bytes: tuple[int | None, ...]
    skipped: int
    skipped_steps: tuple[int, ...]
    onset: NonFiniteOnset
    budget: HistoryBudget
    applied_norms: tuple[float | None, ...] = ()
    last: GradFlow | None = None
    activations: ActivationCapture | None = None
    memory: MemoryWatch | None = None
    profile: ProfileResult | None = None
    profile_note: str = ""
    optimizer: str | None = None
    scaler: bool = False
    compiled: tuple[str, ...] = ()
    backwards: int = 0
    passes_without_update: int = 0
    unzeroed_steps: int = 0
    first_unzeroed: int | None = None
    cleared_steps: int = 0
    first_cleared: int | None = None
    modes: ModeCounts = field(default_factory=ModeCounts)
    weight: LayerSeries = field(default_factory=lambda: LayerSeries("weight", (), (), ()))
    experts: tuple[ExpertUse, ...] = ()
    act_sat: LayerSeries = field(default_factory=lambda: LayerSeries("act_sat", (), (), ()))
    grad_weight: LayerSeries = field(
        default_factory=lambda: LayerSeries("grad_weight", (), (), ()))
    update: LayerSeries = field(default_factory=lambda: LayerSeries("update", (), (), ()))
    unoptimized: tuple[str, ...] = ()
    param_groups: tuple[tuple[float, float], ...] = ()
    broken_update: BrokenUpdate | None = None
    loss_broadcast: LossBroadcast | None = None
    loss_on_probabilities: LossOnProbabilities | None = None
    same_inputs: tuple[int, int] = (0, 0)
    padded_labels: tuple[int, int] = (0, 0)
    output_scales: tuple[tuple[float, float], ...] = ()
    spikes: tuple[Spike, ...] = ()
    clip_setting: str = ""
    first_step: int = 0
    loss_seen: bool = True
    producer: str = "torchscope.monitor"
    resumed_at: tuple[int, ...] = ()

    @property
    def median_step_ms(self) -> float | None:
        """The median step time over the buckets' means, weighted by their steps; None
        before any step."""
        if not self.step_ms:
            return None
        ordered = sorted(self.step_ms, key=lambda b: b.mean)
        half = sum(b.count for b in ordered) / 2
        seen = 0
        for b in ordered:
            seen += b.count
            if seen >= half:
                return b.mean
        return ordered[-1].mean
