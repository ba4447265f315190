"""Saved-activation accounting: what autograd keeps for backward, module by module.

During one forward (and the loss), `torch.autograd.graph.saved_tensors_hooks` sees every
tensor an autograd node saves. Each is attributed to the innermost module running at that
moment (the `HookSession` module stack), and deduplicated by storage: a ReLU output saved by
the ReLU and again by the next Linear is one allocation, counted once, for the module that
saved it first. Parameters and buffers are model state, counted apart.

Storages freed before backward (a branch whose result was dropped) are not kept for
backward and are not counted; storage liveness is tracked with `StorageWeakRef`, which also
keeps a reused address from being mistaken for the same storage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from torchscope.hooks.session import HookSession
from torchscope.hooks.tree import iter_tensors
from torchscope.memory._step import (
    SEGMENT_LABEL,
    LossFn,
    StorageKey,
    default_loss,
    preserved_state,
    state_keys,
    storage_key,
    storage_nbytes,
)
from torchscope.memory.records import (
    OUTSIDE,
    ModuleSaved,
    SavedActivations,
    SavedStorage,
    StorageKind,
)
from torchscope.models.target import ModelInputs, call_model

__all__ = ["default_loss", "saved_activations"]


@dataclass
class _Entry:
    """A storage while the forward runs (mutable; frozen into `SavedStorage` at the end)."""

    module: str
    module_type: str
    shape: tuple[int, ...]
    dtype: str
    device: str
    nbytes: int
    kind: StorageKind
    ref: StorageWeakRef | None
    saves: int = 1
    savers: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Accounting:
    """`SavedActivations` plus what the planner needs: storage keys and block inputs."""

    saved: SavedActivations
    keys: tuple[StorageKey, ...]  # aligned with saved.storages
    block_inputs: dict[str, tuple[tuple[StorageKey, int], ...]]


class _Recorder:
    def __init__(
        self,
        stack: list[str],
        types: dict[str, str],
        params: dict[StorageKey, str],
        buffers: dict[StorageKey, str],
        inputs: set[StorageKey],
    ) -> None:
        self._stack = stack
        self._types = types
        self._params = params
        self._buffers = buffers
        self._inputs = inputs
        self.live: dict[StorageKey, _Entry] = {}
        self.dead: list[tuple[StorageKey, _Entry]] = []
        self.saves = 0
        self._anon = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        # Called for every tensor an autograd node saves.
        self.saves += 1
        module, module_type = self._where()
        key = storage_key(t)
        ref: StorageWeakRef | None = None
        if key is None:
            self._anon += 1
            key = ("nostorage", -self._anon)
        else:
            ref = StorageWeakRef(t.untyped_storage())
        entry = self.live.get(key)
        if entry is not None and entry.ref is not None and entry.ref.expired():
            self.dead.append((key, entry))  # freed, and its address reused by a new storage
            entry = None
        if entry is None:
            kind: StorageKind = (
                "parameter" if key in self._params
                else "buffer" if key in self._buffers
                else "input" if key in self._inputs
                else "activation"
            )
            entry = _Entry(module, module_type, tuple(t.shape), str(t.dtype), str(t.device),
                           storage_nbytes(t), kind, ref, saves=0)
            self.live[key] = entry
        entry.saves += 1
        if module not in entry.savers:
            entry.savers.append(module)
        # A detached alias (same storage): when a node saves its own output, keeping `t`
        # itself would hold that output's grad_fn from inside the graph, a cycle through C++
        # that Python's gc cannot break. The accounting never runs backward, so no gradient
        # depends on what is returned here.
        return t.detach()

    def _where(self) -> tuple[str, str]:
        if not self._stack:
            return OUTSIDE, ""
        top = self._stack[-1]
        label = SEGMENT_LABEL.get()
        if label is not None and label[0] == top:
            return label[1], label[2]
        return top, self._types.get(top, "")


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _account(
    model: nn.Module,
    inputs: ModelInputs,
    loss_fn: LossFn | None = None,
    watch: Sequence[tuple[str, nn.Module]] = (),
) -> _Accounting:
    """Run one forward + loss under the saved-tensor hooks and freeze what was saved.

    `watch` modules get a pre-hook recording the storages of their positional tensor inputs
    (what a checkpoint of that module would keep).
    """
    params, buffers = state_keys(model)
    input_keys = {
        k for _, t in iter_tensors((inputs.args, dict(inputs.kwargs)))
        if (k := storage_key(t)) is not None
    }
    types = {name: type(m).__name__ for name, m in model.named_modules()}
    block_inputs: dict[str, tuple[tuple[StorageKey, int], ...]] = {}
    with preserved_state(model), HookSession(model) as session:
        stack = session.enable_module_stack()
        for name, module in watch:

            def pre(_m: nn.Module, args: tuple[Any, ...], _n: str = name) -> None:
                if _n in block_inputs:
                    return  # a block called twice keeps its first call's inputs
                found = [(k, storage_nbytes(t)) for _, t in iter_tensors(args)
                         if (k := storage_key(t)) is not None]
                block_inputs[_n] = tuple(found)

            session.forward_pre_hook(module, pre)
        recorder = _Recorder(stack, types, params, buffers, input_keys)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(
            recorder.pack, _unpack
        ):
            out = call_model(model, inputs)
            loss = (loss_fn or default_loss)(out)
        out_keys: dict[StorageKey, int] = {}
        for _, t in iter_tensors(out):
            k = storage_key(t)
            if k is not None:
                out_keys.setdefault(k, storage_nbytes(t))
        alive = [(k, e) for k, e in recorder.live.items()
                 if e.ref is None or not e.ref.expired()]
        saves = recorder.saves
        # The graph (and everything saved) is released when out/loss go out of scope here.
        del out, loss
    saved = _freeze(alive, out_keys, saves)
    return _Accounting(saved, tuple(k for k, _ in alive), block_inputs)


def _freeze(
    alive: list[tuple[StorageKey, _Entry]], out_keys: dict[StorageKey, int], saves: int
) -> SavedActivations:
    storages = tuple(
        SavedStorage(e.module, e.module_type, e.shape, e.dtype, e.device, e.nbytes, e.saves,
                     e.kind, tuple(e.savers))
        for _, e in alive
    )
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
    )


def saved_activations(
    model: nn.Module, inputs: Any, *, loss_fn: LossFn | None = None
) -> SavedActivations:
    """Count what autograd saves for backward during one forward (and the loss).

    The model runs once in its current train/eval mode; its gradients, buffers and the RNG
    are left as they were, and no backward runs.

    Args:
        model: the model.
        inputs: a tensor, a tuple of positional inputs, a dict of keyword inputs, or
            `ModelInputs`.
        loss_fn: maps the model output to the scalar loss; default: the output's `loss`
            entry, else the sum of its floating-point tensors (which saves nothing itself).

    Returns:
        Storages, per-module rows (summing to `total_bytes`) and totals.

    Example:
        >>> s = saved_activations(DeepMLP(), torch.randn(32, 64))
        >>> s.total_bytes  # 9 storages of 32 × 64 float32
        73728
    """
    return _account(model, ModelInputs.of(inputs), loss_fn).saved

