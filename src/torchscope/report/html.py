"""report.html: one self-contained page (inline CSS, inline SVG plots, no script, no network).

`render_report` lays out the summary and the ranked findings, then asks each section for its
plots and its HTML fragment. The fragment functions below format a section's record; they
never compute a conclusion.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping, Sequence
from importlib import resources
from typing import TYPE_CHECKING, Any

from torchscope._util import fmt_bytes, fmt_num, fmt_pct, fmt_shape
from torchscope.findings import Finding

if TYPE_CHECKING:
    from torchscope.doctor.runner import DoctorReport
    from torchscope.doctor.section import SectionOutcome
    from torchscope.doctor.sections.activations import ActivationsResult
    from torchscope.doctor.sections.compile import CompileResult
    from torchscope.doctor.sections.gradients import GradientsResult
    from torchscope.doctor.sections.memory import MemoryResult
    from torchscope.doctor.sections.profile import ProfileResult

__all__ = [
    "activations_fragment",
    "compile_fragment",
    "gradients_fragment",
    "memory_fragment",
    "plot_figure",
    "profile_fragment",
    "render_report",
    "table",
]

MAX_ROWS = 300  # table rows shown before the rest is summarised

Cell = str | int | float | None


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _css() -> str:
    return resources.files("torchscope.report").joinpath("report.css").read_text()


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
            cls = ' class="num"' if (i in num_cols or (is_num and i not in raw_cols)) else ""
            cells.append(f"<td{cls}>{text}</td>")
        tr = '<tr class="bad">' if r_i in bad else "<tr>"
        body.append(tr + "".join(cells) + "</tr>")
    more = ""
    if len(all_rows) > MAX_ROWS:
        more = (f'<p class="note">{len(all_rows) - MAX_ROWS:,} more rows are in report.json.'
                "</p>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>{more}"


def plot_figure(plot_id: str, svg: str, caption: str) -> str:
    """A `<figure class="plot">` holding an inline SVG; `data-plot` names it for tests."""
    return (f'<figure class="plot" data-plot="{_e(plot_id)}">{svg}'
            f"<figcaption>{_e(caption)}</figcaption></figure>")


def _plots(plots: Mapping[str, str], captions: Mapping[str, str]) -> str:
    return "".join(plot_figure(pid, svg, captions.get(pid, pid)) for pid, svg in plots.items())


def _evidence(evidence: Mapping[str, Any]) -> str:
    parts = []
    for k, v in evidence.items():
        if isinstance(v, float):
            text = fmt_num(v)
        elif isinstance(v, int) and not isinstance(v, bool):
            text = f"{v:,}"
        else:
            text = str(v)
        parts.append(f"{k}={text}")
    return ", ".join(parts)


# ---------------------------------------------------------------------------- fragments
def activations_fragment(result: ActivationsResult, plots: Mapping[str, str]) -> str:
    """Leaf-module activation table, the NaN/Inf trace and the two activation plots."""
    t = result.trace
    if t.producer is not None:
        trace = (f'<p class="sev error">First NaN/Inf: {_e(t.producer.module or "<root>")} '
                 f"({_e(t.producer.module_type)}), carried on by {len(t.passers)} module(s).</p>")
    elif not t.clean:
        trace = '<p class="sev error">The input already holds NaN/Inf.</p>'
    else:
        trace = '<p class="note">Every output is finite.</p>'
    rows: list[tuple[Cell, ...]] = []
    bad: list[int] = []
    for r in result.leaf_records:
        s = r.output
        if s is None:
            continue
        if not r.finite:
            bad.append(len(rows))
        dead = f"{s.dead_units}/{s.channels}" if s.dead_units is not None else None
        rows.append((r.module or "<root>", r.module_type, r.call if r.call else None,
                     fmt_shape(s.shape), s.dtype.replace("torch.", ""), s.mean, s.std, s.min,
                     s.max, fmt_pct(s.zero_frac), dead, s.nonfinite))
    head = (f'<p class="note">One forward, {len(result.leaf_records):,} leaf-module calls, '
            f"{_e(fmt_bytes(result.output_bytes))} of outputs, "
            f"{result.forward_ms:.1f} ms for the first forward with hooks.</p>")
    tbl = table(("module", "type", "call", "output shape", "dtype", "mean", "std", "min", "max",
                 "zeros", "dead ch.", "NaN/Inf"), rows, numeric=(2, 5, 6, 7, 8, 9, 10, 11),
                bad_rows=bad)
    return head + trace + _plots(plots, {
        "activations-stats": "Mean ± std, min and max of each leaf module's output.",
        "activations-zeros": "Share of exactly-zero outputs; red bars have dead channels.",
    }) + tbl


def gradients_fragment(result: GradientsResult, plots: Mapping[str, str]) -> str:
    """Per-layer gradient norms in backward order."""
    ratio = result.ratio()
    head = ""
    if ratio is not None:
        head = (f'<p class="note">{_e(ratio[1])} receives {ratio[2]:.3g}× less gradient than '
                f"{_e(ratio[0])}; total norm {_e(fmt_num(result.total_norm))}.</p>")
    rows = [(ly.module, ly.grad_output_norm,
             "None" if ly.grad_input_norm is None else fmt_num(ly.grad_input_norm),
             ly.param_grad_norm) for ly in result.layers]
    return head + _plots(plots, {"gradients-flow": "Gradient norm reaching each layer (log)."}) \
        + table(("module (backward order)", "grad_output norm", "grad_input norm",
                 "param grad norm"), rows, numeric=(1, 2, 3))


def memory_fragment(result: MemoryResult, plots: Mapping[str, str]) -> str:
    """Memory totals, saved activations per module and checkpoint plans."""
    totals = table(("what", "bytes"), [
        ("saved activations", fmt_bytes(result.saved_bytes)),
        ("parameters", fmt_bytes(result.param_bytes)),
        ("gradients", fmt_bytes(result.grad_bytes)),
        ("optimizer state", fmt_bytes(result.optimizer_bytes)),
        ("estimated step peak", fmt_bytes(result.peak_estimate_bytes)),
        ("measured step peak", fmt_bytes(result.measured_peak_bytes)),
    ], numeric=(1,))
    modules = table(("module", "type", "saved", "tensors"),
                    [(m.module or "<root>", m.module_type, fmt_bytes(m.saved_bytes), m.tensors)
                     for m in sorted(result.modules, key=lambda m: -m.saved_bytes)],
                    numeric=(2, 3))
    plans = ""
    if result.plans:
        plans = "<h3>Checkpoint plans</h3>" + table(
            ("plan", "blocks", "saved", "recompute ms", "gradients identical"),
            [(p.name, ", ".join(p.blocks) or "—", fmt_bytes(p.saved_bytes), p.recompute_ms,
              p.verified) for p in result.plans],
            numeric=(2, 3), bad_rows=[i for i, p in enumerate(result.plans) if p.verified is False])
    elif result.plans_note:
        plans = f'<h3>Checkpoint plans</h3><p class="note">{_e(result.plans_note)}</p>'
    return totals + _plots(plots, {
        "memory-saved": "Bytes autograd saved for backward, per module.",
        "memory-plans": "Checkpoint plans: saved memory against recompute time.",
    }) + modules + plans


def profile_fragment(result: ProfileResult, plots: Mapping[str, str]) -> str:
    """Phase split, top ops and time per module."""
    phases = table(("phase", "ms"), [("step", result.step_ms), ("forward", result.forward_ms),
                                     ("backward", result.backward_ms),
                                     ("optimizer", result.optimizer_ms)], numeric=(1,))
    total = result.self_cpu_total_us or 1.0
    ops = table(("op", "calls", "self CPU ms", "total CPU ms", "self %"),
                [(o.name, o.calls, o.self_cpu_us / 1e3, o.total_cpu_us / 1e3,
                  fmt_pct(o.self_cpu_us / total)) for o in result.ops[:40]], numeric=(1, 2, 3, 4))
    modules = ""
    if result.modules:
        modules = "<h3>Time per module</h3>" + table(
            ("module", "calls/step", "forward self ms/step", "backward self ms/step"),
            [(m.module or "<root>", m.calls, m.forward_ms, m.backward_ms)
             for m in result.modules], numeric=(1, 2, 3))
    return (f'<p class="note">{result.steps} profiled training steps.</p>' + phases
            + _plots(plots, {"profile-ops": "Top ops by self CPU time over the profiled steps.",
                             "profile-modules": "Forward and backward time per step of each module "
                                                "itself (its timed children excluded)."})
            + "<h3>Top ops</h3>" + ops + modules)


def compile_fragment(result: CompileResult, plots: Mapping[str, str]) -> str:
    """One row per torch.compile mode."""
    def even(v: float | None) -> str:
        return "never" if v is None else f"{v:,.0f}"

    rows = [(m.mode, m.cold_s, m.warm_s, m.eager_ms, m.compiled_ms,
             None if m.speedup is None else f"{m.speedup:.2f}×",
             even(m.break_even_calls) if not m.error else "—", m.graph_breaks, m.recompiles,
             m.max_abs_diff, m.error or "") for m in result.modes]
    return _plots(plots, {"compile-speedup": "Speedup over eager; below the dashed line "
                                             "compiled code is slower."}) + table(
        ("mode", "cold compile s", "warm compile s", "eager ms", "compiled ms", "speedup",
         "break-even calls", "graph breaks", "recompiles", "max abs diff", "error"),
        rows, numeric=(1, 2, 3, 4, 5, 6, 7, 8, 9),
        bad_rows=[i for i, m in enumerate(result.modes) if m.error])


# ---------------------------------------------------------------------------- page
def _finding_rows(findings: Sequence[tuple[str, Finding]]) -> str:
    if not findings:
        return '<p class="note">No findings: nothing looked wrong in the sections that ran.</p>'
    rows = [(f'<span class="sev {f.severity.label}">{f.severity.label}</span>', _e(sec),
             f"{_e(f.summary)}<div class=\"evidence\">{_e(_evidence(f.evidence))}</div>",
             f'<span class="fix">{_e(f.fix) or "—"}</span>', f"<code>{_e(f.code)}</code>")
            for sec, f in findings]
    return table(("severity", "section", "finding and evidence", "suggested fix", "code"), rows,
                 raw=(0, 1, 2, 3, 4))


def _section_html(outcome: SectionOutcome) -> str:
    body = ""
    if outcome.status == "ok" and outcome.section is not None:
        from torchscope.report.plots_doctor import figure_svg

        svgs: dict[str, str] = {}
        failed: list[str] = []
        try:
            figures = outcome.section.plots(outcome.result)
        except Exception as exc:  # a plot must not cost the user the whole report
            figures, failed = {}, [f"plots: {type(exc).__name__}: {exc}"]
        for pid, fig in figures.items():
            try:
                svgs[pid] = figure_svg(fig)
            except Exception as exc:
                failed.append(f"{pid}: {type(exc).__name__}: {exc}")
        body = outcome.section.html(outcome.result, svgs) + "".join(
            f'<p class="note">could not draw {_e(f)}</p>' for f in failed)
    note = f'<p class="note">{_e(outcome.note)}</p>' if outcome.note else ""
    timing = f" · {outcome.seconds:.1f} s" if outcome.status in ("ok", "failed") else ""
    return (f'<section id="section-{_e(outcome.name)}" class="doctor-section" '
            f'data-section="{_e(outcome.name)}" data-status="{_e(outcome.status)}">'
            f'<h2>{_e(outcome.title)} <span class="status {_e(outcome.status)}">'
            f"{_e(outcome.status)}</span><small class=\"note\">{timing}</small></h2>"
            f"{note}{body}</section>")


def render_report(report: DoctorReport) -> str:
    """The whole report.html as a string."""
    from torchscope.doctor.document import SCHEMA_VERSION

    t = report.target
    nav = "".join(f'<a href="#section-{_e(o.name)}"><span class="dot {_e(o.status)}"></span>'
                  f"{_e(o.title)}</a>" for o in report.outcomes)
    counts = "".join(f'<span class="count {sev}">{n} {sev}</span>' for sev, n in (
        ("error", sum(1 for _, f in report.findings if f.severity.label == "error")),
        ("warning", sum(1 for _, f in report.findings if f.severity.label == "warning")),
        ("info", sum(1 for _, f in report.findings if f.severity.label == "info"))))
    status_rows = [(_e(o.title), f'<span class="status {_e(o.status)}">{_e(o.status)}</span>',
                    f"{o.seconds:.1f}", _e(o.note) or "—") for o in report.outcomes]
    env = " · ".join(f"{_e(k)} {_e(v)}" for k, v in report.environment.items())
    opts = report.options
    mode = "fast" if opts.fast else "full"
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>torchscope doctor: {_e(t.name)}</title>
<style>
{_css()}
</style>
</head>
<body>
<header>
<h1>torchscope doctor <small>{_e(t.name)}</small></h1>
<p class="target">{_e(t.model_class)} · {t.parameters:,} parameters ({t.trainable:,} trainable)
 · inputs {_e(t.inputs)} · {_e(t.device)} · {mode} run, {report.seconds:.1f} s</p>
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
{_finding_rows(report.findings)}
</section>
{"".join(_section_html(o) for o in report.outcomes)}
</main>
<footer>report.json schema {SCHEMA_VERSION} · created {_e(report.created)} · {env}</footer>
</body>
</html>
"""
