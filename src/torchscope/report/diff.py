"""`torchscope diff`: compare the headline metrics of two report.json documents against
thresholds (pure)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from torchscope.errors import TorchscopeError

__all__ = ["DEFAULT_THRESHOLDS", "MetricChange", "ReportDiff", "ThresholdError", "diff_documents",
           "parse_thresholds"]

ChangeStatus = Literal["regressed", "failed", "improved", "unchanged", "new", "gone", "n/a"]

# Relative change, in the worse direction, that counts as a regression; the longest matching
# prefix of a metric's name applies. Counts of broken things tolerate no increase at all.
DEFAULT_THRESHOLDS: dict[str, float] = {
    "": 0.10,
    "activations.nonfinite_modules": 0.0,
    "activations.dead_units": 0.0,
    "gradients": 0.5,
    "gradients.layers_without_gradient": 0.0,
    "memory": 0.10,
    "profile.bare_step_ms": 0.25,  # wall time on a shared machine is noisy
    "profile.step_ms": 0.25,  # before report.json 1.12: the step timed under the profiler
    "run.step_ms": 0.25,
    "compile.speedup": 0.20,
    "compile.cold_s": 0.50,
}


class ThresholdError(TorchscopeError):
    """A `--threshold` value is malformed."""


@dataclass(frozen=True)
class MetricChange:
    """One metric in both reports.

    Attributes:
        name, label, unit: the metric's.
        better: `lower` or `higher`.
        old, new: the values (None where a report lacks it).
        change: (new - old) / |old|; ±inf when old is 0 and new is not; None when unknown.
        threshold: the relative change in the worse direction that counts as a regression;
            for two timings with intervals (`low`, `high`), the change between the nearer
            ends of the two intervals, so that a change inside the noise is none.
        status: regressed, improved, unchanged, new (only in new), gone (only in old), n/a,
            or failed: in old, while its section failed in new (a backward that now
            raises), which is a regression too.
    """

    name: str
    label: str
    unit: str
    better: str
    old: float | None
    new: float | None
    change: float | None
    threshold: float
    status: ChangeStatus


@dataclass(frozen=True)
class ReportDiff:
    """Every compared metric, in name order, and what differs between the two runs besides
    (`notes`: another model, other inputs, another torch, other CPU threads, sections that
    failed or were skipped in one of them)."""

    old: str
    new: str
    changes: tuple[MetricChange, ...]
    notes: tuple[str, ...] = ()

    @property
    def regressions(self) -> tuple[MetricChange, ...]:
        """Changes beyond their threshold in the worse direction, and metrics whose section
        failed in the new report."""
        return tuple(c for c in self.changes if c.status in ("regressed", "failed"))


def parse_thresholds(items: Sequence[str]) -> dict[str, float]:
    """`["0.2", "profile.bare_step_ms=0.5", "gradients=1"]` → thresholds over the defaults.

    A bare number replaces every default threshold; `NAME=FRAC` sets it for metrics whose
    name starts with NAME (the longest matching NAME wins). FRAC is a fraction (0.2 = 20%)
    or a percentage (`20%`).

    Raises:
        ThresholdError: an item is not `FRAC` or `NAME=FRAC` with FRAC >= 0.
    """
    parts = [p.strip() for item in items for p in item.split(",") if p.strip()]
    bare = [p for p in parts if "=" not in p]
    # A bare number replaces every default; NAME=FRAC then refines, whatever the order.
    out = {"": _fraction(bare[-1], bare[-1])} if bare else dict(DEFAULT_THRESHOLDS)
    given: set[str] = set()
    for part in parts:
        if "=" in part:
            key, _, value = part.rpartition("=")
            key = key.strip()
            out[key] = _fraction(value.strip(), part)
            given.add(key)
    # `profile=50%` is for every profile metric: a default on a longer name under it
    # (`profile.bare_step_ms`) would otherwise win as the longer prefix and ignore the user.
    for key in given:
        for default in [k for k in out if k not in given and k != key and k.startswith(key)]:
            del out[default]
    return out


def _fraction(text: str, item: str) -> float:
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or value < 0:
        raise ThresholdError(
            f"threshold {item!r} is not FRAC or NAME=FRAC with a non-negative FRAC.",
            fix="write e.g. --threshold 0.1 or --threshold profile.bare_step_ms=25%.")
    return value


def _threshold_for(name: str, thresholds: Mapping[str, float]) -> float:
    best = max((k for k in thresholds if name.startswith(k)), key=len, default="")
    return thresholds.get(best, DEFAULT_THRESHOLDS[""])


def _span(entry: Any) -> tuple[float, float] | None:
    """A timing's interval (`low`, `high`), or None for an exact number."""
    if not isinstance(entry, Mapping):
        return None
    low, high = _value({"value": entry.get("low")}), _value({"value": entry.get("high")})
    return None if low is None or high is None else (low, high)


def _value(entry: Any) -> float | None:
    v = entry.get("value") if isinstance(entry, Mapping) else None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def diff_documents(
    old: Mapping[str, Any],
    new: Mapping[str, Any],
    thresholds: Mapping[str, float] | None = None,
    *,
    old_name: str = "old",
    new_name: str = "new",
) -> ReportDiff:
    """Compare the `metrics` of two report.json documents.

    Args:
        old, new: documents as `load_document` returns them.
        thresholds: as `parse_thresholds` returns them; default `DEFAULT_THRESHOLDS`.
        old_name, new_name: how to call the two reports in output.

    Raises:
        ThresholdError: the documents are of two kinds (a doctor report and a run report
            measure different things), or a threshold beyond the defaults names no metric
            of either (it would do nothing).
    """
    kinds = [str(d.get("kind", "doctor")) for d in (old, new)]
    if kinds[0] != kinds[1]:
        raise ThresholdError(
            f"{old_name} is a {kinds[0]} report and {new_name} a {kinds[1]} report: they "
            "measure different things.", fix="compare two reports of one kind (two doctor "
            "reports, or two run reports).")
    th = dict(thresholds) if thresholds is not None else dict(DEFAULT_THRESHOLDS)
    om: Mapping[str, Any] = old.get("metrics", {})
    nm: Mapping[str, Any] = new.get("metrics", {})
    unknown = [k for k in th if k not in DEFAULT_THRESHOLDS
               and not any(m.startswith(k) for m in (*om, *nm))]
    if unknown:
        shown = ", ".join(sorted({*om, *nm})[:4])
        raise ThresholdError(
            f"--threshold {unknown[0]}=... names no metric of either report.",
            fix=f"use a metric name or its prefix: {shown}, ... (the diff table lists "
            "them all).")
    status_of = [{k: str(v.get("status", "ok")) for k, v in d.get("sections", {}).items()
                  if isinstance(v, Mapping)} for d in (old, new)]
    changes = []
    for name in sorted(set(om) | set(nm)):
        meta = nm.get(name) or om.get(name) or {}
        better = str(meta.get("better", "lower"))
        a, b = _value(om.get(name)), _value(nm.get(name))
        limit = _threshold_for(name, th)
        change: float | None = None
        status: ChangeStatus
        section = name.split(".", 1)[0]
        if name not in om:
            status = "new"
        elif status_of[1].get(section) == "failed" and status_of[0].get(section) != "failed":
            status = "failed"
        elif name not in nm:
            status = "gone"
        elif a is None or b is None:
            status = "n/a"
        else:
            if a == b:
                change = 0.0
            elif a == 0:
                change = math.copysign(math.inf, b - a)
            else:
                change = (b - a) / abs(a)
            worse = change if better == "lower" else -change
            span_a, span_b = _span(om.get(name)), _span(nm.get(name))
            if span_a is not None and span_b is not None and a > 0:
                # Timings: only the gap between the two intervals counts, a change inside
                # the noise is none (two runs of one model read 1.8 and 11 ms a step on a
                # busy machine).
                rise = (span_b[0] - span_a[1]) / a  # > 0: new wholly above old
                fall = (span_a[0] - span_b[1]) / a  # > 0: new wholly below old
                gain, loss = (fall, rise) if better == "lower" else (rise, fall)
                worse = loss if loss > 0 else -gain if gain > 0 else 0.0
            status = ("regressed" if worse > limit else
                      "improved" if worse < -limit or (limit == 0 and worse < 0) else "unchanged")
        changes.append(MetricChange(name, str(meta.get("label", name)), str(meta.get("unit", "")),
                                    better, a, b, change, limit, status))
    return ReportDiff(old_name, new_name, tuple(changes),
                      _notes(old, new, status_of, old_name, new_name))


# What a report records of its run that, differing, makes the metrics measure two things.
_SETUP = (("target", "model_class", "model"), ("target", "inputs", "inputs"),
          ("target", "device", "device"), ("environment", "torch", "torch"),
          ("environment", "cpu_threads", "CPU threads"))


def _notes(old: Mapping[str, Any], new: Mapping[str, Any],
           status_of: list[dict[str, str]], old_name: str, new_name: str) -> tuple[str, ...]:
    """What differs between the two runs besides their metrics: their setup, and sections
    that failed or were skipped in one of them (their metrics are not compared)."""
    out = []
    for part, key, label in _SETUP:
        a, b = (d.get(part, {}).get(key) if isinstance(d.get(part), Mapping) else None
                for d in (old, new))
        if a is not None and b is not None and a != b:
            out.append(f"{label} differs: {a} in {old_name}, {b} in {new_name}")
    for section in sorted(set(status_of[0]) | set(status_of[1])):
        a, b = status_of[0].get(section), status_of[1].get(section)
        if a != b and "ok" in (a, b):
            out.append(f"section {section} is {a or 'absent'} in {old_name} and "
                       f"{b or 'absent'} in {new_name}")
    return tuple(out)
