"""The lint analyzer: a lint run's violations as generic `Finding`s (`lint.TS00x`).

Registered for `LintResult`, so `lint_paths(...).findings()` reads like every other
capability's result.
"""

from __future__ import annotations

from typing import Any

from torchscope.findings import Finding, analyzer
from torchscope.lint.records import LintResult

__all__ = ["lint_findings"]


@analyzer(LintResult)
def lint_findings(result: LintResult, thresholds: Any = None) -> list[Finding]:
    """One `Finding` per violation, in the run's order (path, line, column, code).

    Args:
        result: the lint run.
        thresholds: unused; lint rules have no thresholds (kept for the common signature).
    """
    return [v.to_finding() for v in result.violations]
