"""report.json: the versioned document a doctor run writes, and reading it back for `diff`.

The schema ships as package data (`torchscope/report/report.schema.json`) and is described
in docs/report-schema.md. `SCHEMA_VERSION` follows semver: a reader accepts any document with
the same major version.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from torchscope._util import __version__, to_jsonable
from torchscope.doctor.runner import DoctorReport
from torchscope.errors import TorchscopeError

__all__ = ["SCHEMA_ID", "SCHEMA_VERSION", "ReportFormatError", "build_document", "load_document",
           "load_schema"]

SCHEMA_ID = "torchscope.report"
SCHEMA_VERSION = "1.1"


class ReportFormatError(TorchscopeError):
    """A file given as a doctor report is missing, not JSON, or not a report of this schema."""


def build_document(report: DoctorReport) -> dict[str, Any]:
    """The JSON-ready report.json content for `report`."""
    o = report.options
    sections: dict[str, Any] = {}
    for out in report.outcomes:
        data = None
        if out.status == "ok" and out.section is not None:
            data = to_jsonable(out.section.to_json(out.result))
        sections[out.name] = {
            "title": out.title, "status": out.status, "note": out.note,
            "seconds": out.seconds,
            "capability": out.section.capability if out.section is not None else "",
            "data": data,
        }
    findings = [
        {"section": sec, "code": f.code, "severity": f.severity.label, "summary": f.summary,
         "evidence": to_jsonable(dict(f.evidence)), "fix": f.fix, "module": f.module}
        for sec, f in report.findings
    ]
    metrics = {k: {"value": to_jsonable(m.value), "better": m.better, "unit": m.unit,
                   "label": m.label} for k, m in report.metrics.items()}
    return {
        "schema": SCHEMA_ID,
        "schema_version": SCHEMA_VERSION,
        "torchscope_version": __version__,
        "created": report.created,
        "seconds": report.seconds,
        "target": to_jsonable(report.target),
        "environment": dict(report.environment),
        "options": {"fast": o.fast, "skip": sorted(o.skip), "loss": o.loss, "steps": o.steps,
                    "compile_modes": list(o.compile_modes), "compile_iters": o.compile_iters,
                    "device": o.device, "seed": o.seed},
        "sections": sections,
        "findings": findings,
        "metrics": metrics,
    }


def load_schema() -> dict[str, Any]:
    """The shipped JSON Schema (draft 2020-12) of report.json."""
    text = resources.files("torchscope.report").joinpath("report.schema.json").read_text()
    schema: dict[str, Any] = json.loads(text)
    return schema


def load_document(path: str | Path) -> dict[str, Any]:
    """Read a report.json and check it is a doctor report this version can read.

    Raises:
        ReportFormatError: missing file, bad JSON, another schema or major version, or no
            `metrics` object.
    """
    p = Path(path)
    if p.is_dir() and (p / "report.json").is_file():
        p = p / "report.json"
    if not p.is_file():
        raise ReportFormatError(f"report {str(path)!r} does not exist.",
                                fix="pass the report.json that `torchscope doctor` wrote.")
    try:
        doc = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ReportFormatError(
            f"{str(path)!r} is not JSON ({exc}).",
            fix="pass the report.json that `torchscope doctor` wrote.") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA_ID:
        raise ReportFormatError(f"{str(path)!r} is not a torchscope doctor report (no "
                                f"\"schema\": \"{SCHEMA_ID}\").",
                                fix="pass the report.json that `torchscope doctor` wrote.")
    version = str(doc.get("schema_version", ""))
    if version.split(".", maxsplit=1)[0] != SCHEMA_VERSION.split(".", maxsplit=1)[0]:
        raise ReportFormatError(
            f"{str(path)!r} has schema_version {version!r}; this torchscope reads "
            f"{SCHEMA_VERSION.split('.', maxsplit=1)[0]}.x.",
            fix="regenerate both reports with the same torchscope version.")
    if not isinstance(doc.get("metrics"), dict):
        raise ReportFormatError(f"{str(path)!r} has no \"metrics\" object.",
                                fix="regenerate it with `torchscope doctor`.")
    for name, entry in doc["metrics"].items():
        if not isinstance(entry, dict) or entry.get("better", "lower") not in ("lower", "higher"):
            raise ReportFormatError(
                f"{str(path)!r}: metric {name!r} is not an object with \"better\" lower or "
                f"higher (got {json.dumps(entry)[:60]}).",
                fix="regenerate it with `torchscope doctor`.")
    return doc
