"""The `profile` section: a few training steps of the step (forward, loss, backward, SGD)
under `torch.profiler` through `torchscope.profiling.profile_steps`; the record and its
findings are the capability's own."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torchscope.doctor.section import DoctorOptions, Section
from torchscope.profiling import ProfileResult, profile_steps
from torchscope.report.document import Metric
from torchscope.report.html import per_step, phase_ms, profile_fragment
from torchscope.report.plots_doctor import profile_modules_plot, profile_ops_plot

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from torchscope.step import Step

__all__ = ["ProfileSection"]


class ProfileSection(Section[ProfileResult]):
    """torch.profiler over a few training steps: top ops, phases, time per module."""

    name = "profile"
    title = "Time"
    capability = "torchscope.profiling.profile_steps"

    def run(self, step: Step, options: DoctorOptions) -> ProfileResult:
        return profile_steps(step, steps=options.profile_steps,
                             baseline_steps=0 if options.fast else None)

    def metrics(self, record: ProfileResult) -> dict[str, Metric]:
        return {"profile.step_ms": Metric(record.timing.profiled_ms, "lower", "ms",
                                          "training step time")}

    def to_json(self, record: ProfileResult) -> dict[str, Any]:
        ops = sorted(record.ops, key=lambda o: -o.self_cpu_ms)
        return {
            "steps": record.steps, "step_ms": record.timing.profiled_ms,
            "forward_ms": phase_ms(record, "forward"),
            "backward_ms": phase_ms(record, "backward"),
            "optimizer_ms": phase_ms(record, "optimizer"),
            # Summed over the profiled steps, in microseconds as torch.profiler gives them.
            "ops": [{"name": o.name, "calls": o.calls, "self_cpu_us": o.self_cpu_ms * 1e3,
                     "total_cpu_us": o.cpu_total_ms * 1e3,
                     "self_device_us": o.self_device_ms * 1e3 if o.self_device_ms else None}
                    for o in ops],
            "modules": [{"module": m.module, "calls": round(per_step(record, m.calls)),
                         "forward_ms": per_step(record, m.forward_self_ms),
                         "backward_ms": per_step(record, m.backward_self_ms)}
                        for m in record.modules],
        }

    def plots(self, record: ProfileResult) -> dict[str, Figure]:
        out: dict[str, Figure] = {}
        if record.ops:
            out["profile-ops"] = profile_ops_plot(record.ops)
        if record.modules:
            out["profile-modules"] = profile_modules_plot(record)
        return out

    def html(self, record: ProfileResult, plots: Mapping[str, str]) -> str:
        return profile_fragment(record, plots)


SECTION = ProfileSection()
