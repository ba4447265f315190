"""Verification: the loss and every gradient with checkpointing vs without.

Both runs start from the same seed, so dropout draws the same masks; non-reentrant
checkpointing with `preserve_rng_state=True` replays that RNG state on recomputation, so
the recomputed masks match too. Both runs also start from the same buffers. The model's
gradients, buffers and the global RNG are restored afterwards.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch import nn

from torchscope._process import seeded
from torchscope.errors import VerificationError
from torchscope.memory.records import GradComparison, Verification
from torchscope.step import LossSpec, Step

__all__ = ["check", "verify"]


class Suspendable(Protocol):
    """What `verify` needs of checkpointing: a way to run without it (`CheckpointHandle`)."""

    def suspended(self) -> AbstractContextManager[None]:
        """Run without checkpointing inside the block."""
        ...


# (rtol, atol) past which a difference fails; bitwise equality is reported separately.
_TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-5, 1e-6),
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
}


def _run(step: Step, leaves: list[tuple[str, torch.Tensor]], seed: int) -> tuple[
        torch.Tensor, list[torch.Tensor | None], list[torch.Tensor]]:
    """One seeded forward + backward from the model's current state, which is restored
    after: (loss, gradients, buffers)."""
    with step.preserved(clear_grads=True), seeded(seed):
        loss = step.forward_backward()
        grads = [None if t.grad is None else t.grad.detach().clone() for _, t in leaves]
        return loss, grads, [b.detach().clone() for b in step.model.buffers()]


def _compare(name: str, ref: torch.Tensor | None, got: torch.Tensor | None) -> tuple[
        GradComparison, bool]:
    """The comparison and whether it is within tolerance."""
    if ref is None or got is None:
        equal = ref is None and got is None
        return GradComparison(name, equal, 0.0 if equal else float("inf"),
                              missing=ref is not None and got is None,
                              extra=ref is None and got is not None), equal
    if ref.shape != got.shape or ref.dtype != got.dtype:
        return GradComparison(name, False, float("inf")), False
    bitwise = bool(torch.equal(ref, got))
    if bitwise:
        return GradComparison(name, True, 0.0), True
    diff = (ref.double() - got.double()).abs()  # float64 so that the difference is exact
    max_diff = float(diff.max()) if diff.numel() else 0.0
    rtol, atol = _TOLERANCE.get(ref.dtype, (1e-5, 1e-6))
    close = bool(torch.allclose(got, ref, rtol=rtol, atol=atol, equal_nan=True))
    return GradComparison(name, False, max_diff), close


def verify(
    model: nn.Module | Step,
    handle: Suspendable,
    inputs: Any = None,
    *,
    loss_fn: LossSpec = "auto",
    target: Any = None,
    seed: int = 0,
) -> Verification:
    """Run one training step without and one with `handle`'s checkpointing and compare.

    Both runs are the step's `forward_backward`, start from the model as it is and from
    `torch.manual_seed(seed)`; the model, its gradients, buffers and the RNG are left as
    they were.

    Args:
        model: the model `handle` is installed on, or a `Step` on it.
        handle: the checkpointing (suspended for the reference run).
        inputs: tensor, tuple, dict or `ModelInputs`.
        loss_fn: the step's loss (see `torchscope.step`).
        target: its target; None draws seeded targets where the loss needs one.
        seed: both runs start from `torch.manual_seed(seed)`.

    Returns:
        The comparison; `check()` turns a failed one into a `VerificationError`.
    """
    step = Step.of(model, inputs, loss_fn=loss_fn, target=target)
    leaves = [*step.model.named_parameters(), *step.input_leaves()]
    with handle.suspended():
        ref_loss, ref_grads, ref_buffers = _run(step, leaves, seed)
    try:
        got_loss, got_grads, got_buffers = _run(step, leaves, seed)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        raise VerificationError(
            f"the checkpointed step raised {type(exc).__name__}: {first} "
            "(the same step without checkpointing ran fine).",
            fix="a checkpointed block must recompute exactly what it computed: do not "
            "mutate state in forward (Hugging Face models: call with use_cache=False).",
        ) from exc
    loss_cmp, loss_ok = _compare("loss", ref_loss, got_loss)
    grads: list[GradComparison] = []
    ok = loss_ok
    for (name, _), ref, got in zip(leaves, ref_grads, got_grads, strict=True):
        cmp, close = _compare(name, ref, got)
        grads.append(cmp)
        ok = ok and close
    buffers_equal = all(torch.equal(a, b) for a, b in zip(ref_buffers, got_buffers, strict=True))
    return Verification(
        loss_equal=loss_cmp.bitwise_equal,
        loss_abs_diff=loss_cmp.max_abs_diff,
        grads=tuple(grads),
        bitwise_equal=loss_cmp.bitwise_equal and all(g.bitwise_equal for g in grads),
        max_abs_diff=max([loss_cmp.max_abs_diff, *(g.max_abs_diff for g in grads)]),
        ok=ok,
        seed=seed,
        buffers_equal=buffers_equal,
    )


def check(v: Verification, *, require_bitwise: bool = False) -> Verification:
    """Return `v` if it passed; raise otherwise.

    Raises:
        VerificationError: a gradient is missing or extra, or a difference exceeds the
            dtype's tolerance (or, with `require_bitwise`, any difference at all).
    """
    missing = [g.name for g in v.grads if g.missing]
    extra = [g.name for g in v.grads if g.extra]
    if missing:
        raise VerificationError(
            f"with checkpointing, {len(missing)} gradient(s) that the normal step computes "
            f"are None: {', '.join(missing[:5])}.",
            fix="use non-reentrant checkpointing (torchscope does) and make sure checkpointed "
            "blocks return tensors that the loss uses.",
        )
    if extra:
        raise VerificationError(
            f"with checkpointing, {len(extra)} gradient(s) appear that the normal step does not "
            f"compute: {', '.join(extra[:5])}.",
            fix="check that the checkpointed blocks do not depend on global state.",
        )
    if not v.ok or (require_bitwise and not v.bitwise_equal):
        worst = max(v.grads, key=lambda g: g.max_abs_diff, default=None)
        where = (f"; largest gradient difference {worst.max_abs_diff:.3g} in {worst.name}"
                 if worst is not None and worst.max_abs_diff > 0 else "")
        raise VerificationError(
            f"checkpointing changed the result: loss differs by {v.loss_abs_diff:.3g}{where} "
            f"(seed {v.seed}); expected identical loss and gradients.",
            fix="look for randomness outside torch's RNG or state mutated in forward inside the "
            "checkpointed blocks, or exclude those blocks.",
        )
    return v
