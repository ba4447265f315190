"""The report document: what a report holds, and report.json built from it and read back.

A report is made of *sections*, each the outcome of one measurement (a capability's record,
its findings and headline metrics), plus what was examined (`TargetInfo`), the environment,
the options the producer was asked for and the training step every section measured
(`StepInfo`). `torchscope doctor` fills one (`kind` "doctor"); the run monitor fills one
over the steps of a training run (`kind` "run"), with the same renderers, JSON and `diff`.

Rendering a section's record stays with whoever produced it: an outcome carries a
`SectionRenderer` (the doctor's sections are), so this layer never needs to know the
producer. report.json's schema ships as package data (`report.schema.json`), described in
docs/report-schema.md; `SCHEMA_VERSION` follows semver: a reader accepts any document with
the same major version.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from torchscope._util import __version__, to_jsonable
from torchscope.errors import TorchscopeError
from torchscope.findings import Analyzed, Finding, Severity, analyzer, rank, ranked
from torchscope.step import StepInfo

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "SCHEMA_ID",
    "SCHEMA_VERSION",
    "Better",
    "Metric",
    "Report",
    "ReportFormatError",
    "ReportKind",
    "SectionOutcome",
    "SectionRenderer",
    "Status",
    "TargetInfo",
    "build_document",
    "load_document",
    "load_schema",
    "machine_facts",
]

SCHEMA_ID = "torchscope.report"
SCHEMA_VERSION = "1.12"

Status = Literal["ok", "skipped", "failed"]
ReportKind = Literal["doctor", "run"]
Better = Literal["lower", "higher"]


class ReportFormatError(TorchscopeError):
    """A file given as a report is missing, not JSON, or not a report of this schema."""


@dataclass(frozen=True)
class TargetInfo:
    """What was examined.

    Attributes:
        name: the TARGET as given (`tiny-cnn`, `factory.py:build`) or the class name.
        model_class: the model's class.
        parameters: every parameter element.
        trainable: the elements of parameters that require grad.
        inputs: the input shapes, as `ModelInputs.describe()` gives them.
        device: where the model ran.
    """

    name: str
    model_class: str
    parameters: int
    trainable: int
    inputs: str
    device: str


@dataclass(frozen=True)
class Metric:
    """A headline number that `torchscope diff` compares between two reports.

    Attributes:
        value: the measured number (None when it could not be measured).
        better: whether a `lower` or `higher` value is an improvement.
        unit: `ratio`, `bytes`, `ms`, `s`, `count` or `x` (a speedup factor); for display.
        label: what it measures, in a few words.
        low, high: for a timing, the confidence interval of `value`, the median of its
            samples (`torchscope._timing.median_interval`): `diff` tells no change inside
            the noise. None for an exact number.
    """

    value: float | None
    better: Better
    unit: str
    label: str
    low: float | None = None
    high: float | None = None


class SectionRenderer(Protocol):
    """What draws a section's record in report.html (the producer's section object)."""

    def plots(self, record: Any) -> Mapping[str, Figure]:
        """Figures to embed, by plot id."""

    def html(self, record: Any, plots: Mapping[str, str]) -> str:
        """An HTML fragment for the record; `plots` maps plot id to an inline `<svg>`."""


@dataclass(frozen=True)
class SectionOutcome:
    """What one section of a report produced.

    Attributes:
        name: stable identifier, the key in report.json.
        title: heading in the HTML report and the terminal.
        status: `ok`, `skipped` (the user asked so) or `failed` (it raised).
        note: why it was skipped or failed, or what an ok section had to leave out (one
            line); empty otherwise.
        seconds: wall time spent in the section.
        capability: the public function the section measured with, for readers.
        record: the capability's own record when ok (e.g. a `torchscope.grads.GradFlow`).
        data: the JSON-ready `data` object of report.json for the record (None unless ok).
        findings: the record's findings.
        metrics: headline numbers for `diff`, keyed `"<section>.<what>"`.
        error: the exception a failed section raised (or that an ok section worked
            around, see `note`), traceback included.
        renderer: draws `record` in report.html; None draws nothing but the envelope.
    """

    name: str
    title: str
    status: Status
    note: str = ""
    seconds: float = 0.0
    capability: str = ""
    record: Any = None
    data: Mapping[str, Any] | None = None
    findings: tuple[Finding, ...] = ()
    metrics: Mapping[str, Metric] = field(default_factory=dict)
    error: BaseException | None = field(default=None, compare=False, repr=False)
    renderer: SectionRenderer | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Report(Analyzed):
    """Everything one report holds; renderers, report.json and `diff` read only this.

    Attributes:
        target: what was examined.
        options: what the producer was asked for, JSON-ready.
        outcomes: one per section, in run order.
        environment: torch/python/platform facts.
        created: ISO-8601 UTC time the run started.
        seconds: wall time of the whole run.
        step: the training step the sections measured, stated once for the whole report
            (None when no section ran one).
        kind: `doctor` (one step, examined by every capability) or `run` (the steps of a
            training run, watched by `torchscope.monitor` or a framework callback).
    """

    target: TargetInfo
    options: Mapping[str, Any]
    outcomes: tuple[SectionOutcome, ...]
    environment: Mapping[str, str | int | bool]
    created: str
    seconds: float
    step: StepInfo | None = None
    kind: ReportKind = "doctor"

    def outcome(self, name: str) -> SectionOutcome:
        """The outcome of the section called `name`.

        Raises:
            KeyError: no such section ran.
        """
        for o in self.outcomes:
            if o.name == name:
                return o
        raise KeyError(name)

    def section_findings(self) -> list[tuple[str, Finding]]:
        """(section, finding) pairs in report order (`torchscope.findings.rank`): the user's
        model, loop and data before caveats, a cause before its symptoms, the most severe
        first; run order within that."""
        return ranked(((o.name, f) for o in self.outcomes for f in o.findings),
                      lambda p: p[1])

    @property
    def metrics(self) -> dict[str, Metric]:
        """Every section's headline numbers."""
        return {k: v for o in self.outcomes for k, v in o.metrics.items()}

    def count(self, severity: Severity) -> int:
        """How many findings have this severity."""
        return sum(1 for o in self.outcomes for f in o.findings if f.severity == severity)


@analyzer(Report)
def report_findings(report: Report, thresholds: Any = None) -> list[Finding]:
    """Every section's findings, most severe first.

    Args:
        report: the report.
        thresholds: unused: each section's findings were drawn by its capability's analyzer
            when the section ran.
    """
    return rank(f for o in report.outcomes for f in o.findings)


# The loss diagnosis report.json 1.9–1.11 kept under `step` (now in the gradients data).
_STEP_COMPAT = ("loss_broadcast", "loss_on_probabilities", "padded_labels")
# Verdict lines stay one terminal line's worth: a longer summary is cut at a word.
_VERDICT_SUMMARY_CHARS = 160


def _short(text: str) -> str:
    text = text.rstrip(".")
    if len(text) <= _VERDICT_SUMMARY_CHARS:
        return text
    return text[:_VERDICT_SUMMARY_CHARS].rsplit(" ", 1)[0] + " …"


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def verdict_level(report: Report) -> Literal["failed", "warning", "healthy"]:
    """How the verdict reads at a glance (its colour): `failed` where a section failed or
    there is an error, `warning` where there is a warning, else `healthy`."""
    if any(o.status == "failed" for o in report.outcomes) or report.count(Severity.ERROR):
        return "failed"
    return "warning" if report.count(Severity.WARNING) else "healthy"


def verdict(report: Report) -> str:
    """The report's verdict: one line a user can act on, printed before anything else.

    A failed section comes first (a report whose sections failed never reads healthy); then
    the errors and warnings, named by the first in report order; otherwise "healthy", with
    the sections that looked and how many notes (info findings and caveats) there are.
    """
    failed = [o for o in report.outcomes if o.status == "failed"]
    pairs = report.section_findings()
    errors = [f for _, f in pairs if f.severity is Severity.ERROR]
    warnings = [f for _, f in pairs if f.severity is Severity.WARNING]
    notes = len(pairs) - len(errors) - len(warnings)
    if failed:
        first = failed[0]
        why = f": {_short(first.note)}" if first.note else ""
        rest = [_count(len(errors), "error")] if errors else []
        rest += [_count(len(warnings), "warning")] if warnings else []
        tail = f"; besides, {' and '.join(rest)}" if rest else ""
        return (f"failed: {_count(len(failed), 'section')} could not run "
                f"({', '.join(o.name for o in failed)}); {first.title}{why}{tail}")
    if errors or warnings:
        top = (errors or warnings)[0]
        head = [_count(len(errors), "error")] if errors else []
        head += [_count(len(warnings), "warning")] if warnings else []
        where = f" ({top.module})" if top.module and top.module not in top.summary else ""
        return f"{' and '.join(head)}: {_short(top.summary)}{where}"
    looked = [o.title.lower() for o in report.outcomes if o.status == "ok"]
    span = "in this run" if report.kind == "run" else "on this step"
    seen = ""
    if looked:
        seen = " in " + (looked[0] if len(looked) == 1 else
                         f"{', '.join(looked[:-1])} or {looked[-1]}")
    tail = f"; {_count(notes, 'note')}" if notes else ""
    return f"healthy: nothing wrong{seen} {span}{tail}"


def build_document(report: Report) -> dict[str, Any]:
    """The JSON-ready report.json content for `report`."""
    sections = {
        o.name: {"title": o.title, "status": o.status, "note": o.note, "seconds": o.seconds,
                 "capability": o.capability,
                 "data": to_jsonable(o.data) if o.status == "ok" else None}
        for o in report.outcomes}
    findings = [
        {"section": sec, "code": f.code, "severity": f.severity.label,
         "subject": f.subject.value, "summary": f.summary,
         "evidence": to_jsonable(dict(f.evidence)), "fix": f.fix, "module": f.module}
        for sec, f in report.section_findings()]
    metrics = {k: {"value": to_jsonable(m.value), "better": m.better, "unit": m.unit,
                   "label": m.label,
                   **({} if m.low is None or m.high is None else
                      {"low": to_jsonable(m.low), "high": to_jsonable(m.high)})}
               for k, m in report.metrics.items()}
    doc: dict[str, Any] = {
        "schema": SCHEMA_ID,
        "schema_version": SCHEMA_VERSION,
        "kind": report.kind,
        "verdict": verdict(report),
        "torchscope_version": __version__,
        "created": report.created,
        "seconds": report.seconds,
        "target": asdict(report.target),
        "environment": dict(report.environment),
        "options": to_jsonable(report.options),
    }
    if report.step is not None:
        doc["step"] = {**to_jsonable(report.step), "text": report.step.describe()}
        # Readers of 1.9–1.11 found the loss diagnosis under `step`; it is the gradients
        # section's now, and stays under `step` too within major version 1.
        ran = next((o for o in report.outcomes if o.name == "gradients" and o.status == "ok"),
                   None)
        grads: dict[str, Any] = to_jsonable(ran.data) if ran is not None and ran.data else {}
        doc["step"].update({k: grads[k] for k in _STEP_COMPAT if k in grads})
    doc.update({"sections": sections, "findings": findings, "metrics": metrics})
    return doc


def load_schema() -> dict[str, Any]:
    """The shipped JSON Schema (draft 2020-12) of report.json."""
    text = resources.files("torchscope.report").joinpath("report.schema.json").read_text()
    schema: dict[str, Any] = json.loads(text)
    return schema


def _bad(path: str | Path, what: str, fix: str = "pass the report.json that `torchscope "
         "doctor` wrote.") -> ReportFormatError:
    return ReportFormatError(f"{str(path)!r}{what}", fix=fix)


def load_document(path: str | Path) -> dict[str, Any]:
    """Read a report.json (or the folder holding one) and check this version can read it.

    Raises:
        ReportFormatError: missing file, bad JSON, another schema or major version, or no
            `metrics` object.
    """
    p = Path(path)
    if p.is_dir():
        if not (p / "report.json").is_file():
            raise _bad(path, " is a folder without a report.json.",
                       fix="pass the folder `torchscope doctor --out` wrote, or its "
                       "report.json.")
        p = p / "report.json"
    if not p.is_file():
        raise _bad(path, " does not exist.")
    try:
        doc = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _bad(path, f" is not JSON ({exc}).") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA_ID:
        raise _bad(path, f" is not a torchscope report (no \"schema\": \"{SCHEMA_ID}\").")
    major = SCHEMA_VERSION.split(".", maxsplit=1)[0]
    version = str(doc.get("schema_version", ""))
    if version.split(".", maxsplit=1)[0] != major:
        raise _bad(path, f" has schema_version {version!r}; this torchscope reads {major}.x.",
                   fix="regenerate both reports with the same torchscope version.")
    regenerate = "regenerate it with `torchscope doctor`."
    if not isinstance(doc.get("metrics"), dict):
        raise _bad(path, " has no \"metrics\" object.", fix=regenerate)
    for name, entry in doc["metrics"].items():
        if not isinstance(entry, dict) or entry.get("better", "lower") not in ("lower", "higher"):
            raise _bad(path, f": metric {name!r} is not an object with \"better\" lower or "
                       f"higher (got {json.dumps(entry)[:60]}).", fix=regenerate)
    return doc


def machine_facts(device: str) -> dict[str, str | int | bool]:
    """The report's `environment`: torch and Python versions, platform, device, CPU threads
    and count, CUDA, and the GPU's name when the report ran on one."""
    import os
    import platform

    import torch

    env: dict[str, str | int | bool] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "device": device,
        "cpu_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count() or 1,
        "cuda": torch.cuda.is_available(),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return env
