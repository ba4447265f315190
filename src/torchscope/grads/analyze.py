"""Diagnosis of gradient flow: pure functions from records to `Finding`s.

`diagnose` is the analyzer of `GradFlow` and `diagnose_watch` that of `GradWatch`; read them
as `flow.findings()` and `watch.findings()`.

Vanishing and exploding are judged on scale-free measures across depth (`depth_profile`),
never on raw norms of tensors of different sizes: a 10-100x spread between a head and a stem
is ordinary at initialisation. docs/diagnosis.md gives every criterion and its source.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from torchscope._util import common_parent, fit_line, fmt_names, fmt_times, is_norm_type
from torchscope.catalogue import entry
from torchscope.errors import TorchscopeError
from torchscope.findings import Entry, Finding, Severity, analyzer, rank
from torchscope.grads.flow import GradWatch
from torchscope.grads.loss import LossBroadcast, LossOnProbabilities
from torchscope.grads.ranks import rank_findings
from torchscope.grads.records import (
    NO_GRAD,
    NOT_REACHED,
    NOT_RUN,
    RAN_IN_REENTRANT_CHECKPOINT,
    RAN_NO_GRAD,
    BrokenUpdate,
    GradFlow,
    GradHistory,
    LayerGrads,
    ModuleGradRecord,
    ParamGradRecord,
    combine_norms,
    ratio,
    rms,
)
from torchscope.hooks.compiled import ran_eagerly, unseen_forward

__all__ = [
    "DepthProfile",
    "DepthUnit",
    "GradThresholds",
    "Trend",
    "depth_profile",
    "diagnose",
    "diagnose_history",
    "diagnose_watch",
    "find_broken_update",
    "find_cleared",
    "find_clipping",
    "find_dead",
    "find_exploding",
    "find_frozen",
    "find_frozen_zero",
    "find_idle_forwards",
    "find_loss_broadcast",
    "find_loss_on_probabilities",
    "find_nonfinite",
    "find_not_optimized",
    "find_not_zeroed",
    "find_padding_in_loss",
    "find_stale_weights",
    "find_unreached",
    "find_unseen_forward",
    "find_update_ratio",
    "find_vanishing",
    "layer_norms",
    "layer_scaled",
    "unit_name",
]

# Every finding made here, from its catalogue entry (torchscope.catalogue._grads).
_CLEARED_BEFORE_STEP = entry("grads.cleared_before_step")
_CLIPPED = entry("grads.clipped")
_COMPILED_EAGER = entry("grads.compiled_eager")
_DEAD = entry("grads.dead")
_EXPLODING = entry("grads.exploding")
_FROZEN = entry("grads.frozen")
_FROZEN_ZERO = entry("grads.frozen_zero")
_IDLE_FORWARD = entry("grads.idle_forward")
_LOSS_BROADCAST = entry("grads.loss_broadcast")
_LOSS_ON_PROBABILITIES = entry("grads.loss_on_probabilities")
_NO_STEP = entry("grads.no_step")
_NO_UPDATE = entry("grads.no_update")
_NONFINITE = entry("grads.nonfinite")
_NONFINITE_UPDATE = entry("grads.nonfinite_update")
_NOT_OPTIMIZED = entry("grads.not_optimized")
_NOT_ZEROED = entry("grads.not_zeroed")
_PADDING_IN_LOSS = entry("grads.padding_in_loss")
_STALE_WEIGHTS = entry("grads.stale_weights")
_UNREACHED = entry("grads.unreached")
_UNSEEN_FORWARD = entry("grads.unseen_forward")
_UPDATE_RATIO = entry("grads.update_ratio")
_VANISHING = entry("grads.vanishing")
_ZERO_INIT = entry("grads.zero_init")

Metric = Literal["grad_output", "params"]
Measure = Literal["relative", "rms", "output_rms"]

# Activations whose derivative is at most 1/4 (sigmoid) or 1 (tanh) and tends to 0 when they
# saturate: the classic cause of vanishing gradients (Glorot & Bengio 2010).
_SATURATING = frozenset({"Sigmoid", "Tanh", "Hardsigmoid", "Hardtanh", "Softsign", "LogSigmoid"})


@dataclass(frozen=True)
class GradThresholds:
    """Where the diagnosis draws its lines (docs/diagnosis.md says why each is where it is).

    Attributes:
        possible: change across depth (the fitted factor between the nearest and the
            farthest position, see `Trend`) from which a trend is reported as possible
            (info).
        likely: the change from which it is likely (warning).
        severe: the change from which the first layers effectively stop learning (error).
        consistency: smallest R² of the log-linear fit for a change to count as a steady
            geometric trend.
        min_positions: depth positions a trend needs (the one nearest the loss is left
            out, see `depth_profile`).
        bottleneck: ratio between the largest measure and a smaller one farther from the
            loss, in both parameter measures, reported as a possible bottleneck when the
            decay is not steady.
        exploding_norm: a total gradient norm above this is exploding (warning).
        exploding_error_norm: the same for an error.
        dead_norm: a gradient whose norm is at most this counts as all-zero.
        growth_ratio: in a history, last / first total norm at or above which the norm is
            growing out of bounds.
        update_high: median update ratio ‖Δw‖/‖w‖ over the layers from which the step
            likely moves the weights too far (warning); about 1e-3 is the usual figure.
        update_elevated: the median update ratio reported as possibly high (info).
        update_low: the median update ratio below which the step possibly barely moves
            the weights (info).
        clipped_by: in a history, the median factor by which the loop's clipping shrank
            the gradients on the clipped samples, from which clipping on half the samples
            or more is said (`grads.clipped`).
        stale_warn: the share of half-precision weights with a gradient that an update
            left as they were (rounded back: `ParamGradRecord.update_stale`) from which
            `grads.stale_weights` is a warning. A bfloat16 GPT-2 under AdamW keeps 83 % at
            lr 1e-5, 15 % at 1e-4 and 1.5 % at 1e-3.
        stale_info: the share from which it is an info.
    """

    possible: float = 10.0
    likely: float = 100.0
    severe: float = 1e5
    consistency: float = 0.75
    min_positions: int = 3
    bottleneck: float = 1e3
    exploding_norm: float = 1e3
    exploding_error_norm: float = 1e6
    dead_norm: float = 0.0
    growth_ratio: float = 100.0
    update_high: float = 1e-1
    update_elevated: float = 1e-2
    update_low: float = 1e-5
    clipped_by: float = 2.0
    stale_warn: float = 0.5
    stale_info: float = 0.1


def layer_norms(flow: GradFlow, metric: Metric = "grad_output") -> list[tuple[str, float]]:
    """Raw per-layer norms in backward order (nearest the loss first), finite and positive
    only: for display. The diagnosis compares scale-free measures instead (`depth_profile`).

    Layers are the recorded modules that own parameters, or every recorded module when
    none does. "grad_output" combines all calls and micro-batches of a module; "params"
    combines the module's own parameter gradients.

    Raises:
        TorchscopeError: `metric` is neither "grad_output" nor "params".
    """
    owners = {r.module for r in flow.modules if r.owns_params}
    order = [m for m in flow.layers() if not owners or m in owners]
    if metric == "params":
        source = flow.param_norms()
    elif metric == "grad_output":
        source = flow.output_norms()
    else:
        raise TorchscopeError(f"metric={metric!r} is not a gradient metric; expected "
                              "'grad_output' or 'params'.",
                              fix="pass metric='grad_output' or metric='params'.")
    out = []
    for m in order:
        n = source.get(m)
        if n is not None and math.isfinite(n) and n > 0:
            out.append((m, n))
    return out


# ---------------------------------------------------------------------- depth profile
@dataclass(frozen=True)
class DepthUnit:
    """One position in depth: a repeated block (`model.layers.3`) or a single module.

    Attributes:
        name: the block's or module's qualified name.
        modules: the weighted modules it holds, in backward order.
        relative: `‖g‖/‖w‖` of their weight matrices together.
        rms: RMS of their weight matrices' gradients together.
        output_rms: RMS of the gradient arriving at their outputs together.
    """

    name: str
    modules: tuple[str, ...]
    relative: float | None
    rms: float | None
    output_rms: float | None

    def measure(self, which: Measure) -> float | None:
        """One of the measures by name, only when finite and positive (a log is taken)."""
        v = {"relative": self.relative, "rms": self.rms, "output_rms": self.output_rms}[which]
        return v if v is not None and math.isfinite(v) and v > 0 else None


@dataclass(frozen=True)
class Trend:
    """A log-linear fit of one measure against depth, from near the loss toward the input.

    Attributes:
        measure: "relative", "rms" or "output_rms".
        positions: how many positions were fitted.
        first: the fitted position nearest the loss.
        last: the fitted position farthest from it (nearest the input).
        per_position: fitted factor from one position to the next toward the input (< 1
            shrinks, > 1 grows).
        change: fitted factor from `first` to `last`: `per_position ** (positions - 1)`.
        r2: coefficient of determination of the fit of log10(measure): 1 for a steady
            geometric trend, near 0 when the values scatter around a flat line.
    """

    measure: str
    positions: int
    first: str
    last: str
    per_position: float
    change: float
    r2: float

    @property
    def decay(self) -> float:
        """How many times smaller the measure ends than it starts (1/change)."""
        return 1.0 / self.change

    def steady(self, consistency: float) -> bool:
        """Whether the trend is a steady geometric one (R² at least `consistency`)."""
        return self.r2 >= consistency


@dataclass(frozen=True)
class DepthProfile:
    """The measures across depth that vanishing and exploding are judged on.

    Attributes:
        units: depth positions in backward order (0 is nearest the loss).
        body: the positions fitted: the units from the first repeated block on (a
            classifier, an LM head or BERT's pooler, nearer the loss and in no repeated
            block, routinely gets 10-1000x the body's relative gradient at
            initialisation); without repeated blocks, every unit but the nearest.
        excluded: modules left out of the profile and why (embeddings, tied weights,
            a block's matrices behind a small layer scale).
        follows: for body units in no repeated block whose place the records show
            (`_branch_links`), the unit whose gradient feeds theirs: a body unit's name, or
            None where it is fed from a call nearer the loss than the body (the head), so
            that it starts a branch of its own. A unit the records do not place is absent.
    """

    units: tuple[DepthUnit, ...]
    body: tuple[DepthUnit, ...]
    excluded: tuple[tuple[str, str], ...]
    follows: tuple[tuple[str, str | None], ...] = ()

    @property
    def stacks(self) -> tuple[tuple[DepthUnit, ...], ...]:
        """The body split into stacks of repeated blocks, in backward order: units whose
        names agree up to their first index (`model.decoder.layers`, `model.encoder.layers`;
        a ResNet's `stages.2.layers.1` and `stages.1.layers.0` are one stack, and so are
        torchvision's `layer1.0` and `layer4.1`). A trend is
        fitted within a stack, never across two: an encoder's gradient comes from every
        decoder layer at once, through cross-attention, not from the decoder's last block,
        so the step between two stacks is no layer-by-layer decay (a transformers BART at
        initialisation: level within each stack, 90-250x lower in the encoder). Units in no
        repeated block stay with the stack before them, unless `follows` places them: one
        fed from nearer the loss than the body starts a stack of its own (a parallel
        branch: an RNN cell beside an RNN stack, both read by one head), and one fed by a
        body unit continues that unit's stack, or forks it when the unit is not that
        stack's last."""
        out: list[list[DepthUnit]] = []
        keys: list[str | None] = []
        follows = dict(self.follows)
        for u in self.body:
            key = _stack_name(u.name)
            if key is None and u.name in follows:
                feed = follows[u.name]
                at = next(((k, j) for k in range(len(out) - 1, -1, -1)
                           for j, v in enumerate(out[k]) if v.name == feed), None)
                if at is None:  # fed from the head or the loss: a branch of its own
                    out.append([u])
                    keys.append(None)
                elif at[1] == len(out[at[0]]) - 1:
                    out[at[0]].append(u)
                else:  # fed by a unit inside a stack: a fork off it
                    out.append([*out[at[0]][: at[1] + 1], u])
                    keys.append(keys[at[0]])
                continue
            if out and (key is None or key == keys[-1] or keys[-1] is None):
                out[-1].append(u)
                if keys[-1] is None:
                    keys[-1] = key
            else:
                out.append([u])
                keys.append(key)
        return tuple(tuple(stack) for stack in out)

    def trend(self, which: Measure, stack: int | None = None) -> Trend | None:
        """The fit of one measure over the body, or over one of its `stacks`; None with
        fewer than two values."""
        units = self.body if stack is None else self.stacks[stack]
        pts = [(i, u) for i, u in enumerate(units) if u.measure(which) is not None]
        if len(pts) < 2:
            return None
        xs = [float(i) for i, _ in pts]
        slope, r2 = fit_line(xs, [math.log10(u.measure(which) or 1.0) for _, u in pts])
        span = xs[-1] - xs[0]
        return Trend(which, len(pts), pts[0][1].name, pts[-1][1].name, 10.0 ** slope,
                     10.0 ** (slope * span), r2)


def unit_name(module: str) -> str:
    """The repeated block a module belongs to: its name up to the last numeric component
    (`model.layers.3.mlp.up_proj` -> `model.layers.3`); the module itself without one."""
    parts = module.split(".")
    idx = [i for i, p in enumerate(parts) if p.isdigit()]
    return ".".join(parts[: idx[-1] + 1]) if idx else module


# A block's branch behind a per-channel gain of this RMS or less gets that much of the
# stream's gradient: 10x less and more, the size of a "possible" trend.
_LAYER_SCALE_RMS = 0.1


def layer_scaled(flow: GradFlow,
                 scale_of: Callable[[ParamGradRecord], float | None] | None = None,
                 ) -> dict[str, str]:
    """Repeated blocks whose branches sit behind a small layer scale, each with the scale's
    name: a trainable one-dimensional parameter of RMS at most `_LAYER_SCALE_RMS`, neither a
    bias nor a norm layer's gain, in the block (ConvNeXt's `layer_scale_parameter` starts
    at 1e-6, DINOv2's `lambda1` and CaiT's at 1e-5). Until it grows, the block's matrices
    get gradient scaled by it, while the stem and the head on the residual stream do not:
    a step in the profile that is no decay across depth.

    Args:
        flow: the step whose parameters are read.
        scale_of: a parameter's RMS at another time than `flow`'s (a run's first sample,
            before the scale grew); its RMS in `flow` by default.
    """
    types = {r.module: r.module_type for r in flow.modules}
    out: dict[str, str] = {}
    for p in flow.params:
        t = types.get(p.module)
        if not p.requires_grad or p.tied_to is not None or len(p.shape) != 1 \
                or p.name.endswith("bias") or t is None or is_norm_type(t):
            continue
        scale = rms(p.weight_norm, p.numel) if scale_of is None else scale_of(p)
        unit = unit_name(p.module)
        if scale is not None and scale <= _LAYER_SCALE_RMS and _in_block(unit):
            out.setdefault(unit, p.name)
    return out


def depth_profile(flow: GradFlow) -> DepthProfile:
    """Scale-free gradient measures per depth position, in backward order.

    The layers are the reached modules with weight matrices or kernels (Linear, Conv,
    GPT-2's Conv1D, ...); embeddings are left out (a lookup's gradient touches only the rows
    of the tokens in the batch, so its RMS says how many rows were used), and so are tied
    weights (used at two depths at once). Layers of one repeated block (a name with an
    index, `encoder.layer.3.*`) make one position, their measures combined over all their
    matrices: so the attention query/key projections, whose gradients are small at
    initialisation while the attention is near uniform, do not pass for a vanishing layer.
    """
    excluded: list[tuple[str, str]] = []
    groups: dict[str, list[LayerGrads]] = {}
    layers = sorted((lg for lg in flow.layer_grads() if lg.order is not None),
                    key=lambda lg: lg.order or 0)
    dims = {p.name: len(p.shape) for p in flow.params}
    scaled = layer_scaled(flow)
    for lg in layers:
        if not any(dims[p] >= 2 for p in lg.params):  # no weight matrix (norms, biases only)
            continue
        if "Embedding" in lg.module_type:
            excluded.append((lg.module, "embedding"))
            continue
        if lg.tied:
            excluded.append((lg.module, "tied weight"))
            continue
        unit = unit_name(lg.module)
        if unit in scaled:
            excluded.append((lg.module, f"behind a layer scale ({scaled[unit]})"))
            continue
        groups.setdefault(unit, []).append(lg)
    units: list[DepthUnit] = []
    for name, lgs in groups.items():
        g = combine_norms(lg.grad_norm for lg in lgs)
        w = combine_norms(lg.weight_norm for lg in lgs) \
            if all(lg.weight_norm is not None for lg in lgs) else None
        o = combine_norms(lg.output_norm for lg in lgs)
        units.append(DepthUnit(
            name, tuple(lg.module for lg in lgs), ratio(g, w),
            rms(g, sum(lg.numel for lg in lgs)),
            rms(o, sum(lg.output_numel for lg in lgs if lg.output_norm is not None))))
    # The head: the units nearer the loss than the first repeated block, at least one.
    first_block = next((i for i, u in enumerate(units) if _in_block(u.name)), 1)
    body = tuple(units[max(first_block, 1):])
    return DepthProfile(tuple(units), body, tuple(excluded),
                        _branch_links(flow, tuple(units), body))


# Two norms of one gradient tensor, read at two places (a module's grad_input and the next
# one's grad_output), or of its parts and the whole (squares summed), agree to this relative
# difference at most: norms are kept as float32 (a relative step of 6e-8) and summed in
# one order or another.
_SAME_GRAD = 1e-6


def _same(a: float, b: float) -> bool:
    return abs(a - b) <= _SAME_GRAD * max(abs(a), abs(b))


def _branch_links(flow: GradFlow, units: tuple[DepthUnit, ...], body: tuple[DepthUnit, ...]
                  ) -> tuple[tuple[str, str | None], ...]:
    """Where each body unit in no repeated block is fed from, as far as the records show:
    the unit whose call passes down the gradient that arrives at the unit's nearest call, or
    None for one nearer the loss than the body (the head; `DepthProfile.follows`).

    Backward order alone does not say it: autograd runs a branch built later in the forward
    before an earlier one, so a Python-looped RNN cell beside an RNN stack, both read by one
    head, comes between the head and the stack, and fitted as one series it looked like a
    145x decay over 4 layers of a healthy model. The records name no edges, but a gradient
    tensor has one norm wherever it is read. A call is fed by the nearer call that passed
    down a gradient of its output's shape and norm (`_SAME_GRAD`), or, when its output's
    gradient is one part of a nearer call's input gradient (a `torch.cat` or slices), by
    that call where another call's output gradient is the rest: the norms' squares add up.
    The walk goes from the unit's nearest call through leaf modules (an activation, a norm,
    a pooling) until it meets a unit's module; a unit it cannot place is left out and keeps
    its place by backward order."""
    calls = [r for r in flow.modules if r.order is not None]
    member = {m: u.name for u in units for m in u.modules}
    names = {r.module for r in flow.modules}
    inner = {n.rpartition(".")[0] for n in names if n}  # "" (the root) for a top-level one
    # Containers pass their first child's input gradient on as their own: leave them out.
    nodes = [r for r in calls if r.module in member or r.module not in inner]
    outs = sorted((g.norm * g.norm, r.order or 0, r.key)
                  for r in nodes for g in r.grad_output
                  if g.norm is not None and math.isfinite(g.norm) and g.norm > 0)
    squares = [o[0] for o in outs]

    def feeder(x: ModuleGradRecord) -> ModuleGradRecord | None:
        xo = x.order or 0
        nearer = [r for r in nodes if (r.order or 0) < xo]
        got = [g for g in x.grad_output
               if g.norm is not None and math.isfinite(g.norm) and g.norm > 0]
        direct = [r for r in nearer for g in r.grad_input for o in got
                  if g.norm is not None and g.shape == o.shape and _same(g.norm, o.norm or 0.0)]
        if direct:  # the nearest: a module's input gradient is also its container's
            return max(direct, key=lambda r: r.order or 0)
        for r in sorted(nearer, key=lambda r: -(r.order or 0)):
            for g in r.grad_input:
                if g.norm is None or not math.isfinite(g.norm):
                    continue
                for o in got:
                    rest = g.norm * g.norm - (o.norm or 0.0) ** 2
                    if rest <= _SAME_GRAD * g.norm * g.norm:
                        continue
                    i = bisect.bisect_left(squares, rest * (1 - 2 * _SAME_GRAD))
                    while i < len(outs) and outs[i][0] <= rest * (1 + 2 * _SAME_GRAD):
                        if outs[i][2] != x.key and outs[i][1] > (r.order or 0):
                            return r
                        i += 1
        return None

    out: list[tuple[str, str | None]] = []
    inside = {u.name for u in body}
    for u in body:
        if _in_block(u.name):
            continue
        mine = [r for r in nodes if r.module in u.modules]
        if not mine:
            continue
        cur: ModuleGradRecord | None = min(mine, key=lambda r: r.order or 0)
        while cur is not None:
            cur = feeder(cur)
            at = None if cur is None else member.get(cur.module)
            if cur is not None and at is not None and at != u.name:
                out.append((u.name, at if at in inside else None))
                break
    return tuple(out)


def _stack_name(unit: str) -> str | None:
    """The stack a unit's repeated block belongs to: its name up to the first index
    (`model.decoder.layers.3` -> `model.decoder.layers`), with the numbers that end a name
    taken off (torchvision's `layer1` ... `layer4` are one chain of stages); None outside
    any block."""
    parts = unit.split(".")
    first = next((i for i, p in enumerate(parts) if p.isdigit()), None)
    return None if first is None else ".".join(p.rstrip("0123456789") for p in parts[:first])


def _in_block(unit: str) -> bool:
    """Whether a unit is one of a repeated block (its name has an index)."""
    return any(part.isdigit() for part in unit.split("."))


# ---------------------------------------------------------------------- advice
# Weights this far below (or above, inverted) std 1/sqrt(fan_in) are an init far off the
# usual ones (Kaiming's with ReLU is 1.41 of it; transformers' std 0.02 is 0.18 of it at a
# width of 64 and 1.3 at 4096).
_SMALL_INIT = 0.25


def _model_kinds(flow: GradFlow, between: tuple[str, str] | None = None
                 ) -> tuple[frozenset[str], bool]:
    """The saturating activations the step ran through, and whether it has norm layers.

    Args:
        between: the depth units (`DepthUnit.name`) nearest to and farthest from the loss
            of the stretch judged: only the saturating activations whose calls lie between
            them in backward order count (a generator's output Tanh, above its nearest
            layer, is none of the stretch's).
    """
    types = {r.module_type for r in flow.modules}
    saturating = types & _SATURATING
    if between is not None:
        reached = [(r.order, r) for r in flow.modules if r.order is not None]
        near = min((o for o, r in reached if _within(r.module, between[0])), default=None)
        last = max((o for o, r in reached if _within(r.module, between[1])), default=None)
        if near is not None and last is not None:
            saturating = {r.module_type for o, r in reached if near < o < last
                          and r.module_type in _SATURATING}
    return frozenset(saturating), any(is_norm_type(t) for t in types)


def _vanishing_fix(flow: GradFlow, between: tuple[str, str] | None = None) -> str:
    saturating, has_norm = _model_kinds(flow, between)
    parts = []
    if saturating:
        parts.append(f"replace the saturating {'/'.join(sorted(saturating))} between layers "
                     "with ReLU/GELU-family activations")
    parts.append("initialise for the activation (Kaiming for ReLU-family, Xavier/Glorot for "
                 "tanh)")
    if not has_norm:
        parts.append("add normalization (BatchNorm/LayerNorm) between layers")
    else:
        parts.append("check that the normalization layers' gain (weight) does not start small")
    parts.append("add residual connections, or shorten the path from the loss to the first "
                 "layers")
    return "; ".join(parts) + "."


def _init_scale(flow: GradFlow) -> float | None:
    """How the weight matrices of the depth profile's layers compare with an init of std
    1/sqrt(fan_in): the median over them of `rms(w) * sqrt(fan_in)` (1 for LeCun's init,
    1.41 for Kaiming's with ReLU); None without weights read."""
    layers = {m for u in depth_profile(flow).units for m in u.modules}
    types = {r.module: r.module_type for r in flow.modules}
    scales = []
    for p in flow.params:
        if p.module not in layers or len(p.shape) < 2 or not p.weight_norm:
            continue
        # GPT-2's Conv1D keeps its weight as (in, out); Linear and Conv as (out, in, ...).
        fan_in = p.shape[0] if types.get(p.module) == "Conv1D" else math.prod(p.shape[1:])
        scales.append((rms(p.weight_norm, p.numel) or 0.0) * math.sqrt(fan_in))
    return statistics.median(scales) if scales else None


def _recurrent_gain(flow: GradFlow) -> tuple[str, float] | None:
    """The recurrent weight (`weight_hh*` of an `nn.RNN`, `nn.LSTM`, `nn.GRU` or their
    cells) with the largest RMS × √hidden, and that figure: an orthogonal matrix's is 1,
    and an i.i.d. one's largest eigenvalue is about it (the circular law), so above 1 the
    gradient through time grows by about that factor per step. None without one read."""
    types = {r.module: r.module_type for r in flow.modules}
    gains = []
    for p in flow.params:
        if not p.name.rpartition(".")[2].startswith("weight_hh") or len(p.shape) != 2 or \
                not p.weight_norm or types.get(p.module, "").removesuffix("Cell") not in \
                ("RNN", "LSTM", "GRU"):
            continue
        gains.append((p.name, (rms(p.weight_norm, p.numel) or 0.0) * math.sqrt(p.shape[1])))
    return max(gains, key=lambda g: g[1]) if gains else None


def _exploding_fix(flow: GradFlow) -> str:
    _, has_norm = _model_kinds(flow)
    scale = _init_scale(flow)
    batch_norm = any("BatchNorm" in r.module_type for r in flow.modules)
    if scale is not None and scale < _SMALL_INIT and batch_norm:
        # Behind BatchNorm a weight's scale cancels in the forward, and its gradient grows
        # as it shrinks: a small init makes the gradients large, the other way round.
        init = (f"raise the init scale, not lower it: the layers' weights are "
                f"{1 / scale:.0f}× below std 1/sqrt(fan_in) (median layer), and behind "
                "BatchNorm a weight's gradient grows as the weight shrinks; initialise with "
                "nn.init.kaiming_normal_(weight, mode='fan_out'), as torchvision's models do")
    elif scale is not None and scale > 1 / _SMALL_INIT:
        init = (f"lower the init scale: the layers' weights are {scale:.0f}× std "
                "1/sqrt(fan_in) (median layer); Kaiming/Xavier: std = gain/sqrt(fan_in)")
    else:
        init = "lower the init scale (Kaiming/Xavier: std = gain/sqrt(fan_in))"
    clip = "clip with torch.nn.utils.clip_grad_norm_ (max_norm around 1.0)"
    if flow.clip_factor > 1:
        # The loop clips already: the update is bounded, the gradients' size is the symptom.
        clip = (f"the loop already clips (the update used a total norm of "
                f"{flow.applied_norm:.3g}, {fmt_times(flow.clip_factor)} below this), which "
                "bounds each step but not the cause")
    parts = [clip, init]
    recurrent = _recurrent_gain(flow)
    if recurrent is not None and recurrent[1] > 1.0:
        # Through time, not through depth: the recurrent weight is applied at every step.
        parts[1] = (f"initialise the recurrent weight {recurrent[0]} with nn.init.orthogonal_: "
                    f"its RMS × √hidden is {recurrent[1]:.2f} (an orthogonal matrix's is 1), "
                    "and the gradient through time grows by about that much per time step")
    elif not has_norm:
        parts.append("add normalization layers")
    parts.append("lower the learning rate")
    return "; ".join(parts) + "."


def _certainty(change: float, t: GradThresholds) -> tuple[Severity, str] | None:
    if change >= t.severe:
        return Severity.ERROR, "severe"
    if change >= t.likely:
        return Severity.WARNING, "likely"
    if change >= t.possible:
        return Severity.INFO, "possible"
    return None


def _trend_evidence(tr: Trend) -> dict[str, float | int | str | bool | None]:
    return {f"{tr.measure}_change": tr.change, f"{tr.measure}_per_layer": tr.per_position,
            f"{tr.measure}_r2": tr.r2}


# ---------------------------------------------------------------------- findings
def find_vanishing(flow: GradFlow, thresholds: GradThresholds | None = None) -> list[Finding]:
    """Parameter gradients that shrink toward the input, judged on the relative gradient
    ‖g‖/‖w‖ and the gradient RMS of each depth position (`depth_profile`).

    Likely (warning) when both fall steadily (a log-linear fit with R² >= `consistency`)
    by `likely` or more over at least `min_positions` positions; possible (info) from
    `possible`; error from `severe`. Without a steady trend, a position `bottleneck` times
    below a nearer one in both measures is a possible bottleneck (info). The backward
    signal (grad_output) is not judged here: it legitimately shrinks through pooling and
    default inits while the weights' inputs grow to make up for it.
    """
    t = thresholds or GradThresholds()
    prof = depth_profile(flow)
    if len(prof.body) < 2:
        return []
    found: list[tuple[float, Finding]] = []
    for k, stack in enumerate(prof.stacks):
        rel, rms_ = prof.trend("relative", k), prof.trend("rms", k)
        if rel is None or rms_ is None or min(rel.positions, rms_.positions) < \
                t.min_positions or not (rel.steady(t.consistency) and
                                        rms_.steady(t.consistency)):
            continue
        decay = min(rel.decay, rms_.decay)  # the weaker of the two measures decides
        verdict = _certainty(decay, t)
        if verdict is not None:
            severity, word = verdict
            far = stack[-1].name
            found.append((decay, _VANISHING.finding(
                severity=severity,
                summary=f"{word} vanishing gradients: the relative gradient ‖g‖/‖w‖ falls "
                f"{fmt_times(rel.decay)} over {rel.positions} layers toward the input "
                f"({fmt_times(1 / rel.per_position)} per layer, steady: fit R² {rel.r2:.2f}), "
                f"from {rel.first} to {rel.last}",
                evidence={"nearest": rel.first, "farthest": rel.last,
                          "positions": rel.positions, "decay": decay,
                          **_trend_evidence(rel), **_trend_evidence(rms_),
                          "step": flow.index},
                fix=_vanishing_fix(flow, (rel.first, rel.last)),
                module=far,
            )))
    if found:  # the stack that loses the most
        return [max(found, key=lambda df: df[0])[1]]
    return _bottleneck(flow, prof, t)


def _bottleneck(flow: GradFlow, prof: DepthProfile, t: GradThresholds) -> list[Finding]:
    """A position far below a nearer one of its stack in both parameter measures, without
    a trend."""
    best: tuple[float, DepthUnit, DepthUnit] | None = None
    pairs = [(j, low, stack) for stack in prof.stacks for j, low in enumerate(stack)]
    for j, low, stack in pairs:
        lr, ls = low.measure("relative"), low.measure("rms")
        if lr is None or ls is None:
            continue
        for high in stack[:j]:
            hr, hs = high.measure("relative"), high.measure("rms")
            if hr is None or hs is None:
                continue
            drop = min(hr / lr, hs / ls)
            if drop >= t.bottleneck and (best is None or drop > best[0]):
                best = (drop, high, low)
    if best is None:
        return []
    drop, high, low = best
    return [_VANISHING.finding(
        severity=Severity.INFO,
        summary=f"possible gradient bottleneck: {low.name} gets {fmt_times(drop)} less relative "
        f"gradient than {high.name}, nearer the loss, without a steady trend in between",
        evidence={"nearest": high.name, "farthest": low.name, "drop": drop,
                  "relative_high": high.relative, "relative_low": low.relative,
                  "rms_high": high.rms, "rms_low": low.rms, "step": flow.index},
        fix="look at what lies between them: a saturating gate or activation, a small "
        "scale factor, or a detach(); " + _vanishing_fix(flow, (high.name, low.name)),
        module=low.name,
    )]


def find_exploding(flow: GradFlow, thresholds: GradThresholds | None = None) -> list[Finding]:
    """Gradients that grow toward the input, or a total norm above `exploding_norm`.

    Growth is judged on the backward signal itself, the RMS of the gradient arriving at
    each depth position: growing steadily toward the input by `likely` or more is likely
    exploding (warning); from `possible`, and with the relative gradient growing steadily
    by `possible` too, possible (info). A total norm (what
    `clip_grad_norm_` returns) above `exploding_norm` is a warning, above
    `exploding_error_norm` an error; with a growth trend both go in one finding.
    """
    t = thresholds or GradThresholds()
    prof = depth_profile(flow)
    total = flow.total_norm
    big = math.isfinite(total) and total > t.exploding_norm
    total_sev = (Severity.ERROR if total > t.exploding_error_norm else Severity.WARNING) \
        if big else None
    grown: list[tuple[Trend, tuple[Severity, str]]] = []
    for k in range(len(prof.stacks)):  # within each stack (see `DepthProfile.stacks`)
        out_tr, rel = prof.trend("output_rms", k), prof.trend("relative", k)
        if out_tr is None or out_tr.positions < t.min_positions or \
                not out_tr.steady(t.consistency):
            continue
        verdict = _certainty(out_tr.change, t)
        # Below `likely`, growth counts only when the weights' gradients grow with it: the
        # backward signal of a residual stack adds up block after block (resnet-mini: 10x
        # over 9 blocks) while each block's relative gradient stays level.
        if verdict is not None and verdict[0] == Severity.INFO and not (
                rel is not None and rel.steady(t.consistency) and rel.change >= t.possible):
            verdict = None
        if verdict is not None:
            grown.append((out_tr, verdict))
    if grown:
        out_tr, (severity, word) = max(grown, key=lambda g: g[0].change)
        if total_sev is not None and total_sev > severity:
            severity, word = total_sev, "likely"
        if severity == Severity.ERROR:
            word = "severe"
        return [_EXPLODING.finding(
            severity=severity,
            summary=f"{word} exploding gradients: the gradient arriving at each layer "
            f"grows {fmt_times(out_tr.change)} over {out_tr.positions} layers toward the "
            f"input ({fmt_times(out_tr.per_position)} per layer, steady: fit R² "
            f"{out_tr.r2:.2f}), from {out_tr.first} to {out_tr.last}"
            + (f"; total norm {total:.3g}" if big else ""),
            evidence={"nearest": out_tr.first, "farthest": out_tr.last,
                      "positions": out_tr.positions, **_trend_evidence(out_tr),
                      "total_norm": total, "step": flow.index},
            fix=_exploding_fix(flow),
            module=out_tr.last,
        )]
    if total_sev is None:
        return []
    small = _small_init_total(flow, t) if total_sev == Severity.WARNING else None
    if small is not None:
        return [small]
    biggest = max(((m, n) for m, n in flow.param_norms().items()
                   if n is not None and math.isfinite(n)), key=lambda x: x[1],
                  default=(None, math.nan))
    return [_EXPLODING.finding(
        severity=total_sev,
        summary=f"total gradient norm {total:.3g} is above {t.exploding_norm:g}"
        + (f"; largest at {biggest[0]} ({biggest[1]:.3g})" if biggest[0] is not None else ""),
        evidence={"total_norm": total, "threshold": t.exploding_norm,
                  "largest_module": biggest[0], "largest_norm": biggest[1],
                  "step": flow.index},
        fix=_exploding_fix(flow),
        module=biggest[0],
    )]


def _small_init_total(flow: GradFlow, t: GradThresholds) -> Finding | None:
    """The large total norm of parameters with weights 100x smaller than the median weight
    matrix's (RMS), or zero: what follows normalises them, so their gradient grows as their
    weights shrink (RWKV's small-init embedding, std 1e-4 before a LayerNorm, by design; the
    zero class and position tokens of transformers' AST before a LayerNorm of eps 1e-12).
    Info, with what clipping the total would do, when they hold 90 % of it (squared); None
    when the total is spread out."""
    total = flow.total_norm
    params = [p for p in flow.params if p.requires_grad and p.tied_to is None
              and p.norm is not None and p.weight_norm is not None and p.numel]
    weight_rms = {p.name: rms(p.weight_norm, p.numel) or 0.0 for p in params}
    matrices = [weight_rms[p.name] for p in params if p.weight_norm and len(p.shape) >= 2]
    if not matrices or not total > 0:
        return None
    median = statistics.median(matrices)
    # Biases start at zero by convention: their gradients are no sign of a small init.
    small = sorted((p for p in params if weight_rms[p.name] <= median / 100
                    and not p.name.endswith("bias")),
                   key=lambda p: p.norm or 0.0, reverse=True)
    share = math.fsum((p.norm or 0.0) ** 2 for p in small) / total ** 2
    if not small or share < 0.9 or not median > 0:
        return None
    top = small[0]
    names = ", ".join(p.name for p in small[:3]) + (", ..." if len(small) > 3 else "")
    largest = max(weight_rms[p.name] for p in small)
    if len(small) == 1:
        what = f"{top.name}'s, whose weights are " + ("zero" if largest == 0 else (
            f"{median / largest:.0f}× smaller than the median weight matrix's (RMS "
            f"{largest:.2g})"))
    else:
        what = f"that of {len(small)} parameters whose weights are " + (
            "all zero" if largest == 0 else
            f"{median / largest:.0f}× or more below the median weight matrix's") + \
            f" ({names})"
    return _EXPLODING.finding(
        severity=Severity.INFO,
        summary=f"total gradient norm {total:.3g} is above {t.exploding_norm:g}, "
        f"{100 * share:.0f}% of it (squared) {what}: what follows normalises them, so "
        "their gradient grows as their weights shrink (a small or zero init, as RWKV's "
        "embedding or a class token's)",
        evidence={"total_norm": total, "largest_module": top.module, "param": top.name,
                  "params": len(small), "share": share, "weight_rms": largest,
                  "median_weight_rms": median, "step": flow.index},
        fix="with Adam-family optimizers its size does not matter, and it falls as those "
            "weights grow. Clipping the total (clip_grad_norm_ at 1.0, the HF Trainer's "
            "default) shrinks every other parameter's gradient with it: under SGD, clip or "
            "scale those parameters apart (their own parameter group).",
        module=top.module)


def find_dead(flow: GradFlow, thresholds: GradThresholds | None = None) -> list[Finding]:
    """Modules whose gradient is all zeros (every output gradient, or every parameter's),
    and modules that receive gradient but pass an all-zero gradient down.

    Only gradients that exist are judged: a frozen parameter has none and is never dead
    (`find_frozen` names it).
    """
    t = thresholds or GradThresholds()
    dead_out: dict[str, list[float]] = {}
    alive_out: set[str] = set()
    for r in flow.modules:
        for g in r.grad_output:
            if g.norm is None:
                continue
            if g.norm <= t.dead_norm:
                dead_out.setdefault(r.module, []).append(g.norm)
            else:
                alive_out.add(r.module)
    dead_params: dict[str, list[str]] = {}
    alive_params: set[str] = set()
    for p in flow.params:
        if p.norm is None or p.tied_to is not None:  # frozen or unreached; a tied alias
            continue
        if p.norm <= t.dead_norm:
            dead_params.setdefault(p.module, []).append(p.name)
        else:
            alive_params.add(p.module)
    found = []
    # A module whose parameters are all frozen does not learn: a zero gradient arriving at
    # it is no news about it (the trainable layers it passes that zero to are reported).
    owners: dict[str, bool] = {}
    for p in flow.params:
        owners[p.module] = owners.get(p.module, False) or p.requires_grad
    frozen = {m for m, trainable in owners.items() if not trainable}
    modules = [m for m in flow.layers()
               if m in dead_out and m not in alive_out and m not in frozen]
    modules += [m for m in dead_params if m not in alive_params and m not in modules]
    if modules and not alive_out and not alive_params:
        return [_zero_loss_gradient(flow, modules, dead_params)]
    # Receives gradient but passes none down (every ReLU unit off, a zero mask): the cause.
    blockers: dict[str, str] = {}
    for r in flow.modules:
        out_n, in_n = r.output_norm, r.input_norm
        if out_n is not None and in_n is not None and out_n > t.dead_norm >= in_n:
            blockers.setdefault(r.module, r.module_type)
    # A module whose own parameters are all exactly zero passes no gradient down until the
    # optimizer's first update moves them: a deliberate zero init (LoRA's B, a residual
    # branch's last norm gain), not a dead layer. The layers it starves are told under it.
    zeroed = [m for m in blockers if m in _zero_init(flow)]
    if zeroed:
        # The other modules of their layers that get no gradient because of them (LoRA's
        # A), and, in an adapter layer (`q_proj.lora_B.default`), those that pass none down
        # because of them: DoRA's magnitude scales a zero update at the start. A block's own
        # module that passes none down (a dead ReLU after a residual sum) is still told.
        starved = [m for m in modules if any(_within(m, _scope(z)) for z in zeroed)]
        starved += [m for m in blockers if m not in zeroed and any(
            _within(m, _scope(z)) for z in zeroed if _scope(z) != _parent(z))]
        found.append(_zero_init_finding(flow, zeroed, starved))
        blockers = {m: v for m, v in blockers.items() if m not in zeroed and m not in starved}
        modules = [m for m in modules if m not in starved]
    half = _float16(flow)
    order = {m: i for i, m in enumerate(flow.layers())}  # backward order
    # Where the gradient reaching a module is this small, a zero it passes down is float32
    # running out of range (a norm reads 0 once every element is under about 1e-19), and
    # so is the zero the modules under it get: one finding with those whose parameter
    # gradients round to zero below (`_zero_despite_gradient`).
    arriving = _arriving(flow)
    faded = [m for m in blockers
             if m not in half and arriving.get(m, math.inf) < _VANISHED_NORM]
    if faded:
        top = min(order.get(m, len(order)) for m in faded)
        faded += [m for m in modules if m not in alive_out and m not in half
                  and order.get(m, -1) > top]
        blockers = {m: v for m, v in blockers.items() if m not in faded}
    for m, type_name in blockers.items():
        found.append(_DEAD.finding(
            severity=Severity.WARNING,
            summary=f"{m or '<root>'} ({type_name}) receives gradient but passes an all-zero "
            "gradient down",
            evidence={"kind": "blocks", "float16": m in half, "step": flow.index},
            fix=_UNDERFLOW if m in half else _DROPS_ALL if "Dropout" in type_name else
            "look for dead ReLUs (lower the learning rate, LeakyReLU/GELU, check biases "
            "and init) or a mask that blocks every position.",
            module=m,
        ))
    # One module that passes no gradient down starves the modules below it: two or more
    # are one finding (transformers' MobileNetV1: a dropout of p=0.999, then 82 modules).
    if len(blockers) == 1:
        cause = next(iter(blockers))
        at = order.get(cause, -1)
        below = [m for m in modules if order.get(m, -1) > at >= 0]
        if len(below) > 1:
            modules = [m for m in modules if m not in below]
            found.append(_DEAD.finding(
                severity=Severity.WARNING,
                summary=f"{below[0]} and the {len(below) - 1} module(s) below it receive an "
                f"all-zero gradient (to {below[-1]}): {cause or '<root>'} passes none down",
                evidence={"kind": "zero", "modules": len(below), "last": below[-1],
                          "cause": cause, "float16": any(m in half for m in below),
                          "step": flow.index},
                fix=_UNDERFLOW if any(m in half for m in below) else
                f"see {cause or '<root>'}'s finding: what passes no gradient down stops every "
                "layer below it from learning.",
                module=below[0]))
    # A gradient reaches these, yet every parameter gradient is exactly zero: what they
    # multiply it by is zero, or the products round to zero. One finding for them all.
    # Only a leaf (Linear, Conv, a norm) applies its parameters to its input, so only there
    # does that mean a zero input. A module with children uses its own parameters inside
    # its forward (a bias table added to its attention scores, a class token): LeViT's
    # `attention_biases` get none under a softmax over its 1x1 map's one position. Those
    # are told below, with that cause.
    parents = {a for r in flow.modules for a in _ancestors(r.module)}
    reached = [m for m in modules if m in alive_out and m not in half and m not in parents]
    if any(arriving.get(m, math.inf) < _VANISHED_NORM for m in reached + faded):
        # Once the gradient has faded, a module reading an all-zero gradient with no
        # blocker above it has faded with it (EfficientNet's squeeze-excitation gates,
        # whose gradient is the one arriving times activations at 1e-34).
        top = min((order.get(b, len(order)) for b in blockers), default=len(order))
        faded += [m for m in modules if m not in alive_out and m not in half
                  and m not in faded and order.get(m, len(order)) < top]
    if reached or faded:
        modules = [m for m in modules if m not in reached and m not in faded]
        found.append(_zero_despite_gradient(flow, list(dict.fromkeys(reached + faded)),
                                            dead_params, arriving))
    # Queries and keys that get none while their values do: the scores get none.
    one = _scoreless_attention([m for m in modules if m not in half], alive_out)
    if one:
        modules = [m for m in modules if m not in one]
        found.append(_scoreless_finding(flow, one))
    # A part of the model every measured module of which gets none is one finding, at
    # its top (CvT's last query projection: a convolution, its norm and a reshape).
    for part, inside in _dead_parts(flow, modules).items():
        modules = [m for m in modules if m not in inside]
        params = [n for m in inside if m not in alive_params for n in dead_params.get(m, [])]
        found.append(_DEAD.finding(
            severity=Severity.WARNING,
            summary=f"{part}: the {len(inside)} module(s) in it get all-zero gradients "
            f"({fmt_names(inside)})",
            evidence={"kind": "zero", "modules": len(inside), "first": inside[0],
                      "last": inside[-1], "zero_params": len(params),
                      "params": ", ".join(params), "float16": any(m in half for m in inside),
                      "step": flow.index},
            fix=_UNDERFLOW if any(m in half for m in inside) else _ZERO_CAUSES,
            module=part,
        ))
    for m in modules:
        names = dead_params.get(m, []) if m not in alive_params else []
        own = m in alive_out and m in parents  # its own parameters, used inside its forward
        what = "an all-zero gradient" if m in dead_out and m not in alive_out else \
            "all-zero gradients for its own parameters" if own else \
            "all-zero parameter gradients"
        found.append(_DEAD.finding(
            severity=Severity.WARNING,
            summary=f"{m or '<root>'} receives {what}",
            evidence={"kind": "zero", "zero_outputs": len(dead_out.get(m, [])),
                      "zero_params": len(names),
                      "params": ", ".join(names), "float16": m in half, "step": flow.index},
            fix=_UNDERFLOW if m in half else _OWN_PARAMS if own else _ZERO_CAUSES,
            module=m,
        ))
    return found


_ZERO_CAUSES = (
    "look for dead ReLUs (lower the learning rate, LeakyReLU/GELU), a branch multiplied "
    "by zero, a mask that blocks every position, an output the loss reads no element of "
    "(a slice that leaves it out: a head on the class token alone, after a last layer "
    "that still computes every position), or a softmax over one element (attention over "
    "a sequence of length 1: its query and key get none).")


def _dead_parts(flow: GradFlow, modules: list[str]) -> dict[str, list[str]]:
    """Parts of the model (a module with children, not the root) holding two or more of
    `modules`, whose every measured module (one with a record or a parameter) is among
    them: the topmost such part -> its modules among them, in `modules`' order."""
    dead = set(modules)
    known = {r.module for r in flow.modules} | {p.module for p in flow.params}
    # The parts that hold a measured module which is not dead: it and everything above it.
    live = {a for x in known if x not in dead for a in (*_ancestors(x), x)}
    parts: dict[str, list[str]] = {}
    for m in modules:
        tops = [a for a in _ancestors(m)[1:] if a not in live]  # not the root
        if tops:
            parts.setdefault(tops[0], []).append(m)
    return {top: inside for top, inside in parts.items() if len(inside) > 1}


_OWN_PARAMS = (
    "a gradient reaches it, and its own parameters are used inside its forward, not on its "
    "input: a bias added to attention scores gets none where the softmax runs over one "
    "element (a sequence of length 1, a 1×1 feature map: inputs too small for the model, "
    "or a mask that leaves one position); else look for a branch multiplied by zero.")


def _ancestors(module: str) -> list[str]:
    """The names of every module above `module`, the root ("") included; none for the
    root itself."""
    parts = module.split(".") if module else []
    return [".".join(parts[:i]) for i in range(len(parts))]


# An attention's query, key and value projections by their usual names: BERT, ViT and
# MobileViT's `query`/`key`/`value`, Llama, BART and OPT's `q_proj`/`k_proj`/`v_proj`, T5's
# `q`/`k`/`v`.
_QKV = (("query", "key", "value"), ("q_proj", "k_proj", "v_proj"), ("q", "k", "v"))


def _scoreless_attention(modules: list[str], alive_out: set[str]) -> list[str]:
    """The query and key projections among `modules` (which get an all-zero gradient) whose
    attention's value projection gets a non-zero one, both of one attention or neither.

    The scores are the only way into the queries and keys, and a softmax over one element
    is 1 whatever its score: with one position to attend to, they get exactly zero while
    the values, which the softmax weighs by 1, still get the whole gradient. (So they do
    when every position holds the same value vector.)"""
    dead = set(modules)
    found: list[str] = []
    for parent in dict.fromkeys(m.rpartition(".")[0] for m in modules):
        at = f"{parent}." if parent else ""
        for q, k, v in _QKV:
            if f"{at}{q}" in dead and f"{at}{k}" in dead and f"{at}{v}" in alive_out:
                found += [f"{at}{q}", f"{at}{k}"]
    return found


def _scoreless_finding(flow: GradFlow, modules: list[str]) -> Finding:
    """One finding for the query and key projections that `_scoreless_attention` found."""
    layers = list(dict.fromkeys(m.rpartition(".")[0] for m in modules))
    where = f"the attention {layers[0] or '<root>'}" if len(layers) == 1 else \
        f"{len(layers)} attention layers in {common_parent(layers) or '<root>'}"
    return _DEAD.finding(
        severity=Severity.WARNING,
        summary=f"the query and key projections of {where} receive an all-zero gradient "
        "while their value projections do not: no gradient reaches the attention scores",
        evidence={"kind": "no_score_gradient", "modules": len(modules),
                  "layers": len(layers), "first": modules[0], "last": modules[-1],
                  "step": flow.index},
        fix="the scores are the only way into the queries and keys, and they get no gradient "
        "when the weights they set cannot change the output: most often a softmax over one "
        "position, which is 1 whatever its score (the sequence these attentions run over "
        "has length 1, as in transformers' MobileViT given 64-pixel images, one patch in "
        "its last stage; or a mask leaves one position): give them a longer sequence "
        "(larger inputs, smaller patches) or leave those attentions out. Otherwise every "
        "position holds the same value vector (identical tokens: check the embeddings and "
        "position tables before them).",
        module=modules[0],
    )


# A gradient this small reaching a layer leaves products with its input that float32 (whose
# smallest subnormal is 1.4e-45) rounds to zero: the gradient has vanished, not stopped.
_VANISHED_NORM = 1e-20


def _arriving(flow: GradFlow) -> dict[str, float]:
    """The smallest non-zero norm of the gradient reaching each module's output."""
    out: dict[str, float] = {}
    for r in flow.modules:
        n = r.output_norm
        if n is not None and n > 0 and math.isfinite(n):
            out[r.module] = min(n, out.get(r.module, math.inf))
    return out


def _zero_despite_gradient(flow: GradFlow, modules: list[str],
                           dead_params: dict[str, list[str]],
                           arriving: dict[str, float]) -> Finding:
    """One finding for the modules whose parameter gradients are all exactly zero though a
    non-zero gradient reaches their outputs, and, where that gradient has faded under
    `_VANISHED_NORM`, for the modules that pass or get a gradient whose float32 norm reads
    0 from there down. A weight's gradient is the gradient reaching the module times its
    input: with a normal gradient arriving, the input is zero; with a vanishing one, the
    products round to zero (transformers' EfficientNet with its BatchNorm gains at 0.02:
    45 layers, the gradient at the stem 3e-35)."""
    order = {m: i for i, m in enumerate(flow.layers())}
    modules = sorted(modules, key=lambda m: order.get(m, len(order)))  # from the loss down
    norms = {m: arriving[m] for m in modules if m in arriving}
    near, far = modules[0], modules[-1]
    vanished = min(norms.values(), default=math.inf) < _VANISHED_NORM

    def at(m: str) -> str:
        return f"{m or '<root>'} (gradient norm {norms[m]:.1e})" if m in norms else \
            f"{m or '<root>'}"

    if vanished:
        lowest = min(norms, key=norms.__getitem__)
        summary = (f"{len(modules)} module(s) get no usable gradient, from {at(near)} to "
                   f"{far or '<root>'}: the gradient reaching them falls to {at(lowest)}, "
                   "below what float32 holds in their parameter gradients")
        fix = ("the gradient and the activations it multiplies have shrunk through depth "
               "until float32 rounds their products to 0 (under 1.4e-45), and a gradient "
               "norm to 0 (every element under about 1e-19): find where the activation "
               "scale collapses (activations.scale_drift; norm gains near zero or an init "
               "far too small) and fix that, and the gradients come back with it.")
    else:
        summary = (f"{at(near)} gets all-zero parameter gradients though a gradient reaches "
                   "it" if len(modules) == 1 else
                   f"{len(modules)} modules get all-zero parameter gradients though a "
                   f"gradient reaches each, from {at(near)} to {at(far)}")
        fix = ("their inputs are all zero: the layer feeding them outputs zeros (dead ReLUs, "
               "a zero mask, a zero-initialised or constant layer); see its activation "
               "findings.")
    return _DEAD.finding(
        severity=Severity.WARNING,
        summary=summary,
        evidence={"kind": "vanished" if vanished else "zero_input", "modules": len(modules),
                  "first": near, "last": far,
                  "zero_params": sum(len(dead_params.get(m, [])) for m in modules),
                  "smallest_arriving": min(norms.values(), default=None),
                  "step": flow.index},
        fix=fix,
        module=far,
    )


_DROPS_ALL = ("a dropout passes an all-zero gradient down only where it dropped every "
              "element: check its p, the probability of dropping (p near 1 drops nearly "
              "all; a keep probability given as p does this, as transformers' "
              "MobileNetV1Config's default classifier_dropout_prob=0.999 does).")


# float16's smallest subnormal is 2**-24, about 6e-8: a gradient below it is 0 there.
_UNDERFLOW = ("its gradient is float16, where values under 6e-8 round to 0: scale the loss "
              "with torch.amp.GradScaler (torch.autocast's fp16 recipe), or train in bfloat16; "
              "if it stays zero with a scaled loss, look for dead ReLUs or a mask that blocks "
              "every position.")


def _float16(flow: GradFlow) -> frozenset[str]:
    """Modules whose recorded gradients are float16 and which held no GradScaler's scale:
    there a small gradient underflows to zero."""
    if flow.scale is not None:
        return frozenset()
    return frozenset(r.module for r in flow.modules
                     if any(g.dtype == "torch.float16" for g in (*r.grad_output, *r.grad_input)))


def _zero_init(flow: GradFlow) -> frozenset[str]:
    """Modules whose own trainable parameters all read exactly zero when the gradient was
    read (before the optimizer's update). A frozen parameter's value is not read, so a
    module holding one is never in it."""
    zero: dict[str, bool] = {}
    for p in flow.params:
        if p.tied_to is None:
            zero[p.module] = zero.get(p.module, True) and p.weight_norm == 0.0
    return frozenset(m for m, z in zero.items() if z)


def _parent(module: str) -> str:
    return module.rpartition(".")[0]


def _scope(module: str) -> str:
    """The layer a zero-initialised module belongs to, whose other modules it starves: its
    parent, or its grandparent when the parent is a named wrapper rather than a block of a
    list (peft keeps LoRA's B in a dict by adapter name: `q_proj.lora_B.default`)."""
    parent = _parent(module)
    wrapper, _, key = parent.rpartition(".")
    return wrapper if wrapper and not key.isdigit() else parent


def _within(module: str, scope: str) -> bool:
    return not scope or module == scope or module.startswith(scope + ".")


def _zero_init_finding(flow: GradFlow, zeroed: list[str], starved: list[str]) -> Finding:
    """One finding for the zero-initialised modules that pass no gradient down in this step,
    and for the other modules of their layers that get or pass down none because of them."""
    after = f", so {len(starved)} other module(s) of their layers get or pass down none in " \
        f"this step ({fmt_names(starved)})" if starved else ""
    return _ZERO_INIT.finding(
        severity=Severity.INFO,
        summary=f"{len(zeroed)} module(s) start at zero ({fmt_names(zeroed)}): all their "
        "parameters are 0, a deliberate zero init (LoRA's B, a residual branch's last norm "
        f"gain), and they pass no gradient down until the optimizer first moves them{after}",
        evidence={"zero_init": len(zeroed), "modules": ", ".join(zeroed),
                  "starved": len(starved), "starved_modules": ", ".join(starved),
                  "step": flow.index},
        module=zeroed[0],
    )


def _zero_loss_gradient(flow: GradFlow, modules: list[str],
                        dead_params: dict[str, list[str]]) -> Finding:
    """One finding for a step in which no module and no parameter got a non-zero gradient:
    the cause is the loss, above every layer, so no layer is named."""
    evidence: dict[str, float | int | str | bool | None] = {
        "kind": "loss", "zero_modules": len(modules),
        "zero_params": sum(len(v) for v in dead_params.values()), "step": flow.index}
    if flow.step is not None:
        evidence["loss"] = flow.step.loss
        evidence["loss_value"] = flow.step.loss_value
    return _DEAD.finding(
        severity=Severity.WARNING,
        summary="every gradient is zero: the loss gives the model's output an all-zero "
        f"gradient, so none of its {len(modules)} layers learns",
        evidence=evidence,
        fix="make the loss depend on the output: cross-entropy over one class (an (N, 1) "
        "output) is 0 whatever the output, so use BCEWithLogitsLoss for a binary label or "
        "MSE for one value; also look for a loss multiplied by zero, or a batch whose "
        "targets are all ignore_index.",
    )


def find_nonfinite(flow: GradFlow, thresholds: GradThresholds | None = None) -> list[Finding]:
    """NaN/Inf gradients, naming the first module where they appear in backward order."""
    del thresholds  # no threshold: any NaN or Inf is reported
    bad_params = [p for p in flow.params if not p.finite]
    first = next((r for r in flow.modules if r.order is not None and not r.finite), None)
    if first is None and not bad_params and math.isfinite(flow.total_norm):
        return []
    evidence: dict[str, float | int | str | bool | None] = {
        "nonfinite_params": len(bad_params), "total_norm": flow.total_norm,
        "step": flow.index,
    }
    loss = flow.step.loss_value if flow.step is not None else None
    module: str | None
    if loss is not None and not math.isfinite(loss):
        # The forward already made NaN/Inf: every gradient inherits it, and the module to
        # blame is the forward's producer (activations.nonfinite), not a backward.
        evidence.update(loss=loss)
        summary = (f"the loss is {loss}, so the gradients are NaN/Inf: the forward produced "
                   "it (capture_activations names the module that did)")
        module = None
    elif first is not None:
        from_above = not all(g.finite for g in first.grad_output)
        evidence.update(module_call=first.call, backward_order=first.order,
                        arrives_from_above=from_above)
        where = first.module or "<root>"
        how = ("arrives already non-finite from above it (the loss or code outside the "
               "recorded modules)") if from_above else "is produced by its backward"
        summary = f"NaN/Inf gradient first appears at {where} in backward order: it {how}"
        module = None if from_above and first.order == 0 else first.module
    else:
        module = bad_params[0].module if bad_params else None
        summary = (f"NaN/Inf in the gradients of {len(bad_params)} parameter(s), first "
                   f"{bad_params[0].name}") if bad_params else "the total gradient norm is NaN/Inf"
    return [_NONFINITE.finding(
        severity=Severity.ERROR,
        summary=summary,
        evidence=evidence,
        module=module,
    )]


# Optimizers whose step divides by a running statistic plus `eps` (Adam's sqrt(v) + eps).
_DIVIDES_BY_EPS = frozenset({"Adam", "AdamW", "NAdam", "RAdam", "Adamax", "Adagrad",
                             "Adadelta", "RMSprop", "SparseAdam"})
# The smallest positive number of each half-precision dtype (a subnormal): a value at or
# under half of it rounds to 0 there.
_SMALLEST = {"torch.float16": 2.0 ** -24, "torch.bfloat16": 2.0 ** -133}


def find_broken_update(broken: BrokenUpdate | None) -> list[Finding]:
    """`grads.nonfinite_update` (error): an optimizer update wrote NaN/Inf into parameters
    whose weights and gradients were finite (`GradFlow.broken_update`; a watch's first,
    `GradWatch.broken_update`). Every later forward computes with those weights, so the
    NaN/Inf that later steps show starts here, not in a module. Where the optimizer
    divides by a running statistic plus `eps` and `eps` is 0 in the parameters' dtype
    (Adam's default 1e-8 in float16), that is named: a statistic that underflows to 0
    then divides by 0."""
    if broken is None:
        return []
    zero_in = [d for d in broken.dtypes if broken.eps is not None and d in _SMALLEST
               and broken.eps <= _SMALLEST[d] / 2]
    opt = broken.optimizer or "the optimizer"
    cause = ""
    if zero_in and broken.optimizer in _DIVIDES_BY_EPS:
        dtype = zero_in[0].removeprefix("torch.")
        cause = (f": {opt}'s eps={broken.eps:g} is 0 in {dtype} (its smallest number is "
                 f"{_SMALLEST[zero_in[0]]:.1e}), so where a gradient's running square "
                 "underflows to 0 the step divides by 0")
        fix = (f"keep the weights in float32 and run the forward under torch.autocast("
               f"dtype=torch.{dtype}) with a torch.amp.GradScaler: {opt} then keeps its "
               f"state in float32; if the weights must stay {dtype}, pass an eps that "
               f"{dtype} holds (1e-4, not {broken.eps:g}).")
    else:
        fix = ("lower the learning rate; with half-precision weights, keep them in float32 "
               "under torch.autocast; look for NaN/Inf in the optimizer's state (a custom "
               "optimizer that divides by a running statistic needs an eps).")
    return [_NONFINITE_UPDATE.finding(
        severity=Severity.ERROR,
        summary=f"{opt}'s update at step {broken.step} wrote NaN/Inf into "
                f"{len(broken.params)} of {broken.measured} parameters "
                f"({fmt_names(broken.params, 3)}) whose weights and gradients were finite"
                f"{cause}; every later step computes with them",
        evidence={"step": broken.step, "parameters": len(broken.params),
                  "measured": broken.measured, "first": broken.params[0],
                  "dtypes": ", ".join(broken.dtypes), "eps": broken.eps},
        fix=fix,
        module=broken.params[0].rpartition(".")[0] or None,
    )]


def find_loss_broadcast(b: LossBroadcast | None) -> list[Finding]:
    """`grads.loss_broadcast` (error): the loss broadcast the model's output against a
    target of as many elements laid out otherwise (`GradFlow.loss_broadcast` of a step
    torchscope ran, `GradWatch.loss_broadcast` of the user's): `(N, 1)` predictions
    against `(N,)` targets are compared pairwise, every prediction with every target. Each
    prediction's gradient then pulls it toward the mean of all targets, and the model
    learns that mean; the gradients reach every layer and nothing else reads wrong. A
    warning where the output was broadcast along a larger target's own dimensions (`(N,
    1)` against `(N, K)`, `LossBroadcast.per_row`): each row learns its targets' mean."""
    if b is None:
        return []
    out = f"the output{b.output} {b.output_shape}"
    evidence: dict[str, float | int | str | bool | None] = {
        "output": b.output, "output_shape": str(b.output_shape),
        "broadcast_shape": str(b.shape), "op": b.op,
        "target_shape": None if b.target_shape is None else str(b.target_shape)}
    k = b.per_row
    if k is not None:
        # (N, 1) against (N, K): each prediction meets its own row's K targets. A warning:
        # one value per row scored against K may be meant (rarely).
        evidence["per_row"] = k
        severity = Severity.WARNING
        summary = (f"the loss broadcast {out} against the target {b.target_shape} ({b.op}): "
                   f"each prediction is compared with the {k} targets of its row, so it is "
                   f"pulled toward their mean and the model learns one value where the "
                   f"target holds {k}")
        fix = (f"give the model {k} outputs per row where it should predict {k} values (its "
               "last layer's out_features), or give the target the output's shape "
               f"{b.output_shape} (one value per row) before the loss.")
    else:
        against = f"the target {b.target_shape}" if b.target_shape is not None else \
            "a tensor without gradient (the target)"
        severity = Severity.ERROR
        summary = (f"the loss broadcast {out} against {against} into {b.shape} ({b.op}): it "
                   "compares every prediction with every target, so each prediction is "
                   "pulled toward the mean of all targets and the model learns their mean")
        fix = (f"give both one shape before the loss: target.view{b.output_shape}, or "
               f"output{b.output}.view{b.target_shape}.") if b.target_shape is not None else \
            (f"give the target the output's shape {b.output_shape} before the loss "
             "(target.view_as(output)), or squeeze the output's size-1 dimension.")
    return [_LOSS_BROADCAST.finding(severity, summary, evidence, fix=fix)]


def find_padding_in_loss(padded_labels: tuple[int, int] | None, *,
                         of: Entry | None = None, where: str = "in this step",
                         evidence: dict[str, int] | None = None) -> list[Finding]:
    """Labels on padding (warning): a transformers model's labels hold a token (not -100)
    at positions that its attention mask pads and its loss reads (`padded_label_counts`).
    Its loss ignores only -100, so it trains the model to predict the pad token there (for
    GPT-2 and Llama, whose pad token is often the end-of-sequence token, to end every text
    early). `labels = input_ids.clone()` after padding does it;
    DataCollatorForLanguageModeling (mlm=False) writes -100 there.

    One finding for a step torchscope ran (`grads.padding_in_loss`, from
    `GradFlow.padded_labels`) and for a run's sampled steps (`run.padding_in_loss`).

    Args:
        padded_labels: `(padded, counted)`, or None where they were not read.
        of: the finding's entry: `grads.padding_in_loss`'s by default, `run.padding_in_loss`'s
            for a run.
        where: which steps were counted, as the summary says it.
        evidence: more evidence (a run's sample count).
    """
    if padded_labels is None or not padded_labels[1]:
        return []
    padded, counted = padded_labels
    return [(of or _PADDING_IN_LOSS).finding(
        Severity.WARNING,
        f"the loss trains on padding: {counted} of the {padded} label positions that the "
        f"attention mask pads and the loss reads ({where}) hold a token, not -100, so the "
        "model learns to predict the pad token there",
        {"padded": padded, "counted": counted, **(evidence or {})},
        fix=_PADDING_IN_LOSS.fix)]  # the same fix for a step and for a run


def find_loss_on_probabilities(p: LossOnProbabilities | None) -> list[Finding]:
    """`grads.loss_on_probabilities` (error): the loss applied its own softmax or sigmoid
    to an output that already went through one (`GradFlow.loss_on_probabilities`,
    `GradWatch.loss_on_probabilities`): probabilities taken as logits. The runtime side of
    the lint rule TS014, wherever the softmax is: a model's final `nn.Softmax` or
    `nn.Sigmoid` layer included, which no reading of the training code can see. A warning
    where the loss was torchscope's own choice (`assumed`): the training is wrong only if
    it takes the same loss."""
    if p is None:
        return []
    out = f"the output{p.output} {p.output_shape}"
    where = f"{out}, a {p.squash}'s result" if p.in_model else \
        f"a {p.squash} of {out}"
    severity = Severity.ERROR
    if p.loss == "cross_entropy":
        c = p.classes or 2
        floor = math.log(1 + (c - 1) / math.e)
        summary = (f"cross-entropy takes log_softmax of {where}: probabilities taken as "
                   f"logits, so the loss cannot fall below log(1 + (C - 1)/e) = {floor:.2f} "
                   f"(C = {c}) and the gradient shrinks as they saturate: training stalls")
        fix = ("give cross_entropy the logits: " + (
            f"drop the model's final {p.squash.capitalize()} layer and apply softmax only to "
            "report probabilities." if p.in_model else "remove the softmax before it."))
    elif p.loss == "nll_loss":
        summary = (f"nll_loss takes {where}: it wants log-probabilities, and of "
                   "probabilities it computes -p, not -log p")
        fix = "use log_softmax instead of softmax, or cross_entropy on the logits."
    else:
        summary = (f"{p.loss} applies a sigmoid to {where}: probabilities taken as logits, "
                   "so its predictions stay between 0.5 and 0.73 and the gradient toward a "
                   "0 label never falls below 0.5")
        fix = ("give it the logits: " + (
            "drop the model's final Sigmoid layer." if p.in_model else
            "remove the sigmoid before it.") +
            " Or keep the probabilities and use binary_cross_entropy.")
    if p.assumed:
        # torchscope chose the loss: the training code is wrong only if it does the same.
        severity = Severity.WARNING
        summary = f"if the training takes {p.loss} as this step does: {summary}"
    return [_LOSS_ON_PROBABILITIES.finding(
        severity=severity,
        summary=summary,
        evidence={"output": p.output, "output_shape": str(p.output_shape),
                  "squash": p.squash, "loss": p.loss, "in_model": p.in_model,
                  "classes": p.classes, "assumed": p.assumed},
        fix=fix,
    )]


def find_unreached(flow: GradFlow, thresholds: GradThresholds | None = None) -> list[Finding]:
    """Trainable parameters that received no gradient this step, one finding per module
    (the first five; the rest in one more). Those whose modules ran only inside a
    reentrant checkpoint whose inputs do not require grad are one warning: torch drops
    their gradients with no more than a UserWarning."""
    del thresholds
    missing: dict[str, list[str]] = {}
    cut: dict[str, list[str]] = {}  # by a reentrant checkpoint
    for p in flow.params:
        if p.requires_grad and p.tied_to is None and p.norm is None:
            if p.reason == RAN_IN_REENTRANT_CHECKPOINT:
                cut.setdefault(p.module, []).append(p.name)
            elif p.reason in (NOT_REACHED, NO_GRAD, RAN_NO_GRAD, NOT_RUN):
                missing.setdefault(p.module, []).append(p.name)
    found = []
    if cut:
        where = common_parent(list(cut))
        count = sum(len(v) for v in cut.values())
        found.append(_UNREACHED.finding(
            severity=Severity.WARNING,
            summary=f"{count} trainable parameter(s) in {len(cut)} module(s) under "
            f"{where or '<root>'} received no gradient: they ran inside a reentrant "
            "checkpoint (torch.utils.checkpoint with use_reentrant=True, torch's default) "
            "whose inputs do not require grad, which drops every gradient inside it",
            evidence={"params": count, "reason": RAN_IN_REENTRANT_CHECKPOINT,
                      "modules": ", ".join(m or "<root>" for m in list(cut)[:10]),
                      "step": flow.index},
            fix="pass use_reentrant=False to checkpoint (recommended), or make its input "
                "require grad (x.requires_grad_(); in transformers, "
                "model.enable_input_require_grads()).",
            module=where))
    # A repeated block none of whose parameters ran (LayerDrop skipped the layer): one
    # finding for the block, not one per module in it.
    for unit in dict.fromkeys(unit_name(m) for m in missing):
        inside = [p for p in flow.params if p.requires_grad and p.tied_to is None
                  and (p.module == unit or p.module.startswith(unit + "."))]
        held = [m for m in missing if m == unit or m.startswith(unit + ".")]
        if len(held) > 1 and all(p.reason == NOT_RUN for p in inside):
            names = [n for m in held for n in missing.pop(m)]
            missing[unit] = names
    found += _unused_in_every_block(flow, missing)
    mods = list(missing)

    def fix_for(m: str) -> str:
        reason = flow.param(missing[m][0]).reason
        if reason == RAN_NO_GRAD:
            return ("it ran under torch.no_grad inside the training forward: if its "
                    "parameters should learn, run it with gradients enabled; if not, freeze "
                    "them (requires_grad_(False)) so optimizers and DDP skip them.")
        if reason == NOT_RUN:
            return ("a module that a branch, a router or LayerDrop skips (an expert of a "
                    "mixture of experts that got no token, a layer dropped for the step) "
                    "learns nothing in that step; if it never "
                    "runs, check what selects it (an MoE's load balancing); if it is unused, "
                    "remove or freeze it (requires_grad_(False)) so optimizers and DDP "
                    "(find_unused_parameters) skip it.")
        return ("if they should learn, make the loss depend on them; if not, freeze them "
                "(requires_grad_(False)) so optimizers and DDP skip them.")

    def summary_for(m: str) -> str:
        shown = ", ".join(missing[m][:4]) + (", ..." if len(missing[m]) > 4 else "")
        names = f"{len(missing[m])} trainable parameter(s) received no gradient ({shown})"
        if flow.param(missing[m][0]).reason == NOT_RUN:
            return f"{m or '<root>'} did not run in the step's forward: its {names}"
        return f"{m or '<root>'}: {names}"

    found += [_UNREACHED.finding(
        severity=Severity.INFO,
        summary=summary_for(m),
        evidence={"params": len(missing[m]), "reason": flow.param(missing[m][0]).reason,
                  "step": flow.index},
        fix=fix_for(m), module=m) for m in mods[:5]]
    rest = mods[5:]
    if rest:
        found.append(_UNREACHED.finding(
            severity=Severity.INFO,
            summary=f"{sum(len(missing[m]) for m in rest)} more trainable parameter(s) in "
            f"{len(rest)} more module(s) received no gradient, e.g. {rest[0] or '<root>'}",
            evidence={"params": sum(len(missing[m]) for m in rest),
                      "modules": ", ".join(m or "<root>" for m in rest[:10]),
                      "step": flow.index},
            fix=fix_for(rest[0])))
    return found


def _unused_in_every_block(flow: GradFlow, missing: dict[str, list[str]]) -> list[Finding]:
    """One finding per stack of repeated blocks for the modules that did not run in any of
    its blocks (transformers' Longformer has global-attention projections in each layer,
    which run only with a `global_attention_mask`), taken out of `missing` (module ->
    its parameters without gradient)."""

    def split(module: str) -> tuple[str, str, str] | None:
        unit = unit_name(module)  # model.layers.3
        family, _, index = unit.rpartition(".")
        return (family, index, module[len(unit) + 1:]) if index.isdigit() else None

    blocks: dict[str, set[str]] = {}  # stack -> its blocks' indices
    for p in flow.params:
        if (where := split(p.module)) is not None:
            blocks.setdefault(where[0], set()).add(where[1])
    unused: dict[tuple[str, str], set[str]] = {}  # (stack, module in a block) -> blocks
    for m, names in missing.items():
        where = split(m)
        if where is not None and where[2] and flow.param(names[0]).reason == NOT_RUN:
            unused.setdefault((where[0], where[2]), set()).add(where[1])
    found = []
    for family, indices in blocks.items():
        rests = [r for (f, r), seen in unused.items() if f == family and seen == indices]
        if len(indices) < 2 or not rests:
            continue
        names = [n for r in rests for i in sorted(indices, key=int)
                 for n in missing.pop(f"{family}.{i}.{r}")]
        found.append(_UNREACHED.finding(
            severity=Severity.INFO,
            summary=f"{', '.join(rests)} did not run in the step's forward in any of the "
            f"{len(indices)} blocks of {family}: their {len(names)} trainable parameter(s) "
            "received no gradient",
            evidence={"params": len(names), "reason": NOT_RUN, "blocks": len(indices),
                      "modules": ", ".join(rests), "step": flow.index},
            fix="modules that every block holds and none runs are a part of the "
                "architecture that this configuration or input leaves out (Longformer's "
                "global-attention projections without a global_attention_mask); if they "
                "never run in training, freeze them (requires_grad_(False)) so optimizers "
                "and DDP (find_unused_parameters) skip them.",
            module=family))
    return found


def find_frozen(flow: GradFlow, thresholds: GradThresholds | None = None) -> list[Finding]:
    """Frozen parameters (requires_grad=False), named once: they are not trained, so no
    other finding judges them (a frozen layer is never "dead")."""
    del thresholds
    frozen = [p for p in flow.params if not p.requires_grad and p.tied_to is None]
    if not frozen:
        return []
    mods = list(dict.fromkeys(p.module for p in frozen))
    where = common_parent(mods) if len(mods) > 1 else mods[0]
    total = len([p for p in flow.params if p.tied_to is None])
    return [_FROZEN.finding(
        severity=Severity.INFO,
        summary=f"{len(frozen)} of {total} parameters are frozen (requires_grad=False) in "
        f"{len(mods)} module(s)" + (f" under {where}" if where else "")
        + ": not trained, and not judged",
        evidence={"params": len(frozen), "modules": len(mods),
                  "elements": sum(p.numel for p in frozen), "step": flow.index},
        module=where or None,
    )]


def find_frozen_zero(flow: GradFlow, thresholds: GradThresholds | None = None
                     ) -> list[Finding]:
    """Frozen parameters whose every value is zero (`GradFlow.frozen_zero`): no optimizer
    moves them, so whatever they add or scale gets nothing from them, for good
    (transformers 5's ViT-MAE: its decoder's fixed position table, zeroed by its init,
    leaves every masked token the same, and the decoder's attention query and key get no
    gradient)."""
    del thresholds
    if not flow.frozen_zero:
        return []
    names = list(flow.frozen_zero)
    owner = {p.name: p.module for p in flow.params}
    one = len(names) == 1
    named = fmt_names(names)
    return [_FROZEN_ZERO.finding(
        severity=Severity.WARNING,
        summary=f"{named} {'is' if one else 'are'} frozen (requires_grad=False) and all "
        f"zero: nothing will ever change {'it' if one else 'them'}, so what "
        f"{'it feeds gets' if one else 'they feed get'} nothing from {'it' if one else 'them'}",
        evidence={"params": ", ".join(names), "count": len(names), "step": flow.index},
        module=owner.get(names[0]),
    )]


# Optimizers whose update has a set size relative to the weights, whatever the gradient.
_NORMALISED_UPDATES = frozenset({"Muon"})


def find_update_ratio(flow: GradFlow, thresholds: GradThresholds | None = None, *,
                      fallen: float | None = None) -> list[Finding]:
    """The optimizer step's size against the weights, when it was measured
    (`watch_gradients` with an optimizer): the median over the layers of ‖Δw‖/‖w‖, whose
    usual healthy figure is about 1e-3.

    Args:
        flow: the step.
        thresholds: when a ratio becomes a finding.
        fallen: over a run, how many times the total gradient norm fell from the run's
            start to this step. From `possible` on, a small step is what a model that fits
            its data takes as its gradients fall, and the finding says so rather than
            asking for a larger learning rate (an MLP at a loss of 6e-8 after 1,500 SGD
            steps: 2.6e-6).
    """
    t = thresholds or GradThresholds()
    # A layer whose weights started at zero (LoRA's B) moves by about 1/k of its norm at its
    # k-th update whatever the learning rate: it has no scale yet to compare the step with.
    grown = _grown_from_zero(flow)
    ratios = sorted((lg.update_ratio, lg.module) for lg in flow.layer_grads()
                    if lg.update_ratio is not None and math.isfinite(lg.update_ratio)
                    and lg.module not in grown)
    if not ratios:
        return []
    median = ratios[len(ratios) // 2][0]
    hi, lo = ratios[-1], ratios[0]
    evidence: dict[str, float | int | str | bool | None] = {
        "median": median, "largest": hi[0], "largest_module": hi[1], "smallest": lo[0],
        "smallest_module": lo[1], "layers": len(ratios), "from_zero": len(grown),
        "step": flow.index}
    optimizer = flow.optimizer or (flow.step.optimizer if flow.step is not None else None)
    if t.update_elevated <= median < t.update_high and optimizer in _NORMALISED_UPDATES:
        # Muon orthogonalises each update: it moves a matrix by about the learning rate
        # (0.02 by default) of its norm by design, not 1e-3.
        return []
    if median >= t.update_elevated:
        likely = median >= t.update_high
        return [_UPDATE_RATIO.finding(
            severity=Severity.WARNING if likely else Severity.INFO,
            summary=f"{'likely' if likely else 'possibly'} too large a step: the optimizer "
            f"moves the median layer by {median:.2g} of its norm (‖Δw‖/‖w‖; about 1e-3 is "
            f"usual), up to {hi[0]:.2g} at {hi[1]}",
            evidence=evidence,
            fix="lower the learning rate (or warm it up); check the loss scale",
            module=hi[1])]
    if hi[0] == 0:  # no layer moved at all: nothing about the step's size to judge
        # Half-precision weights also stay put under a step below half their spacing.
        half = any(p.update_stale is not None for p in flow.params)
        return [_UPDATE_RATIO.finding(
            severity=Severity.INFO,
            summary=f"the optimizer step moved no layer's weights (‖Δw‖ = 0 in all "
            f"{len(ratios)}): a learning rate of 0, as on a warm-up's first step, a step "
            "that skipped the update, "
            + ("gradients cleared before it, or a step too small for half-precision weights "
               "to register (stale weights)" if half else "or gradients cleared before it"),
            evidence=evidence,
            fix="nothing to do on a warm-up's first step; otherwise check the learning rate, "
            "that the optimizer holds these parameters, and that zero_grad() does not run "
            "between backward() and step()",
            module=lo[1])]
    stale = _stale(flow)[3]
    if median <= t.update_low and stale is not None and stale >= t.stale_warn:
        # Most half-precision weights rounded their step away: the ratio measures the
        # rounding, not the learning rate (`grads.stale_weights` says so).
        return []
    if median <= t.update_low and flow.clip_factor > 1:
        # The update is lr times the clipped gradient: the clipping sets its size.
        evidence["clip_factor"] = flow.clip_factor
        return [_UPDATE_RATIO.finding(
            severity=Severity.INFO,
            summary=f"possibly too small a step: the optimizer moves the median layer by "
            f"{median:.2g} of its norm (‖Δw‖/‖w‖; about 1e-3 is usual), with gradients the "
            f"loop clipped {fmt_times(flow.clip_factor)} (total norm {flow.total_norm:.3g} to "
            f"{flow.applied_norm:.3g})",
            evidence=evidence,
            fix="the clipping, not the learning rate, sets this step's size: where it acts "
            "on every step, bring the gradients' scale down (init, normalisation) or raise "
            "max_norm before raising the learning rate",
            module=lo[1])]
    if median <= t.update_low and fallen is not None and fallen >= t.possible:
        evidence["gradient_fall"] = fallen
        return [_UPDATE_RATIO.finding(
            severity=Severity.INFO,
            summary=f"a small step: the optimizer moves the median layer by {median:.2g} of "
            f"its norm (‖Δw‖/‖w‖; about 1e-3 is usual), while the total gradient norm has "
            f"fallen {fmt_times(fallen)} since the run began: the steps of a model that "
            "fits its data shrink with its gradients",
            evidence=evidence,
            fix="nothing while the loss still falls or has reached its floor; raise the "
            "learning rate, or check the scheduler, only if the loss stalls above it",
            module=lo[1])]
    if median <= t.update_low:
        return [_UPDATE_RATIO.finding(
            severity=Severity.INFO,
            summary=f"possibly too small a step: the optimizer moves the median layer by "
            f"{median:.2g} of its norm (‖Δw‖/‖w‖; about 1e-3 is usual)",
            evidence=evidence,
            fix="raise the learning rate, or check that the scheduler did not decay it to "
            "nothing",
            module=lo[1])]
    return []


_Stale = tuple[list[tuple[ParamGradRecord, tuple[int, int]]], int, int, float | None]


def _stale(flow: GradFlow) -> _Stale:
    """Half-precision parameters whose update was counted, with (kept, moving) each; the
    totals of both; and the share of weights with a gradient that the update left as they
    were: None where none was counted, or where nothing moved at all (a learning rate of 0
    is as likely as rounding: `grads.update_ratio` says so)."""
    held = [(p, p.update_stale) for p in flow.params
            if p.update_stale is not None and p.tied_to is None and p.update_stale[1]]
    kept = sum(c[0] for _, c in held)
    moving = sum(c[1] for _, c in held)
    return held, kept, moving, kept / moving if moving and kept < moving else None


def find_stale_weights(flow: GradFlow, thresholds: GradThresholds | None = None
                       ) -> list[Finding]:
    """`grads.stale_weights`: bfloat16 or float16 weights that the optimizer's update left
    exactly as they were though their gradient was nonzero (`update_stale`, measured with
    the update ratios). Kept in half precision with no float32 master copy, a weight moves
    only by a step of at least half the spacing of the dtype's numbers there: from 1/512 of
    it in bfloat16, which at AdamW's fine-tuning rates (1e-5 per step) on weights of 0.02
    is most of them (the Gopher paper's appendix C.2 saw it at scale). The loss then stalls
    with no other sign: the update ratios stay ordinary, carried by the small weights that
    still move."""
    t = thresholds or GradThresholds()
    held, kept, moving, share = _stale(flow)
    if share is None or share < t.stale_info:
        return []
    # Named by the parameter holding the most stale weights: LayerNorm gains at 1.0 go
    # stale first (a step under 1/512 of 1.0), but are few.
    worst, (w_kept, w_moving) = max(held, key=lambda pc: pc[1][0])
    dtypes = sorted({p.dtype.removeprefix("torch.") for p, _ in held})
    spacing = {"bfloat16": "1/512 to 1/256 of it in bfloat16",
               "float16": "1/4096 to 1/2048 of it in float16"}
    return [_STALE_WEIGHTS.finding(
        severity=Severity.WARNING if share >= t.stale_warn else Severity.INFO,
        summary=f"stale weights: the optimizer step left {share:.0%} of the {moving:,} "
        f"{' and '.join(dtypes)} weights that had a gradient exactly as they were "
        f"({len(held)} parameters; {w_kept:,} in {worst.name}): without float32 master "
        "weights, a step under half the spacing of the dtype's numbers at a weight ("
        + "; ".join(spacing[d] for d in dtypes if d in spacing) + ") rounds back to it",
        evidence={"stale": share, "kept": kept, "moving": moving, "params": len(held),
                  "dtypes": ", ".join(dtypes), "worst": worst.name,
                  "worst_stale": w_kept / w_moving, "step": flow.index},
        module=worst.module)]


def _grown_from_zero(flow: GradFlow) -> frozenset[str]:
    """Modules every trainable parameter of which started at zero in the watch
    (`GradFlow.from_zero`); a zero bias beside a random weight does not make one."""
    started = set(flow.from_zero)
    every: dict[str, bool] = {}
    for p in flow.params:
        if p.requires_grad and p.tied_to is None:
            every[p.module] = every.get(p.module, True) and p.name in started
    return frozenset(m for m, z in every.items() if z)


def find_idle_forwards(flow: GradFlow, thresholds: GradThresholds | None = None
                       ) -> list[Finding]:
    """Forwards of the step that ran with gradients on and that no backward reached: each
    built an autograd graph and kept its activations alive for nothing until its output was
    dropped (the usual cause: an evaluation pass without `torch.no_grad()`)."""
    del thresholds  # a count, not a measure: any such forward is reported
    n = flow.idle_forwards
    if not n:
        return []
    return [_IDLE_FORWARD.finding(
        severity=Severity.INFO,
        summary=f"{n} forward(s) of the model in step {flow.index} ran with gradients on, "
        "but no backward reached them: each built an autograd graph and kept its "
        "activations until its output was dropped",
        evidence={"idle_forwards": n, "micro_batches": flow.micro_batches,
                  "step": flow.index},
    )]


def find_unseen_forward(flow: GradFlow, thresholds: GradThresholds | None = None
                        ) -> list[Finding]:
    """`grads.unseen_forward`: the parameters got gradients in the step, but no hook on the
    watched modules fired in its forward, so nothing per layer was measured. A watch reports
    such a step as empty, which reads as healthy."""
    del thresholds  # no measure: either a hook fired or none did
    if flow.modules or not any(p.norm is not None for p in flow.params):
        return []
    return [unseen_forward(
        _UNSEEN_FORWARD,
        f"the parameters got gradients in step {flow.index}, but no watched module's "
        "forward ran through torchscope's hooks: nothing per layer was measured",
        {"step": flow.index, "backward_calls": flow.backward_calls})]


@analyzer(GradFlow)
def diagnose(flow: GradFlow, thresholds: GradThresholds | None = None) -> list[Finding]:
    """Every gradient finding for one step, most severe first (`flow.findings()`)."""
    found: list[Finding] = []
    for fn in (find_nonfinite, find_vanishing, find_exploding, find_dead, find_unreached,
               find_frozen, find_frozen_zero, find_update_ratio, find_stale_weights,
               find_idle_forwards, find_unseen_forward):
        found += fn(flow, thresholds)
    found += find_loss_broadcast(flow.loss_broadcast)
    found += find_loss_on_probabilities(flow.loss_on_probabilities)
    found += find_padding_in_loss(flow.padded_labels)
    found += find_broken_update(flow.broken_update)
    found += rank_findings(flow)  # DDP/FSDP2 only: ranks that diverge or see skewed data
    return rank(found)


def diagnose_history(
    history: GradHistory, thresholds: GradThresholds | None = None
) -> list[Finding]:
    """Findings over sampled steps: the first non-finite total, a growing total norm, and
    clipping that acts on most steps (`find_clipping`)."""
    t = thresholds or GradThresholds()
    found: list[Finding] = find_clipping(history, t)
    totals = history.total_norms
    bad = next((i for i, v in enumerate(totals) if not math.isfinite(v)), None)
    if bad is not None:
        found.append(_NONFINITE.finding(
            severity=Severity.ERROR,
            summary=f"the total gradient norm became NaN/Inf at step {history.steps[bad]}",
            evidence={"step": history.steps[bad], "samples": len(history)},
            fix="inspect that step with gradient_flow(); lower the learning rate or use "
            "GradScaler/bf16.",
        ))
    finite = [(s, v) for s, v in zip(history.steps, totals, strict=True)
              if math.isfinite(v) and v > 0]
    if len(finite) >= 2:
        (s0, v0), (s1, v1) = finite[0], finite[-1]
        if v1 / v0 >= t.growth_ratio:
            found.append(_EXPLODING.finding(
                severity=Severity.WARNING,
                summary=f"the total gradient norm grew {fmt_times(v1 / v0)} from step {s0} to "
                f"step {s1}",
                evidence={"first_step": s0, "first_norm": v0, "last_step": s1,
                          "last_norm": v1, "ratio": v1 / v0},
                fix=("the loop already clips the gradients it applies; lower the learning "
                     "rate." if history.clip_factors()[-1] > 1 else
                     "clip with torch.nn.utils.clip_grad_norm_ and lower the learning rate."),
            ))
    return rank(found)


def find_clipping(history: GradHistory, thresholds: GradThresholds | None = None
                  ) -> list[Finding]:
    """`grads.clipped` (info): the loop shrank the gradients it applied (clipping, read as
    `GradHistory.applied_norms`) on half the sampled steps or more, three samples or more,
    by `clipped_by` or more (median). Clipping that cuts spikes now and then, or that
    trims a few percent, stays silent."""
    t = thresholds or GradThresholds()
    factors = history.clip_factors()
    clipped = [i for i, f in enumerate(factors) if f > 1]
    if len(history) < 3 or 2 * len(clipped) < len(history):
        return []
    totals = [history.total_norms[i] for i in clipped]
    applied = [history.applied_norms[i] or 0.0 for i in clipped]
    factor, total = statistics.median(factors[i] for i in clipped), statistics.median(totals)
    if factor < t.clipped_by:
        return []
    return [_CLIPPED.finding(
        severity=Severity.INFO,
        summary=f"the loop clipped the gradients on {len(clipped)} of {len(history)} sampled "
        f"steps, by {fmt_times(factor)} (median: a total norm of {total:.3g} applied as "
        f"{statistics.median(applied):.3g})",
        evidence={"clipped": len(clipped), "samples": len(history), "median_factor": factor,
                  "median_total_norm": total, "median_applied_norm": statistics.median(applied),
                  "first_step": history.steps[clipped[0]],
                  "last_step": history.steps[clipped[-1]]},
        fix="where clipping acts on most steps, max_norm, not the gradient, sets each "
            "update's size, and the learning rate scales a normalised step: fine if meant "
            f"(early in a large model's training); otherwise set max_norm (the HF Trainer's "
            f"max_grad_norm, Lightning's gradient_clip_val) near the usual total "
            f"({total:.3g}) so that it cuts only spikes (clipping by value: a value only "
            "spikes reach), and lower the learning rate if the steps are then too large",
    )]


def find_no_step(step_by: str, steps: int, backwards: int,
                 optimizer: str | None) -> list[Finding]:
    """`grads.no_step`: backward passes ran, but the optimizer whose `step()` ends a step
    never stepped, so no step was counted: the loop steps another optimizer (SAM's
    `base_optimizer`, a wrapper's inner one) or updates the weights itself."""
    if step_by != "optimizer" or steps or backwards < 2:
        return []
    return [_NO_STEP.finding(
        severity=Severity.WARNING,
        summary=f"{backwards} backward passes ran but the optimizer given "
        f"({optimizer or 'optimizer='}) never stepped: a step is counted at its step(), so "
        "no step was counted or sampled (only the passes left at the end, as one)",
        evidence={"backwards": backwards, "optimizer": optimizer},
    )]


def find_not_zeroed(unzeroed: int, first: int | None, steps: int,
                    history: GradHistory | None = None) -> list[Finding]:
    """`grads.not_zeroed`: optimizer steps whose gradients still held the previous step's,
    because nothing zeroed them in between: each update uses the sum of every gradient since
    the loop began, so it grows step after step. A loop that zeroes them in place between
    the backward and the step reads the same way from metadata: where `history` shows it
    (`_zeroed_samples`), `grads.cleared_before_step` says so instead."""
    if not unzeroed or _zeroed_samples(history):
        return []
    return [_NOT_ZEROED.finding(
        severity=Severity.WARNING,
        summary=f"the gradients were never zeroed between optimizer steps: {unzeroed} of "
        f"{steps} steps (from step {first}) updated with the sum of every earlier step's "
        "gradient too",
        evidence={"steps": unzeroed, "first_step": first, "of": steps},
    )]


def find_cleared(cleared: int, first: int | None, steps: int,
                 history: GradHistory | None = None) -> list[Finding]:
    """`grads.cleared_before_step`: optimizer steps whose gradients the loop cleared between
    the backward and the step (`cleared`, set to None: metadata), or zeroed in place (sampled
    steps of `history` whose update used a total norm of 0 while the backward's was not):
    those updates used no gradient, so the model does not learn."""
    zeroed = _zeroed_samples(history)
    if not cleared and not zeroed:
        return []
    if cleared:
        summary = (f"the loop cleared the gradients between the backward and the optimizer's "
                   f"step on {cleared} of {steps} steps (from step {first}): those updates "
                   "used no gradient")
    else:
        summary = (f"the gradients that the optimizer's update used were all zero on "
                   f"{len(zeroed)} sampled step(s) (from step {zeroed[0]}), while the "
                   "backward's were not: the loop zeroed them between the backward and the "
                   "step")
    return [_CLEARED_BEFORE_STEP.finding(
        severity=Severity.WARNING,
        summary=summary,
        evidence={"steps": cleared, "first_step": first if cleared else zeroed[0],
                  "of": steps, "zeroed_samples": len(zeroed)},
    )]


def find_not_optimized(names: Sequence[str], optimizer: str | None) -> list[Finding]:
    """`grads.not_optimized`: trainable parameters that get gradients but that no optimizer
    stepped while the watch was open (`GradWatch.unoptimized`): they never train, and the
    optimizer's `zero_grad()` never clears them either, so their gradients pile up."""
    if not names:
        return []
    shown = fmt_names(names, 4)
    return [_NOT_OPTIMIZED.finding(
        severity=Severity.WARNING,
        summary=f"{len(names)} parameter(s) get gradients that no optimizer steps ({shown}): "
                f"they never train, and {optimizer or 'the optimizer'}.zero_grad() never "
                "clears them, so their gradients add up over the steps",
        evidence={"parameters": len(names), "first": names[0]},
        module=names[0].rpartition(".")[0] or None,
    )]


def _zeroed_samples(history: GradHistory | None) -> list[int]:
    """The sampled steps whose update used gradients of total norm 0 while the backward's
    was not: zeroed between the backward and the step."""
    if history is None or not history.applied_norms:
        return []
    return [s for s, t, a in zip(history.steps, history.total_norms, history.applied_norms,
                                 strict=True) if a == 0 and t > 0]


def find_no_update(backwards: int, without_update: int, steps: int) -> list[Finding]:
    """`grads.no_update`: every backward pass added to no parameter of the model
    (`without_update` of them, left out, and no other): the loop trains other tensors
    (functional training on copies of the parameters), or only calls
    `torch.autograd.grad`."""
    if backwards or without_update < 2:
        return []
    return [_NO_UPDATE.finding(
        severity=Severity.WARNING,
        summary=f"{without_update} backward passes ran but none added to a gradient of "
        "the model's own parameters, so none is a training step's and nothing was sampled",
        evidence={"passes": without_update, "steps": steps},
    )]


@analyzer(GradWatch)
def diagnose_watch(watch: GradWatch, thresholds: GradThresholds | None = None) -> list[Finding]:
    """Findings of a watched loop (`watch.findings()`): the last sample's, then the
    history's, most severe first."""
    last = watch.last
    found = diagnose(last, thresholds) if last is not None else []
    broken = watch.broken_update
    if broken is not None:
        # The first update that wrote NaN/Inf is the cause of the NaN/Inf gradients of the
        # steps after it, last's included: they computed with its weights.
        found = [f for f in found if f.code != _NONFINITE_UPDATE.code
                 and not _after_update(f, broken)]
        found += find_broken_update(broken)
    found += find_loss_broadcast(watch.loss_broadcast)
    found += find_loss_on_probabilities(watch.loss_on_probabilities)
    found += find_no_step(watch.step_by, watch.steps, watch.backwards, watch.optimizer_name)
    found += find_no_update(watch.backwards, watch.passes_without_update, watch.steps)
    found += find_not_zeroed(watch.unzeroed_steps, watch.first_unzeroed, watch.steps,
                             watch.history)
    found += find_cleared(watch.cleared_steps, watch.first_cleared, watch.steps,
                          watch.history)
    found += find_not_optimized(watch.unoptimized, watch.optimizer_name)
    found += ran_eagerly(_COMPILED_EAGER, watch.compiled, "the gradient watch")
    history = diagnose_history(watch.history, thresholds)
    if broken is not None:
        history = [f for f in history if not _after_update(f, broken)]
    return rank(found + history)


def _after_update(finding: Finding, broken: BrokenUpdate) -> bool:
    """A `grads.nonfinite` of a step after the update that wrote NaN/Inf into weights."""
    step = finding.evidence.get("step")
    return finding.code == _NONFINITE.code and isinstance(step, int) and step > broken.step
