"""Saved-activation accounting: what autograd keeps for backward, module by module.

During one forward (and the loss), `torch.autograd.graph.saved_tensors_hooks` sees every
tensor an autograd node saves. Each is attributed to the innermost module running at that
moment (the `HookSession` module stack), or with `select=`/`depth=` to its nearest selected
ancestor, and deduplicated by storage: a ReLU output saved by the ReLU and again by the next
Linear is one allocation, counted once, for the module that saved it first. Parameters and
buffers are model state, counted apart. A `torch.utils.checkpoint` in the model's own code
saves the inputs of what it checkpoints: they count for that module (found from the
checkpoint's frame, once per checkpoint call), whichever module called `checkpoint`, and
`SavedActivations.checkpointed` names what was checkpointed.

Storages freed before backward (a branch whose result was dropped) are not kept for
backward and are not counted; storage liveness is tracked with `StorageWeakRef`, which also
keeps a reused address from being mistaken for the same storage.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from torchscope.hooks.checkpoints import checkpoint_saving, checkpointed_module
from torchscope.hooks.parallel import unwrap_parallel
from torchscope.hooks.select import Selector, select_modules
from torchscope.hooks.session import HookSession
from torchscope.hooks.tree import iter_tensors
from torchscope.memory._common import (
    SEGMENT_LABEL,
    StorageKey,
    storage_key,
    storage_keys,
    storage_nbytes,
)
from torchscope.memory.records import (
    OUTSIDE,
    ModuleSaved,
    SavedActivations,
    SavedStorage,
    StorageKind,
)
from torchscope.step import LossSpec, Step, StepInfo


@dataclass
class _Entry:
    """A storage while the forward runs: its first save, and the counts that grow after."""

    first: SavedStorage  # saves and savers are filled in by `_freeze`
    ref: StorageWeakRef | None
    saves: int = 0
    savers: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Accounting:
    """`SavedActivations` plus what the planner needs: storage keys and block inputs."""

    saved: SavedActivations
    keys: tuple[StorageKey, ...]  # aligned with saved.storages
    # Per watched module that ran, in first-call order: its positional tensor inputs' storages.
    block_inputs: dict[str, tuple[tuple[StorageKey, int], ...]]
    # Per watched module that ran: whether a tensor input (positional or keyword) needs grad.
    inputs_need_grad: dict[str, bool]


def row_owners(model: nn.Module, select: Selector = None, depth: int | None = None
               ) -> dict[str, str] | None:
    """The row each module's saves are counted in, by qualified name; None: its own.

    With `select`, the nearest selected ancestor (the module itself when selected), else the
    root `""`. With only `depth`, the ancestor at that depth (modules at most that deep keep
    their own rows).

    Raises:
        SelectionError: `select` matched nothing, or `depth` is negative.
    """
    if select is None and depth is None:
        return None
    if select is None:
        chosen = {n for n, _ in select_modules(model, lambda _n, _m: True, depth=depth,
                                               include_root=True)}
    else:
        chosen = {n for n, _ in select_modules(model, select, depth=depth)}
    chosen.add("")
    owners: dict[str, str] = {}
    for name, _ in model.named_modules():
        row = name
        while row not in chosen:
            row = row.rpartition(".")[0]  # "a.b.c" -> "a.b" -> "a" -> ""
        owners[name] = row
    return owners


def known_kinds(model: nn.Module, inputs: Any) -> dict[StorageKey, StorageKind]:
    """The storages of the model's parameters and buffers and of `inputs`, with their kind
    (a parameter that is also a buffer or an input counts as a parameter)."""
    kinds: dict[StorageKey, StorageKind] = dict.fromkeys(storage_keys(inputs), "input")
    kinds.update(dict.fromkeys(storage_keys(list(model.buffers())), "buffer"))
    kinds.update(dict.fromkeys(storage_keys(list(model.parameters())), "parameter"))
    return kinds


class _Recorder:
    """The saved-tensor pack hook: attributes and deduplicates every saved storage."""

    def __init__(
        self,
        stack: list[str],
        types: dict[str, str],
        owners: dict[str, str] | None,
        kinds: dict[StorageKey, StorageKind],
        names: dict[int, str] | None = None,
    ) -> None:
        self._stack = stack
        self._types = types
        self._owners = owners
        self._kinds = kinds  # storages that are not activations (see `known_kinds`)
        self._names = names or {}  # id(module) -> qualified name
        self.live: dict[StorageKey, _Entry] = {}
        self.saves = 0
        self._anon = 0
        # What the model checkpoints itself with torch.utils.checkpoint, in call order: the
        # modules' names, or the functions' qualified names.
        self.checkpointed: dict[str, None] = {}

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The `saved_tensors_hooks` context that feeds this recorder."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, _unpack)

    def pack(self, t: torch.Tensor) -> tuple[torch.Tensor, int]:
        # Called for every tensor an autograd node saves; reads metadata only (no sync).
        self.saves += 1
        module, module_type = self._where()
        label = SEGMENT_LABEL.get()
        if label is None or not self._stack or label[0] != self._stack[-1]:
            # Not one of torchscope's own checkpoint segments: a checkpoint in the model's
            # code keeps the inputs of what it checkpoints, for that module, not for the
            # module whose forward called `checkpoint`.
            held, fn = checkpoint_saving()
            if held:
                target = checkpointed_module(fn)
                name = self._names.get(id(target)) if target is not None else None
                if name is not None:
                    module, module_type = self._row(name, self._types.get(name, ""))
                self.checkpointed.setdefault(
                    name if name is not None else
                    getattr(fn, "__qualname__", type(fn).__name__), None)
        key = storage_key(t)
        ref: StorageWeakRef | None = None
        if key is None:
            self._anon += 1
            key = ("nostorage", -self._anon)
        else:
            ref = StorageWeakRef(t.untyped_storage())
        entry = self.live.get(key)
        if entry is not None and entry.ref is not None and ref is not None and (
                entry.ref.expired() or entry.ref.cdata != ref.cdata):
            # Its address now belongs to another storage: that one was freed before
            # backward, or its memory was (FSDP2 resizes an unsharded weight's to 0).
            entry = None
        if entry is None:
            # A parameter not among the model's at the forward's start is one still: FSDP2
            # swaps in the unsharded weights (`nn.Parameter`s) inside each layer's forward.
            kind = self._kinds.get(key) or (
                "parameter" if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)
                else "activation")
            entry = _Entry(SavedStorage(module, module_type, tuple(t.shape), str(t.dtype),
                                        str(t.device), storage_nbytes(t), 0, kind, ()), ref)
            self.live[key] = entry
        entry.saves += 1
        if module not in entry.savers:
            entry.savers.append(module)
        # A detached alias (same storage, same version counter): when a node saves its own
        # output, keeping `t` itself would hold that output's grad_fn from inside the graph,
        # a cycle through C++ that Python's gc cannot break. Autograd skips its in-place
        # check for hooked tensors, so the version is kept to make that check in `_unpack`.
        return t.detach(), t._version

    def _where(self) -> tuple[str, str]:
        if not self._stack:
            return OUTSIDE, ""
        top = self._stack[-1]
        label = SEGMENT_LABEL.get()
        if label is not None and label[0] == top:
            return self._row(label[1], label[2])
        return self._row(top, self._types.get(top, ""))

    def _row(self, name: str, module_type: str) -> tuple[str, str]:
        """The row (with `select=`/`depth=`) and type that `name`'s saves count under."""
        if self._owners is None:
            return name, module_type
        row = self._owners.get(name, name)
        return row, (module_type if row == name else self._types.get(row, ""))

    def alive(self) -> list[tuple[StorageKey, _Entry]]:
        """The storages still alive now, in save order."""
        return [(k, e) for k, e in self.live.items() if e.ref is None or not e.ref.expired()]


def _unpack(packed: tuple[torch.Tensor, int]) -> torch.Tensor:
    t, version = packed
    if t._version != version:
        # The error autograd itself raises for a saved tensor modified in place.
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: [{t.dtype} {list(t.shape)}] is at version {t._version}; "
            f"expected version {version} instead.")
    return t


def _freeze(
    alive: Sequence[tuple[StorageKey, _Entry]], out_keys: dict[StorageKey, int], saves: int,
    step: StepInfo | None = None, checkpointed: Sequence[str] = (),
    compiled: tuple[str, ...] = (),
) -> SavedActivations:
    storages = tuple(replace(e.first, saves=e.saves, savers=tuple(e.savers)) for _, e in alive)
    rows: dict[str, list[SavedStorage]] = {}
    for s in storages:
        if s.kind in ("activation", "input"):
            rows.setdefault(s.module, []).append(s)
    modules = tuple(
        ModuleSaved(name, group[0].module_type, sum(s.nbytes for s in group), len(group),
                    sum(s.saves for s in group), tuple(sorted({s.dtype for s in group})))
        for name, group in rows.items()
    )
    saved_keys = {k for k, _ in alive}
    return SavedActivations(
        storages=storages,
        modules=modules,
        total_bytes=sum(m.bytes for m in modules),
        input_bytes=sum(s.nbytes for s in storages if s.kind == "input"),
        state_bytes=sum(s.nbytes for s in storages if s.kind in ("parameter", "buffer")),
        output_bytes=sum(n for k, n in out_keys.items() if k not in saved_keys),
        saves=saves,
        step=step,
        checkpointed=tuple(checkpointed),
        compiled=compiled,
    )


def _account(
    step: Step,
    watch: Sequence[tuple[str, nn.Module]] = (),
    owners: dict[str, str] | None = None,
) -> _Accounting:
    """Run the step's `forward_backward` with the saved-tensor hooks on during micro-batch
    0's forward and loss, and freeze what is alive just before its backward.

    `watch` modules get a pre-hook recording the storages of their positional tensor inputs
    (what a checkpoint of that module would keep) and whether any tensor input needs grad.
    """
    model = step.model
    first_inputs = step.micro_batches()[0][0]
    kinds = known_kinds(model, (first_inputs.args, dict(first_inputs.kwargs)))
    block_inputs: dict[str, tuple[tuple[StorageKey, int], ...]] = {}
    need_grad: dict[str, bool] = {}
    seen: list[tuple[list[tuple[StorageKey, _Entry]], dict[StorageKey, int], int]] = []
    with step.preserved(clear_grads=True), HookSession(model) as session, ExitStack() as saving:
        # The session's names: inside a DDP or compile wrapper, those of the module itself.
        types = {name: type(m).__name__ for name, m in session.model.named_modules()}
        names = {id(m): name for name, m in session.model.named_modules()}
        stack = session.enable_module_stack()
        for name, module in watch:

            def pre(_m: nn.Module, args: tuple[Any, ...], *kwargs: Any, _n: str = name
                    ) -> None:
                if _n not in block_inputs:  # a block called twice keeps its first inputs
                    block_inputs[_n] = tuple(storage_keys(args).items())
                # Metadata only (no sync): does gradient flow into this call? (`kwargs` is
                # the keyword-argument dict torch passes with `with_kwargs=True`.)
                need_grad[_n] = need_grad.get(_n, False) or any(
                    t.requires_grad for _, t in iter_tensors((args, kwargs)))

            session.forward_pre_hook(module, pre, with_kwargs=True)
        recorder = _Recorder(stack, types, owners, kinds, names)
        saving.enter_context(recorder.hooks())

        def before_backward(micro: int, output: Any, _loss: torch.Tensor) -> None:
            # Everything autograd saved for micro-batch 0 is alive now.
            if micro == 0:
                saving.close()
                seen.append((recorder.alive(), storage_keys(output), recorder.saves))

        loss = step.forward_backward(before_backward=before_backward)
    alive, out_keys, saves = seen[0]
    saved = _freeze(alive, out_keys, saves, step.info(loss), list(recorder.checkpointed),
                    session.compiled)
    return _Accounting(saved, tuple(k for k, _ in alive), block_inputs, need_grad)


def saved_activations(
    model: nn.Module | Step,
    inputs: Any = None,
    *,
    loss_fn: LossSpec = "auto",
    target: Any = None,
    optimizer: torch.optim.Optimizer | None = None,
    select: Selector = None,
    depth: int | None = None,
) -> SavedActivations:
    """Count what autograd saves for backward during one training step's forward and loss.

    The step runs once (`Step.forward_backward`, no optimizer step) in the model's current
    train/eval mode; what micro-batch 0 saved is counted just before its backward, when all
    of it is alive. Tensors the loss saves count under `OUTSIDE`. Parameters, buffers,
    gradients (inputs' too), optimizer state and the RNG are left exactly as they were.

    Args:
        model: the model, or a `Step` (then pass no inputs or step options).
        inputs: a tensor, a tuple of positional inputs, a dict of keyword inputs, or
            `ModelInputs`.
        loss_fn: `"auto"`, `"cross_entropy"`, `"mse"`, `"sum"` or a callable (see
            `torchscope.step`); `"sum"` saves nothing, so only the model's tensors count.
        target: the loss target; None draws seeded targets where the loss needs one.
        optimizer: recorded in `step` (not stepped).
        select: count each storage for its nearest selected ancestor (see
            `torchscope.select_modules`), else for the root `""`; default: the innermost
            module that saved it.
        depth: count deeper modules' storages for their ancestor at this depth.

    Returns:
        Storages, per-module rows (summing to `total_bytes`), totals and the step's
        `StepInfo`.

    Raises:
        ModelError: the model or the loss raised.
        SelectionError: `select` matched nothing, or `depth` is negative.

    Example:
        >>> s = saved_activations(DeepMLP(), torch.randn(32, 64), loss_fn="sum")
        >>> s.total_bytes  # 9 storages of 32 × 64 float32
        73728
    """
    step = Step.of(model, inputs, loss_fn=loss_fn, target=target, optimizer=optimizer)
    return _account(step, owners=row_owners(unwrap_parallel(step.model), select, depth)).saved
