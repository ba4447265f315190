"""Write a doctor run to disk: report.html and report.json side by side."""

from __future__ import annotations

import json
from pathlib import Path

from torchscope.doctor.document import build_document
from torchscope.doctor.runner import DoctorReport

__all__ = ["write_report"]


def write_report(report: DoctorReport, out_dir: str | Path) -> tuple[Path, Path]:
    """Render `report` into `out_dir` (created if needed).

    Returns:
        (path of report.html, path of report.json).
    """
    from torchscope.report.html import render_report

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    html_path = out / "report.html"
    json_path = out / "report.json"
    json_path.write_text(json.dumps(build_document(report), indent=2, allow_nan=False) + "\n")
    html_path.write_text(render_report(report), encoding="utf-8")
    return html_path, json_path
