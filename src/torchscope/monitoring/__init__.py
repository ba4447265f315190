"""Inside the user's own training run: `torchscope.monitor` and the run report.

    with torchscope.monitor(model, opt, every=10, out="run-report") as mon:
        for x, y in loader:
            ...                                      # your loop, unchanged
    mon.result                                       # RunRecord: series over the steps
    mon.result.findings()                            # findings about the run
    # run-report/report.html, report.json            # the run report (kind "run")

The monitor is a composition of the capabilities' own watches (`watch_gradients`,
`watch_activations`, `watch_memory`, `watch_time`), sampled together on one step in
`every`, with a bounded history. The framework callbacks
(`torchscope.integrations.lightning`, `torchscope.integrations.hf`) drive the same `Monitor`.
"""

from typing import TYPE_CHECKING, Any

from torchscope.monitoring.analyze import RunThresholds, analyze_run
from torchscope.monitoring.history import SampleHistory, StepBuckets
from torchscope.monitoring.records import (
    HistoryBudget,
    LayerSeries,
    NonFiniteOnset,
    RunRecord,
)
from torchscope.monitoring.run import Monitor, monitor

if TYPE_CHECKING:
    from torchscope.monitoring.report import RunReport, run_report, write_run_report

# The run report renders with the doctor's sections, matplotlib and rich: a training
# script that only opens a monitor should not wait for them (seconds, more than torch's
# own import on a slow machine). They are imported when the report is written, or when
# one of these names is first asked for.
_REPORT_NAMES = frozenset({"RunReport", "run_report", "write_run_report"})


def __getattr__(name: str) -> Any:
    if name in _REPORT_NAMES:
        from torchscope.monitoring import report

        value = getattr(report, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'torchscope.monitoring' has no attribute {name!r}")

__all__ = [
    "HistoryBudget",
    "LayerSeries",
    "Monitor",
    "NonFiniteOnset",
    "RunRecord",
    "RunReport",
    "RunThresholds",
    "SampleHistory",
    "StepBuckets",
    "analyze_run",
    "monitor",
    "run_report",
    "write_run_report",
]
