"""The lab's analyzer: a claim that did not hold here is a warning, one not checked an info."""

from __future__ import annotations

from typing import Any

from torchscope.catalogue import entry
from torchscope.findings import Finding, Severity, analyzer
from torchscope.lab.records import LabResult

__all__ = ["lab_findings"]

_CLAIM_FAILED = entry("lab.claim_failed")
_CLAIM_UNCHECKED = entry("lab.claim_unchecked")


@analyzer(LabResult)
def lab_findings(result: LabResult, thresholds: Any = None) -> list[Finding]:
    """One finding per claim that failed (`lab.claim_failed`) or was not checked
    (`lab.claim_unchecked`), in the lab's order; claims that held are not findings.

    Args:
        result: the lab run.
        thresholds: unused (kept for the common signature).
    """
    out = []
    for c in result.claims:
        if c.held is True:
            continue
        failed = c.held is False
        made = _CLAIM_FAILED if failed else _CLAIM_UNCHECKED
        out.append(made.finding(
            Severity.WARNING if failed else Severity.INFO,
            f"{c.milestone}: {c.claim}" + (f" (measured {c.measured!r}, expected "
                                           f"{c.expected!r})" if failed else " (not checked)"),
            {"milestone": c.milestone, "measured": repr(c.measured),
             "expected": repr(c.expected)},
            fix=c.note))
    return out
