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
backward and are not counted; storage liveness is tracked with a weak reference to the
storage, which also keeps a reused address from being mistaken for the same storage.

The pack hook runs for every saved tensor of a sampled forward, so it does only what must
be read then (the storage, its first view's metadata, the module running): the records
are built once, when the forward's accounting is frozen.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchscope._util import frozen_record
from torchscope.hooks.checkpoints import checkpoint_saving, checkpointed_module
from torchscope.hooks.parallel import unwrap_parallel
from torchscope.hooks.select import Selector, select_modules
from torchscope.hooks.session import HookSession
from torchscope.hooks.tree import iter_tensors
from torchscope.memory._common import (
    SEGMENT_LABEL,
    StorageKey,
    device_name,
    storage_keys,
    storage_nbytes,
    storage_of,
)
from torchscope.memory.records import (
    OUTSIDE,
    ModuleSaved,
    SavedActivations,
    SavedStorage,
    StorageKind,
)
from torchscope.step import LossSpec, Step, StepInfo

# A storage's weak reference (its address, from `_weak_ref()`): is it dead; release it.
_EXPIRED: Callable[[int], bool] = torch.UntypedStorage._expired  # type: ignore[assignment]
_FREE: Callable[[int], None] = torch.UntypedStorage._free_weak_ref


class _Entry:
    """A storage while the forward runs: its first save, and the counts that grow after.

    It holds the storage weakly (`torch.multiprocessing`'s `StorageWeakRef`, without that
    class's per-instance look-up of the legacy `torch.Storage`): `cdata` is the storage's
    address, which no other storage can take while the reference lives; 0 for a tensor
    without storage, or once released. The recorder releases it (`_Recorder.settle`).
    """

    __slots__ = ("cdata", "device", "dtype", "kind", "module", "module_type", "nbytes",
                 "savers", "saves", "shape")

    def __init__(self, storage: torch.UntypedStorage | None, t: torch.Tensor, module: str,
                 module_type: str, device: str, nbytes: int, kind: StorageKind) -> None:
        # (typed as a storage by torch's stubs: it is the address, an int)
        self.cdata: int = 0 if storage is None else storage._weak_ref()  # type: ignore[assignment]
        self.module = module
        self.module_type = module_type
        self.shape = t.shape  # of the first saved view (a torch.Size: made a tuple when frozen)
        self.dtype = t.dtype
        self.device = device
        self.nbytes = nbytes
        self.kind: StorageKind = kind
        self.saves = 1
        self.savers = [module]


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    """`str(dtype)`, cached."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)
    return name


def _is_parameter(t: torch.Tensor) -> bool:
    """`isinstance(t, nn.Parameter)`, without the metaclass's Python check for the plain
    tensors that most saved tensors are (it accepts a tensor flagged `_is_param` too)."""
    if type(t) is torch.Tensor:
        return bool(getattr(t, "_is_param", False))
    return isinstance(t, nn.Parameter)


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


def known_kinds(model: nn.Module, inputs: Any,
                modules: Sequence[nn.Module] | None = None) -> dict[StorageKey, StorageKind]:
    """The storages of the model's parameters and buffers and of `inputs`, with their kind
    (a parameter that is also a buffer or an input counts as a parameter).

    `modules`: `list(model.modules())`, where the caller keeps it (a watch, per sampled
    forward): the same tensors are read from each module without walking the tree again.
    """
    kinds: dict[StorageKey, StorageKind] = dict.fromkeys(storage_keys(inputs), "input")
    if modules is None:
        buffers, params = model.buffers(), model.parameters()
    else:
        buffers = (b for m in modules for b in m._buffers.values() if b is not None)
        params = (p for m in modules for p in m._parameters.values() if p is not None)
    for b in buffers:
        found = storage_of(b)
        if found is not None:
            kinds[found[1]] = "buffer"
    for p in params:
        found = storage_of(p)
        if found is not None:
            kinds[found[1]] = "parameter"
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
        stack = self._stack
        label = SEGMENT_LABEL.get()
        if stack and label is not None and label[0] == stack[-1]:
            # One of torchscope's own checkpoint segments: its first block's.
            module, module_type = label[1], label[2]
            if self._owners is not None:
                module, module_type = self._row(module, module_type)
        else:
            if stack:
                module = stack[-1]
                module_type = self._types.get(module, "")
                if self._owners is not None:
                    module, module_type = self._row(module, module_type)
            else:
                module, module_type = OUTSIDE, ""
            # A checkpoint in the model's code keeps the inputs of what it checkpoints, for
            # that module, not for the module whose forward called `checkpoint`.
            held, fn = checkpoint_saving()
            if held:
                target = checkpointed_module(fn)
                name = self._names.get(id(target)) if target is not None else None
                if name is not None:
                    module, module_type = self._row(name, self._types.get(name, ""))
                self.checkpointed.setdefault(
                    name if name is not None else
                    getattr(fn, "__qualname__", type(fn).__name__), None)
        found = storage_of(t)
        entry: _Entry | None
        if found is None:
            self._anon += 1
            key: StorageKey = ("nostorage", -self._anon)
            storage = None
            entry = None
        else:
            storage, key = found
            entry = self.live.get(key)
            # Its address may now belong to another storage: that one was freed before
            # backward, or its memory was (FSDP2 resizes an unsharded weight's to 0). The
            # entry's weak reference keeps the old storage's address from being reused by
            # a new one, so the same address means the same storage, alive (`t` holds it).
            if entry is not None and entry.cdata != storage._cdata:
                _FREE(entry.cdata)
                entry.cdata = 0
                entry = None
        if entry is None:
            # A parameter not among the model's at the forward's start is one still: FSDP2
            # swaps in the unsharded weights (`nn.Parameter`s) inside each layer's forward.
            kind = self._kinds.get(key)
            if kind is None:
                base = t._base
                kind = "parameter" if _is_parameter(t) or (
                    base is not None and _is_parameter(base)) else "activation"
            if storage is None:
                self.live[key] = _Entry(None, t, module, module_type, device_name(t.device),
                                        storage_nbytes(t), kind)
            else:
                self.live[key] = _Entry(storage, t, module, module_type, key[0],
                                        int(storage.nbytes()), kind)
        else:
            entry.saves += 1
            if module not in entry.savers:
                entry.savers.append(module)
        # A detached alias (same storage, same version counter): when a node saves its own
        # output, keeping `t` itself would hold that output's grad_fn from inside the graph,
        # a cycle through C++ that Python's gc cannot break. A leaf (a parameter, an input,
        # a mask: no grad_fn) makes no cycle, and is kept as autograd itself keeps it.
        # Autograd skips its in-place check for hooked tensors, so the version is kept to
        # make that check in `_unpack`.
        return (t if t.is_leaf else t.detach()), t._version

    def _row(self, name: str, module_type: str) -> tuple[str, str]:
        """The row (with `select=`/`depth=`) and type that `name`'s saves count under."""
        if self._owners is None:
            return name, module_type
        row = self._owners.get(name, name)
        return row, (module_type if row == name else self._types.get(row, ""))

    def settle(self) -> list[tuple[StorageKey, _Entry]]:
        """The storages still alive now, in save order; the recorder is done.

        Every weak reference is released here (a storage that backward frees is then
        deleted at once), so nothing may be saved through this recorder after.
        """
        alive = []
        for k, e in self.live.items():
            cdata, e.cdata = e.cdata, 0
            if cdata:
                dead = _EXPIRED(cdata)
                _FREE(cdata)
                if dead:
                    continue
            alive.append((k, e))
        return alive

    def __del__(self, _free: Any = _FREE) -> None:
        # A recorder never settled (its forward raised) releases its references here.
        # (`_free` is bound at definition: `torch` may be torn down first at exit.)
        for e in self.live.values():
            if e.cdata:
                _free(e.cdata)
                e.cdata = 0


def _unpack(packed: tuple[torch.Tensor, int]) -> torch.Tensor:
    t, version = packed
    if t._version != version:
        # The error autograd itself raises for a saved tensor modified in place.
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: [{t.dtype} {list(t.shape)}] is at version {t._version}; "
            f"expected version {version} instead.")
    return t




_COUNTED = frozenset(("activation", "input"))  # the kinds a module's row counts


def _row_bytes(alive: Sequence[tuple[StorageKey, _Entry]]) -> dict[str, int]:
    """Bytes per row, in first-save order: `_freeze`'s `modules` rows without the records."""
    rows: dict[str, int] = {}
    for _, e in alive:
        if e.kind in _COUNTED:
            rows[e.module] = rows.get(e.module, 0) + e.nbytes
    return rows


def _freeze(
    alive: Sequence[tuple[StorageKey, _Entry]], out_keys: dict[StorageKey, int], saves: int,
    step: StepInfo | None = None, checkpointed: Sequence[str] = (),
    compiled: tuple[str, ...] = (),
) -> SavedActivations:
    dtypes = _DTYPE_NAMES
    storages = tuple([
        frozen_record(SavedStorage, {
            "module": e.module, "module_type": e.module_type, "shape": tuple(e.shape),
            "dtype": dtypes.get(e.dtype) or _dtype_name(e.dtype), "device": e.device,
            "nbytes": e.nbytes, "saves": e.saves, "kind": e.kind, "savers": tuple(e.savers)})
        for _, e in alive])
    rows: dict[str, list[SavedStorage]] = {}
    input_bytes = state_bytes = 0
    for s in storages:
        if s.kind in _COUNTED:
            group = rows.get(s.module)
            if group is None:
                rows[s.module] = [s]
            else:
                group.append(s)
            if s.kind == "input":
                input_bytes += s.nbytes
        else:  # a parameter or a buffer
            state_bytes += s.nbytes
    modules = tuple([
        ModuleSaved(name, group[0].module_type, sum([s.nbytes for s in group]), len(group),
                    sum([s.saves for s in group]), tuple(sorted({s.dtype for s in group})))
        for name, group in rows.items()
    ])
    saved_keys = {k for k, _ in alive} if out_keys else set()
    return SavedActivations(
        storages=storages,
        modules=modules,
        total_bytes=sum(m.bytes for m in modules),
        input_bytes=input_bytes,
        state_bytes=state_bytes,
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
                seen.append((recorder.settle(), storage_keys(output), recorder.saves))

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
