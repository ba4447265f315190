"""Measured memory of one forward + backward, and the totals a training step holds.

On CUDA the caching allocator's own counters are read: `reset_peak_memory_stats()` before the
step, `max_memory_allocated()` / `max_memory_reserved()` after it. Allocated is what tensors
occupy; reserved is what the allocator holds from the driver (allocated plus its cache).

On CPU there is no allocator counter, so `torch.profiler` runs with `profile_memory=True` and
its `[memory]` events (one per allocation and free made by a tensor op in the step, with the
signed byte count) are summed in time order. The running sum's maximum is the peak of memory
allocated *during* the step above what was allocated when it began: parameters, inputs and
anything allocated earlier are not in it, and neither are allocations that bypass the c10 CPU
allocator (Python objects, some third-party kernels' scratch memory).

Bytes are what this rank holds: a DTensor (FSDP2's sharded parameters, gradients and
optimizer state) counts its local shard. `rank_bytes` sets those against what the same model
would hold on every rank under DDP.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchscope._process import quiet_kineto
from torchscope.distributed.world import local_tensor, strategy_of
from torchscope.hooks.parallel import parallel_wrapper
from torchscope.memory._common import storage_keys
from torchscope.memory.records import MeasuredMemory, MemoryTotals, SavedActivations
from torchscope.step import LossSpec, Step, synchronize

_CPU = torch.autograd.DeviceType.CPU  # type: ignore[attr-defined]


def measure_step(
    model: nn.Module | Step,
    inputs: Any = None,
    *,
    loss_fn: LossSpec = "auto",
    target: Any = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> MeasuredMemory:
    """Measure the memory of one training step's forward + backward (`Step.forward_backward`;
    no optimizer step). The model is left exactly as it was, gradients and buffers included.

    Args:
        model: the model (its device decides the method), or a `Step`.
        inputs: tensor, tuple, dict or `ModelInputs`.
        loss_fn: the step's loss (see `torchscope.step`).
        target: the loss target; None draws seeded targets where the loss needs one.
        optimizer: recorded in `step` (not stepped).
    """
    return _measure(Step.of(model, inputs, loss_fn=loss_fn, target=target, optimizer=optimizer))


def _measure(step: Step) -> MeasuredMemory:
    device = step.device
    if device.type == "cuda":
        with step.preserved(clear_grads=True):
            synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            loss = step.forward_backward()
            synchronize(device)
            peak = torch.cuda.max_memory_allocated(device)
            end = torch.cuda.memory_allocated(device)
            reserved = torch.cuda.memory_reserved(device)
            peak_reserved = torch.cuda.max_memory_reserved(device)
        return MeasuredMemory(str(device), "cuda-allocator", base, peak, peak - base, end,
                              reserved, peak_reserved, step=step.info(loss))
    from torch.profiler import ProfilerActivity, profile

    # Kineto prints profiler_start/stop lines unless its log level is raised before start.
    with step.preserved(clear_grads=True), quiet_kineto(), profile(
            activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = step.forward_backward()
    # Every CPU allocation (+bytes) and free (-bytes) the profiler recorded, in time order.
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == _CPU)
    running = peak = 0
    for _, nbytes in events:
        running += nbytes
        peak = max(peak, running)
    return MeasuredMemory(str(device), "cpu-profiler", 0, peak, peak, running,
                          step=step.info(loss))


def _unique_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages among `tensors` (of a DTensor: its local shard)."""
    return sum(storage_keys([local_tensor(t) for t in tensors]).values())


def _whole_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of `tensors` held whole (a DTensor at its global size), each tensor once."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


# Per-parameter state tensors of the same size as the parameter, by optimizer class, as a
# function of its param-group options; used before the first step fills `optimizer.state`.
def _state_multiplier(opt: torch.optim.Optimizer, group: dict[str, Any]) -> float | None:
    name = type(opt).__name__
    if name in ("Adam", "AdamW", "NAdam", "RAdam", "Adamax"):
        return 2.0 + bool(group.get("amsgrad"))
    if name == "SGD":
        return float(bool(group.get("momentum", 0)))
    if name == "RMSprop":
        return 1.0 + bool(group.get("momentum", 0)) + bool(group.get("centered"))
    if name == "Adagrad":
        return 1.0
    if name in ("Adadelta", "Rprop", "ASGD"):
        return 2.0
    return None


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> tuple[int | None, str]:
    """Bytes of the optimizer's state and how they were found.

    `measured` when `optimizer.state` is populated (after a step), else `estimated` from the
    optimizer type (Adam keeps 2 tensors per parameter, SGD with momentum 1, ...), or
    `unknown` for an optimizer type not in that table.
    """
    tensors = [v for state in optimizer.state.values() for v in state.values()
               if isinstance(v, torch.Tensor)]
    if tensors:
        return _unique_bytes(tensors), "measured"
    total = 0.0
    for group in optimizer.param_groups:
        mult = _state_multiplier(optimizer, group)
        if mult is None:
            return None, "unknown"
        params = [p for p in group["params"] if p.requires_grad]
        total += mult * _unique_bytes(params)
    return int(total), "estimated"


def memory_totals(model: nn.Module, saved: SavedActivations,
                  optimizer: torch.optim.Optimizer | None = None) -> MemoryTotals:
    """Parameters, buffers, gradients, optimizer state, saved activations and the estimated
    peak (see `MemoryTotals`) of a step that saved `saved`."""
    params = storage_keys([local_tensor(p) for p in model.parameters()])
    p_bytes = sum(params.values())
    # A buffer that shares a parameter's storage is already counted with the parameters.
    b_bytes = sum(n for k, n in storage_keys(list(model.buffers())).items() if k not in params)
    g_bytes = _unique_bytes(p for p in model.parameters() if p.requires_grad)
    opt_bytes, source = (optimizer_state_bytes(optimizer) if optimizer is not None
                         else (None, "none"))
    step = saved.total_bytes + saved.output_bytes + g_bytes
    peak = p_bytes + b_bytes + (opt_bytes or 0) + step
    return MemoryTotals(p_bytes, b_bytes, g_bytes, opt_bytes, source, saved.total_bytes,
                        saved.output_bytes, peak, step)


@dataclass(frozen=True)
class RankBytes:
    """The model state one rank holds, against the same model held whole on every rank (DDP).

    Attributes:
        strategy: `ddp`, `fsdp2` or `none`.
        parameters: bytes of parameters on this rank (FSDP2: its shards).
        gradients: bytes of the gradients of trainable parameters (FSDP2: sharded).
        optimizer_state: bytes of optimizer state (measured after a step, else estimated;
            None for an optimizer whose state is unknown, or without one).
        buckets: DDP's gradient buckets: one more copy of the gradients, unless DDP was
            built with `gradient_as_bucket_view=True`; 0 otherwise.
        replicated_parameters: parameters held whole, as under DDP.
        replicated_gradients: gradients held whole.
        replicated_optimizer_state: optimizer state for whole parameters.
        replicated_buckets: DDP's default buckets for the whole gradients.
    """

    strategy: str
    parameters: int
    gradients: int
    optimizer_state: int | None
    buckets: int
    replicated_parameters: int
    replicated_gradients: int
    replicated_optimizer_state: int | None
    replicated_buckets: int

    @property
    def total(self) -> int:
        """Everything this rank holds for the model's state."""
        return self.parameters + self.gradients + (self.optimizer_state or 0) + self.buckets

    @property
    def replicated_total(self) -> int:
        """What every rank would hold under DDP (default buckets)."""
        return (self.replicated_parameters + self.replicated_gradients
                + (self.replicated_optimizer_state or 0) + self.replicated_buckets)

    @property
    def saving(self) -> float:
        """`replicated_total / total`: how many times less this rank holds than under DDP."""
        return self.replicated_total / self.total if self.total else 1.0


def rank_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> RankBytes:
    """The bytes of model state this rank holds, and what DDP would hold for the same model.

    Args:
        model: the model as trained: a DDP wrapper, an FSDP2-sharded model, or a plain one.
        optimizer: its optimizer (state measured when populated, else estimated by type).
    """
    strategy = strategy_of(model)
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    opt_bytes, source = optimizer_state_bytes(optimizer) if optimizer is not None else \
        (None, "none")
    p_local, g_local = _unique_bytes(params), _unique_bytes(trainable)
    p_whole, g_whole = _whole_bytes(params), _whole_bytes(trainable)
    if optimizer is not None and source == "measured":
        opt_whole: int | None = _whole_bytes(
            v for state in optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor))
    else:  # estimated per parameter, so in proportion to the parameters
        opt_whole = None if opt_bytes is None else (
            round(opt_bytes * p_whole / p_local) if p_local else opt_bytes)
    wrapper = parallel_wrapper(model)
    bucket_view = bool(getattr(wrapper, "gradient_as_bucket_view", False))
    buckets = g_local if strategy == "ddp" and not bucket_view else 0
    return RankBytes(strategy, p_local, g_local, opt_bytes, buckets, p_whole, g_whole,
                     opt_whole, g_whole)
