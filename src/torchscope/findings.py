"""`Finding`: what every analyzer returns, and what every renderer ranks and prints.

Every result type of every capability derives from `Analyzed`, so findings are read the same
way everywhere: `result.findings()` (or `result.findings(thresholds)`). The analysis itself
stays a pure function in its capability's `analyze` module, registered for its record type
with `@analyzer(RecordType)`; the record never imports its analyzer, so records stay below
analysis in the import graph.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from torchscope.errors import TorchscopeError

__all__ = ["Analyzed", "Finding", "Severity", "analyzer", "rank"]


class Severity(enum.IntEnum):
    """How much a finding matters; higher sorts first."""

    INFO = 0
    WARNING = 1
    ERROR = 2

    @property
    def label(self) -> str:
        """Lower-case name: `info`, `warning`, `error`."""
        return self.name.lower()


@dataclass(frozen=True)
class Finding:
    """One conclusion of an analyzer, with its evidence and a suggested fix.

    Attributes:
        code: stable identifier, `area.what` (e.g. `grads.vanishing`, `memory.checkpoint_plan`).
        severity: how much it matters.
        summary: one plain sentence, e.g. "conv1 (ReLU): 7 of 8 channels (88%) are zero for every
            sample and position".
        evidence: the numbers behind it, by name (unformatted).
        fix: what to do about it; empty when nothing needs doing.
        module: the module it concerns, when there is one.
    """

    code: str
    severity: Severity
    summary: str
    evidence: Mapping[str, float | int | str | bool | None] = field(default_factory=dict)
    fix: str = ""
    module: str | None = None


def rank(findings: Iterable[Finding]) -> list[Finding]:
    """Most severe first; stable within one severity."""
    return sorted(findings, key=lambda f: -int(f.severity))


Analyzer = Callable[..., list[Finding]]
_A = TypeVar("_A", bound=Analyzer)
_ANALYZERS: dict[type, Analyzer] = {}


def analyzer(record_type: type) -> Callable[[_A], _A]:
    """Register `fn(record, thresholds=None) -> list[Finding]` as the analyzer of a type.

    Subclasses of `record_type` use it too, unless they register their own.
    """

    def register(fn: _A) -> _A:
        _ANALYZERS[record_type] = fn
        return fn

    return register


class Analyzed:
    """Base of every result type: `findings()` runs the capability's registered analyzer."""

    __slots__ = ()

    def findings(self, thresholds: Any = None) -> list[Finding]:
        """What the capability's analyzer concludes from this result (pure, repeatable).

        Args:
            thresholds: the capability's thresholds object (e.g. `GradThresholds`); None
                uses its defaults.
        """
        for cls in type(self).__mro__:
            fn = _ANALYZERS.get(cls)
            if fn is not None:
                return fn(self, thresholds)
        raise TorchscopeError(
            f"no analyzer is registered for {type(self).__name__}.",
            fix="import the capability's package (e.g. torchscope.grads) before asking for "
            "findings.")
