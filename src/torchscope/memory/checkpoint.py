"""Reversible gradient checkpointing of chosen blocks with `torch.utils.checkpoint`.

A checkpointed block's `forward` is replaced, on that instance only, by one that calls the
original through `torch.utils.checkpoint.checkpoint(use_reentrant=False,
preserve_rng_state=True)`. Nothing else changes: no wrapper module (so `state_dict()` keys stay
the same), the block's own hooks still fire once per forward, and `remove()` deletes the
instance attribute again, leaving the model exactly as before.

Consecutive children of an `nn.Sequential` may share one checkpoint (a *segment*, as in
Chen et al. 2016); then the Sequential's `forward` is replaced by the same loop that
`nn.Sequential.forward` runs, with the segment called under one checkpoint.

Non-reentrant checkpointing is used on purpose: the reentrant variant returns no gradient
for the parameters inside a block whose inputs do not require grad, and
`checkpoint_sequential` never checkpoints its last segment.

`verify` runs one step with and one without checkpointing from the same seed, so dropout
draws the same masks (and `preserve_rng_state=True` replays them on recomputation), and from
the same buffers; it compares the loss, every gradient, the buffers and what the model
returned (after backward, so that state the recomputation changed shows), and restores
gradients, buffers and the RNG afterwards.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from torchscope._process import seeded
from torchscope.errors import SelectionError, TorchscopeError, VerificationError, describe
from torchscope.hooks.select import select_modules
from torchscope.hooks.tree import iter_tensors
from torchscope.memory._common import SEGMENT_LABEL
from torchscope.memory.records import GradComparison, OutputChange, Verification
from torchscope.step import LossSpec, Step

_MISSING = object()
# Modules whose forward a live handle replaced -> that handle (one owner per module).
_OWNERS: weakref.WeakKeyDictionary[nn.Module, CheckpointHandle] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Blocks:
    """The checkpointable blocks of a model, in execution order.

    Attributes:
        names: qualified module names.
        parent: name of the plain `nn.Sequential` they are consecutive children of, when
            they are (all of its children, or a run of them); only then can consecutive
            blocks share one checkpoint.
    """

    names: tuple[str, ...]
    parent: str | None = None

    @property
    def groupable(self) -> bool:
        """Whether consecutive blocks can be checkpointed as one segment."""
        return self.parent is not None

    def subset(self, model: nn.Module, keep: Sequence[str]) -> Blocks:
        """The blocks named in `keep`, in `keep`'s order; they stay groupable only when
        they are still consecutive children of the same plain `nn.Sequential`."""
        names = tuple(n for n in keep if n in self.names)
        parent = self.parent
        if parent is not None:
            children = _container_blocks(parent, model.get_submodule(parent)).names
            start = children.index(names[0]) if names else 0
            if names != children[start:start + len(names)]:
                parent = None
        return Blocks(names, parent)


BlockSpec = str | nn.Module | Blocks | Sequence[str | nn.Module] | None
"""What `apply` and the planner accept as `blocks=` (see `resolve_blocks`)."""


NO_BLOCKS_FIX = "name the blocks: blocks=['layer1', 'layer2'] or a glob like 'layers.*'."


def no_blocks_message(model: nn.Module) -> str:
    """Why `resolve_blocks(model)` finds nothing to checkpoint."""
    return (f"{type(model).__name__} has no nn.Sequential or nn.ModuleList of 2+ blocks to "
            "checkpoint.")


def _container_blocks(name: str, m: nn.Module) -> Blocks:
    prefix = f"{name}." if name else ""
    children = [(child, c) for child, c in m._modules.items() if c is not None]
    # A TorchScript child takes no hook, so the planner cannot measure it: not a block.
    names = tuple(prefix + child for child, c in children
                  if not isinstance(c, torch.jit.ScriptModule))
    # Only a plain nn.Sequential's loop can be replaced by one that groups its children.
    plain = (isinstance(m, nn.Sequential) and type(m).forward is nn.Sequential.forward
             and "forward" not in vars(m) and len(names) == len(children))
    return Blocks(names, name if plain else None)


def _is_block_list(m: nn.Module) -> bool:
    """A container of 2+ repeated blocks: children of one type, each with submodules."""
    children = [c for c in m._modules.values() if c is not None]
    return (isinstance(m, (nn.Sequential, nn.ModuleList)) and len(children) >= 2
            and len({type(c) for c in children}) == 1
            and all(next(c.children(), None) is not None for c in children))


def default_blocks(model: nn.Module) -> Blocks | None:
    """The blocks `resolve_blocks(model)` picks, or None when the model has no
    `nn.Sequential` / `nn.ModuleList` of 2+ children (see `resolve_blocks`)."""
    named = dict(model.named_modules())
    lists = [n for n, m in named.items() if _is_block_list(m)]
    # Outermost lists only: a list inside another list's block is part of that block.
    outer = [n for n in lists
             if not any(o != n and (o == "" or n.startswith(o + ".")) for o in lists)]
    if len(outer) == 1:
        return _container_blocks(outer[0], named[outer[0]])
    if outer:
        return Blocks(tuple(b for n in outer for b in _container_blocks(n, named[n]).names))
    containers = [(n, m) for n, m in named.items()
                  if isinstance(m, (nn.Sequential, nn.ModuleList)) and len(m) >= 2]
    if not containers:
        return None
    n, m = max(containers, key=lambda nm: (len(nm[1]), -nm[0].count(".") - bool(nm[0])))
    return _container_blocks(n, m)


def resolve_blocks(model: nn.Module, blocks: BlockSpec = None) -> Blocks:
    """Turn a block specification into qualified names.

    Args:
        model: the model.
        blocks: one of
            - None: the children of every outermost list of repeated blocks (an
              `nn.Sequential` / `nn.ModuleList` of 2+ children of one type, each with
              submodules), e.g. GPT-2's `transformer.h`, or T5's `encoder.block` and
              `decoder.block` together; without such a list, the children of the longest
              `nn.Sequential` / `nn.ModuleList` (the shallowest on ties);
            - an `nn.Sequential` / `nn.ModuleList` (or its name): its children;
            - any other module, or its qualified name: that single block;
            - a glob over qualified names or a type name (`layer*`, `GPT2Block`), as in
              `torchscope.select_modules`; of nested matches only the outermost are kept;
            - a sequence of the above: their union;
            - a `Blocks` (returned as is).

    Raises:
        SelectionError: nothing matched, or one block contains another.
    """
    if isinstance(blocks, Blocks):
        return blocks
    named = dict(model.named_modules())
    names_of = {id(m): n for n, m in named.items()}
    if blocks is None:
        found = default_blocks(model)
        if found is None:
            raise SelectionError(no_blocks_message(model), fix=NO_BLOCKS_FIX)
        return found
    if isinstance(blocks, (nn.Sequential, nn.ModuleList)) and id(blocks) in names_of:
        return _container_blocks(names_of[id(blocks)], blocks)
    if isinstance(blocks, str) and isinstance(named.get(blocks), (nn.Sequential, nn.ModuleList)):
        return _container_blocks(blocks, named[blocks])
    items: Sequence[str | nn.Module] = (
        [blocks] if isinstance(blocks, (str, nn.Module)) else list(blocks)
    )
    picked: set[str] = set()
    for item in items:
        if isinstance(item, nn.Module):
            if id(item) not in names_of:
                raise SelectionError(f"the {type(item).__name__} given as a block is not part "
                                     f"of {type(model).__name__}.",
                                     fix="pass a submodule of the model, or its name.")
            picked.add(names_of[id(item)])
        elif item in named:
            picked.add(item)
        else:
            # A glob like 'layers.*' also matches every descendant; keep the outermost.
            hits = [n for n, _ in select_modules(model, item)]
            picked.update(n for n in hits
                          if not any(h != n and (h == "" or n.startswith(h + ".")) for h in hits))
    ordered = tuple(n for n in named if n in picked)
    for a in ordered:
        for b in ordered:
            if a != b and (a == "" or b.startswith(a + ".")):
                raise SelectionError(
                    f"block {a or '<root>'!r} contains block {b!r}; checkpointing both would "
                    "recompute the inner one twice.",
                    fix="pick blocks that do not nest.",
                )
    return Blocks(ordered)


def _validate_segments(blocks: Blocks, segments: Sequence[tuple[int, int]]) -> tuple[
        tuple[int, int], ...]:
    n = len(blocks.names)
    out = tuple(sorted((int(a), int(b)) for a, b in segments))
    last = 0
    for a, b in out:
        if not 0 <= a < b <= n or a < last:
            raise SelectionError(
                f"checkpoint segments {list(out)} are not disjoint ranges within 0..{n}.",
                fix="give sorted, non-overlapping (start, stop) pairs, stop exclusive.",
            )
        if b - a > 1 and not blocks.groupable:
            raise SelectionError(
                f"segment ({a}, {b}) spans {b - a} blocks, but these blocks are not the "
                "children of a plain nn.Sequential, so they cannot run under one checkpoint.",
                fix="use one-block segments, e.g. segments=[(i, i + 1) ...].",
            )
        last = b
    return out


class CheckpointHandle:
    """Checkpointing installed on a model; `remove()` (or leaving the `with`) undoes it.

    Attributes:
        blocks: the blocks it was chosen from.
        segments: `(start, stop)` block-index ranges, each under one checkpoint.
        verification: the verification run when example inputs were given, else None.
    """

    def __init__(self, model: nn.Module, blocks: Blocks,
                 segments: tuple[tuple[int, int], ...], preserve_rng_state: bool) -> None:
        self._model_ref = weakref.ref(model)
        self.blocks = blocks
        self.segments = segments
        self.preserve_rng_state = preserve_rng_state
        self.verification: Verification | None = None
        # (module, previous instance attribute `forward` or _MISSING)
        self._patched: list[tuple[nn.Module, object]] = []
        self._removed = False

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> CheckpointHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    @property
    def active(self) -> bool:
        """True while the checkpointed forwards are installed."""
        return bool(self._patched)

    @property
    def checkpointed(self) -> tuple[str, ...]:
        """Names of the checkpointed blocks."""
        return tuple(self.blocks.names[i] for a, b in self.segments for i in range(a, b))

    def remove(self) -> None:
        """Restore every replaced `forward`; the model is exactly as before. Safe twice."""
        self._uninstall()
        self._removed = True

    @contextmanager
    def suspended(self) -> Iterator[None]:
        """Run without checkpointing inside the block (for a reference run)."""
        was = self.active
        self._uninstall()
        try:
            yield
        finally:
            if was and not self._removed:
                self._install()

    # ------------------------------------------------------------------ patching
    def _install(self) -> None:
        model = self._model_ref()
        if model is None:
            raise ReferenceError("the model of this CheckpointHandle was garbage collected")
        named = dict(model.named_modules())
        targets: list[tuple[nn.Module, Callable[..., Any]]] = []
        multi = {a: b for a, b in self.segments if b - a > 1}
        for a, b in self.segments:
            if b - a == 1:
                module = named[self.blocks.names[a]]
                targets.append((module, _CheckpointedForward(
                    module, vars(module).get("forward"), self.preserve_rng_state)))
        if multi:
            parent_name = self.blocks.parent or ""
            parent = named[parent_name]
            # Block indices -> positions among the parent's children (the blocks may be a
            # consecutive run of them that does not start at the first child).
            children = _container_blocks(parent_name, parent).names
            at = {name: i for i, name in enumerate(children)}
            first = at.get(self.blocks.names[0], -1)
            if children[first:first + len(self.blocks.names)] != self.blocks.names:
                raise SelectionError(
                    f"the blocks are not consecutive children of {parent_name or '<root>'}, "
                    "so several of them cannot run under one checkpoint.",
                    fix="use one-block segments, or blocks that follow each other.")
            targets.append((parent, _SegmentedForward(
                parent, parent_name, {a + first: b + first for a, b in multi.items()},
                children, self.preserve_rng_state)))
        for module, _ in targets:
            if _OWNERS.get(module, self) is not self:
                raise TorchscopeError(
                    f"{type(module).__name__} is already checkpointed by another handle.",
                    fix="remove() the earlier checkpointing before applying a new plan.",
                )
        try:
            for module, fwd in targets:
                self._patched.append((module, vars(module).get("forward", _MISSING)))
                vars(module)["forward"] = fwd
                _OWNERS[module] = self
        except BaseException:
            self._uninstall()
            raise

    def _uninstall(self) -> None:
        while self._patched:
            module, previous = self._patched.pop()
            if previous is _MISSING:
                vars(module).pop("forward", None)
            else:
                vars(module)["forward"] = previous
            if _OWNERS.get(module) is self:
                del _OWNERS[module]


class _CheckpointedForward:
    """The `forward` a checkpointed block gets: its own forward under one checkpoint.

    A plain object rather than a closure, so that `copy.deepcopy(model)` rebinds it to the
    copied module and `pickle` can store it (a copy made while checkpointing is applied stays
    checkpointed; the handle only restores the original model).
    """

    def __init__(self, module: nn.Module, previous: Callable[..., Any] | None,
                 preserve_rng_state: bool) -> None:
        self.module = module
        self.previous = previous  # an instance-level forward the user had set, if any
        self.preserve_rng_state = preserve_rng_state

    def original(self, *args: Any, **kwargs: Any) -> Any:
        """The block's forward as it was before checkpointing."""
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.original(*args, **kwargs)  # nothing is saved without grad
        return checkpoint(self.original, *args, use_reentrant=False,
                          preserve_rng_state=self.preserve_rng_state, **kwargs)


class _SegmentedForward:
    """The `forward` of an `nn.Sequential` whose consecutive children share checkpoints: the
    same loop as `nn.Sequential.forward`, with each segment run under one checkpoint."""

    def __init__(self, parent: nn.Module, parent_name: str, segments: dict[int, int],
                 names: tuple[str, ...], preserve_rng_state: bool) -> None:
        self.parent = parent
        self.parent_name = parent_name
        self.segments = segments  # start -> stop (exclusive), as positions among children
        self.names = names  # qualified names of all the children
        self.preserve_rng_state = preserve_rng_state

    def _run(self, start: int, stop: int, x: Any) -> Any:
        for child in self._children()[start:stop]:
            x = child(x)
        return x

    def _children(self) -> list[nn.Module]:
        return [m for m in self.parent._modules.values() if m is not None]

    def __call__(self, input: Any) -> Any:
        children = self._children()
        x, i = input, 0
        while i < len(children):
            stop = self.segments.get(i)
            if stop is None or not torch.is_grad_enabled():
                x, i = children[i](x), i + 1
                continue
            # Attribute the checkpoint's saved inputs to the segment's first block.
            token = SEGMENT_LABEL.set((self.parent_name, self.names[i],
                                       type(children[i]).__name__))
            try:
                x = checkpoint(self._run, i, stop, x, use_reentrant=False,
                               preserve_rng_state=self.preserve_rng_state)
            finally:
                SEGMENT_LABEL.reset(token)
            i = stop
        return x


# (rtol, atol) past which a difference fails; bitwise equality is reported separately.
_TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-5, 1e-6),
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
}


_RECOMPUTE_FIX = ("a checkpointed block must recompute exactly what it computed: do not "
                  "mutate state in forward (Hugging Face models: call with use_cache=False).")

# (path, "shape dtype", dtype, element count, |values| summed in float64) of one returned
# tensor.
_Returned = tuple[str, str, torch.dtype, int, torch.Tensor]


def _returned(output: Any, prefix: str) -> list[_Returned]:
    """What the model returned, as it stands now: every tensor in `output`, state objects
    such as a KV cache entered too. Values are kept as one float64 sum of magnitudes per
    tensor, on its device, so that the comparison holds no copy of the output."""
    out: list[_Returned] = []
    for path, tensor in iter_tensors(output, prefix, objects=True):
        if tensor.is_meta or tensor.layout != torch.strided:  # no values to sum here
            continue
        t = tensor.detach()
        # Magnitudes, so that one changed value cannot cancel against another; float64
        # holds a float32 tensor's sum to ~1e-16 relative.
        total = (t.abs() if t.is_complex() else t).to(torch.float64).abs().sum()
        out.append((path, f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}", t.dtype,
                    t.numel(), total))
    return out


def _seeded_step(step: Step, leaves: list[tuple[str, torch.Tensor]], seed: int) -> tuple[
        torch.Tensor, list[torch.Tensor | None], list[torch.Tensor], list[_Returned]]:
    """One seeded forward + backward from the model's current state, which is restored
    after: (loss, gradients, buffers, what the model returned, read after its backward)."""
    pending: list[tuple[int, Any]] = []
    returned: list[_Returned] = []
    several = step.accumulate > 1

    def settle() -> None:
        # The pending micro-batch's backward has run: read its output now and let it go.
        while pending:
            micro, output = pending.pop()
            returned.extend(_returned(output, f"output[{micro}]" if several else "output"))

    def keep(micro: int, output: Any, _loss: torch.Tensor) -> None:
        settle()
        pending.append((micro, output))

    with step.preserved(clear_grads=True), seeded(seed):
        loss = step.forward_backward(before_backward=keep)
        settle()
        grads = [None if t.grad is None else t.grad.detach().clone() for _, t in leaves]
        return loss, grads, [b.detach().clone() for b in step.model.buffers()], returned


def _output_changes(ref: list[_Returned], got: list[_Returned]) -> tuple[OutputChange, ...]:
    """The returned tensors that differ between the runs: present in one only, another
    shape or dtype, or a sum of magnitudes outside the dtype's tolerance."""
    # One host read for all the sums; this is the verification, not a hook.
    sums = (torch.stack([t.cpu() for *_, t in (*ref, *got)]).tolist() if ref or got else [])
    ref_at = {path: (meta, dtype, n, x)
              for (path, meta, dtype, n, _), x in zip(ref, sums[:len(ref)], strict=True)}
    got_at = {path: (meta, x) for (path, meta, *_), x in zip(got, sums[len(ref):], strict=True)}
    changes = []
    for path in [*ref_at, *(p for p in got_at if p not in ref_at)]:
        a, b = ref_at.get(path), got_at.get(path)
        if a is None or b is None or a[0] != b[0]:
            changes.append(OutputChange(path, "absent" if a is None else a[0],
                                        "absent" if b is None else b[0]))
            continue
        (meta, dtype, n, x), (_, y) = a, b
        # Each element within the gradients' tolerance keeps the sum within n * atol +
        # rtol * sum; integer and bool values must match exactly.
        rtol, atol = (_TOLERANCE.get(dtype, (1e-5, 1e-6))
                      if dtype.is_floating_point or dtype.is_complex else (0.0, 0.0))
        if not (x == y or (math.isnan(x) and math.isnan(y))
                or abs(x - y) <= n * atol + rtol * abs(x)):
            changes.append(OutputChange(path, meta, meta))
    return tuple(changes)


def _compare(name: str, ref: torch.Tensor | None, got: torch.Tensor | None) -> tuple[
        GradComparison, bool]:
    """The comparison and whether it is within tolerance."""
    if ref is None or got is None:
        equal = ref is None and got is None
        return GradComparison(name, equal, 0.0 if equal else float("inf"),
                              missing=ref is not None and got is None,
                              extra=ref is None and got is not None), equal
    if ref.shape != got.shape or ref.dtype != got.dtype:
        return GradComparison(name, False, float("inf")), False
    bitwise = bool(torch.equal(ref, got))
    if bitwise:
        return GradComparison(name, True, 0.0), True
    diff = (ref.double() - got.double()).abs()  # float64 so that the difference is exact
    max_diff = float(diff.max()) if diff.numel() else 0.0
    rtol, atol = _TOLERANCE.get(ref.dtype, (1e-5, 1e-6))
    close = bool(torch.allclose(got, ref, rtol=rtol, atol=atol, equal_nan=True))
    return GradComparison(name, False, max_diff), close


def verify(
    model: nn.Module | Step,
    handle: CheckpointHandle,
    inputs: Any = None,
    *,
    loss_fn: LossSpec = "auto",
    target: Any = None,
    seed: int = 0,
) -> Verification:
    """Run one training step without and one with `handle`'s checkpointing and compare.

    Both runs are the step's `forward_backward`, start from the model as it is and from
    `torch.manual_seed(seed)`; the model, its gradients, buffers and the RNG are left as
    they were.

    Args:
        model: the model `handle` is installed on, or a `Step` on it.
        handle: the checkpointing (suspended for the reference run).
        inputs: tensor, tuple, dict or `ModelInputs`.
        loss_fn: the step's loss (see `torchscope.step`).
        target: its target; None draws seeded targets where the loss needs one.
        seed: both runs start from `torch.manual_seed(seed)`.

    Returns:
        The comparison; `check()` turns a failed one into a `VerificationError`.
    """
    step = Step.of(model, inputs, loss_fn=loss_fn, target=target)
    leaves = [*step.model.named_parameters(), *step.input_leaves()]
    with handle.suspended():
        ref_loss, ref_grads, ref_buffers, ref_returned = _seeded_step(step, leaves, seed)
    try:
        got_loss, got_grads, got_buffers, got_returned = _seeded_step(step, leaves, seed)
    except Exception as exc:
        raise VerificationError(
            f"the checkpointed step raised {describe(exc)} "
            "(the same step without checkpointing ran fine).", fix=_RECOMPUTE_FIX) from exc
    loss_cmp, loss_ok = _compare("loss", ref_loss, got_loss)
    compared = [_compare(name, ref, got)
                for (name, _), ref, got in zip(leaves, ref_grads, got_grads, strict=True)]
    grads = [cmp for cmp, _ in compared]
    buffers_equal = all(torch.equal(a, b) for a, b in zip(ref_buffers, got_buffers, strict=True))
    return Verification(
        loss_equal=loss_cmp.bitwise_equal,
        loss_abs_diff=loss_cmp.max_abs_diff,
        grads=tuple(grads),
        bitwise_equal=loss_cmp.bitwise_equal and all(g.bitwise_equal for g in grads),
        max_abs_diff=max([loss_cmp.max_abs_diff, *(g.max_abs_diff for g in grads)]),
        ok=loss_ok and all(close for _, close in compared),
        seed=seed,
        buffers_equal=buffers_equal,
        outputs=_output_changes(ref_returned, got_returned),
    )


def check(v: Verification, *, require_bitwise: bool = False) -> Verification:
    """Return `v` if it passed; raise otherwise.

    Raises:
        VerificationError: a gradient is missing or extra, a returned tensor ended
            differently (state the recomputation changed, such as a KV cache), or a
            difference exceeds the dtype's tolerance (or, with `require_bitwise`, any
            difference at all).
    """
    missing = [g.name for g in v.grads if g.missing]
    extra = [g.name for g in v.grads if g.extra]
    if missing:
        raise VerificationError(
            f"with checkpointing, {len(missing)} gradient(s) that the normal step computes "
            f"are None: {', '.join(missing[:5])}.",
            fix="use non-reentrant checkpointing (torchscope does) and make sure checkpointed "
            "blocks return tensors that the loss uses.",
        )
    if extra:
        raise VerificationError(
            f"with checkpointing, {len(extra)} gradient(s) appear that the normal step does not "
            f"compute: {', '.join(extra[:5])}.",
            fix="check that the checkpointed blocks do not depend on global state.",
        )
    if not v.ok or (require_bitwise and not v.bitwise_equal):
        worst = max(v.grads, key=lambda g: g.max_abs_diff, default=None)
        where = (f"largest gradient difference {worst.max_abs_diff:.3g} in {worst.name}"
                 if worst is not None and worst.max_abs_diff > 0 else "")
        loss = (f"loss differs by {v.loss_abs_diff:.3g}" if v.loss_abs_diff
                else "the same loss" if where else "loss identical")
        raise VerificationError(
            f"checkpointing changed the result: {loss}{'; ' if where else ''}{where} "
            f"(seed {v.seed}); expected identical loss and gradients.",
            fix="look for randomness outside torch's RNG or state mutated in forward inside the "
            "checkpointed blocks, or exclude those blocks.",
        )
    if v.outputs:
        first = v.outputs[0]
        change = (f"{first.path} was {first.without} and became {first.with_checkpointing}"
                  if first.without != first.with_checkpointing
                  else f"the values of {first.path} ({first.without}) changed")
        raise VerificationError(
            f"with checkpointing, {len(v.outputs)} tensor(s) the model returned ended "
            f"differently after backward: {change}; expected what the step without "
            "checkpointing returned (recomputation ran forward again and changed state it "
            "returned).", fix=_RECOMPUTE_FIX)
    return v


def apply(
    model: nn.Module | Step,
    blocks: BlockSpec = None,
    *,
    segments: Sequence[tuple[int, int]] | None = None,
    preserve_rng_state: bool = True,
    example_inputs: Any = None,
    loss_fn: LossSpec = "auto",
    target: Any = None,
    seed: int = 0,
    require_bitwise: bool = False,
) -> CheckpointHandle:
    """Checkpoint blocks of `model` with `torch.utils.checkpoint` (non-reentrant).

    Args:
        model: the model, changed in place until `remove()`; or a `Step`, whose model is
            checkpointed and whose step verifies it at once.
        blocks: which blocks (see `resolve_blocks`); default: the children of the longest
            `nn.Sequential` / `nn.ModuleList`.
        segments: `(start, stop)` ranges over the blocks, each run under one checkpoint;
            default: every block on its own, the last one included.
        preserve_rng_state: restore the RNG for recomputation, so dropout recomputes the
            same mask (keep True unless the blocks draw no random numbers).
        example_inputs: when given (tensor, tuple, dict or `ModelInputs`), verify at once
            that the loss and every gradient of a training step match a run without
            checkpointing.
        loss_fn: the loss of that step (see `torchscope.step`).
        target: its target; None draws seeded targets where the loss needs one.
        seed: the seed both verification runs start from.
        require_bitwise: make a verification that is not bitwise equal fail.

    Returns:
        A handle: use it in a `with` block or call `remove()`.

    Raises:
        SelectionError: bad blocks or segments.
        VerificationError: the verification failed; checkpointing was removed again.

    Example:
        >>> with torchscope.memory.apply(model, blocks="transformer.h"):
        ...     model(**batch).loss.backward()
    """
    step = (Step.of(model, example_inputs, loss_fn=loss_fn, target=target)
            if isinstance(model, Step) or example_inputs is not None else None)
    module = step.model if step is not None else model
    assert isinstance(module, nn.Module)
    resolved = resolve_blocks(module, blocks)
    if segments is None:
        segments = [(i, i + 1) for i in range(len(resolved.names))]
    handle = CheckpointHandle(module, resolved, _validate_segments(resolved, segments),
                              preserve_rng_state)
    handle._install()
    if step is not None:
        try:
            handle.verification = check(verify(step, handle, seed=seed),
                                        require_bitwise=require_bitwise)
        except BaseException:
            handle.remove()
            raise
    return handle
