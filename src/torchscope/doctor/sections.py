"""The doctor's built-in sections, in run order, and the section registry.

Each section calls one capability's public function on the doctor's shared `Step` and keeps
that capability's own record; its findings are the capability's own (`record.findings()`),
its tables and plots come from `torchscope.report`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torchscope._timing import MIN_SAMPLES
from torchscope.capture import ActivationCapture, TensorStats, capture_activations, trace_nonfinite
from torchscope.compile import CompileReport, compile_report
from torchscope.doctor.section import DoctorOptions, Section
from torchscope.findings import Severity
from torchscope.grads import GradFlow, gradient_flow, layer_norms
from torchscope.grads.records import combine_norms
from torchscope.lint import LintResult, lint_paths
from torchscope.memory import MemoryReport, analyze_memory
from torchscope.profiling import ProfileResult, profile_steps
from torchscope.report.compile import speed_verdict
from torchscope.report.document import Metric
from torchscope.report.html import (
    activations_fragment,
    compile_fragment,
    gradients_fragment,
    leaf_records,
    lint_fragment,
    memory_fragment,
    mode_error,
    per_step,
    phase_ms,
    plan_rows,
    profile_fragment,
)
from torchscope.report.lint import json_payload
from torchscope.report.plots_doctor import (
    activation_stats_plot,
    activation_zeros_plot,
    compile_speedup_plot,
    profile_modules_plot,
    profile_ops_plot,
)
from torchscope.report.plots_grads import plot_gradient_flow
from torchscope.report.plots_memory import plot_plans, plot_saved

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from torchscope.step import Step

__all__ = [
    "ActivationsSection",
    "CompileSection",
    "GradientsSection",
    "LintSection",
    "MemorySection",
    "ProfileSection",
    "get_section",
    "register_section",
    "registered_sections",
    "section_names",
]

COMPILE_TIMEOUT_S = 300.0  # per mode, in its child process


def _stats_json(s: TensorStats) -> dict[str, Any]:
    return {
        "path": s.path, "shape": list(s.shape), "dtype": s.dtype, "device": s.device,
        "numel": s.numel, "bytes": s.nbytes, "mean": s.mean, "std": s.std, "min": s.min,
        "max": s.max, "norm": s.norm, "zero_frac": s.zero_frac, "nan": s.nan_count,
        "inf": s.inf_count, "dead_units": s.dead_units, "channels": s.channels,
        "unit_dim": s.unit_dim, "saturated_frac": s.saturated_frac,
        "saturated_units": s.saturated_units,
        # A model input's features (since 1.8), only where read.
        **({} if s.feature_dim is None else {
            "feature_dim": s.feature_dim, "feature_rms_max": s.feature_rms_max,
            "feature_rms_median": s.feature_rms_median,
            "feature_max_index": s.feature_max_index}),
    }


def _totals(record: ActivationCapture) -> tuple[int, int]:
    """(bytes of every leaf output, dead units over every leaf output)."""
    stats = [s for r in leaf_records(record) for s in r.outputs]
    return sum(s.nbytes for s in stats), sum(s.dead_units or 0 for s in stats)


class ActivationsSection(Section[ActivationCapture]):
    """Activations of one forward through `torchscope.capture`: shapes, statistics, dead
    units, NaN/Inf producer.

    It captures every module's output (the layers, `leaf_modules`, are what the tables and
    plots show; the containers are captured too, so that `trace_nonfinite` can tell a
    producer from a carrier).
    """

    name = "activations"
    title = "Activations"
    capability = "torchscope.capture.capture_activations"

    def run(self, step: Step, options: DoctorOptions) -> ActivationCapture:
        childless = next(step.model.children(), None) is None
        # Every module, containers too; a model without children is captured as its own root.
        return capture_activations(step, select=None if childless else (lambda n, m: True))

    def metrics(self, record: ActivationCapture) -> dict[str, Metric]:
        t = trace_nonfinite(record.records)
        nonfinite = (1 if t.producer is not None else 0) + len(t.passers) + len(t.other_producers)
        output_bytes, dead = _totals(record)
        return {
            "activations.nonfinite_modules": Metric(float(nonfinite), "lower", "count",
                                                    "module calls with NaN/Inf output"),
            "activations.dead_units": Metric(float(dead), "lower", "count",
                                             "dead ReLU units"),
            "activations.output_bytes": Metric(float(output_bytes), "lower", "bytes",
                                               "bytes of leaf outputs"),
        }

    def to_json(self, record: ActivationCapture) -> dict[str, Any]:
        t = trace_nonfinite(record.records)
        leaf_names = {r.module for r in leaf_records(record)}
        output_bytes, dead = _totals(record)
        return {
            "output_bytes": output_bytes,
            "dead_units": dead,
            "modules": [
                {"module": r.module, "type": r.module_type, "call": r.call,
                 "leaf": r.module in leaf_names, "inputs_finite": r.inputs_finite,
                 "outputs": [_stats_json(s) for s in r.outputs],
                 "model_input": None if r.model_input is None
                 else _stats_json(r.model_input)}
                for r in record.records
            ],
            "nonfinite": {
                "producer": None if t.producer is None else t.producer.key,
                "passers": [r.key for r in t.passers],
                "other_producers": [r.key for r in t.other_producers],
            },
        }

    def plots(self, record: ActivationCapture) -> dict[str, Figure]:
        leaves = leaf_records(record)
        return {"activations-stats": activation_stats_plot(leaves),
                "activations-zeros": activation_zeros_plot(leaves)}

    def html(self, record: ActivationCapture, plots: Mapping[str, str]) -> str:
        return activations_fragment(record, plots)


class GradientsSection(Section[GradFlow]):
    """Gradient norms per layer after one forward and backward of the step, through
    `torchscope.grads.gradient_flow`."""

    name = "gradients"
    title = "Gradient flow"
    capability = "torchscope.grads.gradient_flow"

    def run(self, step: Step, options: DoctorOptions) -> GradFlow:
        return gradient_flow(step)

    def metrics(self, record: GradFlow) -> dict[str, Metric]:
        # Layers whose trainable parameters got no gradient at all (a stray .detach(), a
        # dead layer): the ratios below leave them out, so without this a model cut off
        # from its lower layers would read as gradients that vanish less.
        trainable: dict[str, bool] = {}
        for p in record.params:
            if p.requires_grad and p.tied_to is None:
                trainable[p.module] = trainable.get(p.module, False) or bool(p.norm)
        out = {"gradients.layers_without_gradient": Metric(
            float(sum(not got for got in trainable.values())), "lower", "count",
            "layers whose trainable parameters got no gradient")}
        # The norms `diagnose` compares: parameter-owning modules, nearest the loss first.
        norms = layer_norms(record)
        if len(norms) < 2:
            return out
        near, n_near = norms[0]
        far, n_far = norms[-1]
        out["gradients.vanishing_ratio"] = Metric(n_near / n_far, "lower", "ratio",
                                                  f"{near} / {far} grad norm")
        for module, norm in norms[1:]:
            out[f"gradients.ratio:{module}"] = Metric(n_near / norm, "lower", "ratio",
                                                      f"{near} / {module} grad norm")
        return out

    def to_json(self, record: GradFlow) -> dict[str, Any]:
        ratio = self.metrics(record).get("gradients.vanishing_ratio")
        outputs, params = record.output_norms(), record.param_norms()
        inputs: dict[str, list[float | None]] = {}
        for r in record.modules:
            inputs.setdefault(r.module, []).append(r.input_norm)
        reached = {r.module for r in record.modules if r.reached}
        return {
            "total_norm": record.total_norm,
            "applied_norm": record.applied_norm,
            "vanishing_ratio": None if ratio is None else ratio.value,
            # Every call of a module combined, reached modules in backward order.
            "layers": [{"module": m, "grad_output_norm": outputs.get(m),
                        "grad_input_norm": combine_norms(inputs[m]),
                        "param_grad_norm": params.get(m)}
                       for m in record.layers() if m in reached],
            # What the step's loss did with the output and the labels (grads.loss_*,
            # grads.padding_in_loss); report.json's build makes them JSON.
            "loss_broadcast": record.loss_broadcast,
            "loss_on_probabilities": record.loss_on_probabilities,
            "padded_labels": record.padded_labels,
        }

    def plots(self, record: GradFlow) -> dict[str, Figure]:
        return {"gradients-flow": plot_gradient_flow(record)} if record.layers() else {}

    def html(self, record: GradFlow, plots: Mapping[str, str]) -> str:
        return gradients_fragment(record, plots)


class MemorySection(Section[MemoryReport]):
    """What autograd keeps for backward, per module, and what checkpointing would save,
    through `torchscope.memory.analyze_memory`.

    Saved activations per module, the step's totals, the measured peak and, when the model
    has a sequence of blocks, checkpoint plans measured and verified bitwise
    (`checkpoint="auto"`).
    """

    name = "memory"
    title = "Memory"
    capability = "torchscope.memory.analyze_memory"

    def run(self, step: Step, options: DoctorOptions) -> MemoryReport:
        if options.fast:
            return analyze_memory(step, checkpoint="none", repeats=1)
        # The least-recompute plan within what √L segments keep, verified bitwise. A model
        # without blocks, or a plan that fails its verification, costs nothing else: the
        # record says so (`no_plan`, a plan's `failed`) and its findings explain it.
        # Offered, not asked for: its caveats are notes (`MemoryReport.proposed`).
        return analyze_memory(step, checkpoint="auto", proposed=True)

    def metrics(self, record: MemoryReport) -> dict[str, Metric]:
        return {"memory.saved_bytes": Metric(float(record.saved.total_bytes), "lower", "bytes",
                                             "activations saved for backward"),
                "memory.peak_estimate_bytes": Metric(float(record.totals.peak_estimate),
                                                     "lower", "bytes", "estimated step peak")}

    def to_json(self, record: MemoryReport) -> dict[str, Any]:
        t, plans = record.totals, record.plans
        base = None if plans is None else plans.measurement("none")
        return {
            "saved_bytes": record.saved.total_bytes, "param_bytes": t.parameters,
            "grad_bytes": t.gradients, "optimizer_bytes": t.optimizer_state,
            "peak_estimate_bytes": t.peak_estimate,
            "measured_peak_bytes": None if record.measured is None else record.measured.peak_bytes,
            "step_ms": None if base is None else base.step_ms,
            "modules": [{"module": m.module, "type": m.module_type, "saved_bytes": m.bytes,
                         "tensors": m.storages} for m in record.saved.modules],
            "plans": [{"name": p.name, "blocks": list(p.checkpointed),
                       "saved_bytes": p.saved_bytes, "recompute_ms": cost[0],
                       "recompute_low_ms": cost[1], "recompute_high_ms": cost[2],
                       "verified": ok}
                      for p, cost, ok in ([] if plans is None else plan_rows(plans))],
        }

    def plots(self, record: MemoryReport) -> dict[str, Figure]:
        out: dict[str, Figure] = {}
        if record.saved.modules:
            out["memory-saved"] = plot_saved(record.saved)
        if record.plans is not None and record.plans.plans:
            out["memory-plans"] = plot_plans(record.plans)
        return out

    def html(self, record: MemoryReport, plots: Mapping[str, str]) -> str:
        return memory_fragment(record, plots)


class ProfileSection(Section[ProfileResult]):
    """torch.profiler over a few training steps of the step (forward, loss, backward, SGD)
    through `torchscope.profiling.profile_steps`: top ops, phases, time per module."""

    name = "profile"
    title = "Time"
    capability = "torchscope.profiling.profile_steps"

    def run(self, step: Step, options: DoctorOptions) -> ProfileResult:
        # --fast times as few plain steps as it profiles: the step time diff compares is
        # the plain one, in either kind of run.
        return profile_steps(step, steps=options.profile_steps,
                             baseline_steps=MIN_SAMPLES if options.fast else None)

    def metrics(self, record: ProfileResult) -> dict[str, Metric]:
        # The step the user runs: the median of the plain steps (the baseline the profiler's
        # overhead is measured against), with its interval: diff tells no change inside it.
        # The profiled steps measure the profiler too (0.88 ms under --fast's 3 profiled
        # steps, 88 ms under a full run's for one MLP).
        spread = record.timing.baseline_interval
        return {"profile.bare_step_ms": Metric(
            None if spread is None else spread.median, "lower", "ms",
            "training step time without the profiler",
            None if spread is None or spread.n < 2 else spread.low,
            None if spread is None or spread.n < 2 else spread.high)}

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


class CompileSection(Section[CompileReport]):
    """torch.compile through `torchscope.compile.compile_report`: compile cost, speedup and
    break-even per mode.

    Each mode is measured in its own child process (the forward, under `torch.no_grad`).
    `--fast` skips this section: a cold inductor compile costs seconds per mode.
    """

    name = "compile"
    title = "torch.compile"
    capability = "torchscope.compile.compile_report"
    slow = True

    def run(self, step: Step, options: DoctorOptions) -> CompileReport:
        # measure="forward": inference of the step's model on its inputs (under its autocast).
        # An offer, not asked for: slower than eager is a note (`CompileReport.proposed`).
        return compile_report(step, modes=options.compile_modes, iters=options.compile_iters,
                              timeout_s=COMPILE_TIMEOUT_S, proposed=True)

    def metrics(self, record: CompileReport) -> dict[str, Metric]:
        out: dict[str, Metric] = {}
        for m in record.modes:
            if m.speedup is not None:
                # With its interval: diff tells no change inside the timing noise.
                r = m.speedup_ratio
                out[f"compile.speedup:{m.mode}"] = Metric(
                    m.speedup, "higher", "x", f"compile speedup ({m.mode})",
                    None if r is None else r.low, None if r is None else r.high)
            if m.cold_compile_s is not None:
                out[f"compile.cold_s:{m.mode}"] = Metric(m.cold_compile_s, "lower", "s",
                                                         f"cold compile time ({m.mode})")
        return out

    def to_json(self, record: CompileReport) -> dict[str, Any]:
        return {"graph_count": record.graph_count, "modes": [
            {"mode": m.mode, "error": mode_error(m),
             "cold_s": m.cold_compile_s, "warm_s": m.warm_compile_s, "eager_ms": m.eager_ms,
             "compiled_ms": m.compiled_ms, "speedup": m.speedup,
             "speedup_low": None if m.speedup_ratio is None else m.speedup_ratio.low,
             "speedup_high": None if m.speedup_ratio is None else m.speedup_ratio.high,
             "verdict": speed_verdict(m, record),
             "break_even_calls": m.break_even_calls,
             # From one `torch._dynamo.explain` of the forward, the same for every mode.
             "graph_breaks": len(record.graph_breaks), "recompiles": len(m.recompiles),
             "max_abs_diff": m.max_abs_diff}
            for m in record.modes]}

    def plots(self, record: CompileReport) -> dict[str, Figure]:
        rows = [m for m in record.modes if m.speedup is not None]
        return {"compile-speedup": compile_speedup_plot(rows, record)} if rows else {}

    def html(self, record: CompileReport, plots: Mapping[str, str]) -> str:
        return compile_fragment(record, plots)


class LintSection(Section[LintResult]):
    """The classic training traps in the model's source (`torchscope.lint.lint_paths` on
    `options.sources`): the file the model and its inputs come from, given by the CLI."""

    name = "lint"
    title = "Code"
    capability = "torchscope.lint.lint_paths"

    def skip_reason(self, options: DoctorOptions) -> str | None:
        return None if options.sources else \
            "no source file to lint: the model is a built-in or was given as an object"

    def run(self, step: Step, options: DoctorOptions) -> LintResult:
        del step  # the source, not the model
        return lint_paths(list(options.sources))

    def metrics(self, record: LintResult) -> dict[str, Metric]:
        problems = sum(v.severity >= Severity.WARNING for v in record.violations)
        return {"lint.problems": Metric(float(problems), "lower", "count",
                                        "traps in the source (warnings and errors)")}

    def to_json(self, record: LintResult) -> dict[str, Any]:
        return json_payload(record)

    def html(self, record: LintResult, plots: Mapping[str, str]) -> str:
        return lint_fragment(record)


_REGISTRY: list[Section[Any]] = [
    ActivationsSection(), GradientsSection(), MemorySection(), ProfileSection(), CompileSection(),
    LintSection(),
]


def register_section(section: Section[Any], *, before: str | None = None) -> None:
    """Add a section (or replace the one with the same name, keeping its place).

    Args:
        section: the section instance.
        before: run it before the section of this name; default at the end.

    Raises:
        KeyError: `before` names no registered section.
    """
    names = section_names()
    if section.name in names:
        _REGISTRY[names.index(section.name)] = section
    elif before is None:
        _REGISTRY.append(section)
    else:
        _REGISTRY.insert(_REGISTRY.index(get_section(before)), section)


def registered_sections() -> list[Section[Any]]:
    """The registered sections in run order (a copy)."""
    return list(_REGISTRY)


def section_names() -> list[str]:
    """Names of the registered sections in run order."""
    return [s.name for s in _REGISTRY]


def get_section(name: str) -> Section[Any]:
    """The registered section called `name`.

    Raises:
        KeyError: no such section.
    """
    for s in _REGISTRY:
        if s.name == name:
            return s
    raise KeyError(f"no section named {name!r}; registered: {', '.join(section_names())}")
