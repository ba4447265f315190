"""Gradient checkpointing, reversible and verified: `torchscope.checkpointing.apply(model)`.

A thin public front for `torchscope.memory`'s checkpointing:

    >>> import torchscope.checkpointing as ckpt
    >>> with ckpt.apply(model, blocks="transformer.h", example_inputs=batch) as h:
    ...     assert h.verification.bitwise_equal
    ...     model(**batch).loss.backward()
    >>> report = ckpt.plan(model, batch, budget="2GB")
    >>> handle = ckpt.apply_plan(model, report.plan("budget"), batch)  # always verified
    >>> handle.remove()  # the model is exactly as before
"""

from torchscope.memory.checkpoint import Blocks, BlockSpec, CheckpointHandle, apply, resolve_blocks
from torchscope.memory.planner import apply_plan, parse_bytes
from torchscope.memory.planner import plan_checkpointing as plan
from torchscope.memory.records import CheckpointPlan, PlanReport, Verification
from torchscope.memory.verify import check, verify

__all__ = [
    "BlockSpec",
    "Blocks",
    "CheckpointHandle",
    "CheckpointPlan",
    "PlanReport",
    "Verification",
    "apply",
    "apply_plan",
    "check",
    "parse_bytes",
    "plan",
    "resolve_blocks",
    "verify",
]
