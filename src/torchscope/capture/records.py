"""Frozen records that activation capture produces. They hold numbers, never formatted text."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from torchscope.distributed.ranked import Gatherable
from torchscope.findings import Analyzed


@dataclass(frozen=True)
class TensorStats:
    """Statistics of one tensor leaf of a module's output.

    Attributes:
        path: where the tensor sits in the output (`""` for a bare tensor, `[0]`, `['logits']`).
        shape, dtype, device, numel: as torch reports them (`dtype` like `torch.float32`).
        mean, std, min, max: over all elements; `std` is unbiased, as `Tensor.std()`.
        norm: the L2 norm of the flattened tensor.
        zero_frac: fraction of elements exactly zero (NaN when uncounted NaNs hide it).
        nan_count, inf_count: non-finite elements; None when not counted (capture with
            `count_nonfinite=False`), in which case `finite` still holds exactly, from min/max.
        dead_units: for ReLU-family outputs of rank >= 2, units that are zero for every
            sample and position; None where not measured. The units are dim 1 after a
            convolution (N, C, ...) and the last dim after a linear layer (N, ..., C): see
            `unit_dim`.
        channels: the number of units when `dead_units` or `saturated_units` is measured.
        fused: True when the fused kernel reduced it in one pass (`torchscope._kernels`),
            False when eager ops did (the kernel was still building, or cannot run here).
        unit_dim: the dimension that holds the units when `channels` is set: 1, or -1 for
            the last of 3 or more dims (read from the layers beside the module:
            `torchscope.capture.units`).
        saturated_frac: for bounded activations (Tanh, Sigmoid, Softsign, Hardtanh,
            Hardsigmoid, a tanh RNN or RNNCell), the fraction of values in the saturated
            tails, where the local gradient is below 5 % of its peak (|y| >= 0.975 for
            tanh) or zero; None where not measured.
        saturated_units: of those outputs with 2 or more dims, the units whose every value
            (every sample and position) is in the tails.
        feature_dim: for a model input (`ActivationRecord.model_input`), the dim that holds
            its features: -1 (the last, a Linear's columns) or 1 (a convolution's
            channels); None elsewhere.
        feature_rms_max, feature_rms_median: the RMS of its largest feature and of its
            median feature, over every sample and position.
        feature_max_index: which feature is the largest.
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    device: str
    numel: int
    mean: float
    std: float
    min: float
    max: float
    norm: float
    zero_frac: float
    nan_count: int | None
    inf_count: int | None
    dead_units: int | None = None
    channels: int | None = None
    fused: bool = False
    unit_dim: int | None = None
    saturated_frac: float | None = None
    saturated_units: int | None = None
    feature_dim: int | None = None
    feature_rms_max: float | None = None
    feature_rms_median: float | None = None
    feature_max_index: int | None = None

    @property
    def finite(self) -> bool:
        """True when the tensor holds no NaN and no Inf."""
        if self.nan_count is None or self.inf_count is None:
            return (math.isfinite(self.min) and math.isfinite(self.max)) or self.numel == 0
        return self.nan_count == 0 and self.inf_count == 0

    @property
    def nonfinite(self) -> int | None:
        """NaN plus Inf elements (None when not counted)."""
        if self.nan_count is None or self.inf_count is None:
            return None
        return self.nan_count + self.inf_count

    @property
    def nbytes(self) -> int:
        """Size of the tensor in bytes."""
        itemsize = torch.empty((), dtype=getattr(torch, self.dtype.split(".")[-1])).element_size()
        return self.numel * itemsize

    def is_close_to_constant(self) -> bool:
        """True when every element is equal (zero spread)."""
        return self.numel > 1 and (self.std == 0.0 or math.isclose(self.min, self.max))


@dataclass(frozen=True)
class ActivationRecord:
    """One call of one module during one forward.

    Attributes:
        module: qualified name ("" is the root).
        module_type: the module's class name.
        step: which forward of the capture this call belongs to (0-based).
        call: how many times this module ran before in the same forward (0 for the first).
        order: position of this call among all recorded calls of the forward, in the order
            the calls finished.
        outputs: statistics of each tensor leaf of the output.
        inputs_finite: whether every tensor input was free of NaN and Inf.
        owns_params: whether the module (not the root) has parameters of its own, not
            only in children (`torchscope.hooks.select.holds_parameters`): its output is
            its own computation even when children ran inside it.
        model_input: for a Linear or convolution whose first input is the model's own
            input, a float tensor the model was called with, as it is: that input's
            statistics (what the data pipeline feeds the first layer); None otherwise.
        batch_stats: for a BatchNorm, whether it normalised this call with the batch's own
            statistics (training mode, or no running statistics kept); False otherwise.
        frozen: for a BatchNorm in training mode that keeps running statistics, whether its
            own weight is frozen (`requires_grad=False`): its running statistics still move
            with every batch. False otherwise.
        batch_ranks: for a SyncBatchNorm that normalised over its process group (training,
            more than one rank), the group's size: its statistics cover that many ranks'
            batches. 1 otherwise.
        model_inputs_finite: whether the tensors the model was called with in this forward
            were free of NaN and Inf (integer inputs always are); the same for every record
            of the forward, None where the capture did not see the model's call.
        model_output: whether this call's output is (one of) the tensors the model's
            forward returned, as it is (a classifier's or regressor's head): its scale is
            what the loss asks of it.
    """

    module: str
    module_type: str
    step: int
    call: int
    order: int
    outputs: tuple[TensorStats, ...]
    inputs_finite: bool
    owns_params: bool = False
    model_input: TensorStats | None = None
    batch_stats: bool = False
    frozen: bool = False
    batch_ranks: int = 1
    model_inputs_finite: bool | None = None
    model_output: bool = False

    @property
    def output(self) -> TensorStats | None:
        """The first tensor of the output, or None when the output holds no tensor."""
        return self.outputs[0] if self.outputs else None

    @property
    def finite(self) -> bool:
        """True when every output tensor is finite."""
        return all(s.finite for s in self.outputs)

    @property
    def key(self) -> str:
        """`module#call`, unique within a forward."""
        return f"{self.module}#{self.call}"

    @property
    def label(self) -> str:
        """The call in words: `lin`, `lin (call 2)` for its second call in the forward,
        `<root>` for the model itself."""
        name = self.module or "<root>"
        return name if self.call == 0 else f"{name} (call {self.call + 1})"


@dataclass(frozen=True)
class ReductionPaths:
    """Which path reduced a capture's tensors: the fused kernel or eager ops, and why eager.

    Attributes:
        fused: output tensors reduced by the fused kernel, in one pass each.
        eager: output tensors reduced by eager ops.
        reasons: why the eager ones were, one line per distinct reason (for example the
            kernel still building in the background, or a dtype it does not reduce).
    """

    fused: int
    eager: int
    reasons: tuple[str, ...] = ()

    def describe(self) -> str:
        """`statistics: 27 fused, 2 eager (dtype torch.int64 ...)` in one line."""
        why = f" ({'; '.join(self.reasons)})" if self.reasons else ""
        return f"statistics: {self.fused} fused, {self.eager} eager{why}"


@dataclass(frozen=True)
class ActivationRecords(Analyzed, Gatherable):
    """A capture's records as a plain result: no hooks, no model, picklable.

    `ActivationCapture.result()` returns it; `gather()` brings every rank's to rank 0 as one
    `Ranked` result. Its findings are the capture's (`torchscope.capture` analyzes both).

    Attributes:
        records: every record, in forward order then call-completion order.
        weighted: captured modules with weights that set the scale of what follows.
        paths: which path reduced the tensors (fused kernel or eager ops).
        zero_init: captured modules whose output was constant and whose own parameters
            were all exactly zero when the records were read: a deliberate zero init
            (LoRA's B, a residual branch's last norm gain, a position-bias table), not a
            broken layer.
    """

    records: tuple[ActivationRecord, ...]
    weighted: frozenset[str] = frozenset()
    paths: ReductionPaths | None = None
    zero_init: frozenset[str] = frozenset()
