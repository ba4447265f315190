"""The catalogue of findings (torchscope.catalogue): every code declared once, analyzers
emit only through entries, the report's order reads the entries, and `torchscope explain`
prints them. That every declared code is emitted by some test is checked at the end of a
full run (tests/conftest.py)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

import torchscope.catalogue as catalogue
import torchscope.lint
from torchscope.cli import app
from torchscope.findings import _DECLARED, Entry, Finding, Severity, Subject, rank
from torchscope.lint import RULES

SRC = Path(__file__).resolve().parents[1] / "src" / "torchscope"
runner = CliRunner()
CODE = re.compile(r"^[a-z][a-z0-9_]*\.[A-Za-z0-9_]+$")


def _calls(name: str) -> list[tuple[Path, int, ast.Call]]:
    out = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call):
                fn = node.func
                called = fn.id if isinstance(fn, ast.Name) else \
                    fn.attr if isinstance(fn, ast.Attribute) else None
                if called == name:
                    out.append((path, node.lineno, node))
    return out


def test_analyzers_make_findings_only_through_entries() -> None:
    direct = [f"{p.relative_to(SRC)}:{line}" for p, line, _ in _calls("Finding")
              if p.name != "findings.py"]
    assert not direct, f"Finding(...) made outside the catalogue's entries: {direct}"


def test_every_code_an_analyzer_names_is_declared() -> None:
    named = {(p.relative_to(SRC), line, node.args[0].value)
             for fn in ("entry", "declared") for p, line, node in _calls(fn)
             if node.args and isinstance(node.args[0], ast.Constant)
             and isinstance(node.args[0].value, str)}
    assert named, "no analyzer reads the catalogue"
    undeclared = sorted(f"{p}:{line} {code}" for p, line, code in named
                        if code not in _DECLARED)
    assert not undeclared, undeclared


def test_entries_are_complete() -> None:
    entries = catalogue.entries()
    assert len(entries) > len(RULES)
    for e in entries:
        assert CODE.match(e.code), e.code
        assert e.title and e.meaning and e.criterion and e.severity, e.code
        assert isinstance(e.subject, Subject), e.code
        assert all(c in _DECLARED for c in e.explains), (e.code, e.explains)
        assert e.code not in e.explains, e.code
        if e.subject is Subject.MEASUREMENT:
            assert e.levels == {Severity.INFO}, e.code
    # Every lint rule is in the catalogue under its report code.
    assert {f"lint.{c}" for c in RULES} <= {e.code for e in entries}


def test_a_measurement_caveat_cannot_be_a_warning() -> None:
    with pytest.raises(torchscope.TorchscopeError, match="never a warning"):
        Entry("x.caveat", "a caveat", Subject.MEASUREMENT, frozenset({Severity.WARNING}),
              "warning", "m", "c")


def test_a_finding_outside_its_entry_s_levels_or_undeclared_is_refused() -> None:
    info_only = next(e for e in catalogue.entries() if e.levels == {Severity.INFO})
    with pytest.raises(torchscope.TorchscopeError, match="allows info"):
        info_only.finding(Severity.ERROR, "too loud")
    with pytest.raises(torchscope.TorchscopeError, match="not in the catalogue"):
        catalogue.entry("grads.no_such_code")


def _entry(code: str, subject: Subject, explains: tuple[str, ...] = ()) -> Entry:
    levels = frozenset({Severity.INFO}) if subject is Subject.MEASUREMENT else frozenset(Severity)
    return Entry(code, code, subject, levels, "any", "m", "c", explains=explains)


def test_rank_puts_the_user_s_work_first_and_a_cause_before_its_symptoms(
        monkeypatch: pytest.MonkeyPatch) -> None:
    entries = [_entry("t.caveat", Subject.MEASUREMENT), _entry("t.env", Subject.ENVIRONMENT),
               _entry("t.symptom", Subject.MODEL),
               _entry("t.cause", Subject.LOOP, explains=("t.symptom",)),
               _entry("t.other", Subject.DATA)]
    for e in entries:
        monkeypatch.setitem(_DECLARED, e.code, e)
    caveat = Finding("t.caveat", Severity.INFO, "s", subject=Subject.MEASUREMENT)
    env = Finding("t.env", Severity.ERROR, "s", subject=Subject.ENVIRONMENT)
    symptom = Finding("t.symptom", Severity.ERROR, "s", subject=Subject.MODEL)
    cause = Finding("t.cause", Severity.INFO, "s", subject=Subject.LOOP)
    other = Finding("t.other", Severity.WARNING, "s", subject=Subject.DATA)
    # The cause ranks at its worst symptom's severity, ahead of it; an environment error
    # and a measurement note come after every finding about the user's work.
    assert rank([caveat, env, other, symptom, cause]) == [cause, symptom, other, env, caveat]


def test_explain_lists_every_code_one_per_line() -> None:
    result = runner.invoke(app, ["explain"])
    assert result.exit_code == 0, result.output
    codes = [line.split()[0] for line in result.output.splitlines() if line.strip()]
    assert codes == [e.code for e in catalogue.entries()]
    assert {f"lint.{c}" for c in RULES} <= set(codes)


def test_explain_prints_an_entry() -> None:
    e = next(e for e in catalogue.entries() if not e.code.startswith("lint."))
    result = runner.invoke(app, ["explain", e.code])
    assert result.exit_code == 0, result.output
    out = result.output
    assert out.startswith(f"# {e.code}: {e.title}")
    assert f"Subject: {e.subject.value}" in out
    assert e.meaning in out and e.criterion in out
    lint = runner.invoke(app, ["explain", "TS004"])
    assert lint.exit_code == 0 and lint.output.startswith("# lint.TS004:"), lint.output


def test_explain_an_unknown_code_is_one_line_exit_2() -> None:
    result = runner.invoke(app, ["explain", "grads.nonexistent"])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    assert "torchscope explain" in lines[0]


def test_lint_violations_become_their_rule_s_finding() -> None:
    fixtures = Path(__file__).parent / "lint" / "fixtures"
    result = torchscope.lint.lint_paths([fixtures], config=False, use_gitignore=False)
    seen = {v.code for v in result.violations}
    assert seen == set(RULES), set(RULES) - seen
    for v in result.violations:
        f = v.to_finding()
        assert f.code == f"lint.{v.code}" and f.subject is Subject.LOOP
        assert f.severity <= RULES[v.code].severity
