"""`analyze_memory`: accounting, totals, measurement and (optionally) a verified plan."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

import torch
from torch import nn

from torchscope.errors import TorchscopeError
from torchscope.hooks.select import Selector
from torchscope.memory.checkpoint import (
    BlockSpec,
    default_blocks,
    no_blocks_message,
    resolve_blocks,
)
from torchscope.memory.measure import _measure, memory_totals
from torchscope.memory.planner import parse_bytes, plan_checkpointing, verify_plan
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
    repeats: int = 5,
    seed: int = 0,
    name: str | None = None,
    proposed: bool = False,
) -> MemoryReport:
    """What one training step keeps in memory, and what checkpointing would save.

    Every step it runs is the `Step`'s `forward_backward` (no optimizer step); the first,
    which counts the saved activations, gives `report.step` its loss value. The model is
    left exactly as it was: parameters, buffers, gradients, flags, optimizer state, RNG.

    A checkpoint plan never costs the analysis: when the model has no block sequence (and
    `blocks` is None) or no block with trainable work, `report.no_plan` says why; a plan
    that fails its verification, or keeps no less than no checkpointing, is in
    `report.plans` with `failed` set to the reason. The planning and verification steps run
    with model caches off (`use_cache=False`; `report.plans.notes` says so).

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
        measure: measure memory (and each plan's time against no checkpointing, and its
            peak), not only count.
        repeats: at least this many timed steps per plan (see `plan_checkpointing`).
        seed: seed of the verification runs.
        name: a label for the report (default: the model's class name).
        proposed: the plan is an offer the user did not ask for (the doctor's): a plan's
            caveats (buffers updated twice, gradients not bitwise equal, a failed
            verification) are then notes, not warnings.

    Raises:
        TorchscopeError: `checkpoint` is not one of the plans, or `repeats` is below 1.
        SelectionError: `select` matched nothing, `depth` is negative, or `blocks` was
            given and matched nothing.
        BudgetError: the budget is not a size, or cannot be met (the message names the
            smallest that can).

    Example:
        >>> report = torchscope.analyze_memory(DeepMLP(), torch.randn(32, 64), loss_fn="sum")
        >>> report.saved.total_bytes, report.step.loss
        (73728, 'sum of the output')
    """
    step = Step.of(model, inputs, loss_fn=loss_fn, target=target, optimizer=optimizer)
    if repeats < 1:
        raise TorchscopeError(f"repeats={repeats} times nothing; expected 1 or more.",
                              fix="pass repeats=1 or more.")
    if budget is not None and checkpoint == "none":
        checkpoint = "auto"
    if checkpoint not in ("none", "all", "sqrt", "auto"):
        raise TorchscopeError(f"checkpoint={checkpoint!r} is not a plan; expected 'none', "
                              "'all', 'sqrt' or 'auto'.",
                              fix="pass checkpoint='sqrt' (or 'all', 'auto', 'none').")
    if budget is not None and budget != "sqrt":
        parse_bytes(budget)  # a bad size fails before any work
    # Given blocks that match nothing fail before any work too.
    found = default_blocks(step.model) if blocks is None else resolve_blocks(step.model, blocks)
    checkpointable = () if found is None else found.names
    saved = saved_activations(step, select=select, depth=depth)
    assert saved.step is not None
    totals = memory_totals(step.model, saved, step.optimizer)
    measured = _measure(step) if measure else None
    report = MemoryReport(name or type(step.model).__name__, saved, totals, measured,
                          saved.step, checkpointable=checkpointable, proposed=proposed)
    if checkpoint == "none":
        return report
    if found is None:
        return replace(report, no_plan=no_blocks_message(step.model))
    plan_budget = budget if budget is not None else ("sqrt" if checkpoint == "auto" else None)
    plans = plan_checkpointing(step, blocks=blocks, budget=plan_budget, measure=measure,
                               repeats=repeats, seed=seed)
    chosen = _PLAN_OF[checkpoint]
    if not plans.has(chosen):
        reasons = sorted({reason for _, reason in plans.excluded})
        return replace(report, plans=plans, no_plan=(
            f"no block is left to checkpoint: all {len(plans.excluded)} have "
            f"{'; or '.join(reasons)}."))
    plan = plans.plan(chosen)
    measured_plan = plans.measurement(chosen)
    verification = None
    if measured_plan is not None:  # measured plans were verified when applied
        verification = measured_plan.verification
    elif plan.failed is None and plan.segments:
        outcome = verify_plan(step, plan, seed=seed)
        if isinstance(outcome, str):
            failed = replace(plan, status="unverified", failed=outcome)
            plans = replace(plans, plans=tuple(failed if p is plan else p
                                               for p in plans.plans))
        else:
            verification = outcome
    return replace(report, plans=plans, chosen=chosen, verification=verification)
