"""Findings from a `CompileReport`: does compile pay off, after how many calls, what breaks."""

from __future__ import annotations

from torchscope._timing import fmt_ratio
from torchscope.catalogue import entry
from torchscope.compile.records import CompileReport, GraphBreak, ModeResult, Recompile
from torchscope.findings import Entry, Finding, Severity, analyzer, rank

__all__ = ["compile_findings", "is_ddp_bucket_break"]

_NO_COMPILER = entry("compile.no_compiler")
_FAILED: dict[str, Entry] = {status: entry(f"compile.{status}")
                             for status in ("error", "crashed", "timeout")}
_NOTHING_COMPILED = entry("compile.nothing_compiled")
_NO_MEASURABLE_SPEEDUP = entry("compile.no_measurable_speedup")
_PAYS_OFF = entry("compile.pays_off")
_NEVER_PAYS_OFF = entry("compile.never_pays_off")
_NO_GAIN = entry("compile.no_gain")
_BEST_MODE = entry("compile.best_mode")
_NUMERICS = entry("compile.numerics")
_RECOMPILES = entry("compile.recompiles")
_GRAPH_BREAK = entry("compile.graph_break")
_DDP_BUCKETS = entry("compile.ddp_buckets")

#: Largest output drift (relative to the largest |eager output|) taken as rounding noise.
REL_TOLERANCE = 1e-3

_BREAK_FIX = {
    "print() call": "remove the print from forward, or log outside the compiled region "
                    "(torch._dynamo.config.reorderable_logging_functions.add(print)).",
    "data-dependent branch": "replace the Python `if` on a tensor value with torch.where / "
                             "torch.cond, or move it out of forward.",
    "Tensor.item()": "keep the value a tensor, or set "
                     "torch._dynamo.config.capture_scalar_outputs = True.",
    "tensor to Python": "keep the computation in torch ops; avoid .tolist()/.numpy() in "
                        "forward.",
    "unsupported call": "wrap the call with torch.compiler.disable, or replace it with a "
                        "torch op.",
    "logging call": "log outside the compiled region, or let the compiled code skip the "
                    "call (torch._dynamo.config.ignore_logging_functions.add(<the logging "
                    "function>)).",
}


def _calls(n: int) -> str:
    return f"{n:,} call" + ("" if n == 1 else "s")


def _timing(m: ModeResult) -> str:
    """`120 calls each in 10.0 s (the timing budget)`: how long the speedup was timed."""
    spent = "" if m.timing_s is None else f" in {m.timing_s:.1f} s"
    budget = "" if m.timing_budget_s is None else \
        f" (timing budget {m.timing_budget_s:.0f} s in all)"
    return f"{_calls(m.iters)} each{spent}{budget}"


def _mode_findings(m: ModeResult, *, verdict: bool = True, slower: Severity = Severity.WARNING
                   ) -> list[Finding]:
    """What one mode's result says; `verdict` False leaves out its speedup verdict (a
    report-level finding says it for every mode, or nothing was compiled). `slower` is the
    severity of a mode decidedly slower than eager."""
    label = f"mode {m.mode!r}"
    if m.status == "no_compiler":
        return [_NO_COMPILER.finding(
            Severity.ERROR, f"{label} could not compile: inductor on CPU found no C++ compiler.",
            {"mode": m.mode, "error": m.error})]
    if m.status != "ok":
        made = _FAILED.get(m.status, _FAILED["error"])
        return [made.finding(Severity.ERROR, f"{label} failed ({m.status}): {m.error}",
                             {"mode": m.mode, "status": m.status, "error": m.error})]
    out: list[Finding] = []
    evidence: dict[str, float | int | str | bool | None] = {
                "mode": m.mode, "speedup": m.speedup, "eager_ms": m.eager_ms,
                "compiled_ms": m.compiled_ms, "cold_compile_s": m.cold_compile_s,
                "warm_compile_s": m.warm_compile_s, "break_even_calls": m.break_even_calls,
                "break_even_calls_warm": m.break_even_calls_warm, "calls": m.iters,
                "timing_s": m.timing_s, "timing_budget_s": m.timing_budget_s}
    speed = m.speedup_ratio
    if speed is not None:
        evidence.update(speedup_low=speed.low, speedup_high=speed.high,
                        measurable=speed.measurable)
    if not verdict or m.speedup is None:
        pass
    elif m.undecided:
        assert speed is not None
        # Inside the noise after the budget: neither "pays off" nor "slower" is a fact, and
        # nothing about the model: a caveat of this measurement.
        out.append(_NO_MEASURABLE_SPEEDUP.finding(
            Severity.INFO,
            f"{label}: no speedup could be measured here: compiled calls take "
            f"{m.compiled_ms:.3g} ms vs {m.eager_ms:.3g} ms eager, and the interval "
            f"({speed.low:.2f}–{speed.high:.2f}×) still includes 1 (no difference) after "
            f"{_timing(m)}.",
            evidence))
    elif m.faster and m.break_even_calls is not None:
        warm = (f" ({_calls(m.break_even_calls_warm)} with a warm cache)"
                if m.break_even_calls_warm is not None else "")
        out.append(_PAYS_OFF.finding(
            Severity.INFO,
            f"{label} pays off after {_calls(m.break_even_calls)}{warm}: "
            f"{fmt_ratio(speed) if speed is not None else f'{m.speedup:.2f}×'} faster "
            f"({m.eager_ms:.3g} → {m.compiled_ms:.3g} ms per call) for a "
            f"{m.cold_compile_s:.1f} s cold compile.",
            evidence))
    elif not m.faster:
        # A warning only where the interval says slower; a median alone is a note.
        out.append(_NEVER_PAYS_OFF.finding(
            slower if speed is not None and speed.below else Severity.INFO,
            f"{label} never pays off: compiled calls take {m.compiled_ms:.3g} ms vs "
            f"{m.eager_ms:.3g} ms eager "
            f"({fmt_ratio(speed) if speed is not None else f'{m.speedup:.2f}×'}), after a "
            f"{m.cold_compile_s:.1f} s compile.",
            evidence))
    for what, a, r in (("outputs", m.max_abs_diff, m.max_rel_diff),
                       ("gradients", m.grad_max_abs_diff, m.grad_max_rel_diff)):
        if r is None or r <= REL_TOLERANCE:
            continue
        out.append(_NUMERICS.finding(
            Severity.WARNING,
            f"{label} changes the {what}: max abs diff {a:.3g}, {r:.2%} of the largest "
            "eager value.",
            {"mode": m.mode, "what": what, "max_abs_diff": a, "max_rel_diff": r},
            fix="check the model with torch._dynamo.utils.same / lower-precision ops; "
                "try mode='default' or options={'fallback_random': True}."))
    out.extend(_recompile_findings(m, label))
    return out


def _recompile_findings(m: ModeResult, label: str) -> list[Finding]:
    """One finding per recompiled function: count vs the limit, and the last failing guard."""
    limit = m.recompile_limit
    by_fn: dict[tuple[str, str, int], list[Recompile]] = {}
    for r in m.recompiles:
        by_fn.setdefault((r.function, r.file, r.line), []).append(r)
    out = []
    for (fn, file, line), recs in by_fn.items():
        last = recs[-1]
        shape = "size mismatch" in last.guard
        severity = Severity.ERROR if m.limit_hit or len(recs) >= limit else Severity.WARNING
        summary = (f"{label} recompiled {last.where} {len(recs)}× (limit {limit}); last failing "
                   f"guard: {last.guard}")
        if m.limit_hit:
            summary += ". It hit the limit: torch now runs that frame eagerly."
        fix = ("mark the varying dimension dynamic (torch._dynamo.mark_dynamic(x, 0)) or "
               "compile with dynamic=True; pad inputs to a few fixed shapes."
               if shape else
               "make the guarded Python value constant across calls (do not mutate lists, "
               "counters or globals that forward or a hook reads).")
        out.append(_RECOMPILES.finding(severity, summary,
                           {"function": fn, "file": file, "line": line,
                            "recompiles": len(recs), "limit": limit, "guard": last.guard,
                            "source": last.source, "limit_hit": m.limit_hit},
                           fix=fix, module=fn))
    return out


def is_ddp_bucket_break(b: GraphBreak) -> bool:
    """True for a break DDPOptimizer makes on purpose at a DDP bucket boundary.

    Under `DistributedDataParallel`, `torch.compile` splits the graph where DDP's gradient
    buckets end, so that each bucket's all-reduce can start while backward still runs
    (pytorch/pytorch#108966); Dynamo reports each split as a graph break whose reason names
    DDPOptimizer.
    """
    where = (b.file or "").replace("\\", "/")
    return "DDPOptimizer" in f"{b.reason} {b.detail}" or \
        where.endswith("torch/_dynamo/backends/distributed.py")


def _ddp_bucket_finding(breaks: list[GraphBreak]) -> Finding:
    n = len(breaks)
    return _DDP_BUCKETS.finding(
        Severity.INFO,
        f"DDPOptimizer cut the compiled graph at DDP's gradient buckets ({n} graph "
        f"break{'' if n == 1 else 's'} it reports): expected, so that each bucket's "
        "all-reduce overlaps the rest of backward; not a graph break to fix.",
        {"breaks": n, "reason": breaks[0].reason},
        fix="nothing to fix; DDP's bucket_cap_mb sets how many pieces. fullgraph=True cannot "
            "hold under DDP (torch._dynamo.config.optimize_ddp = False gives one graph, "
            "without the overlap).")


def _break_finding(b: GraphBreak) -> Finding:
    inside = f" inside {b.hook}" if b.hook else ""
    return _GRAPH_BREAK.finding(
        Severity.WARNING,
        f"graph break at {b.where} in {b.function or '?'}{inside}: {b.kind} ({b.reason}).",
        {"kind": b.kind, "reason": b.reason, "file": b.file, "line": b.line,
         "function": b.function, "hook": b.hook},
        fix=_BREAK_FIX.get(b.kind, "see torch's reason; wrap the code in "
                                   "torch.compiler.disable if it must stay Python."),
        module=b.function)


@analyzer(CompileReport)
def compile_findings(report: CompileReport, thresholds: object = None) -> list[Finding]:
    """Everything worth saying about a `CompileReport`, most severe first; registered for
    it, so read it as `report.findings()`. `thresholds` is unused: the compile findings have
    none yet.

    A speedup is judged with its interval (`ModeResult.speedup_ratio`): inside the timing
    noise, after the timing budget, it is `compile.no_measurable_speedup` (a measurement
    note), never "pays off" nor "slower"; "slower" is a warning only where the interval lies
    below 1. Each fact is said once: where several modes are all decidedly slower,
    `compile.no_gain` says it for them all. Slower is a note where compiling was only
    offered (`report.proposed`, the doctor's). Where Dynamo compiled nothing
    (`compile.nothing_compiled`), no mode's timing is a verdict on compiling.

    Codes: `compile.pays_off`, `compile.never_pays_off`, `compile.no_measurable_speedup`,
    `compile.numerics`, `compile.recompiles`, `compile.graph_break`, `compile.ddp_buckets`
    (DDPOptimizer's intentional breaks, expected), `compile.best_mode`, `compile.no_gain`,
    `compile.nothing_compiled`, and `compile.<status>` for a mode that failed.
    """
    ok = [m for m in report.modes if m.ok]
    nothing = report.graph_count == 0 and bool(ok)
    # Every mode decidedly slower, with more than one measured: one finding for them all.
    all_slower = len(ok) > 1 and all(m.slower and m.speedup_ratio is not None for m in ok)
    # Slower is a warning where compiling was asked for; the doctor's offer gives a note.
    slower = Severity.INFO if report.proposed else Severity.WARNING
    out: list[Finding] = []
    for m in report.modes:
        out.extend(_mode_findings(m, verdict=not (nothing or all_slower), slower=slower))
    if nothing:
        out.append(_NOTHING_COMPILED.finding(
            slower,
            "torch.compile compiled nothing: Dynamo made 0 graphs of the forward, so every "
            "mode ran eager code and its timings compare eager with eager.",
            {"graph_count": 0, "modes": ", ".join(m.mode for m in ok)}))
    expected = [b for b in report.graph_breaks if is_ddp_bucket_break(b)]
    if expected:
        out.append(_ddp_bucket_finding(expected))
    out.extend(_break_finding(b) for b in report.graph_breaks if not is_ddp_bucket_break(b))
    best = report.best
    if nothing:
        pass
    elif best is not None and len(ok) > 1:
        tied = report.as_fast_as_best
        out.append(_BEST_MODE.finding(
            Severity.INFO,
            f"best mode: {best.mode!r}, {best.speedup:.2f}× eager"
            + (f", paid back after {_calls(best.break_even_calls)}"
               if best.break_even_calls is not None else "")
            + (f" ({', '.join(f'{m.mode!r} {m.speedup:.2f}×' for m in tied)}: no "
               "measurable difference, and it is the simplest)." if tied else "."),
            {"mode": best.mode, "speedup": best.speedup,
             "break_even_calls": best.break_even_calls,
             "as_fast": ", ".join(m.mode for m in tied)},
            fix=f"torch.compile(model, mode={best.mode!r})" if best.mode != "default"
            else "torch.compile(model)"))
    elif all_slower:
        out.append(_NO_GAIN.finding(
            slower,
            f"no measured mode beats eager on {report.inputs} ({report.device}): "
            + ", ".join(f"{m.mode} {fmt_ratio(m.speedup_ratio)}" for m in ok) + ".",
            {"modes": ", ".join(m.mode for m in ok)}))
    return rank(out)
