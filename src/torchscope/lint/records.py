"""Lint records: what the checker found in a file, and files it could not check."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from torchscope.findings import Analyzed, Finding, Severity, declared
from torchscope.lint.rules import RULES


@dataclass(frozen=True)
class LintViolation:
    """One rule violation at one place.

    Attributes:
        path: the file, as given or found (relative paths stay relative).
        line: 1-based line of the flagged name.
        col: 1-based column (in characters) of the flagged name.
        end_line: 1-based last line of the flagged expression.
        end_col: 1-based column just after the flagged expression.
        code: rule code, e.g. `TS001`.
        message: what breaks, specific to this place.
        fix: what to do about it.
        severity: how sure the checker is that this place is the trap: the rule's
            severity, or lower (e.g. a hook handle discarded once at setup is `INFO`).
    """

    path: str
    line: int
    col: int
    end_line: int
    end_col: int
    code: str
    message: str
    fix: str
    severity: Severity

    def to_finding(self) -> Finding:
        """The same violation as a generic `Finding` (`code` = `lint.TS001`)."""
        return declared(f"lint.{self.code}").finding(
            self.severity, self.message,
            {"path": self.path, "line": self.line, "col": self.col,
             "rule": RULES[self.code].name},
            fix=self.fix)


@dataclass(frozen=True)
class LintError:
    """A file that could not be checked (unreadable, undecodable or unparsable).

    Attributes:
        path: the file.
        message: what went wrong, e.g. `cannot parse: invalid syntax`.
        line: 1-based line of a syntax error, or None.
        col: 1-based column of a syntax error, or None.
    """

    path: str
    message: str
    line: int | None = None
    col: int | None = None


@dataclass(frozen=True)
class LintResult(Analyzed):
    """Everything one lint run produced; `findings()` gives its violations as `Finding`s.

    Attributes:
        violations: sorted by path, line, column, code.
        errors: files that could not be checked.
        files: how many files were checked (errors included).
        codes: the rule codes that were enabled.
        notes: remarks about the run (e.g. a config file that could not be read).
        root: folder that relative paths and SARIF URIs are relative to.
    """

    violations: tuple[LintViolation, ...]
    errors: tuple[LintError, ...]
    files: int
    codes: frozenset[str]
    notes: tuple[str, ...] = ()
    root: str = "."

    @property
    def exit_code(self) -> int:
        """0 clean (info notes allowed), 1 a warning or an error, 2 a file could not be
        checked."""
        if self.errors:
            return 2
        return 1 if any(v.severity >= Severity.WARNING for v in self.violations) else 0

    def counts(self, *, notes: bool | None = None) -> dict[str, int]:
        """Violations per rule code, most frequent first.

        Args:
            notes: None counts every violation; True only info notes; False only warnings
                and errors.
        """
        chosen = [v for v in self.violations
                  if notes is None or (v.severity is Severity.INFO) == notes]
        return dict(Counter(v.code for v in chosen).most_common())
