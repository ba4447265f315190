"""`analyze_memory`: accounting, totals, measurement and (optionally) a verified plan."""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from torchscope.errors import TorchscopeError
from torchscope.memory._step import LossFn
from torchscope.memory.analysis import analyze_plans, analyze_saved, analyze_totals
from torchscope.memory.checkpoint import BlockSpec
from torchscope.memory.measure import measure_step, memory_totals
from torchscope.memory.planner import apply_plan, plan_checkpointing
from torchscope.memory.records import MemoryReport, Verification
from torchscope.memory.saved import saved_activations
from torchscope.models.target import ModelInputs

__all__ = ["CheckpointChoice", "analyze_memory"]

CheckpointChoice = Literal["none", "all", "sqrt", "auto"]
_PLAN_OF = {"all": "all", "sqrt": "sqrt", "auto": "budget"}


def analyze_memory(
    model: nn.Module,
    inputs: Any,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    loss_fn: LossFn | None = None,
    checkpoint: CheckpointChoice = "none",
    budget: int | str | None = None,
    blocks: BlockSpec = None,
    measure: bool = True,
    repeats: int = 3,
    seed: int = 0,
    name: str | None = None,
) -> MemoryReport:
    """What one training step keeps in memory, and what checkpointing would save.

    Args:
        model: the model, in the train/eval mode to analyse; left exactly as it was.
        inputs: tensor, tuple, dict or `ModelInputs`.
        optimizer: adds its state (measured, or estimated before its first step).
        loss_fn: maps the output to the scalar loss.
        checkpoint: `none`; `all`, `sqrt` or `auto` plan checkpointing and verify the
            chosen plan (`auto` = least recompute within `budget`, by default within what
            the √L plan keeps).
        budget: saved-activation budget for `auto` (int bytes or `"64KB"`); implies `auto`
            when `checkpoint` is `none`.
        blocks: which blocks may be checkpointed (see `resolve_blocks`).
        measure: measure memory (and each plan's time and peak), not only count.
        repeats: timed repeats per plan.
        seed: seed of the verification runs.
        name: a label for the report (default: the model's class name).

    Raises:
        TorchscopeError: `checkpoint` is not one of the plans.
        BudgetError: the budget cannot be met (the message names the smallest that can).
        VerificationError: the chosen plan changed the loss or a gradient.
    """
    model_inputs = ModelInputs.of(inputs)
    if budget is not None and checkpoint == "none":
        checkpoint = "auto"
    if checkpoint not in ("none", "all", "sqrt", "auto"):
        raise TorchscopeError(f"checkpoint={checkpoint!r} is not a plan; expected 'none', "
                              "'all', 'sqrt' or 'auto'.",
                              fix="pass checkpoint='sqrt' (or 'all', 'auto', 'none').")
    saved = saved_activations(model, model_inputs, loss_fn=loss_fn)
    totals = memory_totals(model, saved, optimizer)
    measured = measure_step(model, model_inputs, loss_fn=loss_fn) if measure else None
    findings = [*analyze_saved(saved), *analyze_totals(totals, measured)]
    plans = None
    chosen = None
    verification: Verification | None = None
    if checkpoint != "none":
        plan_budget = budget if budget is not None else ("sqrt" if checkpoint == "auto" else None)
        plans = plan_checkpointing(model, model_inputs, blocks=blocks, budget=plan_budget,
                                   loss_fn=loss_fn, measure=measure, repeats=repeats, seed=seed)
        chosen = _PLAN_OF[checkpoint]
        measured_plan = plans.measurement(chosen)
        if measured_plan is not None:  # measured plans were verified when applied
            verification = measured_plan.verification
        else:
            with apply_plan(model, plans.plan(chosen), model_inputs, loss_fn=loss_fn,
                            seed=seed) as handle:
                verification = handle.verification
        findings += analyze_plans(plans, chosen)
    return MemoryReport(name or type(model).__name__, saved, totals, measured, plans, chosen,
                        tuple(findings), verification)
