"""`torchscope doctor`: every capability on one model and one training step, one report.

    report = run_doctor(model, x)                  # or run_doctor(Step(model, x, ...))
    report.findings()                              # every section's findings, ranked
    report.outcome("gradients").record             # the capability's own record (GradFlow)
    torchscope.report.html.write_report(report, "torchscope-report")

The doctor is a composition of sections (`Section`): each calls one capability's public
function with the doctor's shared `Step` and keeps that capability's record; the report
document, report.json, `diff` and the renderers live in `torchscope.report`.
"""

from torchscope.doctor.runner import DoctorEvent, DoctorReport, run_doctor
from torchscope.doctor.section import DoctorOptions, Section
from torchscope.doctor.sections import (
    get_section,
    register_section,
    registered_sections,
    section_names,
)

__all__ = [
    "DoctorEvent",
    "DoctorOptions",
    "DoctorReport",
    "Section",
    "get_section",
    "register_section",
    "registered_sections",
    "run_doctor",
    "section_names",
]
