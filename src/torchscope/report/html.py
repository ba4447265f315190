"""report.html: one self-contained page (inline CSS, inline SVG plots, no script, no network).

`render_report` lays out the summary, the training step and the ranked findings, then asks
each section's renderer for its plots and its HTML fragment. The fragment functions below
format a capability's own record; they never compute a conclusion.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping, Sequence
from importlib import resources
from pathlib import Path

from torchscope._util import fmt_bytes, fmt_num, fmt_pct, fmt_shape, write_json
from torchscope.capture import ActivationCapture, ActivationRecord, trace_nonfinite
from torchscope.capture.analyze import leaf_modules
from torchscope.compile import CompileReport, ModeResult
from torchscope.findings import Finding, Severity
from torchscope.grads import GradFlow, layer_norms
from torchscope.memory import CheckpointPlan, MemoryReport, PlanReport
from torchscope.profiling import ProfileResult
from torchscope.report.document import SCHEMA_VERSION, Report, SectionOutcome, build_document
from torchscope.report.findings import evidence_text

__all__ = [
    "activations_fragment",
    "compile_fragment",
    "gradients_fragment",
    "leaf_records",
    "memory_fragment",
    "mode_error",
    "per_step",
    "phase_ms",
    "plan_rows",
    "profile_fragment",
    "render_report",
    "table",
    "write_report",
]

MAX_ROWS = 300  # table rows shown before the rest is summarised

Cell = str | int | float | None


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _cell(value: Cell) -> tuple[str, bool]:
    """(escaped text, is numeric)."""
    if value is None:
        return "—", True
    if isinstance(value, bool):
        return ("yes" if value else "no"), False
    if isinstance(value, int):
        return f"{value:,}", True
    if isinstance(value, float):
        return _e(fmt_num(value)), True
    return _e(value), False


def table(headers: Sequence[str], rows: Iterable[Sequence[Cell]], *,
          numeric: Iterable[int] = (), bad_rows: Iterable[int] = (), raw: Iterable[int] = ()
          ) -> str:
    """An HTML table; cells are escaped unless their column index is in `raw`."""
    num_cols, raw_cols, bad = set(numeric), set(raw), set(bad_rows)
    head = "".join(f'<th class="num">{_e(h)}</th>' if i in num_cols else f"<th>{_e(h)}</th>"
                   for i, h in enumerate(headers))
    body = []
    all_rows = list(rows)
    for r_i, row in enumerate(all_rows[:MAX_ROWS]):
        cells = []
        for i, v in enumerate(row):
            text, is_num = (str(v), False) if i in raw_cols else _cell(v)
            cls = ' class="num"' if i in num_cols or is_num else ""
            cells.append(f"<td{cls}>{text}</td>")
        tr = '<tr class="bad">' if r_i in bad else "<tr>"
        body.append(tr + "".join(cells) + "</tr>")
    more = "" if len(all_rows) <= MAX_ROWS else \
        f'<p class="note">{len(all_rows) - MAX_ROWS:,} more rows are in report.json.</p>'
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>{more}"


def _plots(plots: Mapping[str, str], captions: Mapping[str, str]) -> str:
    """Each inline SVG in a `<figure class="plot">`; `data-plot` names it for tests."""
    return "".join(f'<figure class="plot" data-plot="{_e(pid)}">{svg}'
                   f"<figcaption>{_e(captions.get(pid, pid))}</figcaption></figure>"
                   for pid, svg in plots.items())


# ---------------------------------------------------------------------------- fragments
def leaf_records(capture: ActivationCapture) -> list[ActivationRecord]:
    """The calls of the captured leaf modules (`torchscope.capture.analyze.leaf_modules`):
    what the tables, plots and byte counts show (a container repeats its last child)."""
    records = capture.records
    leaves = leaf_modules(records)
    return [r for r in records if r.module in leaves]


def activations_fragment(capture: ActivationCapture, plots: Mapping[str, str]) -> str:
    """Leaf-module activation table, the NaN/Inf trace and the activation plots."""
    t = trace_nonfinite(capture.records)
    if t.producer is not None:
        trace = (f'<p class="sev error">First NaN/Inf: {_e(t.producer.module or "<root>")} '
                 f"({_e(t.producer.module_type)}), carried on by {len(t.passers)} module(s).</p>")
    elif not t.clean:
        trace = '<p class="sev error">The input already holds NaN/Inf.</p>'
    else:
        trace = '<p class="note">Every output is finite.</p>'
    leaves = leaf_records(capture)
    rows: list[tuple[Cell, ...]] = []
    bad: list[int] = []
    for r in leaves:
        s = r.output
        if s is None:
            continue
        if not r.finite:
            bad.append(len(rows))
        dead = f"{s.dead_units}/{s.channels}" if s.dead_units is not None else None
        rows.append((r.module or "<root>", r.module_type, r.call if r.call else None,
                     fmt_shape(s.shape), s.dtype.replace("torch.", ""), s.mean, s.std, s.min,
                     s.max, fmt_pct(s.zero_frac), dead, s.nonfinite))
    out_bytes = sum(s.nbytes for r in leaves for s in r.outputs)
    head = (f'<p class="note">One forward, {len(leaves):,} leaf-module calls, '
            f"{_e(fmt_bytes(out_bytes))} of outputs.</p>")
    tbl = table(("module", "type", "call", "output shape", "dtype", "mean", "std", "min", "max",
                 "zeros", "dead ch.", "NaN/Inf"), rows, numeric=(2, 5, 6, 7, 8, 9, 10, 11),
                bad_rows=bad)
    return head + trace + _plots(plots, {
        "activations-stats": "Mean ± std, min and max of each leaf module's output.",
        "activations-zeros": "Share of exactly-zero outputs; red bars have dead channels.",
    }) + tbl


def gradients_fragment(flow: GradFlow, plots: Mapping[str, str]) -> str:
    """Per-call gradient norms in backward order, each module's parameter norm once."""
    norms = layer_norms(flow)
    head = f'<p class="note">Total norm (as clip_grad_norm_) {_e(fmt_num(flow.total_norm))}'
    if len(norms) >= 2:
        # A raw measurement, not a diagnosis (tensors of different sizes; see the findings).
        (near, n_near), (far, n_far) = norms[0], norms[-1]
        head += (f"; raw grad_output norm {_e(near)} / {_e(far)}: {n_near / n_far:.3g}×"
                 " (the diagnosis compares ‖g‖/‖w‖ across depth instead)")
    params = flow.param_norms()
    shown: set[str] = set()
    rows: list[tuple[Cell, ...]] = []
    for r in flow.modules:
        if not r.reached:
            continue
        rows.append((r.module or "<root>", r.call if r.call else None,
                     r.output_norm, "None" if r.input_norm is None else fmt_num(r.input_norm),
                     None if r.module in shown else params.get(r.module)))
        shown.add(r.module)
    return head + ".</p>" + _plots(
        plots, {"gradients-flow": "Gradient norm reaching each layer (log)."}) + table(
        ("module (backward order)", "call", "grad_output norm", "grad_input norm",
         "param grad norm"), rows, numeric=(1, 2, 3, 4))


def plan_rows(plans: PlanReport) -> list[tuple[CheckpointPlan, float, bool | None]]:
    """(plan, recompute ms, gradients bitwise identical) per checkpoint plan: measured when
    the plan was applied, else predicted with the verdict None (False: it failed its
    verification)."""
    out: list[tuple[CheckpointPlan, float, bool | None]] = []
    for p in plans.plans:
        m = plans.measurement(p.name)
        ok = None if m is None or m.verification is None else m.verification.ok
        out.append((p, p.recompute_ms if m is None else m.recompute_ms,
                    False if p.status == "unverified" else ok))
    return out


def memory_fragment(report: MemoryReport, plots: Mapping[str, str]) -> str:
    """Memory totals, saved activations per module and checkpoint plans."""
    t = report.totals
    totals = table(("what", "bytes"), [
        ("saved activations", fmt_bytes(report.saved.total_bytes)),
        ("parameters", fmt_bytes(t.parameters)),
        ("gradients", fmt_bytes(t.gradients)),
        ("optimizer state", fmt_bytes(t.optimizer_state)),
        ("estimated step peak", fmt_bytes(t.peak_estimate)),
        ("measured step peak",
         fmt_bytes(None if report.measured is None else report.measured.peak_bytes)),
    ], numeric=(1,))
    modules = table(("module", "type", "saved", "tensors"),
                    [(m.module or "<root>", m.module_type, fmt_bytes(m.bytes), m.storages)
                     for m in sorted(report.saved.modules, key=lambda m: -m.bytes)],
                    numeric=(2, 3))
    plans = ""
    if report.plans is not None and report.plans.plans:
        rows = plan_rows(report.plans)
        plans = "<h3>Checkpoint plans</h3>" + table(
            ("plan", "blocks", "saved", "recompute ms", "gradients identical"),
            [(p.name, ", ".join(p.checkpointed) or "—", fmt_bytes(p.saved_bytes), ms, ok)
             for p, ms, ok in rows],
            numeric=(2, 3), bad_rows=[i for i, (_, _, ok) in enumerate(rows) if ok is False])
    return totals + _plots(plots, {
        "memory-saved": "Bytes autograd saved for backward, per module.",
        "memory-plans": "Checkpoint plans: saved memory against recompute time.",
    }) + modules + plans


def per_step(result: ProfileResult, total: float) -> float:
    """A total over the profiled steps (milliseconds, calls), per step."""
    return total / max(result.steps, 1)


def phase_ms(result: ProfileResult, name: str) -> float | None:
    """Host milliseconds per step of the phase labelled `name`, or None without one."""
    ph = result.phase(name)
    return None if ph is None else per_step(result, ph.cpu_ms)


def profile_fragment(result: ProfileResult, plots: Mapping[str, str]) -> str:
    """Phase split per step, top ops and each module's own time per step."""
    phases = table(("phase", "ms per step"), [
        ("step (median)", result.timing.profiled_ms), ("forward", phase_ms(result, "forward")),
        ("backward", phase_ms(result, "backward")),
        ("optimizer", phase_ms(result, "optimizer"))], numeric=(1,))
    ops = sorted(result.ops, key=lambda o: -o.self_cpu_ms)[:40]
    op_rows = table(("op", "calls", "self CPU ms", "total CPU ms", "self %"),
                    [(o.name, o.calls, o.self_cpu_ms, o.cpu_total_ms, fmt_pct(o.self_cpu_frac))
                     for o in ops], numeric=(1, 2, 3, 4))
    modules = ""
    if result.modules:
        modules = "<h3>Time per module</h3>" + table(
            ("module", "calls/step", "forward self ms/step", "backward self ms/step"),
            [(m.module or "<root>", round(per_step(result, m.calls)),
              per_step(result, m.forward_self_ms), per_step(result, m.backward_self_ms))
             for m in result.modules], numeric=(1, 2, 3))
    return (f'<p class="note">{result.steps} profiled training steps; op times are totals '
            "over them.</p>" + phases
            + _plots(plots, {"profile-ops": "Top ops by self CPU time over the profiled steps.",
                             "profile-modules": "Forward and backward time per step of each "
                                                "module itself (its timed children excluded)."})
            + "<h3>Top ops</h3>" + op_rows + modules)


def mode_error(m: ModeResult) -> str:
    """Why a compile mode was not measured (`timeout: ...`); empty when it was."""
    return "" if m.ok else f"{m.status}: {m.error or ''}".strip(": ")


def compile_fragment(report: CompileReport, plots: Mapping[str, str]) -> str:
    """One row per torch.compile mode."""
    def even(v: int | None) -> str:
        return "never" if v is None else f"{v:,}"

    rows = [(m.mode, m.cold_compile_s, m.warm_compile_s, m.eager_ms, m.compiled_ms,
             None if m.speedup is None else f"{m.speedup:.2f}×",
             even(m.break_even_calls) if m.ok else "—", len(report.graph_breaks),
             len(m.recompiles), m.max_abs_diff, mode_error(m))
            for m in report.modes]
    return _plots(plots, {"compile-speedup": "Speedup over eager; below the dashed line "
                                             "compiled code is slower."}) + table(
        ("mode", "cold compile s", "warm compile s", "eager ms", "compiled ms", "speedup",
         "break-even calls", "graph breaks", "recompiles", "max abs diff", "error"),
        rows, numeric=(1, 2, 3, 4, 5, 6, 7, 8, 9),
        bad_rows=[i for i, m in enumerate(report.modes) if not m.ok])


# ---------------------------------------------------------------------------- page
def _finding_rows(findings: Sequence[tuple[str, Finding]]) -> str:
    if not findings:
        return '<p class="note">No findings: nothing looked wrong in the sections that ran.</p>'
    rows = [(f'<span class="sev {f.severity.label}">{f.severity.label}</span>', _e(sec),
             f"{_e(f.summary)}<div class=\"evidence\">{_e(evidence_text(f.evidence))}</div>",
             f'<span class="fix">{_e(f.fix) or "—"}</span>', f"<code>{_e(f.code)}</code>")
            for sec, f in findings]
    return table(("severity", "section", "finding and evidence", "suggested fix", "code"), rows,
                 raw=(0, 1, 2, 3, 4))


def _section_html(outcome: SectionOutcome) -> str:
    body = ""
    if outcome.status == "ok" and outcome.renderer is not None:
        from torchscope.report.plots_doctor import figure_svg

        svgs: dict[str, str] = {}
        failed: list[str] = []
        try:
            figures = outcome.renderer.plots(outcome.record)
        except Exception as exc:  # a plot must not cost the user the whole report
            figures, failed = {}, [f"plots: {type(exc).__name__}: {exc}"]
        for pid, fig in figures.items():
            try:
                svgs[pid] = figure_svg(fig)
            except Exception as exc:
                failed.append(f"{pid}: {type(exc).__name__}: {exc}")
        body = outcome.renderer.html(outcome.record, svgs) + "".join(
            f'<p class="note">could not draw {_e(f)}</p>' for f in failed)
    note = f'<p class="note">{_e(outcome.note)}</p>' if outcome.note else ""
    timing = f" · {outcome.seconds:.1f} s" if outcome.status in ("ok", "failed") else ""
    return (f'<section id="section-{_e(outcome.name)}" class="doctor-section" '
            f'data-section="{_e(outcome.name)}" data-status="{_e(outcome.status)}">'
            f'<h2>{_e(outcome.title)} <span class="status {_e(outcome.status)}">'
            f"{_e(outcome.status)}</span><small class=\"note\">{timing}</small></h2>"
            f"{note}{body}</section>")


def render_report(report: Report, title: str = "torchscope doctor") -> str:
    """The whole report.html as a string."""
    t = report.target
    css = resources.files("torchscope.report").joinpath("report.css").read_text()
    nav = "".join(f'<a href="#section-{_e(o.name)}"><span class="dot {_e(o.status)}"></span>'
                  f"{_e(o.title)}</a>" for o in report.outcomes)
    counts = "".join(f'<span class="count {sev.label}">{report.count(sev)} {sev.label}</span>'
                     for sev in sorted(Severity, reverse=True))
    status_rows = [(_e(o.title), f'<span class="status {_e(o.status)}">{_e(o.status)}</span>',
                    f"{o.seconds:.1f}", _e(o.note) or "—") for o in report.outcomes]
    env = " · ".join(f"{_e(k)} {_e(v)}" for k, v in report.environment.items())
    mode = "training" if report.kind == "run" else \
        "fast" if report.options.get("fast") else "full"
    step = "" if report.step is None else \
        f'<p class="step" data-step>{_e(report.step.describe())}</p>'
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{_e(title)}: {_e(t.name)}</title>
<style>
{css}
</style>
</head>
<body>
<header>
<h1>{_e(title)} <small>{_e(t.name)}</small></h1>
<p class="target">{_e(t.model_class)} · {t.parameters:,} parameters ({t.trainable:,} trainable)
 · inputs {_e(t.inputs)} · {_e(t.device)} · {mode} run, {report.seconds:.1f} s</p>
{step}
<nav>{nav}</nav>
</header>
<main>
<section id="summary" class="doctor-summary">
<h2>Summary</h2>
<div class="counts">{counts}</div>
{table(("section", "status", "seconds", "note"), status_rows, numeric=(2,), raw=(0, 1, 3))}
</section>
<section id="findings" class="doctor-findings">
<h2>Findings, most severe first</h2>
{_finding_rows(report.section_findings())}
</section>
{"".join(_section_html(o) for o in report.outcomes)}
</main>
<footer>report.json schema {SCHEMA_VERSION} · created {_e(report.created)} · {env}</footer>
</body>
</html>
"""


def write_report(report: Report, out_dir: str | Path) -> tuple[Path, Path]:
    """Write `report` as report.html and report.json side by side in `out_dir` (created
    if needed).

    Returns:
        (path of report.html, path of report.json).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    html_path, json_path = out / "report.html", out / "report.json"
    write_json(json_path, build_document(report))
    html_path.write_text(render_report(report, f"torchscope {report.kind}"), encoding="utf-8")
    return html_path, json_path
