"""`analyze_memory`: accounting, totals, measurement and (optionally) a verified plan."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

import torch
from torch import nn

from torchscope.errors import TorchscopeError
from torchscope.hooks.select import Selector
from torchscope.memory.checkpoint import BlockSpec
from torchscope.memory.measure import _measure, memory_totals
from torchscope.memory.planner import apply_plan, parse_bytes, plan_checkpointing
from torchscope.memory.records import MemoryReport
from torchscope.memory.saved import saved_activations
from torchscope.step import LossSpec, Step

CheckpointChoice = Literal["none", "all", "sqrt", "auto"]
_PLAN_OF = {"all": "all", "sqrt": "sqrt", "auto": "budget"}


def analyze_memory(
    model: nn.Module | Step,
    inputs: Any = None,
    *,
    loss_fn: LossSpec = "auto",
    target: Any = None,
    optimizer: torch.optim.Optimizer | None = None,
    select: Selector = None,
    depth: int | None = None,
    checkpoint: CheckpointChoice = "none",
    budget: int | str | None = None,
    blocks: BlockSpec = None,
    measure: bool = True,
    repeats: int = 3,
    seed: int = 0,
    name: str | None = None,
) -> MemoryReport:
    """What one training step keeps in memory, and what checkpointing would save.

    Every step it runs is the `Step`'s `forward_backward` (no optimizer step); the first,
    which counts the saved activations, gives `report.step` its loss value. The model is
    left exactly as it was: parameters, buffers, gradients, flags, optimizer state, RNG.

    Args:
        model: the model, in the train/eval mode to analyse; or a `Step` (for AMP and
            accumulation; then pass no inputs or step options).
        inputs: tensor, tuple, dict or `ModelInputs`.
        loss_fn: the step's loss (see `torchscope.step`).
        target: its target; None draws seeded targets where the loss needs one.
        optimizer: adds its state (measured, or estimated before its first step).
        select: per-module rows for these modules: each storage counts for its nearest
            selected ancestor (see `saved_activations`).
        depth: per-module rows down to this depth.
        checkpoint: `none`; `all`, `sqrt` or `auto` plan checkpointing and verify the
            chosen plan (`auto` = least recompute within `budget`, by default within what
            the √L plan keeps).
        budget: saved-activation budget for `auto` (int bytes, `"64KB"`, or `"sqrt"`: what
            the √L plan keeps); implies `auto` when `checkpoint` is `none`.
        blocks: which blocks may be checkpointed (see `resolve_blocks`).
        measure: measure memory (and each plan's time and peak), not only count.
        repeats: timed repeats per plan.
        seed: seed of the verification runs.
        name: a label for the report (default: the model's class name).

    Raises:
        TorchscopeError: `checkpoint` is not one of the plans.
        SelectionError: `select` matched nothing, or `depth` is negative.
        BudgetError: the budget is not a size, or cannot be met (the message names the
            smallest that can).
        VerificationError: the chosen plan changed the loss or a gradient.

    Example:
        >>> report = torchscope.analyze_memory(DeepMLP(), torch.randn(32, 64), loss_fn="sum")
        >>> report.saved.total_bytes, report.step.loss
        (73728, 'sum of the output')
    """
    step = Step.of(model, inputs, loss_fn=loss_fn, target=target, optimizer=optimizer)
    if budget is not None and checkpoint == "none":
        checkpoint = "auto"
    if checkpoint not in ("none", "all", "sqrt", "auto"):
        raise TorchscopeError(f"checkpoint={checkpoint!r} is not a plan; expected 'none', "
                              "'all', 'sqrt' or 'auto'.",
                              fix="pass checkpoint='sqrt' (or 'all', 'auto', 'none').")
    if budget is not None and budget != "sqrt":
        parse_bytes(budget)  # a bad size fails before any work
    saved = saved_activations(step, select=select, depth=depth)
    assert saved.step is not None
    totals = memory_totals(step.model, saved, step.optimizer)
    measured = _measure(step) if measure else None
    report = MemoryReport(name or type(step.model).__name__, saved, totals, measured, saved.step)
    if checkpoint == "none":
        return report
    plan_budget = budget if budget is not None else ("sqrt" if checkpoint == "auto" else None)
    plans = plan_checkpointing(step, blocks=blocks, budget=plan_budget, measure=measure,
                               repeats=repeats, seed=seed)
    chosen = _PLAN_OF[checkpoint]
    measured_plan = plans.measurement(chosen)
    if measured_plan is not None:  # measured plans were verified when applied
        verification = measured_plan.verification
    else:
        with apply_plan(step, plans.plan(chosen), seed=seed) as handle:
            verification = handle.verification
    return replace(report, plans=plans, chosen=chosen, verification=verification)
