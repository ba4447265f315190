"""`torchscope doctor`: every capability on one model, one report; plus `diff` and `lab`.

The doctor is an orchestrator of pluggable sections (`Section`): each runs one capability,
returns a frozen record, and analyses and renders it. See `torchscope.doctor.sections`.
"""

from torchscope.doctor.diff import MetricChange, ReportDiff, diff_documents, parse_thresholds
from torchscope.doctor.document import (
    SCHEMA_VERSION,
    ReportFormatError,
    build_document,
    load_document,
    load_schema,
)
from torchscope.doctor.lab import LabClaim, LabResult, LabTable, run_lab
from torchscope.doctor.runner import DoctorEvent, DoctorReport, TargetInfo, run_doctor
from torchscope.doctor.section import (
    CapabilityMissingError,
    DoctorOptions,
    Metric,
    Section,
    SectionOutcome,
    load_capability,
)
from torchscope.doctor.sections import (
    get_section,
    register_section,
    registered_sections,
    section_names,
)
from torchscope.doctor.write import write_report

__all__ = [
    "SCHEMA_VERSION",
    "CapabilityMissingError",
    "DoctorEvent",
    "DoctorOptions",
    "DoctorReport",
    "LabClaim",
    "LabResult",
    "LabTable",
    "Metric",
    "MetricChange",
    "ReportDiff",
    "ReportFormatError",
    "Section",
    "SectionOutcome",
    "TargetInfo",
    "build_document",
    "diff_documents",
    "get_section",
    "load_capability",
    "load_document",
    "load_schema",
    "parse_thresholds",
    "register_section",
    "registered_sections",
    "run_doctor",
    "run_lab",
    "section_names",
    "write_report",
]
