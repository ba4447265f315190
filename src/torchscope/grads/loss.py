"""Loss diagnosis: what a step's loss does with the model's output, and labels on padding.

Two mistakes between the model's output and its loss are read once on autograd's graph,
before backward (`loss_faults`; no tensor is read): a loss that broadcast the output against
its target (`LossBroadcast`, `grads.loss_broadcast`), and a loss that applies its own
softmax or sigmoid to probabilities (`LossOnProbabilities`, `grads.loss_on_probabilities`).
A transformers model's labels that hold a token where its attention mask pads are counted
from its inputs (`padded_label_counts`, `grads.padding_in_loss`).

`gradient_flow` reads them while it runs its step (`StepLossCheck`), a gradient watch when
the loop hands it the loss (`GradWatch.check_loss`), and the run monitor on its sampled
steps; `torchscope.grads.analyze` turns them into findings.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch
from torch import nn

from torchscope.hooks.tree import iter_tensors
from torchscope.step import Step

__all__ = [
    "LossBroadcast",
    "LossFaults",
    "LossOnProbabilities",
    "OutputEdge",
    "StepLossCheck",
    "labelled_modules",
    "labels_against_mask",
    "loss_faults",
    "loss_faults_at",
    "output_edges",
    "padded_label_counts",
]

# The losses torchscope itself takes on logits (`Step`'s "auto" and named losses): a
# softmax's probabilities given to them are the step's choice, not the training code's.
_OWN_LOGIT_LOSSES = ("cross_entropy", "binary_cross_entropy")


@dataclass(frozen=True)
class LossBroadcast:
    """A loss that broadcast a model output against a tensor without gradient (its target)
    of as many elements, laid out otherwise: `(N, 1)` predictions against `(N,)` targets
    become an `(N, N)` table of every prediction against every target. The loss is then the
    mean over that table, and its gradient pulls each prediction toward the mean of all
    targets: the model learns the targets' mean. `torch.nn.MSELoss` warns once; a loss
    written by hand (`((out - y) ** 2).mean()`) does not.

    Attributes:
        output: where the output sits in what the model returned (`""` for the output
            itself, `"['logits']"`, `"[0]"`).
        output_shape: its shape, e.g. `(32, 1)`.
        shape: the broadcast shape, e.g. `(32, 32)`: the output's element count squared.
        op: the autograd node that made it: `SubBackward0` (`out - y`), `ExpandBackward0`
            (`torch.broadcast_tensors` inside `mse_loss` and `l1_loss`), ...
        target_shape: the step's target's shape where the step was given one of the same
            element count; else None (the operand is known only by its lack of gradient).
            Where it equals `shape`, the output was broadcast along the target's own
            dimensions instead (`per_row`).
    """

    output: str
    output_shape: tuple[int, ...]
    shape: tuple[int, ...]
    op: str
    target_shape: tuple[int, ...] | None = None

    @property
    def per_row(self) -> int | None:
        """How many targets each prediction met where the output (`(N, 1)`) was broadcast
        along a larger target's own dimensions (`(N, K)`, K of them); None where every
        prediction met every target."""
        if self.target_shape is None or self.target_shape != self.shape:
            return None
        return math.prod(self.shape) // max(math.prod(self.output_shape), 1)


@dataclass(frozen=True)
class LossOnProbabilities:
    """A loss that applies its own softmax or sigmoid to an output that already went
    through one: `cross_entropy` (its `log_softmax`) after a softmax, `nll_loss` (which
    wants log-probabilities) on softmax probabilities, `binary_cross_entropy_with_logits`
    (its sigmoid) after a sigmoid. The probabilities are taken as logits: the loss has a
    floor it cannot go below and its gradient shrinks as they saturate, so training stalls.

    Attributes:
        output: where the output sits in what the model returned (as `LossBroadcast`).
        output_shape: its shape.
        squash: `softmax` or `sigmoid`: what made the probabilities.
        loss: `cross_entropy`, `nll_loss` or `binary_cross_entropy_with_logits`.
        in_model: the output itself is the squash's result (a final `nn.Softmax` or
            `nn.Sigmoid` layer); False where the loss code applies it.
        classes: the softmax's dimension size (C), else None.
        assumed: the loss is torchscope's own (`loss_fn="auto"` or a named loss on a
            model whose output is a softmax's or sigmoid's result), not the training
            code's: the mistake is the training's only where it takes that loss too.
    """

    output: str
    output_shape: tuple[int, ...]
    squash: str
    loss: str
    in_model: bool
    classes: int | None = None
    assumed: bool = False


class LossFaults(NamedTuple):
    """What the loss's graph shows between the model's output and the loss (`loss_faults`):
    each None where it is not so. `reached`: the walk met the model's output; where it did
    not (a loss from another forward), the two Nones say nothing."""

    broadcast: LossBroadcast | None = None
    probabilities: LossOnProbabilities | None = None
    reached: bool = False


# Autograd nodes walked from the loss toward the model's outputs, at most: the loss's own
# part of the graph is a few nodes; a regularisation term over every weight adds one or two
# per weight. The walk stops at the outputs and never enters the model.
_LOSS_WALK = 1024

# A floating tensor a model returned, as a loss's graph meets it: (its path in the output,
# the autograd node that made it, which of that node's results it is, its shape). Holding
# the node keeps it (and what the next backward frees) until the edges are dropped.
OutputEdge = tuple[str, Any, int, tuple[int, ...]]

# The losses that apply their own squash, by node: (the loss, the squash whose
# probabilities it must not be given). `nll_loss` applies none, and wants
# log-probabilities: softmax's probabilities straight into it are the same mistake.
_SQUASHED = {"LogSoftmaxBackward0": ("cross_entropy", "softmax"),
             "NllLossBackward0": ("nll_loss", "softmax"),
             "NllLoss2DBackward0": ("nll_loss", "softmax"),
             "BinaryCrossEntropyWithLogitsBackward0": ("binary_cross_entropy_with_logits",
                                                       "sigmoid")}
_SQUASH = {"SoftmaxBackward0": "softmax", "SigmoidBackward0": "sigmoid"}
# Ops between the squash and the loss that leave its probabilities probabilities: views,
# casts and copies (the chain holds only ops that keep every element).
_KEEPS = frozenset({
    "ViewBackward0", "UnsafeViewBackward0", "SqueezeBackward0", "SqueezeBackward1",
    "SqueezeBackward2", "UnsqueezeBackward0", "PermuteBackward0", "TransposeBackward0",
    "TBackward0", "ToCopyBackward0", "CloneBackward0", "AliasBackward0"})
# Ops that pick some of the elements, leaving each as it was: probabilities stay
# probabilities (a language model's shift, `logits[:, :-1]`, before or after its softmax).
_PICKS = frozenset({"SliceBackward0", "SelectBackward0", "IndexBackward0"})


def output_edges(output: Any) -> tuple[OutputEdge, ...]:
    """The floating tensors of more than one element in what a model returned, with the
    autograd nodes that made them: where `loss_faults_at` stops its walk."""
    return tuple((path, t.grad_fn, t.output_nr, tuple(t.shape))
                 for path, t in iter_tensors(output)
                 if t.grad_fn is not None and t.is_floating_point() and not t.is_nested
                 and t.numel() > 1)


def loss_faults(loss_tensor: torch.Tensor, output: Any, target: Any = None) -> LossFaults:
    """Two mistakes between a model's output and its loss, read once on autograd's graph
    before backward (`loss_faults_at` on `output_edges(output)`); no tensor is read.

    - `broadcast`: the loss broadcast a floating output of n > 1 elements into n * n
      against an operand that carries no gradient (a target, a constant). Silent on a
      pairwise loss (`s - s.T`: both operands carry the output's gradient) and on a
      comparison with a learned or constant tensor of another size (bins, centres). Also
      an output broadcast along the dimensions of a larger target (`(N, 1)` against
      `(N, K)`) where the target is known to be that operand: the one `mse_loss`,
      `huber_loss` or `smooth_l1_loss` saved, or the step's `target` under `l1_loss`. A
      subtraction written by hand is not told there: against K fixed centres it reads the
      same.
    - `probabilities`: a softmax (a sigmoid) then a loss that applies its own
      (`cross_entropy`, `binary_cross_entropy_with_logits`), or softmax probabilities into
      `nll_loss`. Silent on `nll_loss(log(softmax))` and on `binary_cross_entropy` of
      probabilities, which take them as they are.

    Between the output and the mistake any op that keeps its n elements may come (a
    `squeeze`, a `view`, a cast, a scale); before a softmax's loss, also ops that pick some
    of them (a language model's shift, `logits[:, :-1]`). Both are None where autograd
    keeps no input metadata on its nodes (a torch without `Node._input_metadata`).

    Args:
        loss_tensor: the scalar loss, before backward.
        output: what the model returned.
        target: the step's target, named in a broadcast when it has n elements.
    """
    return loss_faults_at(loss_tensor, output_edges(output), target)


def loss_faults_at(loss_tensor: torch.Tensor, edges: tuple[OutputEdge, ...],
                   target: Any = None) -> LossFaults:
    """`loss_faults` on outputs taken earlier (`output_edges`): a watch takes them when the
    model returns and reads the loss's graph when the loop hands it the loss."""
    root = loss_tensor.grad_fn
    if root is None or not hasattr(root, "_input_metadata") or not edges:
        return LossFaults()
    try:
        return _walk_loss(root, loss_tensor, edges, target)
    except (RuntimeError, ValueError, TypeError, AttributeError, IndexError):
        # A node whose metadata Python cannot read (a tensor subclass's, a ragged dim's):
        # no reading, rather than a step that fails for a diagnosis.
        return LossFaults()


def _walk_loss(root: Any, loss_tensor: torch.Tensor, edges: tuple[OutputEdge, ...],
               target: Any) -> LossFaults:
    outputs = {(id(node), nr): (path, shape) for path, node, nr, shape in edges}
    # parent[id(node)] = (the node that consumes it, the index of its result consumed):
    # breadth first from the loss, each node once. `seen` holds the nodes walked, so that
    # no id is reused while the walk runs.
    parent: dict[int, tuple[Any, int]] = {id(root): (None, 0)}
    seen, queue = [root], deque([root])
    broadcast: LossBroadcast | None = None
    probabilities: LossOnProbabilities | None = None
    reached = False
    while queue and len(seen) < _LOSS_WALK:
        node = queue.popleft()
        for nxt, nr in node.next_functions:
            if nxt is None:
                continue
            hit = outputs.get((id(nxt), nr))
            if hit is not None:
                reached = True
                path, shape = hit
                given = tuple(target.shape) if isinstance(target, torch.Tensor) else None
                chain, top = _chain_above(node, nxt, parent, shape, loss_tensor, given)
                if broadcast is None and top is not None:
                    t_shape = top[2] if top[2] is not None else given \
                        if given is not None and math.prod(given) == math.prod(shape) else None
                    broadcast = LossBroadcast(path, shape, top[0], top[1], t_shape)
                if probabilities is None:
                    probabilities = _squashed_twice(path, shape, chain) or _squashed_twice(
                        path, shape, _picked_chain(node, nxt, parent))
                continue  # never into the model
            if id(nxt) not in parent:
                parent[id(nxt)] = (node, nr)
                seen.append(nxt)
                queue.append(nxt)
    return LossFaults(broadcast, probabilities, reached)


_Broadcast = tuple[tuple[int, ...], str, tuple[int, ...] | None]  # (shape, op, target's)


def _chain_above(node: Any, below: Any, parent: dict[int, tuple[Any, int]],
                 out_shape: tuple[int, ...], loss_tensor: torch.Tensor,
                 target_shape: tuple[int, ...] | None) -> tuple[list[Any], _Broadcast | None]:
    """From the output's node `below` up through `node`, its consumer, toward the loss:
    `(chain, broadcast)`. `chain` holds the output's node and every node above it whose
    result keeps the output's n elements, then the first that does not. `broadcast` is
    `(shape, name, None)` of that first node where it holds n * n and its other operand
    carries no gradient: no edge of its own besides the output's path, or, for a
    one-input op (`expand`), none of its consumer's (`mse_loss` takes the expanded target
    there). Where it holds more than n, not n * n, it is `(shape, name, shape)` when the
    target is known to be that operand and has the result's shape, and the output fills
    it along its own size-1 dimensions only (`(N, 1)` against `(N, K)`)."""
    n = math.prod(out_shape)
    chain: list[Any] = [below]
    while node is not None:
        up, nr = parent[id(node)]
        if up is None:
            shape = tuple(loss_tensor.shape)
        else:
            meta = node._input_metadata  # the shapes of the node's forward results
            if nr >= len(meta):
                return chain, None
            shape = tuple(meta[nr].shape)
            if not all(type(d) is int for d in shape):
                return chain, None  # a nested tensor's ragged dim: no element count
        chain.append(node)
        size = math.prod(shape)
        if size == n:
            below, node = node, up
            continue
        judge, path = (node, below) if len(node.next_functions) > 1 or up is None else \
            (up, node)
        others = [e for e, _ in judge.next_functions if e is not None and e is not path]
        if others:
            return chain, None
        if size == n * n:
            return chain, (shape, type(node).__name__, None)
        # Known to be the target: the one the loss saved (`mse_loss`, `huber_loss` and
        # `smooth_l1_loss` expand the output to it), or the step's, where a loss expanded
        # the output for a subtraction (`l1_loss`). Not `out - y` written by hand: against
        # K fixed centres (a soft histogram of a scalar) it reads the same.
        name = type(node).__name__
        saved = getattr(judge, "_saved_target", None)
        # The loss saves the target as broadcast: one expanded itself ((1, K) bin centres,
        # stride 0 along the batch) is no target of the batch's own.
        known = (tuple(saved.shape) if 0 not in saved.stride() else None) \
            if isinstance(saved, torch.Tensor) else target_shape \
            if name == "ExpandBackward0" and type(judge).__name__ in _SUBTRACTIONS else None
        if size > n and shape == known and _fills(out_shape, shape):
            return chain, (shape, name, shape)
        return chain, None
    return chain, None


_SUBTRACTIONS = frozenset({"SubBackward0", "RsubBackward0", "RsubBackward1"})


def _fills(small: tuple[int, ...], big: tuple[int, ...]) -> bool:
    """`small` broadcasts to `big` by its size-1 dimensions alone, and they share their
    first dimension (the batch): `(N, 1)` and `(N, K)`; not `(N, 1)` and `(1, K)`."""
    if len(small) != len(big) or not small or small[0] != big[0]:
        return False
    return all(s in (b, 1) for s, b in zip(small, big, strict=True))


def _picked_chain(node: Any, below: Any, parent: dict[int, tuple[Any, int]]) -> list[Any]:
    """From the output's node `below` up through `node` toward the loss, while each node
    leaves probabilities probabilities (`_KEEPS`, `_PICKS`) or squashes: what
    `_squashed_twice` reads where a slice comes between the output and its softmax, which
    `_chain_above` (ops that keep every element) stops at. The first other node ends it."""
    chain = [below]
    while node is not None:
        chain.append(node)
        if type(node).__name__ not in _KEEPS | _PICKS | _SQUASH.keys():
            break
        node = parent[id(node)][0]
    return chain


def _squashed_twice(path: str, shape: tuple[int, ...], chain: list[Any]
                    ) -> LossOnProbabilities | None:
    """A softmax or sigmoid on the chain from the output up, then, through ops that keep
    its elements, the node of a loss that applies its own (`_SQUASHED`)."""
    squash: tuple[int, str] | None = None  # (its place on the chain, softmax or sigmoid)
    for i, node in enumerate(chain):
        name = type(node).__name__
        if name in _SQUASH:
            squash = (i, _SQUASH[name])
        elif squash is not None and name in _SQUASHED and _SQUASHED[name][1] == squash[1]:
            first = chain[squash[0]]
            classes = None
            if squash[1] == "softmax":
                dim = int(getattr(first, "_saved_dim", -1))
                if dim >= 2 ** 63:  # a negative dim, read back as an unsigned int64
                    dim -= 2 ** 64
                size = tuple(first._input_metadata[0].shape)
                classes = size[dim] if -len(size) <= dim < len(size) else None
            return LossOnProbabilities(path, shape, squash[1], _SQUASHED[name][0],
                                       in_model=squash[0] == 0, classes=classes)
        elif squash is not None and name not in _KEEPS and name not in _PICKS:
            squash = None  # log, clamp, ...: the loss no longer sees the probabilities
    return None


# ------------------------------------------------------------------ labels on padding
def labels_against_mask(model: nn.Module) -> int | None:
    """The first label position a model's loss reads, where its `labels` line up with its
    `attention_mask` and its loss ignores only -100: a transformers model (a
    `PreTrainedModel`) that is no encoder-decoder, whose labels are the decoder's, not the
    masked encoder input's. Another model's loss may ignore its own pad id: None.

    A causal language model's loss shifts its labels by one (position t's logits predict
    label t + 1), so the label at position 0 is never read: 1 there, 0 elsewhere. A
    left-padded row's first pad is then no fault; its later pads are.
    """
    config = getattr(model, "config", None)
    if not _pretrained(model) or getattr(config, "is_encoder_decoder", False):
        return None
    # transformers names its causal heads so (LlamaForCausalLM, GPT2LMHeadModel,
    # BertLMHeadModel), and picks their shifted loss by the same name.
    name = type(model).__name__
    return 1 if "ForCausalLM" in name or name.endswith("LMHeadModel") else 0


def _pretrained(model: nn.Module) -> bool:
    """A transformers model (a `PreTrainedModel`), found without importing transformers."""
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers")
               for c in type(model).__mro__)


def labelled_modules(model: nn.Module) -> list[tuple[nn.Module, int]]:
    """The modules whose labels `labels_against_mask` reads, each with the first label
    position its loss reads: `model` itself where it is a transformers model, else the
    outermost ones inside it (a LightningModule's `self.model`, a DDP or compiled
    wrapper's module). Nothing inside a transformers model is looked at: an
    encoder-decoder's stacks get no labels."""
    found: list[tuple[nn.Module, int]] = []
    stack = [model]
    while stack:
        m = stack.pop()
        if not _pretrained(m):
            stack.extend(list(m.children())[::-1])
        elif (first := labels_against_mask(m)) is not None:
            found.append((m, first))
    return found


def padded_label_counts(kwargs: Mapping[str, Any], first: int) -> torch.Tensor | None:
    """Of a transformers forward's keyword inputs: the label positions from `first` on
    that the attention mask pads (0), and those of them whose label is not -100, which
    the model's loss counts, as a (2,) int64 tensor on their device (two reductions; not
    read here). None without an `attention_mask` and integer `labels` of one shape."""
    mask, labels = kwargs.get("attention_mask"), kwargs.get("labels")
    if not isinstance(mask, torch.Tensor) or not isinstance(labels, torch.Tensor) or \
            mask.shape != labels.shape or labels.is_floating_point() or mask.dim() == 0:
        return None
    mask, labels = mask[..., first:], labels[..., first:]  # (N, T - first)
    pad = mask == 0  # (N, T - first)
    return torch.stack((pad.sum(), (pad & (labels != -100)).sum()))  # (2,)


class StepLossCheck:
    """What `gradient_flow` reads about its step's loss while the step runs: the two loss
    faults, on the graph of the first micro-batch's loss (`before_backward`), and the
    labels on padding (`padded_labels`).

    Where the model is a transformers model, its labels are counted from the step's own
    inputs; where one runs inside it (a LightningModule's `self.model`, a wrapper that
    builds its inputs), from what that one is given while the check is open, by a forward
    pre-hook that comes off when it closes, raised or not. Never where a compiled module is
    part of the model: its graph would trace the hook.

    Example:
        >>> check = StepLossCheck(step)
        >>> with check:
        ...     step.forward_backward(before_backward=check.before_backward)
        >>> check.faults.broadcast, check.padded_labels()
    """

    def __init__(self, step: Step) -> None:
        self.step = step
        self.faults = LossFaults()
        self._read = False
        self._counts: list[torch.Tensor] = []  # (2,) each, on the device
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def before_backward(self, micro: int, output: Any, loss: torch.Tensor) -> None:
        """`Step.forward_backward`'s `before_backward`: read the loss faults once, on the
        first loss with a graph. Where torchscope chose the loss (`loss_fn="auto"` or a
        named one on logits), probabilities given to it are marked `assumed`."""
        if self._read or loss.grad_fn is None:
            return
        self._read = True
        target = self.step.micro_batches()[micro][1] if self.step.target is not None else None
        faults = loss_faults(loss, output, target)
        resolved = self.step.resolved
        if faults.probabilities is not None and resolved is not None and \
                resolved.kind in _OWN_LOGIT_LOSSES:
            faults = faults._replace(probabilities=replace(faults.probabilities, assumed=True))
        self.faults = faults

    def __enter__(self) -> StepLossCheck:
        model = self.step.model
        if labels_against_mask(model) is not None or \
                any(type(m).__name__ == "OptimizedModule" for m in model.modules()):
            return self
        counts = self._counts

        def counter(first: int) -> Callable[..., None]:
            def pre(_m: nn.Module, _args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
                c = padded_label_counts(kwargs, first)  # (2,) or None
                if c is not None:
                    counts.append(c)

            return pre

        self._handles = [m.register_forward_pre_hook(counter(first), with_kwargs=True)
                         for m, first in labelled_modules(model)]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def padded_labels(self) -> tuple[int, int] | None:
        """`(padded, counted)`: the label positions the attention mask pads that the loss
        reads, and those of them that hold a token, not -100, over every micro-batch; None
        where the model reads no labels against a mask. Read once, here (one host copy)."""
        first = labels_against_mask(self.step.model)
        found: torch.Tensor | None = None
        if first is not None:
            for inputs, _ in self.step.micro_batches():
                c = padded_label_counts(inputs.kwargs, first)  # (2,) or None
                if c is not None:
                    found = c if found is None else found + c
        elif self._counts:
            found = torch.stack(self._counts).sum(0)  # (2,)
        if found is None:
            return None
        padded, counted = found.tolist()
        return int(padded), int(counted)
