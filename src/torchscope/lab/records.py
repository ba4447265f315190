"""Frozen records of a lab run: the lesson's tables refilled, and each claim's verdict."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchscope.findings import Analyzed

__all__ = ["LabClaim", "LabResult", "LabTable"]


@dataclass(frozen=True)
class LabClaim:
    """One claim of the lesson and what this machine measured.

    Attributes:
        milestone: which part of the lesson it belongs to.
        claim: the claim, in the lesson's words where possible.
        expected: the value the lesson states or implies.
        measured: what was measured here (None when not checked).
        held: True/False, or None when not checked.
        note: how it was measured, or why it was not checked.
    """

    milestone: str
    claim: str
    expected: Any
    measured: Any
    held: bool | None
    note: str = ""


@dataclass(frozen=True)
class LabTable:
    """One of the lesson's comparison tables, refilled with measured values."""

    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[Any, ...], ...]


@dataclass(frozen=True)
class LabResult(Analyzed):
    """Every table and claim of a lab run; `findings()` names the claims that did not hold
    on this machine (warning) and those that could not be checked here (info)."""

    milestones: tuple[LabTable, ...]
    claims: tuple[LabClaim, ...]

    @property
    def held(self) -> int:
        """Claims that held."""
        return sum(1 for c in self.claims if c.held is True)

    @property
    def failed(self) -> int:
        """Claims that failed."""
        return sum(1 for c in self.claims if c.held is False)

    @property
    def unchecked(self) -> int:
        """Claims not checked here."""
        return sum(1 for c in self.claims if c.held is None)
