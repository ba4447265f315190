"""Render lint results: ruff-like text, JSON, and SARIF 2.1.0 for code-scanning UIs."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import quote

from rich.text import Text

from torchscope._util import __version__
from torchscope.findings import Severity
from torchscope.lint.records import LintResult, LintViolation
from torchscope.lint.rules import RULES

__all__ = ["SARIF_SCHEMA_URI", "json_payload", "sarif_log", "text_lines"]

SARIF_SCHEMA_URI = (
    "https://docs.oasis-open.org/sarif/sarif/v2.1.0/errata01/os/schemas/sarif-schema-2.1.0.json"
)
_LEVEL = {Severity.ERROR: "error", Severity.WARNING: "warning", Severity.INFO: "note"}
_STYLE = {Severity.ERROR: "bold red", Severity.WARNING: "bold yellow", Severity.INFO: "bold blue"}


def text_lines(result: LintResult, *, show_fixes: bool = True) -> list[Text]:
    """One `path:line:col: CODE message` line per violation (plus its fix), errors, a summary.

    Styled with rich; printed to a file or pipe the styles disappear and the lines are plain.
    """
    out: list[Text] = []
    for v in result.violations:
        # Info notes say so in the line itself: they do not fail the run (exit 0).
        label = " info:" if v.severity is Severity.INFO else ""
        out.append(Text.assemble((f"{v.path}:{v.line}:{v.col}:", "bold"), " ",
                                 (v.code, _STYLE[v.severity]), label, f" {v.message}"))
        if show_fixes:
            out.append(Text(f"    fix: {v.fix}", style="cyan"))
    for e in result.errors:
        where = e.path if e.line is None else f"{e.path}:{e.line}:{e.col or 1}"
        out.append(Text.assemble((f"{where}:", "bold"), (" error:", "bold red"), f" {e.message}"))
    out.append(_summary(result))
    return out


def _summary(result: LintResult) -> Text:
    files = f"{result.files} file{'s' if result.files != 1 else ''}"
    if not result.violations and not result.errors:
        return Text(f"All checks passed ({files}, {len(result.codes)} rules).", style="green")
    parts: list[str] = []
    if result.violations:
        n = len(result.violations)
        counts = ", ".join(f"{code} ×{k}" for code, k in result.counts().items())
        notes = result.counts(notes=True)
        k = sum(notes.values())
        if k == n:
            parts.append(f"Found {n} info note{'s' if n != 1 else ''} ({counts})")
        else:
            found = f"Found {n} problem{'s' if n != 1 else ''} ({counts})"
            if k:
                which = ", ".join(f"{code} ×{c}" for code, c in notes.items())
                found += f", {k} of them info ({which})"
            parts.append(found)
    if result.errors:
        n = len(result.errors)
        parts.append(f"{n} file{'s' if n != 1 else ''} could not be checked")
    return Text(f"{'; '.join(parts)} in {files}.", style="bold")


def _violation_json(v: LintViolation) -> dict[str, Any]:
    rule = RULES[v.code]
    return {
        "path": v.path, "line": v.line, "col": v.col, "end_line": v.end_line,
        "end_col": v.end_col, "code": v.code, "name": rule.name,
        "severity": v.severity.label, "message": v.message, "fix": v.fix,
    }


def json_payload(result: LintResult) -> dict[str, Any]:
    """The whole result as JSON-ready data (`--format json`)."""
    return {
        "tool": "torchscope lint",
        "version": __version__,
        "files": result.files,
        "exit_code": result.exit_code,
        "rules": sorted(result.codes),
        "counts": result.counts(),
        "violations": [_violation_json(v) for v in result.violations],
        "errors": [{"path": e.path, "line": e.line, "col": e.col, "message": e.message}
                   for e in result.errors],
        "notes": list(result.notes),
    }


def _artifact(path: str, root: Path) -> dict[str, Any]:
    absolute = Path(path).resolve()
    try:
        rel = absolute.relative_to(root)
    except ValueError:
        return {"uri": absolute.as_uri()}
    return {"uri": quote(rel.as_posix()), "uriBaseId": "%SRCROOT%"}


def _location(path: str, root: Path, region: dict[str, int] | None) -> dict[str, Any]:
    physical: dict[str, Any] = {"artifactLocation": _artifact(path, root)}
    if region:
        physical["region"] = region
    return {"physicalLocation": physical}


def _rule_descriptor(code: str) -> dict[str, Any]:
    rule = RULES[code]
    return {
        "id": rule.code,
        "name": rule.name,
        "shortDescription": {"text": rule.summary},
        "fullDescription": {"text": f"{rule.summary} {rule.breaks}"},
        "help": {"text": f"Fix: {rule.fix}", "markdown": f"**Fix:** {rule.fix}"},
        "defaultConfiguration": {"level": _LEVEL[rule.severity]},
        "properties": {"tags": ["pytorch", "correctness"], "precision": "high"},
    }


def sarif_log(result: LintResult, *, root: str | Path | None = None) -> dict[str, Any]:
    """The result as a SARIF 2.1.0 log (`--format sarif`), one run, paths relative to `root`.

    Args:
        result: what `lint_paths` returned.
        root: folder the artifact URIs are relative to (`%SRCROOT%`); default `result.root`.
    """
    base = Path(root if root is not None else result.root).resolve()
    codes = sorted(RULES)
    index = {code: i for i, code in enumerate(codes)}
    results = []
    for v in result.violations:
        region: dict[str, int] | None = {"startLine": v.line, "startColumn": v.col,
                  "endLine": v.end_line, "endColumn": v.end_col}
        results.append({
            "ruleId": v.code,
            "ruleIndex": index[v.code],
            "level": _LEVEL[v.severity],
            "message": {"text": f"{v.message} Fix: {v.fix}"},
            "locations": [_location(v.path, base, region)],
        })
    notifications = []
    for e in result.errors:
        region = {"startLine": e.line, "startColumn": e.col or 1} if e.line else None
        notifications.append({
            "level": "error",
            "message": {"text": f"{e.path}: {e.message}"},
            "locations": [_location(e.path, base, region)],
        })
    for note in result.notes:
        notifications.append({"level": "note", "message": {"text": note}})
    return {
        "$schema": SARIF_SCHEMA_URI,
        "version": "2.1.0",
        "runs": [{
            "tool": {"driver": {
                "name": "torchscope",
                "fullName": "torchscope lint",
                "version": __version__,
                "rules": [_rule_descriptor(c) for c in codes],
            }},
            "originalUriBaseIds": {"%SRCROOT%": {"uri": base.as_uri() + "/"}},
            "invocations": [{
                "executionSuccessful": not result.errors,
                "toolExecutionNotifications": notifications,
            }],
            "results": results,
            "columnKind": "unicodeCodePoints",
        }],
    }
