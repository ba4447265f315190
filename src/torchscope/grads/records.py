"""Frozen records of gradient flow. They hold numbers (and fixed reason phrases), never
formatted text."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torchscope.distributed.ranked import Gatherable
from torchscope.errors import TorchscopeError
from torchscope.findings import Analyzed

if TYPE_CHECKING:
    from torchscope.grads.loss import LossBroadcast, LossOnProbabilities
    from torchscope.step import StepInfo

# Why a gradient is missing. Fixed phrases, so tests and renderers can match them.
INPUT_NO_GRAD = "input does not require grad"
OUTPUT_NO_GRAD = "output does not require grad"
NOT_REACHED = "the loss does not reach it"
NOT_MEASURED = "not measured (non-strided or in-place input without history)"
FROZEN = "frozen (requires_grad=False)"
NO_GRAD = "received no gradient (not run, or the loss does not reach it)"
NOT_RUN = "its module did not run in the step's forward"
RAN_NO_GRAD = "ran only with gradients disabled (torch.no_grad) inside a training forward"
RAN_IN_REENTRANT_CHECKPOINT = ("ran only inside a reentrant checkpoint whose inputs do not "
                               "require grad")
PASSES_UNSUMMED = ("reached by more than one backward pass, an earlier one without "
                   "retain_graph: the norm of their sum is not measured")
# Two total norms of one step's gradients within 1 % are the same: the two reads sum in
# different orders and precisions (float64 native sums, `torch._foreach_norm`).
_SAME = 1.01


def clip_factor(total_norm: float, applied_norm: float | None) -> float:
    """`total_norm / applied_norm`: how many times smaller the gradients a step's update
    used were than the backward's; 1.0 where they were not smaller by 1 % or more, where
    `applied_norm` is None or either is not finite, and where it is 0 (zeroed, not
    clipped: `grads.cleared_before_step`)."""
    a, t = applied_norm, total_norm
    if a is None or a == 0 or not (math.isfinite(a) and math.isfinite(t)) or t <= a * _SAME:
        return 1.0
    return t / a


def combine_norms(norms: Iterable[float | None]) -> float | None:
    """L2 norm of the concatenation of tensors whose L2 norms are `norms` (None skipped).

    Returns None when every entry is None.
    """
    vals = [n for n in norms if n is not None]
    if len(vals) == 1:  # most modules' one call, most calls' one output: fsum([x]) is x
        return math.sqrt(vals[0] * vals[0])
    if not vals:
        return None
    return math.sqrt(math.fsum(n * n for n in vals))


def rms(norm: float | None, numel: int) -> float | None:
    """`norm / sqrt(numel)`: the root mean square of a tensor whose L2 norm is `norm`.

    None when `norm` is None or there are no elements.
    """
    return None if norm is None or numel <= 0 else norm / math.sqrt(numel)


def ratio(num: float | None, den: float | None) -> float | None:
    """`num / den`, or None when either is missing or `den` is not positive and finite."""
    if num is None or den is None or not den > 0 or not math.isfinite(den):
        return None
    return num / den


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
    def numel(self) -> int:
        """Elements of the tensor (and of its gradient)."""
        return math.prod(self.shape)

    @property
    def rms(self) -> float | None:
        """Root mean square of the gradient, `norm / sqrt(numel)`: comparable between tensors
        of different sizes. None without a gradient or for an empty tensor."""
        return rms(self.norm, self.numel)

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
        grad_output: gradient arriving from above, per output tensor. It is read where
            autograd sums every use of the output: a module that also uses a tensor it
            returns (`return self.b(h), h`) has that inner use's gradient in it too.
            torch's own full backward hooks leave it out by wrapping the outputs in an
            identity node, which would put a node into the user's graph and fails on an
            in-place op after the module; torchscope does not.
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
    def output_numel(self) -> int:
        """Elements of the outputs that received a gradient."""
        return sum(g.numel for g in self.grad_output if g.present)

    @property
    def output_rms(self) -> float | None:
        """Root mean square of every element of every output gradient together."""
        return rms(self.output_norm, self.output_numel)

    @property
    def finite(self) -> bool:
        """False when any gradient of this call holds NaN or Inf."""
        return all(g.finite for g in self.grad_output + self.grad_input)


@dataclass(frozen=True)
class ParamGradRecord:
    """The gradient of one parameter at the end of a step (after all micro-batches).

    A parameter registered under two names (tied weights: GPT-2's `lm_head.weight` is
    `transformer.wte.weight`) has a record under each; the second names the first in
    `tied_to`, shows the same gradient, and is counted once in every total.

    Attributes:
        name: qualified parameter name, e.g. `conv1.weight`.
        module: qualified name of the module that owns it.
        shape: parameter shape.
        dtype: parameter dtype.
        requires_grad: False for frozen parameters.
        norm: L2 norm of `.grad` (unscaled with a GradScaler); None when there is no grad.
        reason: why `norm` is None.
        weight_norm: L2 norm of the parameter itself when the gradient was read (before the
            optimizer's update); None for frozen parameters.
        update_norm: L2 norm of the optimizer's change to the parameter in this step,
            `‖w_after - w_before‖`; None unless measured (`watch_gradients` with an optimizer).
        tied_to: for a second name of the same tensor, the first name; else None.
        expert_norms: for a mixture of experts' fused expert weight (shape (experts, ...),
            owned by a module whose class name ends in `Experts`, as transformers' are),
            the norm of each expert's slice of the gradient: 0 for an expert that no token
            reached in the step. None for any other parameter, and under FSDP2.
        update_stale: for a bfloat16 or float16 parameter whose update was measured,
            `(kept, moving)`: of its `moving` elements with a nonzero gradient, the `kept`
            ones the update left exactly as they were (stale weights: a step smaller than
            half the spacing of the dtype's numbers at a weight rounds back to it). Under
            FSDP2, this rank's shard. None otherwise.
    """

    name: str
    module: str
    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool
    norm: float | None
    reason: str | None = None
    weight_norm: float | None = None
    update_norm: float | None = None
    tied_to: str | None = None
    expert_norms: tuple[float, ...] | None = None
    update_stale: tuple[int, int] | None = None

    @property
    def finite(self) -> bool:
        """False when the gradient holds NaN or Inf."""
        return self.norm is None or math.isfinite(self.norm)

    @property
    def numel(self) -> int:
        """Elements of the parameter."""
        return math.prod(self.shape)

    @property
    def rms(self) -> float | None:
        """Root mean square of the gradient, `‖g‖ / sqrt(numel)`."""
        return rms(self.norm, self.numel)

    @property
    def relative(self) -> float | None:
        """The relative gradient `‖g‖ / ‖w‖`: how far a plain SGD step of learning rate 1
        would move the parameter, as a fraction of its norm. None when either is missing or
        the parameter is all zeros."""
        return ratio(self.norm, self.weight_norm)

    @property
    def update_ratio(self) -> float | None:
        """`‖Δw‖ / ‖w‖` of the optimizer step, when measured (about 1e-3 is the usual
        healthy figure)."""
        return ratio(self.update_norm, self.weight_norm)


@dataclass(frozen=True)
class LayerGrads:
    """One module's scale-free gradient measures in one step.

    The parameter measures are over the module's own trainable weight matrices and kernels
    (parameters of two or more dimensions) when it has any, else over all its own trainable
    parameters: a bias's or a norm gain's gradient is a sum over the batch and positions,
    on another scale than a weight's. Tied parameters count in every module that uses them.

    Attributes:
        module: qualified module name.
        module_type: the module's class name.
        order: backward order of its first reached call (0 is nearest the loss); None when
            no call was reached.
        output_norm: L2 norm of every output gradient of every call together.
        output_numel: elements those output gradients hold.
        grad_norm: L2 norm of the measured parameters' gradients together.
        weight_norm: L2 norm of the measured parameters themselves.
        update_norm: L2 norm of their optimizer update, when measured.
        numel: elements of the measured parameters.
        params: names of the measured parameters.
        tied: whether any measured parameter is shared with another module.
    """

    module: str
    module_type: str
    order: int | None
    output_norm: float | None
    output_numel: int
    grad_norm: float | None
    weight_norm: float | None
    update_norm: float | None
    numel: int
    params: tuple[str, ...]
    tied: bool = False

    @property
    def output_rms(self) -> float | None:
        """RMS of the gradient arriving at the module's outputs."""
        return rms(self.output_norm, self.output_numel)

    @property
    def rms(self) -> float | None:
        """RMS of the measured parameters' gradients."""
        return rms(self.grad_norm, self.numel)

    @property
    def relative(self) -> float | None:
        """`‖g‖ / ‖w‖` of the measured parameters."""
        return ratio(self.grad_norm, self.weight_norm)

    @property
    def update_ratio(self) -> float | None:
        """`‖Δw‖ / ‖w‖` of the measured parameters, when the update was measured."""
        return ratio(self.update_norm, self.weight_norm)


@dataclass(frozen=True)
class RankGrads:
    """Per-parameter gradient norms of every rank in one DDP or FSDP2 step: the rank-aware
    part of a `GradFlow`. One row per rank of the group the step synchronised over.

    Under DDP each rank computes a gradient from its own batch (`local`, read after it
    accumulated and before DDP's all-reduce touched it) and then holds the all-reduced one
    (`synced`, read when backward has returned), which must be the same on every rank.
    Under FSDP2 every rank holds a shard of the reduce-scattered gradient (`local` is the norm
    of that shard); the global norm of a parameter is the root of the summed squares of its
    shards over the parameter's shard group (`shard_rows`), never an all-gather of gradients.

    Attributes:
        strategy: `ddp` or `fsdp2`.
        rank: the global rank that recorded this.
        ranks: the global rank of each row.
        names: parameter names, in `GradFlow.params` order.
        local: `[row][param]` norm of the gradient the rank computed itself (DDP) or of its
            shard (FSDP2); None where it had none.
        synced: `[row][param]` norm of `.grad` once backward returned, for parameters that
            every rank holds whole (all of them under DDP; under FSDP2 only parameters
            outside every `fully_shard`, whose gradients nothing reduces); None elsewhere.
        fingerprints: `[row][param]` the sum of the elements of that same `.grad`: a second
            number that must agree between ranks.
        shard_rows: per parameter, the rows whose shards make up its gradient (FSDP2
            DTensor parameters); empty for parameters held whole.
        weights: `[row][param]` norm of the parameter the rank holds (its shard under
            FSDP2), for relative gradients `‖g‖/‖w‖` of the whole parameter.
        end_norms: DDP, where the ranks were joined at the watch's end: `[row][param]` the
            parameter's norm as the rank held it then, after the last update (float64
            sums); None for one that is not a plain tensor. Empty elsewhere.
        end_sums: the same parameters' position-weighted sums (float64, the sum of each
            row of the last dim times its position from 1): with `end_norms`, two numbers
            that replicas that stayed equal agree on.
    """

    strategy: str
    rank: int
    ranks: tuple[int, ...]
    names: tuple[str, ...]
    local: tuple[tuple[float | None, ...], ...]
    synced: tuple[tuple[float | None, ...], ...]
    fingerprints: tuple[tuple[float | None, ...], ...]
    shard_rows: tuple[tuple[int, ...], ...]
    weights: tuple[tuple[float | None, ...], ...] = ()
    end_norms: tuple[tuple[float | None, ...], ...] = ()
    end_sums: tuple[tuple[float | None, ...], ...] = ()

    @property
    def row(self) -> int:
        """The row of the rank that recorded this."""
        return self.ranks.index(self.rank)

    def norm(self, index: int) -> float | None:
        """The gradient norm of parameter `index` as one process would compute it: the
        root of the summed squares of its shards (FSDP2), else the synchronised norm."""
        rows = self.shard_rows[index]
        if rows:
            return combine_norms(self.local[r][index] for r in rows)
        return self.synced[self.row][index]

    def weight_norm(self, index: int) -> float | None:
        """The norm of parameter `index` as one process would compute it: the root of the
        summed squares of its shards (FSDP2), else this rank's."""
        if not self.weights:
            return None
        rows = self.shard_rows[index]
        if rows:
            return combine_norms(self.weights[r][index] for r in rows)
        return self.weights[self.row][index]

    def local_totals(self) -> tuple[float | None, ...]:
        """Per row, the norm of every local gradient (or shard) together."""
        return tuple(combine_norms(row) for row in self.local)

    def diverged(self, rel: float = 1e-6) -> tuple[str, ...]:
        """Names of the parameters held whole whose synchronised gradients differ between
        ranks (one rank has none while another has one, or the norms or element sums differ
        by more than `rel`, relative)."""
        out = []
        for i, name in enumerate(self.names):
            if self.shard_rows[i]:
                continue
            for column in (tuple(row[i] for row in self.synced),
                           tuple(row[i] for row in self.fingerprints)):
                if disagree(column, rel):
                    out.append(name)
                    break
        return tuple(out)


def disagree(values: Sequence[float | None], rel: float, *, partial: bool = True,
             scale: float = 0.0) -> bool:
    """Whether the ranks' `values` of one number differ: by more than `rel` of the largest
    of them (or of `scale`, for a sum whose terms may cancel), in which NaN/Inf they hold,
    or (with `partial`) in being present on some ranks only. Fewer than two present values
    never differ among themselves."""
    present = [v for v in values if v is not None]
    if partial and present and len(present) != len(values):
        return True
    if len(present) < 2:
        return False
    if not all(math.isfinite(v) for v in present):
        return len({repr(v) for v in present}) > 1  # NaN/Inf on some ranks, or different ones
    lo, hi = min(present), max(present)
    return hi - lo > rel * max(abs(lo), abs(hi), scale, 1e-30)


@dataclass(frozen=True)
class BrokenUpdate:
    """A sampled optimizer update that wrote NaN/Inf into parameters whose weights and
    gradients were finite before it (`GradFlow.broken_update`; a watch keeps the first,
    `GradWatch.broken_update`). Every later forward computes with those weights.

    Attributes:
        step: the sampled step whose update it was.
        params: the parameters it made NaN/Inf, in module order (a tied parameter once).
        dtypes: their dtypes, each once, in order of first appearance.
        measured: parameters whose update the step measured.
        optimizer: the optimizer's class name, or None.
        eps: the optimizer's `eps` (`GradFlow.optimizer_eps`), or None.
    """

    step: int
    params: tuple[str, ...]
    dtypes: tuple[str, ...]
    measured: int
    optimizer: str | None = None
    eps: float | None = None


@dataclass(frozen=True)
class GradFlow(Analyzed, Gatherable):
    """Everything measured in one step: per-call module records and per-parameter norms.

    Its findings (`flow.findings()`) are `torchscope.grads.diagnose`'s.

    Attributes:
        index: the sampled step's index (optimizer steps counted from 0; backward calls
            without an optimizer); 0 for `gradient_flow`.
        modules: per-call records, in backward order (nearest the loss first); calls no
            gradient reached follow in forward order.
        params: one record per parameter name of the model, in module order (a tied
            parameter's second name included, see `ParamGradRecord.tied_to`).
        total_norm: the L2 norm over every parameter gradient, the number that
            `torch.nn.utils.clip_grad_norm_` returns; 0.0 when no parameter has a gradient.
        scale: the GradScaler scale that was divided out, or None without a scaler.
        micro_batches: forwards of the model in this step that a backward reached.
        backward_calls: backward passes that reached the parameters in this step.
        idle_forwards: forwards of the model in this step that ran with gradients on but
            that no backward reached (an evaluation pass without `torch.no_grad`); they are
            no micro-batch, and their calls are not in `modules`.
        step: the training step torchscope ran (loss, its value, optimizer, AMP,
            accumulation); None for a step of the user's own loop (`watch_gradients`).
        ranks: on a DDP or FSDP2 model, every rank's per-parameter norms (`RankGrads`);
            then `params` hold the norms one process would compute (DDP: synchronised;
            FSDP2: global) and `modules` this rank's own activation gradients. None on one
            process. `flow.gather()` brings every rank's flow to rank 0.
        fused_norms, eager_norms: gradients of module outputs and inputs whose norm the
            fused kernel computed (`torchscope._kernels`, one pass; float32 spans summed in
            float64 on CPU float32, float64 sums elsewhere) and those
            eager `vector_norm` did (while the kernel was building, or where it cannot run);
            parameter norms come from one call per backward (the native list kernel or
            `torch._foreach_norm`).
        from_zero: trainable parameters that read all zero when the watch opened (with an
            optimizer) or at this or an earlier sampled step of it (a zero init: LoRA's B).
            Their update ratio measures how far they have grown from zero, not the step's
            size. Empty for `gradient_flow`.
        applied_norm: the total norm of the gradients the optimizer's update used, where
            the loop changed them between the backward and the update (clipping; a
            GradScaler's scale is divided out of both); None where nothing changed them
            (the update used `total_norm`'s gradients), or where it was not read (no
            optimizer, an unsampled step, FSDP2 under `manual=True`). Under FSDP2 it is
            joined from every rank's shards, and kept only where it differs from
            `total_norm` (clipping moves no DTensor's version counter).
        optimizer: the class name of the optimizer whose update a watch measured, or None.
        optimizer_eps: that optimizer's `eps` (the smallest over its parameter groups),
            or None: without one, or where no group holds a float `eps`.
        experts: a mixture of experts kept as separate modules (the children of a module
            whose class name ends in `Experts`, or of an `nn.ModuleList` named `experts`):
            per experts module, its expert modules in order. Fused expert weights carry
            their experts in `ParamGradRecord.expert_norms` instead.
        frozen_zero: frozen parameters (requires_grad=False; not biases, up to 2**20
            elements) whose every value was zero when the gradients were read: nothing can
            change them. Not read across ranks (empty under DDP and FSDP2).
        loss_broadcast: where the step's loss broadcast the model's output against its
            target into every pair of the two, or along a larger target's rows
            (`loss_faults`, read by `gradient_flow` on the first micro-batch's graph); None
            where it did not, or where it was not read (a watch keeps its own).
        loss_on_probabilities: where the step's loss applied its own softmax or sigmoid to
            an output that already went through one (`loss_faults`); None where it did not.
        padded_labels: `(padded, counted)` where the model is a transformers model whose
            loss reads `labels` against its `attention_mask` and the step gave it both, or
            it runs one that it gives both (`StepLossCheck.padded_labels`, over every
            micro-batch): the label positions the mask pads that the loss reads, and those
            of them that hold a token, not -100. None where not so.
    """

    index: int
    modules: tuple[ModuleGradRecord, ...]
    params: tuple[ParamGradRecord, ...]
    total_norm: float
    scale: float | None = None
    micro_batches: int = 1
    backward_calls: int = 1
    step: StepInfo | None = None
    ranks: RankGrads | None = None
    fused_norms: int = 0
    eager_norms: int = 0
    idle_forwards: int = 0
    from_zero: tuple[str, ...] = ()
    applied_norm: float | None = None
    optimizer: str | None = None
    experts: tuple[tuple[str, tuple[str, ...]], ...] = ()
    frozen_zero: tuple[str, ...] = ()
    optimizer_eps: float | None = None
    loss_broadcast: LossBroadcast | None = None
    loss_on_probabilities: LossOnProbabilities | None = None
    padded_labels: tuple[int, int] | None = None

    @property
    def broken_update(self) -> BrokenUpdate | None:
        """The parameters whose weights and gradient were finite when the gradients were
        read but whose measured update is NaN/Inf: the optimizer's update wrote NaN/Inf
        into them (`BrokenUpdate`); None where it wrote none, or no update was measured."""
        measured = [p for p in self.params if p.update_norm is not None and p.tied_to is None]
        broken = [p for p in measured if p.update_norm is not None
                  and not math.isfinite(p.update_norm) and p.finite
                  and p.weight_norm is not None and math.isfinite(p.weight_norm)]
        if not broken:
            return None
        return BrokenUpdate(step=self.index, params=tuple(p.name for p in broken),
                            dtypes=tuple(dict.fromkeys(p.dtype for p in broken)),
                            measured=len(measured), optimizer=self.optimizer,
                            eps=self.optimizer_eps)

    def idle_experts(self) -> dict[str, tuple[str, tuple[bool, ...]]]:
        """Per experts module of a mixture of experts: the weight read per expert (its
        first fused weight; "" for experts kept as separate modules), and per expert,
        whether no gradient reached it in this step (no token did): a zero slice of the
        fused weight's gradient, or no gradient in any of its module's parameters."""
        out: dict[str, tuple[str, tuple[bool, ...]]] = {}
        for p in self.params:
            if p.expert_norms is not None and p.tied_to is None and p.module not in out:
                out[p.module] = (p.name, tuple(n == 0.0 for n in p.expert_norms))
        if not self.experts:
            return out
        # Each parameter to the expert module that holds it: one walk up its module's name.
        member = {m: (module, e) for module, ms in self.experts for e, m in enumerate(ms)}
        got: set[tuple[str, int]] = set()
        for p in self.params:
            if p.norm is None or p.norm == 0.0 or not p.requires_grad:
                continue
            name = p.module
            while name and name not in member:
                name = name.rpartition(".")[0]
            if name in member:
                got.add(member[name])
        for module, ms in self.experts:
            out[module] = ("", tuple((module, e) not in got for e in range(len(ms))))
        return out

    @property
    def clip_factor(self) -> float:
        """How many times smaller the gradients the update used were than the backward's
        (`total_norm / applied_norm`): above 1 where the loop clipped them; 1.0 where it
        did not, or where it is not known. Differences under 1 % count as none."""
        return clip_factor(self.total_norm, self.applied_norm)

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
        gradients together (a tied parameter in each module that uses it); None when none
        of them has a gradient."""
        return _by_module((p.module, p.norm) for p in self.params)

    def weight_norms(self) -> dict[str, float | None]:
        """Per module, the norm of its own parameters together, as read with their
        gradients (before the optimizer's update); None where none was read (frozen)."""
        return _by_module((p.module, p.weight_norm) for p in self.params)

    def tied(self) -> dict[str, str]:
        """Second names of tied parameters, each with the name it is tied to."""
        return {p.name: p.tied_to for p in self.params if p.tied_to is not None}

    def layer_grads(self) -> list[LayerGrads]:
        """Scale-free measures per module (`LayerGrads`): the recorded modules in backward
        order, then modules that own parameters but were not recorded."""
        calls: dict[str, list[ModuleGradRecord]] = {}
        for r in self.modules:
            calls.setdefault(r.module, []).append(r)
        owned: dict[str, list[ParamGradRecord]] = {}
        for p in self.params:
            if p.requires_grad:
                owned.setdefault(p.module, []).append(p)
        targets = {p.tied_to for p in self.params if p.tied_to is not None}
        out = []
        for m in dict.fromkeys([*calls, *owned]):
            rs = calls.get(m, [])
            ps = owned.get(m, [])
            measured = [p for p in ([p for p in ps if len(p.shape) >= 2] or ps)
                        if p.norm is not None]
            weights = [p.weight_norm for p in measured]
            updates = [p.update_norm for p in measured]
            out.append(LayerGrads(
                module=m,
                module_type=rs[0].module_type if rs else "",
                order=min((r.order for r in rs if r.order is not None), default=None),
                output_norm=combine_norms(r.output_norm for r in rs),
                output_numel=sum(r.output_numel for r in rs),
                grad_norm=combine_norms(p.norm for p in measured),
                weight_norm=None if None in weights else combine_norms(weights),
                update_norm=None if None in updates else combine_norms(updates),
                numel=sum(p.numel for p in measured),
                params=tuple(p.name for p in measured),
                tied=any(p.tied_to is not None or p.name in targets for p in measured),
            ))
        return out

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
        applied_norms: per sample, `GradFlow.applied_norm`: the total norm of the gradients
            the update used where the loop changed them in place (clipping); None where it
            did not. Empty where not read.
    """

    steps: tuple[int, ...]
    layers: tuple[str, ...]
    output_norms: tuple[tuple[float, ...], ...]
    param_norms: tuple[tuple[float, ...], ...]
    total_norms: tuple[float, ...]
    applied_norms: tuple[float | None, ...] = ()

    def __len__(self) -> int:
        return len(self.steps)

    def clip_factors(self) -> tuple[float, ...]:
        """Per sample, `clip_factor`: how many times the loop shrank the gradients it
        applied (clipping); 1.0 where it did not, or where that was not read."""
        if not self.applied_norms:
            return tuple(1.0 for _ in self.steps)
        return tuple(clip_factor(t, a)
                     for t, a in zip(self.total_norms, self.applied_norms, strict=True))

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
