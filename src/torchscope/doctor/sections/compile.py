"""The `compile` section: adapter over `torchscope.compile.compile_report`.

Each mode is measured in its own child process (inference, `torch.no_grad`); the findings are
`torchscope.compile.compile_findings`'. Without the capability `run` raises
`CapabilityMissingError` and the doctor shows the section as not available. `--fast` skips this
section: a cold inductor compile costs seconds per mode.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from torchscope.doctor.section import DoctorOptions, Metric, Section, load_capability
from torchscope.doctor.sections._adapt import num
from torchscope.findings import Finding
from torchscope.models.target import ModelInputs

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["CAPABILITY", "CompileMode", "CompileResult", "CompileSection", "analyze_compile"]

CAPABILITY = "torchscope.compile.compile_report"
COMPILE_TIMEOUT_S = 300.0  # per mode, in its child process


@dataclass(frozen=True)
class CompileMode:
    """torch.compile measured in one mode.

    Attributes:
        mode: `default`, `reduce-overhead`, `max-autotune`.
        error: why it could not be measured; empty when it was.
        cold_s, warm_s: first-call compile time with a fresh and a reused cache.
        eager_ms, compiled_ms: steady-state median latency.
        speedup: eager_ms / compiled_ms.
        break_even_calls: calls after which compiling has paid for itself; None = never.
        graph_breaks, recompiles: as dynamo counted them.
        max_abs_diff: largest output difference vs eager.
    """

    mode: str
    error: str
    cold_s: float | None
    warm_s: float | None
    eager_ms: float | None
    compiled_ms: float | None
    speedup: float | None
    break_even_calls: float | None
    graph_breaks: int | None
    recompiles: int | None
    max_abs_diff: float | None


@dataclass(frozen=True)
class CompileResult:
    """One row per compile mode and `torchscope.compile.compile_findings`' findings."""

    modes: tuple[CompileMode, ...]
    findings: tuple[Finding, ...] = ()


def _call(model: nn.Module, inputs: ModelInputs, options: DoctorOptions) -> Any:
    compile_report = load_capability(CAPABILITY)
    return compile_report(model, inputs, modes=options.compile_modes, iters=options.compile_iters,
                          timeout_s=COMPILE_TIMEOUT_S)


def _convert(raw: Any) -> CompileResult:
    """`torchscope.compile.CompileReport` → the section's record (one row per mode)."""
    compile_findings = load_capability("torchscope.compile.compile_findings")
    breaks = len(raw.graph_breaks)  # from one `torch._dynamo.explain` of the forward
    rows = tuple(CompileMode(
        m.mode, "" if m.status == "ok" else f"{m.status}: {m.error or ''}".strip(": "),
        num(m.cold_compile_s), num(m.warm_compile_s), num(m.eager_ms), num(m.compiled_ms),
        num(m.speedup), num(m.break_even_calls), breaks, len(m.recompiles), num(m.max_abs_diff))
        for m in raw.modes)
    return CompileResult(rows, tuple(compile_findings(raw)))


def analyze_compile(result: CompileResult) -> list[Finding]:
    """`torchscope.compile.compile_findings`' findings: speedup and break-even per mode,
    failures, recompiles, numerical differences, each graph break."""
    return list(result.findings)


class CompileSection(Section[CompileResult]):
    """torch.compile: compile cost, speedup and break-even per mode."""

    name = "compile"
    title = "torch.compile"
    capability = CAPABILITY
    slow = True

    def run(self, model: nn.Module, inputs: ModelInputs, options: DoctorOptions
            ) -> CompileResult:
        return _convert(_call(model, inputs, options))

    def analyze(self, result: CompileResult) -> list[Finding]:
        return analyze_compile(result)

    def metrics(self, result: CompileResult) -> dict[str, Metric]:
        out: dict[str, Metric] = {}
        for m in result.modes:
            if m.speedup is not None:
                out[f"compile.speedup:{m.mode}"] = Metric(m.speedup, "higher", "x",
                                                          f"compile speedup ({m.mode})")
            if m.cold_s is not None:
                out[f"compile.cold_s:{m.mode}"] = Metric(m.cold_s, "lower", "s",
                                                         f"cold compile time ({m.mode})")
        return out

    def to_json(self, result: CompileResult) -> dict[str, Any]:
        return {"modes": [
            {"mode": m.mode, "error": m.error, "cold_s": m.cold_s, "warm_s": m.warm_s,
             "eager_ms": m.eager_ms, "compiled_ms": m.compiled_ms, "speedup": m.speedup,
             "break_even_calls": m.break_even_calls, "graph_breaks": m.graph_breaks,
             "recompiles": m.recompiles, "max_abs_diff": m.max_abs_diff}
            for m in result.modes]}

    def plots(self, result: CompileResult) -> dict[str, Figure]:
        from torchscope.report.plots_doctor import compile_speedup_plot

        rows = [m for m in result.modes if m.speedup is not None]
        return {"compile-speedup": compile_speedup_plot(rows)} if rows else {}

    def html(self, result: CompileResult, plots: Mapping[str, str]) -> str:
        from torchscope.report.html import compile_fragment

        return compile_fragment(result, plots)


SECTION = CompileSection()
