"""The run report: a `RunRecord` as the doctor's report document (`kind` "run").

Sections, in order: the run (steps, status, step time, total norm, NaN/Inf onset), the
gradient flow over the run (the layer × step heat map), activations over the run (drift,
dead units), memory, the profiled window (the doctor's profile section, when the run was
profiled) and the last sampled step in full (the doctor's gradients section). Each section
carries the run's findings that concern it (`analyze.section_of`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchscope._util import fmt_bytes, fmt_num, to_jsonable
from torchscope.capture.analyze import ActivationThresholds
from torchscope.doctor.sections import GradientsSection, ProfileSection
from torchscope.findings import Finding
from torchscope.monitoring.analyze import section_of
from torchscope.monitoring.history import METRICS, Bucket
from torchscope.monitoring.records import LayerSeries, RunRecord
from torchscope.report.document import Metric, Report, SectionOutcome, TargetInfo, machine_facts
from torchscope.report.html import write_report
from torchscope.report.run import (
    activity_fragment,
    bucket_plot,
    grad_heatmap,
    overview_fragment,
    saved_plot,
    series_fragment,
    series_lines_plot,
    total_norm_plot,
)
from torchscope.step import StepInfo

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["EarlierRun", "RunReport", "earlier_run", "run_report", "write_run_report"]


class RunReport(Report):
    """A run report: the report document with `kind` "run"; `outcome(name).record` is the
    `RunRecord` (the profiled window's `ProfileResult` and the last sample's `GradFlow` for
    `profile` and `last_step`)."""


def _series_json(s: LayerSeries) -> dict[str, Any]:
    return {"steps": list(s.steps), "layers": list(s.layers),
            "values": [list(row) for row in s.values]}


def _buckets_json(buckets: tuple[Bucket, ...]) -> list[dict[str, Any]]:
    return [{"first_step": b.first_step, "steps": b.count, "mean": b.mean, "min": b.low,
             "max": b.high} for b in buckets]


class _Section:
    """A run-report section over the `RunRecord` (a `SectionRenderer`)."""

    name = ""
    title = ""

    def data(self, record: RunRecord) -> dict[str, Any]:
        raise NotImplementedError

    def metrics(self, record: RunRecord) -> dict[str, Metric]:
        return {}

    def plots(self, record: RunRecord) -> Mapping[str, Figure]:
        return {}

    def html(self, record: RunRecord, plots: Mapping[str, str]) -> str:
        raise NotImplementedError


class _Overview(_Section):
    name, title = "run", "Run"

    def data(self, record: RunRecord) -> dict[str, Any]:
        o, b = record.onset, record.budget
        return {
            "steps": record.steps, "samples": record.samples, "every": record.every,
            "step_by": record.step_by, "status": record.status, "error": record.error,
            "seconds": record.seconds, "inputs": record.inputs,
            "median_step_ms": record.median_step_ms, "step_ms": _buckets_json(record.step_ms),
            "skipped": {"count": record.skipped, "steps": list(record.skipped_steps)},
            "nonfinite": {"gradient_step": o.gradient_step,
                          "nonfinite_steps": o.nonfinite_steps,
                          "forward_step": o.forward_step, "module": o.module,
                          "module_type": o.module_type},
            "history": {"capacity": b.capacity, "recent": b.recent, "stride": b.stride,
                        "rows": b.rows, "bytes": b.bytes, "bucket_width": b.bucket_width},
            "resumed_at": list(record.resumed_at),
            # Every per-layer series by its history metric, for a resumed run to go on from
            # (`earlier_run`): the other sections show some of them.
            "series": {"metrics": {m: _series_json(getattr(record, m)) for m in METRICS
                                   if isinstance(getattr(record, m, None), LayerSeries)},
                       "total_norms": list(record.total_norms),
                       "applied_norms": list(record.applied_norms),
                       "saved_bytes": list(record.saved_bytes)},
        }

    def metrics(self, record: RunRecord) -> dict[str, Metric]:
        out = {"run.step_ms": Metric(record.median_step_ms, "lower", "ms",
                                     "median wall time between optimizer steps"),
               "run.skipped_steps": Metric(record.skipped, "lower", "count",
                                           "steps the GradScaler skipped")}
        if record.onset.nonfinite_steps is not None:
            out["run.nonfinite_steps"] = Metric(record.onset.nonfinite_steps, "lower",
                                                "count", "steps with NaN/Inf gradients")
        return out

    def plots(self, record: RunRecord) -> Mapping[str, Figure]:
        out: dict[str, Figure] = {}
        if record.total_norms:
            out["run-total-norm"] = total_norm_plot(
                record.grad_param.steps, record.total_norms,
                onset=record.onset.gradient_step, skipped=record.skipped_steps)
        if record.step_ms:
            out["run-step-time"] = bucket_plot(
                record.step_ms, title="Step time", ylabel="ms")
        return out

    def html(self, record: RunRecord, plots: Mapping[str, str]) -> str:
        o, b = record.onset, record.budget
        if record.status == "stopped":
            state = f"stopped in step {record.first_step + record.steps}: {record.error}"
        else:
            state = f"completed {record.steps} steps"
        resumed: list[tuple[str, Any]] = []
        if record.first_step:
            earlier = [s for s in record.grad_param.steps if s < record.first_step]
            kept = f"; the series go on from this folder's report of the run before " \
                f"({len(earlier)} samples, steps {earlier[0]}–{earlier[-1]})" if earlier \
                else "; no report of the steps before it was in this folder"
            state += f" from step {record.first_step}"
            resumed.append(("resumed", f"at step {record.first_step} from a checkpoint"
                            + (f" (earlier resumes: {', '.join(map(str, record.resumed_at[:-1]))})"
                               if len(record.resumed_at) > 1 else "") + kept))
        if o.gradient_step is not None:
            nonfinite = f"first at step {o.gradient_step} ({o.nonfinite_steps} steps)"
        elif o.nonfinite_steps is not None:
            nonfinite = "none (every step checked)"
        else:
            nonfinite = "not checked every step (a GradScaler skips those steps)"
        facts: list[tuple[str, Any]] = [
            ("status", state),
            *resumed,
            ("steps (" + record.step_by.replace("_", " ") + ")", record.steps),
            ("samples", f"{record.samples:,} (one step in {record.every})"),
            ("median step time", None if record.median_step_ms is None
             else f"{fmt_num(record.median_step_ms)} ms"),
            *([("steps skipped by the GradScaler", record.skipped)] if record.scaler else []),
            ("NaN/Inf in the gradients", nonfinite),
            ("history kept", f"{b.rows} samples (≤ {b.capacity} over the run, one in "
                             f"{b.stride}, + the newest {b.recent}); at most "
                             f"{fmt_bytes(b.bytes)}; steps in buckets of {b.bucket_width}"),
        ]
        return overview_fragment(facts, plots)


class _Gradients(_Section):
    name, title = "grad_history", "Gradient flow over the run"

    def data(self, record: RunRecord) -> dict[str, Any]:
        return {"param_norms": _series_json(record.grad_param),
                "output_norms": _series_json(record.grad_output),
                "total_norms": list(record.total_norms),
                "applied_norms": list(record.applied_norms),
                "experts": [{"module": u.module, "param": u.param, "samples": u.samples,
                             "idle": list(u.idle)} for u in record.experts]}

    def plots(self, record: RunRecord) -> Mapping[str, Figure]:
        if not record.grad_param.layers or not record.grad_param.steps:
            return {}
        return {"run-grad-heatmap": grad_heatmap(record.grad_param)}

    def html(self, record: RunRecord, plots: Mapping[str, str]) -> str:
        return series_fragment(
            [("Parameter-gradient norm per layer", record.grad_param, "num"),
             ("Gradient arriving at each module (grad_output norm)", record.grad_output,
              "num")],
            plots, {"run-grad-heatmap": (
                "Gradient-flow history", "Each layer's parameter-gradient norm (colour, log) "
                "at each sampled step; input side on top.")},
            note=f"{len(record.grad_param.steps)} sampled steps; the gradients each step's "
                 "update used (accumulated, unscaled, before clipping).")


class _Activations(_Section):
    name, title = "act_history", "Activations over the run"

    def data(self, record: RunRecord) -> dict[str, Any]:
        return {"std": _series_json(record.act_std),
                "zero_frac": _series_json(record.act_zero),
                "dead_frac": _series_json(record.act_dead),
                "sat_frac": _series_json(record.act_sat)}

    def metrics(self, record: RunRecord) -> dict[str, Metric]:
        s = record.act_dead
        last = [next((v for v in reversed(s.series(k)) if math.isfinite(v)), None)
                for k in s.layers]
        worst = max((v for v in last if v is not None), default=None)
        return {"act_history.dead_fraction": Metric(worst, "lower", "ratio",
                                                    "largest dead-channel fraction at the end")}

    def plots(self, record: RunRecord) -> Mapping[str, Figure]:
        out: dict[str, Figure] = {}
        if record.act_std.layers:
            out["run-act-std"] = series_lines_plot(
                record.act_std, title="Activation drift: output std per layer", ylabel="std",
                log=True)
        if any(v > 0 for row in record.act_dead.values for v in row):  # NaN > 0 is False
            out["run-act-dead"] = series_lines_plot(
                record.act_dead, title="Dead units per layer", ylabel="dead units (%)",
                percent=True)
        if any(v >= ActivationThresholds().saturated_info for row in record.act_sat.values
               for v in row):
            out["run-act-sat"] = series_lines_plot(
                record.act_sat, title="Saturated values per layer (tanh, sigmoid)",
                ylabel="in the flat tails (%)", percent=True)
        return out

    def html(self, record: RunRecord, plots: Mapping[str, str]) -> str:
        o = record.onset
        note = "The first forward of each sampled step, every leaf module."
        if record.act_dead.layers and "run-act-dead" not in plots:
            note += (" No dead channel in any sample (ReLU family: "
                     f"{', '.join(record.act_dead.layers)}).")
        if o.forward_step is not None:
            where = "the input" if o.module is None else f"{o.module or '<root>'} " \
                f"({o.module_type})"
            note += f" NaN/Inf first seen at step {o.forward_step}, produced by {where}."
        return series_fragment(
            [("Output std", record.act_std, "num"),
             ("Exactly-zero outputs", record.act_zero, "pct"),
             ("Dead units (ReLU family)", record.act_dead, "pct"),
             ("Saturated values (tanh, sigmoid)", record.act_sat, "pct")],
            plots, {"run-act-std": ("Activation drift", "Each layer's output standard "
                                    "deviation (log), the layers that changed most."),
                    "run-act-dead": ("Dead units", "Units that are zero for every "
                                     "sample and position."),
                    "run-act-sat": ("Saturated values", "Values of bounded activations "
                                    "where their local gradient is below 5% of its peak.")},
            note=note)


class _Memory(_Section):
    name, title = "mem_history", "Memory over the run"

    def data(self, record: RunRecord) -> dict[str, Any]:
        return {"steps": list(record.grad_param.steps),
                "saved_bytes": list(record.saved_bytes),
                "device_peak_bytes": _buckets_json(record.device_peak)}

    def metrics(self, record: RunRecord) -> dict[str, Metric]:
        saved = [b for b in record.saved_bytes if b is not None]
        out = {"mem_history.saved_bytes": Metric(saved[-1] if saved else None, "lower",
                                                 "bytes", "saved for backward, last sample")}
        if record.device_peak:
            out["mem_history.device_peak_bytes"] = Metric(
                max(b.high for b in record.device_peak), "lower", "bytes",
                "device memory peak over the run")
        return out

    def plots(self, record: RunRecord) -> Mapping[str, Figure]:
        out: dict[str, Figure] = {}
        if len({b for b in record.saved_bytes if b is not None}) > 1:  # a constant: a line
            out["run-saved"] = saved_plot(record.grad_param.steps, record.saved_bytes)
        if record.device_peak:
            out["run-device-peak"] = bucket_plot(
                record.device_peak, title="Device memory peak per step", ylabel="MiB",
                scale=2.0**20)
        return out

    def html(self, record: RunRecord, plots: Mapping[str, str]) -> str:
        return activity_fragment(record.grad_param.steps, record.saved_bytes,
                                 record.device_peak, plots)


def _findings(record: RunRecord, findings: list[Finding], name: str) -> tuple[Finding, ...]:
    return tuple(f for f in findings if section_of(f) == name)


@dataclass(frozen=True)
class EarlierRun:
    """What a folder's run report holds of the run before a resume, for the resumed run to
    go on from (`earlier_run`).

    Attributes:
        rows: per sample before the resume step, oldest first: (step, per layer its
            `METRICS` values, NaN where missing; total norm; applied norm or None; saved
            bytes or None).
        step_ms: the step-time buckets of the steps before the resume step.
        resumed_at: the steps at which that run had itself been resumed.
        steps: the sampled steps that report held (all of them, for the note).
    """

    rows: tuple[tuple[int, dict[str, list[float]], float, float | None, int | None], ...]
    step_ms: tuple[Bucket, ...]
    resumed_at: tuple[int, ...]
    steps: tuple[int, ...]


def _number(v: Any) -> float:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else math.nan


def earlier_run(out: Path, *, model: str, parameters: int, before: int
                ) -> tuple[EarlierRun | None, str]:
    """Read `out/report.json` for a run resumed at step `before`: the run report of the same
    model (class and parameter count) that it continues, with its samples before `before`.

    Returns:
        (the earlier run, or None where there is none to go on from; why not, in a few
        words, where a report is there but is not this run's: empty otherwise).
    """
    path = out / "report.json"
    if not path.is_file():
        return None, ""
    try:
        doc = json.loads(path.read_text())
        target, data = doc["target"], doc["sections"]["run"]["data"]
        series = data.get("series")
        if doc.get("kind") != "run" or not isinstance(series, dict):
            return None, "it is no run report of this version"
        if target.get("model_class") != model or target.get("parameters") != parameters:
            return None, (f"it is the report of another model ({target.get('model_class')}, "
                          f"{target.get('parameters')} parameters)")
        metrics = series["metrics"]
        grad = metrics["grad_param"]
        steps = [int(k) for k in grad["steps"]]
        totals, applied = series["total_norms"], series["applied_norms"]
        saved = series["saved_bytes"]
        rows = []
        for i, step in enumerate(steps):
            if step >= before:
                continue
            per_layer: dict[str, list[float]] = {}
            for j, metric in enumerate(METRICS):
                m = metrics.get(metric)
                if not m or i >= len(m["values"]):
                    continue
                for layer, v in zip(m["layers"], m["values"][i], strict=True):
                    per_layer.setdefault(layer, [math.nan] * len(METRICS))[j] = _number(v)
            a = applied[i] if i < len(applied) else None
            b = saved[i] if i < len(saved) else None
            rows.append((step, per_layer, _number(totals[i]),
                         None if a is None else _number(a), None if b is None else int(b)))
        buckets = tuple(Bucket(int(b["first_step"]), int(b["steps"]),
                               _number(b["mean"]) * int(b["steps"]), _number(b["min"]),
                               _number(b["max"]))
                        for b in data["step_ms"]
                        if int(b["first_step"]) + int(b["steps"]) <= before)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        return None, f"it could not be read ({type(exc).__name__}: {exc})"
    return EarlierRun(tuple(rows), buckets,
                      tuple(int(s) for s in data.get("resumed_at", ())), tuple(steps)), ""


def run_report(record: RunRecord, *, name: str | None = None, created: str = "",
               options: Mapping[str, Any] | None = None) -> RunReport:
    """The run report document of a `RunRecord`.

    Args:
        record: the run.
        name: the run's name (default: the model's class).
        created: ISO-8601 UTC time the run started.
        options: what the monitor was asked for (report.json's `options`).
    """
    findings = record.findings()
    outcomes: list[SectionOutcome] = []
    sections: list[_Section] = [_Overview(), _Gradients()]
    skipped: dict[str, str] = {}
    sections.append(_Activations())
    if record.activations is None:
        skipped[_Activations.name] = "activations were not watched (activations=False)"
    sections.append(_Memory())
    if record.memory is None and not record.device_peak:
        skipped[_Memory.name] = "memory was not watched (memory=False) and the device " \
                                "reports none"
    capability = "torchscope.monitor"
    for s in sections:
        if s.name in skipped:
            outcomes.append(SectionOutcome(s.name, s.title, "skipped", note=skipped[s.name],
                                           capability=capability, renderer=s))
            continue
        outcomes.append(SectionOutcome(
            s.name, s.title, "ok", capability=capability, record=record,
            seconds=record.seconds if s.name == _Overview.name else 0.0,
            data=to_jsonable(s.data(record)), findings=_findings(record, findings, s.name),
            metrics=s.metrics(record), renderer=s))
    if record.profile is not None:
        prof = ProfileSection()
        outcomes.append(SectionOutcome(
            "profile", f"Time: {record.profile.steps} profiled steps", "ok",
            capability="torchscope.watch_time", record=record.profile,
            data=prof.to_json(record.profile), findings=_findings(record, findings, "profile"),
            renderer=prof))
    elif record.profile_note:
        outcomes.append(SectionOutcome("profile", "Time", "failed", note=record.profile_note,
                                       capability="torchscope.watch_time"))
    if record.last is not None:
        grads = GradientsSection()
        outcomes.append(SectionOutcome(
            "last_step", f"Last sampled step in full (step {record.last.index})", "ok",
            capability="torchscope.watch_gradients", record=record.last,
            data=grads.to_json(record.last), renderer=grads))
    target = TargetInfo(name or record.model, record.model, record.parameters,
                        record.trainable, record.inputs, record.device)
    last = record.last
    step = StepInfo(loss="the training loop's own", loss_value=None,
                    optimizer=record.optimizer, scaler=record.scaler,
                    autocast=record.modes.main_autocast,
                    accumulate=last.micro_batches if last is not None else 1)
    return RunReport(target, dict(options or {}), tuple(outcomes),
                     machine_facts(record.device), created, record.seconds, step, kind="run")


def write_run_report(record: RunRecord, out: str | Path, *, name: str | None = None,
                     created: str = "", options: Mapping[str, Any] | None = None
                     ) -> tuple[Path, Path]:
    """Write the run report as report.html and report.json in `out`.

    Returns:
        (path of report.html, path of report.json).
    """
    return write_report(run_report(record, name=name, created=created, options=options), out)

