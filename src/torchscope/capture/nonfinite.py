"""Analysis: where NaN/Inf first appears in a forward, and which modules only carry it on."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torchscope.capture.records import ActivationRecord


@dataclass(frozen=True)
class NonFiniteTrace:
    """Result of `trace_nonfinite` for one forward.

    Attributes:
        producer: the first call, in execution order, whose output holds NaN/Inf while all its
            tensor inputs were finite; None when the forward stayed finite.
        passers: later calls whose output is non-finite because an input already was.
        other_producers: later calls that created non-finite values from finite inputs too.
        inputs_finite: whether the model's own inputs were finite in that forward; None
            where that is not known.
        calls: every recorded call of that forward, in the order they finished.
    """

    producer: ActivationRecord | None
    passers: tuple[ActivationRecord, ...]
    other_producers: tuple[ActivationRecord, ...]
    inputs_finite: bool | None = None
    calls: tuple[ActivationRecord, ...] = ()

    @property
    def made_between(self) -> bool:
        """NaN/Inf with no producer among the recorded calls though the model's input was
        finite: code outside them made it (plain ops in a parent's forward, or a module
        the capture did not select) before `passers[0]` took it in."""
        return self.producer is None and bool(self.passers) and self.inputs_finite is True

    @property
    def entered_after(self) -> ActivationRecord | None:
        """With `made_between`, the last recorded call that finished finite before the first
        carrier started (not one inside it): the NaN/Inf was made after it. None otherwise."""
        if not self.made_between:
            return None
        first = self.passers[0]
        inside = first.module + "."
        earlier = [r for r in self.calls if r.order < first.order and r.finite
                   and r.module and not r.module.startswith(inside)]
        return earlier[-1] if earlier else None

    @property
    def clean(self) -> bool:
        """True when no recorded output held NaN or Inf."""
        return self.producer is None and not self.passers


def trace_nonfinite(records: Sequence[ActivationRecord], step: int | None = None) -> NonFiniteTrace:
    """Find the module that produced the first NaN/Inf of a forward.

    Args:
        records: activation records (from one or more forwards).
        step: which forward to read; default the last one in `records`.

    Returns:
        The producer (None when that forward stayed finite), the calls that only passed
        NaN/Inf on, and any later independent producers.
    """
    if not records:
        return NonFiniteTrace(None, (), ())
    step = records[-1].step if step is None else step
    calls = tuple(sorted((r for r in records if r.step == step), key=lambda r: r.order))
    producers = [r for r in calls if not r.finite and r.inputs_finite]
    passers = tuple(r for r in calls if not r.finite and not r.inputs_finite)
    given = calls[0].model_inputs_finite if calls else None
    if not producers:
        return NonFiniteTrace(None, passers, (), given, calls)
    # A container finishes after its children: a parent flagged as producer only because its
    # child produced the NaN is not another producer.
    first = producers[0]
    others = tuple(
        r
        for r in producers[1:]
        if not (first.module == "" or r.module == "" or first.module.startswith(r.module + "."))
    )
    parents = tuple(r for r in producers[1:] if r not in others)
    return NonFiniteTrace(first, passers + parents, others, given, calls)
