"""The `compile` section: `torchscope.compile.compile_report` on the doctor's step.

Each mode is measured in its own child process (the forward, under `torch.no_grad`); the
record and its findings are the capability's own. `--fast` skips this section: a cold
inductor compile costs seconds per mode.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torchscope.compile import CompileReport, compile_report
from torchscope.doctor.section import DoctorOptions, Section
from torchscope.report.document import Metric
from torchscope.report.html import compile_fragment, mode_error
from torchscope.report.plots_doctor import compile_speedup_plot

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from torchscope.step import Step

__all__ = ["CompileSection"]

COMPILE_TIMEOUT_S = 300.0  # per mode, in its child process


class CompileSection(Section[CompileReport]):
    """torch.compile: compile cost, speedup and break-even per mode."""

    name = "compile"
    title = "torch.compile"
    capability = "torchscope.compile.compile_report"
    slow = True

    def run(self, step: Step, options: DoctorOptions) -> CompileReport:
        # measure="forward": inference of the step's model on its inputs (under its autocast).
        return compile_report(step, modes=options.compile_modes, iters=options.compile_iters,
                              timeout_s=COMPILE_TIMEOUT_S)

    def metrics(self, record: CompileReport) -> dict[str, Metric]:
        out: dict[str, Metric] = {}
        for m in record.modes:
            if m.speedup is not None:
                out[f"compile.speedup:{m.mode}"] = Metric(m.speedup, "higher", "x",
                                                          f"compile speedup ({m.mode})")
            if m.cold_compile_s is not None:
                out[f"compile.cold_s:{m.mode}"] = Metric(m.cold_compile_s, "lower", "s",
                                                         f"cold compile time ({m.mode})")
        return out

    def to_json(self, record: CompileReport) -> dict[str, Any]:
        return {"modes": [
            {"mode": m.mode, "error": mode_error(m),
             "cold_s": m.cold_compile_s, "warm_s": m.warm_compile_s, "eager_ms": m.eager_ms,
             "compiled_ms": m.compiled_ms, "speedup": m.speedup,
             "break_even_calls": m.break_even_calls,
             # From one `torch._dynamo.explain` of the forward, the same for every mode.
             "graph_breaks": len(record.graph_breaks), "recompiles": len(m.recompiles),
             "max_abs_diff": m.max_abs_diff}
            for m in record.modes]}

    def plots(self, record: CompileReport) -> dict[str, Figure]:
        rows = [m for m in record.modes if m.speedup is not None]
        return {"compile-speedup": compile_speedup_plot(rows)} if rows else {}

    def html(self, record: CompileReport, plots: Mapping[str, str]) -> str:
        return compile_fragment(record, plots)


SECTION = CompileSection()
