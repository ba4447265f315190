"""Activation capture with forward hooks: one record per module call, stats reduced on device."""

from __future__ import annotations

import contextlib
import itertools
import math
import warnings
import weakref
from collections import deque
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from torchscope import _kernels
from torchscope._kernels import DEAD, INFS, MAX, MEAN, MIN, N_MOMENTS, NANS, NORM, STD, ZEROS
from torchscope._util import frozen_record
from torchscope.capture.records import (
    ActivationRecord,
    ActivationRecords,
    ReductionPaths,
    TensorStats,
)
from torchscope.capture.stats import (
    feature_scale,
    finiteness,
    reduce_stats,
    saturation,
    stats_vector,
    tensor_stats,
)
from torchscope.capture.units import Candidate, unit_candidates, unit_dim
from torchscope.distributed.ranked import Ranked
from torchscope.errors import BudgetError, TorchscopeError
from torchscope.findings import Analyzed
from torchscope.hooks.lifecycle import HookedContext
from torchscope.hooks.select import Selector, holds_parameters, own_parameters, select_modules
from torchscope.hooks.session import HookSession
from torchscope.hooks.tree import iter_tensors, nested_shape, nested_values
from torchscope.step import Step

Store = Literal["stats", "tensors"]
OnBudget = Literal["error", "skip"]

# Records kept without `keep_last=` before a one-time warning that the capture keeps growing:
# about 37 MB (a record of one output takes about 0.75 KB on the host; deep-mlp makes 16 per
# forward, 12 MB per 1,000 forwards).
GROWTH_WARNING_RECORDS = 50_000

# Modules whose outputs are >= 0 and whose dead channels mean dead units.
_RELU_FAMILY = (nn.ReLU, nn.ReLU6, nn.Hardtanh, nn.Threshold)
_NONNEGATIVE = (nn.ReLU, nn.ReLU6)  # outputs >= 0: one reduction finds a dead channel
# Bounded activations' tails, where the local gradient has fallen below this share of its
# peak (smooth ones) or to zero (piecewise-linear ones): a value there passes almost no
# gradient back, and a unit whose every value sits there does not learn.
_PEAK_SHARE = 0.05
_TANH_TAIL = math.sqrt(1.0 - _PEAK_SHARE)  # tanh' = 1 - y**2 <= 0.05  <=>  |y| >= 0.9747


def _saturation_bounds(m: nn.Module) -> tuple[float, float] | None:
    """(low, high): the output values at or beyond which module `m`'s local gradient is
    below `_PEAK_SHARE` of its peak, or zero; None for an activation that is not bounded
    (or not one)."""
    if isinstance(m, nn.Tanh):
        return -_TANH_TAIL, _TANH_TAIL
    if isinstance(m, nn.Sigmoid):  # s' = s(1 - s) = (1 - (2s - 1)**2) / 4
        return 0.5 - _TANH_TAIL / 2, 0.5 + _TANH_TAIL / 2
    if isinstance(m, nn.Softsign):  # s' = (1 - |y|)**2
        tail = 1.0 - math.sqrt(_PEAK_SHARE)
        return -tail, tail
    if isinstance(m, nn.Hardsigmoid):  # zero gradient outside -3 < x < 3: y = 0 or 1
        return 0.0, 1.0
    if isinstance(m, nn.Hardtanh) and not isinstance(m, nn.ReLU6):  # ReLU6's 0 is a ReLU's
        return float(m.min_val), float(m.max_val)
    if isinstance(m, nn.RNN | nn.RNNCell) and m.nonlinearity == "tanh":
        return -_TANH_TAIL, _TANH_TAIL  # its outputs are its tanh's: h_t = tanh(...)
    return None


def _own_units(m: nn.Module) -> tuple[Candidate, ...]:
    """A recurrent layer's own units, last in its outputs: (..., hidden × directions) for
    its sequence, (..., hidden) for its final state."""
    if isinstance(m, nn.RNN):
        return (m.hidden_size * (2 if m.bidirectional else 1), False), (m.hidden_size, False)
    if isinstance(m, nn.RNNCell):
        return ((m.hidden_size, False),)
    return ()


# Modules whose weights set the scale of what follows; scale drift is read between these.
_WEIGHTED = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding)
# Those whose default init expects float inputs of about unit scale: a model input they take
# as it is gets its statistics read (`ActivationRecord.model_input`), and its features' scale
# along the dim each one reads them from (`_feature_dim`).
_TAKES_DATA = (nn.Linear, nn.Bilinear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
# BatchNorm1d/2d/3d, their lazy forms and SyncBatchNorm.
_BatchNorm = nn.modules.batchnorm._BatchNorm


def _synced_ranks(m: nn.Module) -> int:
    """The ranks whose batches a SyncBatchNorm normalises over in this call, as its forward
    decides (training, a process group of more than one rank); 1 for any other layer."""
    if not (isinstance(m, nn.SyncBatchNorm) and m.training and dist.is_available()
            and dist.is_initialized()):
        return 1
    return int(dist.get_world_size(m.process_group or dist.group.WORLD))


def _feature_dim(m: nn.Module) -> int | None:
    """Where a layer that takes data holds its input's features: the last dim for a linear
    layer, dim 1 (channels) for a convolution; None for other modules."""
    if isinstance(m, nn.Linear | nn.Bilinear):
        return -1
    return 1 if isinstance(m, _TAKES_DATA) else None


_Leaf = tuple[str, tuple[int, ...], torch.dtype, torch.device, int, int, int, int, int, bool,
              int, int]
"""One tensor of a recorded call, until the host values arrive: (path, shape, dtype, device,
numel, offset of its stats vector among its forward's values, offset of its dead-unit count
or -1, the dimension of its units, offset of its saturation counts or -1, reduced by the
fused kernel, offset of its feature scale or -1 (a model input's), the dim of those
features); dtype and device are made strings when the records are built, not in the hook."""


class _Pending(NamedTuple):
    """A call recorded during a forward whose device stats are not on the host yet (a named
    tuple: built once per hooked call, where a frozen dataclass costs several times more).
    The hook builds it with `tuple.__new__`, every field in this order."""

    module: str
    module_type: str
    call: int
    order: int
    leaves: tuple[_Leaf, ...]
    # Per floating-point tensor input, where its finiteness is: an earlier output's stats
    # vector (offset i >= 0), or a `finiteness` value (offset -1 - i). Integer and boolean
    # inputs are always finite and have none.
    input_rows: tuple[int, ...]
    # A weighted layer's first input where that is the model's own input.
    model_input: _Leaf | None = None
    # A BatchNorm that normalised this call with the batch's own statistics.
    batch_stats: bool = False
    # A BatchNorm in training mode with running statistics and frozen affine parameters.
    frozen: bool = False
    # A SyncBatchNorm that normalised over its process group's batches: the group's size.
    batch_ranks: int = 1
    # Its output is (one of) the model's own: set when the model's forward returns.
    model_output: bool = False


class _Forward(NamedTuple):
    """A forward's recorded calls and the device values they wait for: 0-d and 1-d float64
    tensors that, laid end to end in the order the hooks queued them, are `width` values
    (the offsets in `_Leaf` and `_Pending.input_rows` point into them). Joined into one
    tensor per forward only once several forwards wait (`_RAW_FORWARDS`): the host copy
    joins them anyway, one `hstack` per device for every forward pending."""

    step: int
    calls: list[_Pending]
    values: list[torch.Tensor]
    width: int


# Forwards kept as their hooks left them (a tensor per value) until `records` is read; a
# later one is joined when it ends, so that a capture never read (a long loop without
# `keep_last`) holds a few tensors per forward, not one per value (on a GPU, each holds a
# block of the caching allocator).
_RAW_FORWARDS = 4


def _devices(values: list[torch.Tensor]) -> set[torch.device]:
    # A CUDA model still sees CPU tensors (a PackedSequence's batch_sizes, lengths), and a
    # model split over GPUs has outputs on each: values are joined per device.
    return {v.device for v in values}


_Piece = tuple[torch.device, int, int, int]
"""Where a run of a forward's values lies: (device, start among the values joined on that
device, start among the forward's values, length)."""


def _layout(runs: list[list[tuple[torch.device, int]]]
            ) -> tuple[list[list[_Piece]], dict[torch.device, int]]:
    """Each forward's values as pieces of the per-device joins, from its runs (device,
    length) in the order its hooks queued them, every forward's after the previous one's
    on each device (one run, and so one piece, for a forward all on one device); and how
    many values each device's join holds."""
    ends: dict[torch.device, int] = {}
    out: list[list[_Piece]] = []
    for forward in runs:
        pieces: list[_Piece] = []
        dest = 0
        for device, n in forward:
            start = ends.get(device, 0)
            ends[device] = start + n
            pieces.append((device, start, dest, n))
            dest += n
        out.append(pieces)
    return out, ends


def _assemble(pieces: list[_Piece], width: int, host: dict[torch.device, list[float]]
              ) -> list[float]:
    """A forward's `width` values on the host, in queue order, from its `pieces` of the
    per-device host lists `host`."""
    if len(pieces) == 1:
        device, start, _, n = pieces[0]
        return host[device][start:start + n]
    values = [0.0] * width
    for device, start, dest, n in pieces:
        values[dest:dest + n] = host[device][start:start + n]
    return values


class ActivationCapture(HookedContext, Analyzed):
    """Collects activation records while its `HookSession` is open.

    `findings()` judges what it recorded (see `torchscope.capture.analyze`): the module that
    makes the first NaN/Inf, dead ReLU units, saturated tanh and sigmoid units, model
    inputs never normalised, constant, mostly-zero, large and near-overflow outputs, and
    activation scale drifting across the weighted layers.

    Hooks only enqueue device reductions; reading `records` copies everything pending to
    the host at once, one transfer per device. Tensors kept with `store="tensors"` are in
    `tensors`; keeping one is a device-to-host copy inside the hook (with `offload=True`),
    so that mode is for inspection, not for every step of a long run.

    Args:
        model: any `nn.Module` (a `torch.compile` wrapper is unwrapped).
        select: which modules to hook (see `select_modules`); default: the layers.
        depth: limit the selection depth.
        store: "stats" keeps statistics only; "tensors" also keeps detached copies.
        max_bytes: budget for stored tensors, in bytes; None for no budget.
        offload: copy stored tensors to the CPU (else clone them on their device).
        on_budget: over the budget, "error" raises `BudgetError`; "skip" warns once and
            skips the tensors that do not fit.
        dead_units: count all-zero channels of ReLU-family outputs.
        count_nonfinite: count NaN and Inf elements exactly (see `capture_activations`).
        keep_last: keep the records (and stored tensors) of the last this many forwards
            only; None keeps every forward, and warns once past
            `GROWTH_WARNING_RECORDS` records.

    Attributes:
        active: while False, forwards are not recorded (one Python call per hook); a
            sampler (the run monitor) switches it between forwards.

    Raises:
        TorchscopeError: `store` or `on_budget` is not one of its values, or `keep_last`
            is below 1.
        BudgetError: `max_bytes` is negative.
        SelectionError: `select` matched no module.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        select: Selector = None,
        depth: int | None = None,
        store: Store = "stats",
        max_bytes: int | None = None,
        offload: bool = True,
        on_budget: OnBudget = "error",
        dead_units: bool = True,
        count_nonfinite: bool = True,
        keep_last: int | None = None,
    ) -> None:
        if keep_last is not None and (isinstance(keep_last, bool) or
                                      not isinstance(keep_last, int) or keep_last < 1):
            raise TorchscopeError(f"keep_last={keep_last!r} keeps no forward.",
                                  fix="pass keep_last=1 or more, or None to keep every forward.")
        if store not in ("stats", "tensors"):
            raise TorchscopeError(f"store={store!r} is not a capture mode; expected 'stats' "
                                  "or 'tensors'.", fix="pass store='stats' or store='tensors'.")
        if on_budget not in ("error", "skip"):
            raise TorchscopeError(f"on_budget={on_budget!r} is not a budget policy; expected "
                                  "'error' or 'skip'.",
                                  fix="pass on_budget='error' or on_budget='skip'.")
        if max_bytes is not None and max_bytes < 0:
            raise BudgetError(f"max_bytes={max_bytes} is negative; expected 0 or more bytes.",
                              fix="pass max_bytes=0 or more, or None for no budget.")
        self._session = HookSession(model)
        # The session's model: a torch.compile wrapper is unwrapped, so names stay plain.
        self._targets = select_modules(self._session.model, select, depth=depth)
        self._names = [n for n, _ in self._targets]
        self._weighted = frozenset(n for n, m in self._targets if isinstance(m, _WEIGHTED))
        self._holders = frozenset(n for n, m in self._targets if n and holds_parameters(m))
        self._zero_init: set[str] = set()  # see `zero_init`
        self._store = store
        self._max_bytes = max_bytes
        self._offload = offload
        self._on_budget = on_budget
        self._dead_units = dead_units
        self._count_nonfinite = count_nonfinite
        self._keep_last = keep_last
        self._warned_growth = False
        self.active = True
        self._recording = False  # whether the forward in progress is recorded
        self._pending_calls = 0  # calls in `_pending`, counted without flushing them
        self._records: list[ActivationRecord] = []
        self._tensors: dict[tuple[int, str, str], torch.Tensor] = {}
        self._stored_bytes = 0
        self._warned_budget = False
        self._step = -1
        # Forwards whose values are not on the host yet, flushed together.
        self._pending: list[_Forward] = []
        # The forward in progress: its calls, and the device values they queued (stats
        # vectors, dead-unit counts, input finiteness values, saturation counts and
        # model-input feature scales), `_width` values laid end to end.
        self._cur: list[_Pending] = []
        self._vals: list[torch.Tensor] = []
        self._width = 0
        self._fused = 0
        self._eager = 0
        self._eager_why: dict[tuple[torch.dtype, torch.device], str] = {}
        self._calls: dict[str, int] = {}
        self._names_of: dict[Any, str] = {}  # see `_leaf_stats`
        # Identity of tensors already reduced this forward -> offset of their stats vector
        # (>= 0) or finiteness value (-1 - offset) among `_vals`.
        self._seen: dict[int, tuple[weakref.ReferenceType[torch.Tensor], int]] = {}
        # The forward's model inputs (see `_begin_forward`).
        self._inputs: dict[int, weakref.ReferenceType[torch.Tensor]] = {}
        # Per forward, where its model inputs' finiteness is read (`_row_for_input`).
        self._input_rows: dict[int, tuple[int, ...]] = {}
        # Stats rows of this forward's outputs that a later call took in through a view
        # (those taken as they are are in its `input_rows`).
        self._taken: set[int] = set()

    # ------------------------------------------------------------------ session
    def open(self) -> None:
        """Register the hooks."""
        s = self._session
        model = s.model
        s.forward_pre_hook(model, self._begin_forward, with_kwargs=True, prepend=True)
        s.forward_hook(model, self._end_forward, always_call=True)
        children: dict[str, Any] = {}  # `unit_candidates`' cache: each parent read once
        for name, module in self._targets:
            relu_family = isinstance(module, _RELU_FAMILY)
            bounds = _saturation_bounds(module)
            s.forward_hook(
                module,
                self._make_hook(name, type(module).__name__, relu_family,
                                isinstance(module, _NONNEGATIVE), bounds,
                                _own_units(module) + unit_candidates(model, name, children)
                                if relu_family or bounds is not None else (),
                                _feature_dim(module), isinstance(module, _BatchNorm)),
            )

    def close(self, *, failed: bool = False) -> None:
        """Remove the hooks; records stay readable."""
        self._session.close(failed=failed)
        try:
            self._end_forward(None, (), None)
            if not failed:
                self._flush()  # while the modules are known (`_zero_weights`): one host read
        finally:
            # Drop the module references: records must not keep a model alive.
            self._targets = []

    @property
    def session(self) -> HookSession:
        """The session that owns this capture's hooks."""
        return self._session

    @property
    def modules(self) -> list[str]:
        """Qualified names of the hooked modules."""
        return list(self._names)

    @property
    def forwards(self) -> int:
        """Forwards recorded so far (the next one's records get this `step`)."""
        return self._step + 1

    @property
    def compiled(self) -> tuple[str, ...]:
        """The model's compiled parts (qualified names, `""` the root), which run eagerly
        while the capture is open: torchscope's hooks fire only in eager code."""
        return self._session.compiled

    @property
    def weighted(self) -> frozenset[str]:
        """Hooked modules with weights that set the scale of what follows (Linear, Conv,
        Embedding)."""
        return self._weighted

    @property
    def zero_init(self) -> frozenset[str]:
        """Hooked modules whose own parameters were all exactly zero when their output was
        last seen constant (see `ActivationRecords.zero_init`); a module is checked again
        each time a read forward gives it a constant output."""
        self._flush()
        return frozenset(self._zero_init)

    # ------------------------------------------------------------------ hooks
    def _begin_forward(self, _m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                       ) -> None:
        if torch._C._current_autograd_node() is not None:
            return  # a checkpoint's recomputation, inside backward: not a forward of its own
        if self._cur or self._vals:
            self._end_forward(None, (), None)  # a forward that raised left pending calls
        self._recording = self.active
        if not self._recording:
            return
        self._step += 1
        self._calls = {}
        self._seen = {}
        self._taken = set()
        # The model's own float inputs, by identity: a weighted layer that takes one as it
        # is gets its statistics read (`ActivationRecord.model_input`).
        # A batch passed as one object (`batch.x`) holds the input: positional objects are
        # entered. Keyword ones are not: a KV cache (`past_key_values=`) is state, not data.
        found = itertools.chain(iter_tensors(args, objects=True, named=False),
                                iter_tensors(kwargs, named=False))
        self._inputs = {id(t): weakref.ref(t) for _, t in found
                        if t.is_floating_point() and not t.is_nested}
        # Whether NaN/Inf came in with the input or was made inside: read once per input,
        # on the device, and shared with the first layer that takes it (no second read).
        rows = [self._row_for_input(t) for t in (ref() for ref in self._inputs.values())
                if t is not None]
        self._input_rows[self._step] = tuple([r for r in rows if r is not None])

    def _end_forward(self, _m: nn.Module | None, _args: tuple[Any, ...], _out: Any) -> None:
        if not self._recording:
            return  # nothing was recorded since the last forward's end (`_begin_forward`)
        if _m is not None and torch._C._current_autograd_node() is not None:
            return  # the end of a recomputation (`_begin_forward`)
        if _m is not None and self._cur:
            self._mark_outputs(_out)
        if self._vals or self._cur:
            self._pending.append(_Forward(self._step, self._cur, self._vals, self._width))
            if len(self._pending) > _RAW_FORWARDS:
                self._join(-1)
            self._pending_calls += len(self._cur)
            self._bound()
        elif _m is not None:  # the forward's own end, with nothing to read: no records
            self._input_rows.pop(self._step, None)
        self._cur, self._vals, self._width, self._seen, self._inputs = [], [], 0, {}, {}

    def _join(self, i: int) -> None:
        """Join pending forward `i`'s values into one tensor (where they are on one device)."""
        f = self._pending[i]
        if len(f.values) > 1:
            with contextlib.suppress(RuntimeError):  # on several devices: left as they are
                self._pending[i] = f._replace(values=[torch.hstack(f.values)])  # (width,)

    def _mark_outputs(self, out: Any) -> None:
        """Mark the calls whose output the model returns as it is (a head's logits) and no
        recorded call takes in: their scale is what the loss asks for. A hidden state that
        is returned too (`output_hidden_states=True`) feeds later layers: not marked."""
        returned = [out] if type(out) is torch.Tensor else \
            [t for _, t in iter_tensors(out, named=False)]
        seen = self._seen
        hits = []
        for t in returned:
            hit = seen.get(id(t))
            if hit is not None and hit[0]() is t and hit[1] >= 0:
                hits.append((t, hit[1]))
        if not hits:
            return
        taken = self._taken.union(*[p.input_rows for p in self._cur])
        rows = {row for t, row in hits if row not in taken and not _feeds(t, returned)}
        if not rows:
            return
        cur = self._cur
        for i, p in enumerate(cur):
            for leaf in p.leaves:
                if leaf[5] in rows:
                    cur[i] = p._replace(model_output=True)
                    break

    def _bound(self) -> None:
        """Drop forwards older than `keep_last` (pending ones without reading them), or warn
        once that an unbounded capture has grown large."""
        if self._keep_last is None:
            if not self._warned_growth and \
                    len(self._records) + self._pending_calls >= GROWTH_WARNING_RECORDS:
                self._warned_growth = True
                warnings.warn(
                    f"watch_activations holds {GROWTH_WARNING_RECORDS:,} records: it keeps "
                    "every call of every forward since the block began, so memory grows "
                    "with each step; pass keep_last=N to keep the last N forwards only.",
                    RuntimeWarning, stacklevel=2)
            return
        oldest = self._step - self._keep_last + 1
        if self._pending and self._pending[0][0] < oldest:
            kept = [p for p in self._pending if p[0] >= oldest]
            self._pending_calls -= sum(len(p[1]) for p in self._pending) - \
                sum(len(p[1]) for p in kept)
            self._pending = kept
        for step in [k for k in self._input_rows if k < oldest]:
            del self._input_rows[step]
        recs = self._records
        if recs and recs[0].step < oldest:
            # In forward order: the old ones are a prefix.
            n = 1
            while n < len(recs) and recs[n].step < oldest:
                n += 1
            del recs[:n]
        if self._tensors and min(k[0] for k in self._tensors) < oldest:
            for key in [k for k in self._tensors if k[0] < oldest]:
                t = self._tensors.pop(key)
                self._stored_bytes -= t.numel() * t.element_size()

    def _put(self, value: torch.Tensor, width: int) -> int:
        """Queue `value` (0-d or 1-d, `width` float64 values) for the host copy; returns its
        offset among the forward's values."""
        at = self._width
        self._vals.append(value)
        self._width = at + width
        return at

    def _model_input(self, t: torch.Tensor, dim: int) -> _Leaf | None:
        """A model input that a weighted layer takes as it is, or through a view (an MLP's
        `x.flatten(1)`): its statistics (one stats vector, which its finiteness then reads
        too) and the scale of its features along `dim`, as a leaf of `_Pending`."""
        base = t._base if t._base is not None else t
        ref = self._inputs.get(id(base))
        if ref is None or ref() is not base:
            return None
        hit = self._seen.get(id(t))
        if hit is not None and hit[0]() is t and hit[1] >= 0:
            return None  # read for an earlier layer already
        vec, _, fused = tensor_stats(t, count_nonfinite=self._count_nonfinite)
        at = self._put(vec, N_MOMENTS)
        self._seen[id(t)] = (weakref.ref(t), at)
        feat = self._put(feature_scale(t, dim=dim), 3)
        return ("", tuple(t.shape), t.dtype, t.device, t.numel(), at, -1, 1, -1, fused,
                feat, dim)

    def _row_for_input(self, t: torch.Tensor) -> int | None:
        """Where `t`'s finiteness is read: an earlier output's stats vector when it is one
        (or an input already checked), else a new `finiteness` value (-1 - its offset);
        None for an integer or boolean tensor, which is always finite."""
        base = t._base
        seen = self._seen
        if base is not None:
            # An earlier output taken in through a view (`hidden[:, 0]`, `h[:, :-1]`).
            of_base = seen.get(id(base))
            if of_base is not None and of_base[0]() is base and of_base[1] >= 0:
                self._taken.add(of_base[1])
        hit = seen.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        if not (t.is_floating_point() or t.is_complex()):
            return None  # `finiteness` would be a 0 for it
        row = -1 - self._put(finiteness(nested_values(t) if t.is_nested else t), 1)
        seen[id(t)] = (weakref.ref(t), row)
        return row

    def _make_hook(self, name: str, type_name: str, relu_family: bool, nonnegative: bool,
                   bounds: tuple[float, float] | None, units: tuple[Candidate, ...],
                   feature_dim: int | None, batch_norm: bool) -> Any:
        # What the module and the capture's settings decide, once: the hook runs at every
        # call of a recorded forward.
        want_dead = self._dead_units and relu_family
        counted = self._count_nonfinite
        keep = self._store == "tensors"
        row_for_input = self._row_for_input
        put = self._put
        autograd_node = torch._C._current_autograd_node

        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            # Inside backward, a forward is a checkpoint's recomputation of values the
            # forward already recorded (a reentrant checkpoint's first forward ran under
            # no_grad, and was recorded then).
            if not self._recording or autograd_node() is not None:
                return
            calls = self._calls
            call = calls.get(name, 0)
            calls[name] = call + 1
            seen = self._seen
            # One tensor in, one out is most calls: no walk over nested containers then.
            one = len(args) == 1 and type(args[0]) is torch.Tensor
            ins = args if one else [t for _, t in iter_tensors(args, named=False)]
            # Before the inputs' finiteness, which then reads the model input's stats.
            model_input = self._model_input(ins[0], feature_dim) \
                if feature_dim is not None and ins and self._inputs else None
            if one:
                x = args[0]
                # Most often the output of the call before, as it is.
                hit = seen.get(id(x)) if x._base is None else None
                if hit is not None and hit[0]() is x:
                    input_rows: tuple[int, ...] = (hit[1],)
                else:
                    row = row_for_input(x)
                    input_rows = () if row is None else (row,)
            else:
                input_rows = tuple([r for r in map(row_for_input, ins) if r is not None])
            leaves: list[_Leaf] = []
            outs = (("", output),) if type(output) is torch.Tensor else iter_tensors(output)
            for path, t in outs:
                # A nested tensor (nn.TransformerEncoder's fast path): its elements, and its
                # shape with -1 for a ragged dim.
                if t.is_nested:
                    values, shape = nested_values(t), nested_shape(t)
                else:
                    values, shape = t, t.shape
                # (N, C, ...) after a convolution, (N, ..., C) after a linear layer.
                udim = unit_dim(values.shape, units) if units and values.dim() > 2 else 1
                dead_count = None
                if want_dead:
                    vec, dead_count, fused = stats_vector(
                        values, count_nonfinite=counted, dead_units=True,
                        nonnegative=nonnegative, unit_dim=udim)
                else:  # `stats_vector` without dead units, inline
                    ran = _kernels.run("stats", values)
                    fused = ran is not None
                    vec = reduce_stats(values, count_nonfinite=counted) if ran is None else ran
                vals = self._vals
                at = self._width
                vals.append(vec)
                self._width = at + N_MOMENTS
                seen[id(t)] = (weakref.ref(t), at)
                dead = -1
                if want_dead:
                    if dead_count is not None:
                        dead = put(dead_count, 1)
                    elif vec.shape[0] > N_MOMENTS:  # counted in the kernel's pass
                        dead = at + DEAD
                        self._width += 1
                sat = -1
                if bounds is not None and values.is_floating_point():
                    sat = put(saturation(values, *bounds, dim=udim), 2)
                if fused:
                    self._fused += 1
                else:
                    self._eager += 1
                    key = (t.dtype, t.device)
                    if key not in self._eager_why:
                        self._eager_why[key] = _kernels.why_eager("stats", values) or "eager"
                leaves.append((path, tuple(shape), t.dtype, t.device, values.numel(), at, dead,
                               udim, sat, fused, -1, 0))
                if keep:
                    self._keep(name, call, path, t)
            batch_stats = frozen = False
            ranks = 1
            if batch_norm:
                # A BatchNorm normalises with the batch's statistics in training mode, and
                # always without running statistics (`track_running_stats=False`).
                batch_stats = module.training or module.running_mean is None
                # In training mode its running statistics move with every batch, whether or
                # not its own weight trains: a backbone frozen by requires_grad alone still
                # changes.
                frozen = batch_stats and module.training and \
                    module.running_mean is not None and \
                    isinstance(module.weight, nn.Parameter) and not module.weight.requires_grad
                ranks = _synced_ranks(module) if batch_stats else 1
            cur = self._cur
            # The named tuple's own `__new__` is a Python call: one frame fewer per call.
            cur.append(_tuple_new(_Pending, (
                name, type_name, call, len(cur), tuple(leaves), input_rows, model_input,
                batch_stats, frozen, ranks, False)))

        return hook

    def _keep(self, name: str, call: int, path: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if self._max_bytes is not None and self._stored_bytes + nbytes > self._max_bytes:
            msg = (
                f"storing {name}#{call}{path} ({nbytes:,} B) would exceed max_bytes="
                f"{self._max_bytes:,} (already {self._stored_bytes:,} B stored)"
            )
            if self._on_budget == "error":
                raise BudgetError(
                    msg + ".",
                    fix="raise max_bytes, narrow select=, or use "
                    "on_budget='skip' or store='stats'.",
                )
            if not self._warned_budget:
                self._warned_budget = True
                warnings.warn(
                    msg + "; skipping this and further tensors over the budget.",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return
        copy = t.detach().to("cpu", copy=True) if self._offload else t.detach().clone()
        self._stored_bytes += nbytes
        self._tensors[(self._step, f"{name}#{call}", path)] = copy

    # ------------------------------------------------------------------ results
    @property
    def records(self) -> tuple[ActivationRecord, ...]:
        """Every record so far, in forward order then call-completion order."""
        self._flush()
        return tuple(self._records)

    @property
    def tensors(self) -> dict[tuple[int, str, str], torch.Tensor]:
        """Stored tensors by `(step, "module#call", path)` (only with `store="tensors"`)."""
        return dict(self._tensors)

    @property
    def stored_bytes(self) -> int:
        """Bytes held by `tensors`."""
        return self._stored_bytes

    def last(self) -> tuple[ActivationRecord, ...]:
        """Records of the most recent forward."""
        recs = self.records
        if not recs:
            return ()
        return tuple(r for r in recs if r.step == recs[-1].step)

    def get(self, module: str, call: int = 0, step: int | None = None) -> ActivationRecord:
        """The record of `module`'s `call`-th call in `step` (the last forward by default).

        Raises:
            KeyError: no such record.
        """
        recs = self.records if step is not None else self.last()
        for r in recs:
            if r.module == module and r.call == call and (step is None or r.step == step):
                return r
        raise KeyError(
            f"no record for {module!r} call {call}"
            + (f" in step {step}" if step is not None else "")
        )

    @property
    def paths(self) -> ReductionPaths:
        """How many output tensors the fused kernel reduced, how many eager ops did, and why."""
        return ReductionPaths(self._fused, self._eager, tuple(dict.fromkeys(
            f"{why} for {dtype}" for (dtype, _), why in self._eager_why.items())))

    def result(self) -> ActivationRecords:
        """The records so far as a plain result, without hooks or the model (picklable)."""
        return ActivationRecords(self.records, self._weighted, self.paths,
                                 frozenset(self._zero_init))

    def gather(self, *, timeout: float | None = None) -> Ranked[ActivationRecords] | None:
        """Every rank's `result()` on rank 0 as one `Ranked` result (None on the other ranks).

        Call it on every rank, after the forwards it should hold: it is one collective. On
        one process it returns this process's result alone.

        Args:
            timeout: seconds to wait for the other ranks (default `TORCHSCOPE_TIMEOUT_S`).
        """
        return self.result().gather(timeout=timeout)

    def _host_values(self) -> list[list[float]]:
        """Each pending forward's values on the host, laid end to end as its hooks queued
        them (the offsets of `_Leaf` index this list).

        One host copy per device for everything pending: `hstack` there (every value is
        0-d or 1-d), then `.cpu()` and `.tolist()` once.
        """
        pending = self._pending
        values = [v for f in pending for v in f.values]
        try:
            # Every value on one device, as with most models: one join, and no look at
            # each value's device (30 of them cost 20 us after a training step).
            joined = torch.hstack(values) if values else None
        except RuntimeError:  # `torch.cat` refuses values on several devices
            return self._host_values_by_device()
        # The copy outside the `try`: a device error it reveals is that error, not a cue.
        flat: list[float] = [] if joined is None else joined.cpu().tolist()
        assert len(flat) == sum(f.width for f in pending), \
            "activation values queued with a width other than their size"
        out: list[list[float]] = []
        at = 0
        for f in pending:
            out.append(flat[at:at + f.width])
            at += f.width
        return out

    def _host_values_by_device(self) -> list[list[float]]:
        """`_host_values` for values on several devices: one join per device."""
        runs: list[list[tuple[torch.device, int]]] = []
        parts: dict[torch.device, list[torch.Tensor]] = {}
        for f in self._pending:
            devices = _devices(f.values)
            if len(devices) == 1:
                (device,) = devices
                runs.append([(device, f.width)])
                parts.setdefault(device, []).extend(f.values)
            else:
                runs.append([(v.device, v.numel()) for v in f.values])
                for v in f.values:
                    parts.setdefault(v.device, []).append(v)
        host = {device: torch.hstack(vs).cpu().tolist() for device, vs in parts.items()}
        layout, sizes = _layout(runs)
        # Each value's width, as the hooks counted it, must be its size: else every offset
        # after it would read another value.
        assert all(len(host[d]) == n for d, n in sizes.items()), \
            "activation values queued with a width other than their size"
        return [_assemble(pieces, f.width, host)
                for f, pieces in zip(self._pending, layout, strict=True)]

    def _zero_weights(self, name: str) -> bool:
        """Whether module `name` has parameters of its own, every one exactly zero. Read
        from the device (one count per parameter), only for a module whose output was
        constant, once per flush."""
        module = dict(self._targets).get(name)
        params = [p for _, p in own_parameters(module)] if module is not None else []
        with torch.no_grad():
            return bool(params) and all(int(torch.count_nonzero(p)) == 0 for p in params)

    def _flush(self) -> None:
        if not self._pending:
            return
        checked: dict[str, bool] = {}
        counted = self._count_nonfinite
        holders = self._holders
        records = self._records
        names = self._names_of
        for f, host in zip(self._pending, self._host_values(), strict=True):

            def finite(r: int, host: list[float] = host) -> bool:
                # An input is an earlier output, whose stats decide (counts, or -1 when
                # uncounted, and min/max in every case), or has a `finiteness` value.
                return math.isfinite(host[-1 - r]) if r < 0 else \
                    host[r + NANS] <= 0 and math.isfinite(host[r + MIN]) and \
                    math.isfinite(host[r + MAX])

            step = f.step
            given = self._input_rows.pop(step, None)
            model_finite = None if given is None else all(finite(r) for r in given)
            for p in f.calls:
                # One tensor out and one in is most calls: no generators then.
                leaves, rows = p.leaves, p.input_rows
                if len(leaves) == 1:
                    out = _leaf_stats(leaves[0], host, counted, names)
                    outs: tuple[TensorStats, ...] = (out,)
                    constant = out.finite and out.is_close_to_constant()
                else:
                    outs = tuple([_leaf_stats(leaf, host, counted, names) for leaf in leaves])
                    constant = any(s.finite and s.is_close_to_constant() for s in outs)
                inputs_finite = finite(rows[0]) if len(rows) == 1 else \
                    all(finite(r) for r in rows)
                if constant and p.module not in checked:
                    checked[p.module] = zero = self._zero_weights(p.module)
                    (self._zero_init.add if zero else self._zero_init.discard)(p.module)
                records.append(frozen_record(ActivationRecord, {
                    "module": p.module,
                    "module_type": p.module_type,
                    "step": step,
                    "call": p.call,
                    "order": p.order,
                    "outputs": outs,
                    "inputs_finite": inputs_finite,
                    "owns_params": p.module in holders,
                    "model_input": None if p.model_input is None
                    else _leaf_stats(p.model_input, host, counted, names),
                    "batch_stats": p.batch_stats,
                    "frozen": p.frozen,
                    "batch_ranks": p.batch_ranks,
                    "model_inputs_finite": model_finite,
                    "model_output": p.model_output,
                }))
        self._pending.clear()
        self._pending_calls = 0
        if self._keep_last is not None:
            self._bound()


# Autograd nodes walked back from the other outputs to tell whether one output feeds them.
_FEEDS_WALK = 256


def _feeds(t: torch.Tensor, returned: list[torch.Tensor]) -> bool:
    """Whether `t` feeds another of the tensors the model returned (an embedding returned
    beside the logits computed from it, through plain code such as `F.relu(feat)`): its
    autograd node is among theirs, walked back at most `_FEEDS_WALK` nodes. True where it
    cannot be told (no graph: a forward under no_grad, with other tensors returned) or the
    walk ends undecided, so that only an output known to end the graph is marked."""
    # A scalar returned beside it is the model's own loss, which reads the head as any
    # loss does: no layer of the model.
    others = [o for o in returned if o is not t and o.numel() > 1]
    if not others:
        return False  # nothing else it could feed
    node = t.grad_fn
    if node is None:
        return True
    starts = [o.grad_fn for o in others if o.grad_fn is not None]
    seen: set[int] = set()
    queue = deque(starts)
    while queue:
        n = queue.popleft()
        if n is node:
            return True
        if id(n) in seen:
            continue
        seen.add(id(n))
        if len(seen) > _FEEDS_WALK:
            return True
        queue.extend(nxt for nxt, _ in n.next_functions if nxt is not None)
    return False


_tuple_new = tuple.__new__


def _leaf_stats(leaf: _Leaf, host: list[float], counted: bool, names: dict[Any, str]
                ) -> TensorStats:
    """One leaf of a flushed call as `TensorStats`, from its forward's host values; `names`
    keeps `str()` of each dtype and device seen (a device's takes 0.5 us)."""
    path, shape, dtype, device, numel, at, di, udim, si, fused, fi, fdim = leaf
    units = di >= 0 or (si >= 0 and len(shape) >= 2)
    dtype_name = names.get(dtype)
    if dtype_name is None:
        dtype_name = names[dtype] = str(dtype)
    device_name = names.get(device)
    if device_name is None:
        device_name = names[device] = str(device)
    nans, infs = host[at + NANS], host[at + INFS]
    sat_units = host[si + 1] if si >= 0 else -1.0
    featured = fi >= 0 and host[fi + 2] >= 0  # measured, on 2 or more dims
    return frozen_record(TensorStats, {
        "path": path,
        "shape": shape,
        "dtype": dtype_name,
        "device": device_name,
        "numel": numel,
        "mean": host[at + MEAN],
        "std": host[at + STD],
        "min": host[at + MIN],
        "max": host[at + MAX],
        "norm": host[at + NORM],
        "zero_frac": host[at + ZEROS],
        "nan_count": int(nans) if counted and nans >= 0 else None,
        "inf_count": int(infs) if counted and infs >= 0 else None,
        "dead_units": int(host[di]) if di >= 0 else None,
        "channels": shape[udim] if units else None,
        "fused": fused,
        "unit_dim": (udim if udim == 1 else -1) if units else None,
        "saturated_frac": None if si < 0 else host[si] / numel if numel else 0.0,
        "saturated_units": int(sat_units) if sat_units >= 0 else None,
        "feature_dim": fdim if featured else None,
        "feature_rms_max": math.sqrt(host[fi]) if featured else None,
        "feature_rms_median": math.sqrt(host[fi + 1]) if featured else None,
        "feature_max_index": int(host[fi + 2]) if featured else None,
    })


def capture_activations(
    model: nn.Module | Step,
    inputs: Any = None,
    *,
    select: Selector = None,
    depth: int | None = None,
    store: Store = "stats",
    max_bytes: int | None = None,
    offload: bool = True,
    on_budget: OnBudget = "error",
    train: bool | None = None,
    grad: bool = False,
    count_nonfinite: bool = True,
) -> ActivationCapture:
    """Run one forward of a model on its inputs and capture every selected module's output.

    Args:
        model: any `nn.Module`, or a `Step`: then its forward runs as `step.forward()`, on
            the step's whole batch and under its autocast (leave `inputs` unset).
        inputs: a tensor, a tuple of positional inputs, a dict of keyword inputs, or
            `ModelInputs`.
        select, depth, store, max_bytes, offload, on_budget: as for `ActivationCapture`.
        train: put the model in train (True) or eval (False) mode for the capture; the old
            flags are restored. None leaves the mode as it is.
        grad: run the forward with autograd enabled.
        count_nonfinite: count NaN and Inf elements exactly (two extra passes per tensor);
            with False, finiteness and the NaN producer are still exact, counts are None.

    Returns:
        The finished `ActivationCapture`; its hooks are already removed, and
        `capture.findings()` judges what it recorded.

    Raises:
        ModelError: the model raised; hooks are removed and flags restored first.
        TorchscopeError: a model without inputs, or a `Step` together with inputs.

    Example:
        >>> step = torchscope.Step(model, x, autocast=torch.bfloat16)
        >>> torchscope.capture_activations(step).get("fc").output.dtype
        'torch.bfloat16'
    """
    step = Step.of(model, inputs)
    with watch_activations(
        step.model,
        select=select,
        depth=depth,
        store=store,
        max_bytes=max_bytes,
        offload=offload,
        on_budget=on_budget,
        count_nonfinite=count_nonfinite,
    ) as capture:
        if train is not None:
            capture.session.set_training(train)
        with torch.set_grad_enabled(grad):
            step.forward()
    return capture


def watch_activations(
    model: nn.Module,
    *,
    select: Selector = None,
    depth: int | None = None,
    store: Store = "stats",
    max_bytes: int | None = None,
    offload: bool = True,
    on_budget: OnBudget = "error",
    count_nonfinite: bool = True,
    keep_last: int | None = None,
) -> ActivationCapture:
    """Capture activations in your own loop; every forward inside the block is recorded.

    The hooks come off when the block ends, through an exception or a `KeyboardInterrupt`
    too. The arguments are those of `ActivationCapture`. Every forward adds one record per
    module call (deep-mlp: 16,000 records, about 12 MB, per 1,000 forwards), so for a
    long loop pass `keep_last=N` to keep the last N forwards; without it the capture warns
    once when it holds `GROWTH_WARNING_RECORDS` records.

    Returns:
        An `ActivationCapture` to use as a context manager: hooks go on at `with` and come
        off at its end; its records and `findings()` stay readable after the block.

    Example:
        >>> with torchscope.watch_activations(model, select="Conv2d") as acts:
        ...     for x, y in loader:
        ...         loss = F.cross_entropy(model(x), y)
        ...         loss.backward()
        >>> acts.last()[0].output.shape
    """
    return ActivationCapture(
        model,
        select=select,
        depth=depth,
        store=store,
        max_bytes=max_bytes,
        offload=offload,
        on_budget=on_budget,
        count_nonfinite=count_nonfinite,
        keep_last=keep_last,
    )
