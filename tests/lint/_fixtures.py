"""Shared helpers for the lint tests: fixture files and their `# expect:` annotations."""

from __future__ import annotations

import re
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures"
_EXPECT = re.compile(r"#\s*expect:\s*(?P<codes>(?:TS\d{3}\s*)+)$")


def fixture_files() -> list[Path]:
    return sorted(FIXTURES.glob("ts*.py"))


def expected(path: Path) -> set[tuple[int, str]]:
    """`{(line, code)}` from the `# expect: TS001 TS002` comments of a fixture file."""
    out: set[tuple[int, str]] = set()
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        match = _EXPECT.search(line)
        if match:
            out |= {(lineno, code) for code in match.group("codes").split()}
    return out
