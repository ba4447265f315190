"""Shared helpers for the lint tests: fixture files and their `# expect:` annotations."""

from __future__ import annotations

import re
from pathlib import Path

from torchscope.findings import Severity
from torchscope.lint import RULES

FIXTURES = Path(__file__).parent / "fixtures"
# `# expect: TS001 TS002` (each at its rule's severity) or `# expect: TS002:info`.
_EXPECT = re.compile(r"#\s*expect:\s*(?P<codes>(?:TS\d{3}(?::\w+)?\s*)+)$")


def fixture_files() -> list[Path]:
    return sorted(FIXTURES.glob("ts*.py"))


def expected_with_severity(path: Path) -> set[tuple[int, str, Severity]]:
    """`{(line, code, severity)}` from the `# expect:` comments of a fixture file."""
    out: set[tuple[int, str, Severity]] = set()
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        match = _EXPECT.search(line)
        if match:
            for token in match.group("codes").split():
                code, _, level = token.partition(":")
                severity = Severity[level.upper()] if level else RULES[code].severity
                out.add((lineno, code, severity))
    return out


def expected(path: Path) -> set[tuple[int, str]]:
    """`{(line, code)}` from the `# expect: TS001 TS002` comments of a fixture file."""
    return {(line, code) for line, code, _ in expected_with_severity(path)}
