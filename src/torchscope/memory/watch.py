"""`watch_memory`: what autograd saves per module, sampled in the user's own training loop.

A forward-pre hook on the root module enters `torch.autograd.graph.saved_tensors_hooks` for
a sampled forward and a forward hook (`always_call`) leaves it when that forward ends, so the
accounting is `saved_activations`'s own (the same pack hook, storage-deduplicated, attributed
by the module stack), but of the user's forward, not of a step torchscope runs. The loss is
computed after the forward, outside the hooks: what it saves is not seen.

A sampled forward's rows are counted when it ends; its full records (`MemorySample`, every
storage) are built from what was alive then only when read (`MemoryWatch.last`), so a
sampler that reads only the totals never builds them.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchscope.catalogue import entry
from torchscope.errors import TorchscopeError
from torchscope.findings import Finding
from torchscope.hooks.compiled import unseen_forward
from torchscope.hooks.lifecycle import HookedContext
from torchscope.hooks.select import Selector
from torchscope.hooks.session import HookSession
from torchscope.memory._common import storage_keys
from torchscope.memory.records import MemoryHistory, MemorySample, SavedActivations
from torchscope.memory.saved import _freeze, _Recorder, _row_bytes, known_kinds, row_owners

_UNSEEN_FORWARD = entry("memory.unseen_forward")

# Sampled forwards kept while no backward has reached them (two or three in a step that
# runs the model on several inputs before one backward); older ones are dropped.
_MAX_PENDING = 8


@dataclass
class _Active:
    """The sampled forward in progress."""

    forward: int
    recorder: _Recorder
    hooks: torch.autograd.graph.saved_tensors_hooks
    exc: BaseException | None  # the exception being handled when it began (usually None)
    device: torch.device | None  # the CUDA device whose peak it reads


@dataclass
class _Pending:
    """A sampled forward that ended, kept until a backward reaches its output: a forward
    whose graph is dropped (an evaluation pass run without `torch.no_grad`) saves tensors
    that no step uses, and is no sample."""

    row: list[Any]  # [forward, {row: bytes}, total bytes, CUDA peak]
    freeze: Callable[[], SavedActivations] | None  # builds its records (once, when read)
    handles: list[Any]  # pre-hooks on the output's autograd nodes
    saved: SavedActivations | None = None
    built: MemorySample | None = None

    def sample(self) -> MemorySample:
        """Its `MemorySample`, built when first read (and again once its peak is read)."""
        if self.built is None or self.built.peak_bytes != self.row[3]:
            if self.saved is None:
                assert self.freeze is not None
                self.saved, self.freeze = self.freeze(), None  # drops the entries
            self.built = MemorySample(self.row[0], self.saved, self.row[3])
        return self.built


class MemoryWatch(HookedContext):
    """Samples saved activations per module in the user's own loop; see `watch_memory`.

    Attributes:
        every: sample one grad-enabled forward of the model in `every`.
        forwards: grad-enabled forwards of the model seen so far.
        samples: samples taken so far (the history keeps the newest `max_samples`): sampled
            forwards that a backward reached.
        active: while False, no forward is sampled (a sampler such as the run monitor
            switches it between forwards).
    """

    def __init__(self, model: nn.Module, *, every: int = 1, select: Selector = None,
                 depth: int | None = None, max_samples: int = 1000) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise TorchscopeError(f"every={every!r} samples nothing.",
                                  fix="pass every=1 or more.")
        if isinstance(max_samples, bool) or not isinstance(max_samples, int) or max_samples < 1:
            raise TorchscopeError(f"max_samples={max_samples!r} keeps no history.",
                                  fix="pass max_samples=1 or more.")
        if not isinstance(model, nn.Module):
            raise TorchscopeError(f"the model is a {type(model).__name__}, not an nn.Module.",
                                  fix="pass the model (an nn.Module).")
        self.every = every
        self.forwards = 0
        self.samples = 0
        self.active = True
        self._model_ref = weakref.ref(model)
        self._select = select
        self._depth = depth
        self._session: HookSession | None = None
        self._stack: list[str] = []
        self._types: dict[str, str] = {}
        self._names: dict[int, str] = {}
        # The root's modules in `modules()` order, fixed at open as the names, types and
        # module stack are: each sampled forward reads their parameters and buffers.
        self._modules: list[nn.Module] = []
        self._owners: dict[str, str] | None = None
        self._active: _Active | None = None
        # The newest sampled forward whose CUDA peak is still to be read, and its device.
        self._peak: tuple[_Pending, torch.device] | None = None
        self._pending: list[_Pending] = []  # ended, not yet reached by a backward
        self._backwards = 0  # sampled forwards that a backward reached
        self._last: _Pending | None = None  # the newest sample
        # Newest `max_samples` samples: [forward, {row: bytes}, total bytes, CUDA peak]
        self._rows: deque[list[Any]] = deque(maxlen=max_samples)

    # ------------------------------------------------------------------ lifecycle
    def open(self) -> None:
        """Register the root hooks and the module stack."""
        model = self._model_ref()
        if model is None:
            raise ReferenceError("the model of this MemoryWatch was garbage collected")
        session = HookSession(model)
        self._session = session
        root = session.model  # behind a torch.compile wrapper, the module itself
        self._owners = row_owners(root, self._select, self._depth)
        self._types = {name: type(m).__name__ for name, m in root.named_modules()}
        self._names = {id(m): name for name, m in root.named_modules()}
        self._modules = list(root.modules())
        self._stack = session.enable_module_stack()
        # (HookSession.forward_pre_hook is typed for hooks without kwargs.)
        session.track(root.register_forward_pre_hook(self._pre, with_kwargs=True))
        session.forward_hook(root, self._post, always_call=True)

    def close(self, *, failed: bool = False) -> None:
        """Leave a forward still hooked (an interrupted one), read a pending CUDA peak, and
        remove every hook.

        Args:
            failed: the caller is unwinding an exception.
        """
        try:
            if self._active is not None:
                self._stop()
            if self._peak is not None:
                self._read_peak()
            pending, self._pending = self._pending, []
            for entry in pending:
                # A watch whose forwards no backward reached while it was open (forwards
                # only, or the backward after the block) keeps them; in a training loop
                # they were evaluation passes.
                self._release(entry)
                if not self._backwards:
                    self._commit(entry)
        finally:
            if self._session is not None:
                self._session.close(failed=failed)

    @property
    def session(self) -> HookSession:
        """The `HookSession` owning every hook of this watch.

        Raises:
            TorchscopeError: the watch was never opened.
        """
        if self._session is None:
            raise TorchscopeError("this MemoryWatch was never opened.",
                                  fix="use it in a `with` block: with watch_memory(model) as w:")
        return self._session

    # ------------------------------------------------------------------ hooks
    def _pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._active is not None:
            self._stop()  # a forward that never reached its end (KeyboardInterrupt)
        if self._peak is not None:
            self._read_peak()
        if not torch.is_grad_enabled() or torch._C._current_autograd_node() is not None:
            # Nothing is saved (not a training forward), or a checkpoint's recomputation
            # of the root inside backward: not a forward of its own.
            return
        index = self.forwards
        self.forwards += 1
        if index % self.every or not self.active:
            return
        kinds = known_kinds(module, (args, kwargs), self._modules)
        recorder = _Recorder(self._stack, self._types, self._owners, kinds, self._names)
        # (No tensor is on CUDA before CUDA is initialized: a CPU run skips the scan.)
        device = next((p.device for m in self._modules for p in m._parameters.values()
                       if p is not None and p.is_cuda), None) \
            if torch.cuda.is_initialized() else None
        if device is not None:
            torch.cuda.reset_peak_memory_stats(device)  # host-side counter: no sync
        hooks = recorder.hooks()
        hooks.__enter__()
        self._active = _Active(index, recorder, hooks, sys.exc_info()[1], device)

    def _post(self, _module: nn.Module, _args: tuple[Any, ...], output: Any) -> None:
        active = self._active
        if active is None:
            return
        self._stop()
        if sys.exc_info()[1] is not active.exc:
            return  # always_call hooks run while the forward's exception is handled
        rec = active.recorder
        # What is alive now is what the sample counts; its records are built when read.
        alive = rec.settle()
        rows = _row_bytes(alive)
        freeze = functools.partial(
            _freeze, alive, storage_keys(output), rec.saves, checkpointed=list(rec.checkpointed),
            compiled=self._session.compiled if self._session else ())
        entry = _Pending([active.forward, rows, sum(rows.values()), None], freeze, [])
        if active.device is not None:
            self._peak = (entry, active.device)
        handles = self.session.when_reached(output, lambda: self._reached(entry))
        if handles is None:  # nothing a backward could reach: nothing of it is kept for one
            self._commit(entry)
            return
        entry.handles = handles
        self._pending.append(entry)
        if len(self._pending) > _MAX_PENDING:  # forwards whose graphs were dropped
            self._release(self._pending.pop(0))

    def _reached(self, entry: _Pending) -> None:
        if entry in self._pending:
            self._pending.remove(entry)
            entry.handles = []  # released by the session as they fired
            self._backwards += 1
            self._commit(entry)

    def _release(self, entry: _Pending) -> None:
        handles, entry.handles = entry.handles, []
        if handles and self._session is not None and not self._session.closed:
            self._session.release(handles)

    def _commit(self, entry: _Pending) -> None:
        """Count `entry` as a sample, in forward order (a siamese step's backward reaches
        its second forward first)."""
        forward = entry.row[0]
        at = len(self._rows)
        while at and self._rows[at - 1][0] > forward:
            at -= 1
        if len(self._rows) == self._rows.maxlen:
            if at == 0:
                return  # older than every sample the history keeps
            self._rows.popleft()
            at -= 1
        self._rows.insert(at, entry.row)
        if self._last is None or self._last.row[0] <= forward:
            self._last = entry
        self.samples += 1

    def _stop(self) -> None:
        active = self._active
        assert active is not None
        self._active = None
        active.hooks.__exit__(None, None, None)

    def _read_peak(self) -> None:
        # Set only by `_post`, for the newest sampled forward, committed or not yet.
        assert self._peak is not None
        (entry, device), self._peak = self._peak, None
        entry.row[3] = int(torch.cuda.max_memory_allocated(device))

    # ------------------------------------------------------------------ results
    @property
    def last(self) -> MemorySample | None:
        """The most recent sample in full (every saved storage), or None."""
        return None if self._last is None else self._last.sample()

    @property
    def last_total_bytes(self) -> int | None:
        """`last.saved.total_bytes`, without building the sample's records; None before
        the first sample."""
        return None if self._last is None else int(self._last.row[2])

    @property
    def history(self) -> MemoryHistory:
        """Saved bytes per module of the newest `max_samples` samples."""
        modules = tuple(dict.fromkeys(name for r in self._rows for name in r[1]))
        return MemoryHistory(
            forwards=tuple(r[0] for r in self._rows),
            modules=modules,
            saved_bytes=tuple(tuple(r[1].get(m, 0) for m in modules) for r in self._rows),
            total_bytes=tuple(r[2] for r in self._rows),
            peak_bytes=tuple(r[3] for r in self._rows),
        )

    def findings(self, thresholds: object = None) -> list[Finding]:
        """Findings of the last sample's saved activations and of the history's growth."""
        if not self.forwards:
            return [unseen_forward(
                _UNSEEN_FORWARD, "no forward of the model with gradients on ran "
                "through the memory watch's hooks while it was open: nothing was sampled",
                {"forwards": 0})]
        last = self.last
        found = last.saved.findings(thresholds) if last is not None else []
        return found + self.history.findings(thresholds)


def watch_memory(model: nn.Module, *, every: int = 1, select: Selector = None,
                 depth: int | None = None, max_samples: int = 1000) -> MemoryWatch:
    """Watch what autograd saves for backward, per module, in your own training loop.

    Use the result in a `with` block. Each sampled forward of the model (grad enabled; one
    in `every`) is counted like `saved_activations` counts (storage-deduplicated, per module,
    parameters and buffers apart), while it runs: the hooks see nothing outside the model's
    forward, so tensors the loss saves are not in it. It becomes a sample once a backward
    reaches its output: an evaluation pass run with gradients on, whose graph is dropped,
    is none (a watch that sees no backward at all keeps its forwards). Unsampled forwards
    cost two Python calls per module; hooks read tensor metadata only (no device sync).

    On CUDA, each sample also reads the peak allocated from the start of its forward until
    the model's next forward (or the end of the watch). That resets the CUDA peak counter
    (`torch.cuda.reset_peak_memory_stats`) at every sampled forward: your own
    `torch.cuda.max_memory_allocated()` then reads the peak since the last sample.

    Args:
        model: the model.
        every: sample forwards 0, every, 2*every, ... (counting grad-enabled forwards).
        select: rows for these modules: each storage counts for its nearest selected
            ancestor, else the root `""` (see `torchscope.select_modules`).
        depth: rows down to this depth.
        max_samples: how many samples the history keeps (the newest).

    Raises:
        TorchscopeError: `every` or `max_samples` is below 1.
        SelectionError: `select` matched nothing, or `depth` is negative (on entering).

    Example:
        >>> with torchscope.watch_memory(model, every=10, depth=1) as watch:
        ...     for x, y in loader:
        ...         F.cross_entropy(model(x), y).backward()
        ...         opt.step(); opt.zero_grad()
        >>> watch.history.series("layer1"), watch.last.saved.total_bytes
    """
    return MemoryWatch(model, every=every, select=select, depth=depth, max_samples=max_samples)
