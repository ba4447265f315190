"""`Finding`: what every analyzer returns, and what every renderer ranks and prints."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = ["Finding", "Severity", "rank"]


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
        summary: one plain sentence, e.g. "conv1 receives 67× less gradient than fc".
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
