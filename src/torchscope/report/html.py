"""report.html: one self-contained page (inline CSS, inline SVG plots, no script, no network).

`render_report` lays out a table of contents, the summary, the training step and the ranked
findings, then asks each section's renderer for its plots and its HTML fragment. The
fragment functions below format a capability's own record; they never compute a conclusion.

The page holds up on models of hundreds of modules: charts list full module names grouped by
block (`torchscope.report.charts`), a model of more than `DEEP_ROWS` modules gets a
per-block summary table first and its full table folded (`<details>`), any long table shows
its first `SHOW_ROWS` rows and folds the rest, a chart with nothing to draw is one line
saying why, and every element id is unique on the page (each inline SVG's ids carry their
own prefix).
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from importlib import resources
from pathlib import Path

from torchscope._util import fmt_bytes, fmt_num, fmt_pct, fmt_shape, write_json
from torchscope.capture import ActivationCapture, ActivationRecord, trace_nonfinite
from torchscope.capture.analyze import leaf_modules
from torchscope.compile import CompileReport, ModeResult
from torchscope.findings import Finding, Severity, declared
from torchscope.grads import GradFlow, layer_norms
from torchscope.grads.records import combine_norms
from torchscope.lint import LintResult
from torchscope.memory import CheckpointPlan, MemoryReport, PlanReport
from torchscope.profiling import ProfileResult
from torchscope.report.charts import DEEP_ROWS, block_groups, block_label
from torchscope.report.compile import speed_label
from torchscope.report.document import (
    SCHEMA_VERSION,
    Report,
    SectionOutcome,
    build_document,
    verdict,
    verdict_level,
)
from torchscope.report.findings import evidence_text
from torchscope.report.memory import fmt_recompute, recompute_cost
from torchscope.report.profiling import timing_line

__all__ = [
    "activations_fragment",
    "compile_fragment",
    "gradients_fragment",
    "leaf_records",
    "lint_fragment",
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

MAX_ROWS = 300  # table rows written before the rest is left to report.json
SHOW_ROWS = 20  # rows a long table shows before it folds the rest

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
          numeric: Iterable[int] = (), bad_rows: Iterable[int] = (), raw: Iterable[int] = (),
          folded: str | None = None) -> str:
    """An HTML table; cells are escaped unless their column index is in `raw`.

    A table of more than `SHOW_ROWS` (and a few) rows shows the first `SHOW_ROWS` and folds
    the rest into a `<details>`; `folded` folds the whole table under that summary line.
    """
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

    def tbl(trs: list[str]) -> str:
        return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(trs)}</tbody></table>"

    if folded is not None:
        return _details(folded, tbl(body)) + more
    if len(body) <= SHOW_ROWS + 5:
        return tbl(body) + more
    rest = body[SHOW_ROWS:]
    return tbl(body[:SHOW_ROWS]) + _details(f"{len(rest):,} more rows", tbl(rest)) + more


def _details(summary: str, content: str) -> str:
    return f"<details><summary>{_e(summary)}</summary>{content}</details>"


def _h3(title: str) -> str:
    """A sub-heading of a section (`_section_html` gives it an id; the contents list it)."""
    return f"<h3>{_e(title)}</h3>"


def _plots(plots: Mapping[str, str], captions: Mapping[str, tuple[str, str]]) -> str:
    """Each inline SVG in a `<figure class="plot">` (`data-plot` names it for tests), under
    its caption's title; a plot that had nothing to draw is its one-line reason."""
    out = []
    for pid, svg in plots.items():
        title, caption = captions.get(pid, (pid, ""))
        if not svg.startswith("<svg"):
            out.append(f'<p class="note" data-empty-plot="{_e(pid)}">{_e(title)}: '
                       f"{_e(svg)}</p>")
            continue
        out.append(f'<figure class="plot" data-plot="{_e(pid)}" data-title="{_e(title)}">'
                   f"{svg}<figcaption><b>{_e(title)}.</b> {_e(caption)}</figcaption></figure>")
    return "".join(out)


def _blocks(names: Sequence[str]) -> list[tuple[str, list[int]]] | None:
    """`block_groups` of a list long enough to summarise per block first (more than
    `DEEP_ROWS` modules, in fewer blocks); None otherwise."""
    if len(names) <= DEEP_ROWS:
        return None
    groups = block_groups(names)
    return groups if len(groups) < len(names) else None


def _per_block(names: Sequence[str], groups: Sequence[tuple[str, list[int]]],
               row: Callable[[list[int]], Sequence[Cell]]) -> list[tuple[Cell, ...]]:
    """One summary row per block: its label, its module count, then `row(indices)`."""
    return [(block_label(b, [names[i] for i in idx]), len(idx), *row(idx)) for b, idx in groups]


def _fold_all(n: int, what: str) -> str:
    return f"All {n:,} {what}"


# ---------------------------------------------------------------------------- fragments
def leaf_records(capture: ActivationCapture) -> list[ActivationRecord]:
    """The calls of the captured layers (`torchscope.capture.analyze.leaf_modules`): what
    the tables, plots and byte counts show (a container repeats its last child)."""
    records = capture.records
    leaves = leaf_modules(records)
    return [r for r in records if r.module in leaves]


def activations_fragment(capture: ActivationCapture, plots: Mapping[str, str]) -> str:
    """Leaf-module activation table (per block first on a deep model), the NaN/Inf trace and
    the activation plots."""
    from torchscope.report.plots_doctor import pooled_stats

    t = trace_nonfinite(capture.records)
    if t.producer is not None:
        trace = (f'<p class="sev error">First NaN/Inf: {_e(t.producer.module or "<root>")} '
                 f"({_e(t.producer.module_type)}), carried on by {len(t.passers)} module(s).</p>")
    elif t.made_between:
        trace = (f'<p class="sev error">First NaN/Inf: made outside the captured modules, '
                 f"before {_e(t.passers[0].label)} (the input is finite).</p>")
    elif not t.clean:
        trace = '<p class="sev error">The input already holds NaN/Inf.</p>'
    else:
        trace = '<p class="note">Every output is finite.</p>'
    leaves = [r for r in leaf_records(capture) if r.output is not None]
    outs = [r.output for r in leaves if r.output is not None]  # the same length as leaves
    rows: list[tuple[Cell, ...]] = []
    bad: list[int] = []
    for r, s in zip(leaves, outs, strict=True):
        if not r.finite:
            bad.append(len(rows))
        dead = f"{s.dead_units}/{s.channels}" if s.dead_units is not None else None
        saturated = None if s.saturated_frac is None else fmt_pct(s.saturated_frac)
        rows.append((r.module or "<root>", r.module_type, r.call if r.call else None,
                     fmt_shape(s.shape), s.dtype.replace("torch.", ""), s.mean, s.std, s.min,
                     s.max, fmt_pct(s.zero_frac), dead, saturated, s.nonfinite))
    out_bytes = sum(s.nbytes for r in leaf_records(capture) for s in r.outputs)
    head = (f'<p class="note">One forward, {len(leaves):,} leaf-module calls, '
            f"{_e(fmt_bytes(out_bytes))} of outputs.</p>")
    headers = ("module", "type", "call", "output shape", "dtype", "mean", "std", "min", "max",
               "zeros", "dead units", "saturated", "NaN/Inf")
    names = [r.module for r in leaves]
    groups = _blocks(names)
    summary = ""
    if groups is not None:
        def block(idx: list[int]) -> tuple[Cell, ...]:
            stats = [outs[i] for i in idx]
            mean, std = pooled_stats([outs[i] for i in idx if leaves[i].finite])
            return (fmt_bytes(sum(s.nbytes for s in stats)), mean, std,
                    min((s.min for s in stats), default=None),
                    max((s.max for s in stats), default=None),
                    fmt_pct(max(s.zero_frac for s in stats)),
                    sum(s.dead_units or 0 for s in stats),
                    sum(1 for i in idx if not leaves[i].finite))

        summary = _h3("Per block") + table(
            ("block", "modules", "outputs", "mean", "std", "min", "max", "zeros (max)",
             "dead units", "NaN/Inf modules"),
            _per_block(names, groups, block), numeric=(1, 2, 3, 4, 5, 6, 7, 8, 9),
            bad_rows=[k for k, (_, idx) in enumerate(groups)
                      if any(not leaves[i].finite for i in idx)])
    per_module = table(headers, rows, numeric=(2, 5, 6, 7, 8, 9, 10, 11, 12), bad_rows=bad,
                       folded=None if groups is None else
                       _fold_all(len(rows), "leaf-module outputs"))
    return head + trace + _plots(plots, {
        "activations-stats": ("Output statistics",
                              "Mean ± std and min–max of each leaf module's output."),
        "activations-zeros": ("Zeros", "Share of exactly-zero outputs; red bars have dead "
                                       "channels."),
    }) + summary + _h3("Per module") + per_module


def _tied_notes(flow: GradFlow) -> dict[str, str]:
    """Per module, which of its parameters are tied to another module's (GPT-2's
    `lm_head.weight` is `transformer.wte.weight`), where the records say so
    (`ParamGradRecord.tied_to`: the parameter's first name)."""
    notes: dict[str, list[str]] = {}
    for p in flow.params:
        tied = getattr(p, "tied_to", None)
        if tied:
            for name, to in ((p.name, tied), (tied, p.name)):
                module, _, leaf = name.rpartition(".")
                notes.setdefault(module, []).append(f"{leaf} tied to {to}")
    return {m: "; ".join(dict.fromkeys(v)) for m, v in notes.items()}


def gradients_fragment(flow: GradFlow, plots: Mapping[str, str]) -> str:
    """Per-call gradient norms in backward order (per block first on a deep model), each
    module's parameter norm once, tied parameters named."""
    norms = layer_norms(flow)
    head = f'<p class="note">Total norm (as clip_grad_norm_) {_e(fmt_num(flow.total_norm))}'
    if len(norms) >= 2:
        # A raw measurement, not a diagnosis (tensors of different sizes; see the findings).
        (near, n_near), (far, n_far) = norms[0], norms[-1]
        head += (f"; raw grad_output norm {_e(near)} / {_e(far)}: {n_near / n_far:.3g}×"
                 " (the diagnosis compares ‖g‖/‖w‖ across depth instead)")
    params = flow.param_norms()
    tied = _tied_notes(flow)
    shown: set[str] = set()
    rows: list[tuple[Cell, ...]] = []
    for r in flow.modules:
        if not r.reached:
            continue
        rows.append((r.module or "<root>", r.call if r.call else None,
                     r.output_norm, "None" if r.input_norm is None else fmt_num(r.input_norm),
                     None if r.module in shown else params.get(r.module),
                     "" if r.module in shown else tied.get(r.module, "")))
        shown.add(r.module)
    headers: tuple[str, ...] = ("module (backward order)", "call", "grad_output norm",
                                "grad_input norm", "param grad norm", "note")
    if not tied:  # the note column only says which parameters are tied
        headers, rows = headers[:-1], [row[:-1] for row in rows]
    reached = [r for r in flow.modules if r.reached]
    names = [r.module for r in reached]
    groups = _blocks(names)
    summary = ""
    if groups is not None:
        def block(idx: list[int]) -> tuple[Cell, ...]:
            mods = list(dict.fromkeys(names[i] for i in idx))
            outs = [n for i in idx if (n := reached[i].output_norm) is not None]
            return (max(outs, default=None), combine_norms(params.get(m) for m in mods))

        summary = _h3("Per block (backward order)") + table(
            ("block", "module calls", "grad_output norm (largest)",
             "param grad norm (combined)"), _per_block(names, groups, block),
            numeric=(1, 2, 3))
    return head + ".</p>" + _plots(plots, {"gradients-flow": (
        "Gradient flow", "Gradient norm reaching each layer, input side at the top (log).")}) \
        + summary + _h3("Per module call") + table(
            headers, rows, numeric=(1, 2, 3, 4),
            folded=None if groups is None else _fold_all(len(rows), "module calls"))


def plan_rows(plans: PlanReport) -> list[tuple[CheckpointPlan, tuple[float | None, float | None,
                                                                    float | None], bool | None]]:
    """(plan, recompute (ms, low, high) as `report.memory.recompute_cost` gives it, gradients
    bitwise identical) per checkpoint plan: measured when the plan was applied, else
    predicted with the verdict None (False: it failed its verification)."""
    out: list[tuple[CheckpointPlan, tuple[float | None, float | None, float | None],
                    bool | None]] = []
    for p in plans.plans:
        m = plans.measurement(p.name)
        ok = None if m is None or m.verification is None else m.verification.ok
        out.append((p, recompute_cost(p, m), False if p.status == "unverified" else ok))
    return out


def memory_fragment(report: MemoryReport, plots: Mapping[str, str]) -> str:
    """Memory totals, saved activations per module (per block first on a deep model) and
    checkpoint plans."""
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
    mods = report.saved.modules
    total = max(report.saved.total_bytes, 1)
    groups = _blocks([m.module for m in mods])
    summary = ""
    if groups is not None:
        groups = sorted(groups, key=lambda g: -sum(mods[i].bytes for i in g[1]))
        summary = _h3("Saved per block") + table(
            ("block", "modules", "saved", "share", "tensors"),
            _per_block([m.module for m in mods], groups, lambda idx: (
                fmt_bytes(sum(mods[i].bytes for i in idx)),
                fmt_pct(sum(mods[i].bytes for i in idx) / total),
                sum(mods[i].storages for i in idx))), numeric=(1, 2, 3, 4))
    modules = _h3("Saved per module") + table(
        ("module", "type", "saved", "tensors"),
        [(m.module or "<root>", m.module_type, fmt_bytes(m.bytes), m.storages)
         for m in sorted(mods, key=lambda m: -m.bytes)], numeric=(2, 3),
        folded=None if groups is None else _fold_all(len(mods), "modules, largest first"))
    plans = ""
    if report.plans is not None and report.plans.plans:
        rows = plan_rows(report.plans)
        plans = _h3("Checkpoint plans") + table(
            ("plan", "blocks", "saved", "recompute", "gradients identical"),
            [(p.name, ", ".join(p.checkpointed) or "—", fmt_bytes(p.saved_bytes),
              fmt_recompute(p, report.plans.measurement(p.name)), ok)
             for p, _, ok in rows],
            numeric=(2, 3), bad_rows=[i for i, (_, _, ok) in enumerate(rows) if ok is False])
    return _h3("Totals") + totals + _plots(plots, {
        "memory-saved": ("Saved activations", "Bytes autograd saved for backward, per module, "
                                              "largest first."),
        "memory-plans": ("Checkpoint plans", "Saved memory against recompute time; each "
                                             "plan named in the legend."),
    }) + summary + modules + plans


def per_step(result: ProfileResult, total: float) -> float:
    """A total over the profiled steps (milliseconds, calls), per step."""
    return total / max(result.steps, 1)


def phase_ms(result: ProfileResult, name: str) -> float | None:
    """Host milliseconds per step of the phase labelled `name`, or None without one."""
    ph = result.phase(name)
    return None if ph is None else per_step(result, ph.cpu_ms)


def profile_fragment(result: ProfileResult, plots: Mapping[str, str]) -> str:
    """Phase split per step, top ops and each module's own time per step (per block first
    on a deep model)."""
    # The plain step first: the step the user runs, and the one `diff` compares.
    plain = [] if result.timing.baseline_ms is None else \
        [("step without profiler (median)", result.timing.baseline_ms)]
    phases = table(("phase", "ms per step"), [
        *plain, ("step profiled (median)", result.timing.profiled_ms),
        ("forward", phase_ms(result, "forward")),
        ("backward", phase_ms(result, "backward")),
        ("optimizer", phase_ms(result, "optimizer"))], numeric=(1,))
    ops = sorted(result.ops, key=lambda o: -o.self_cpu_ms)[:40]
    op_rows = table(("op", "calls", "self CPU ms", "total CPU ms", "self %"),
                    [(o.name, o.calls, o.self_cpu_ms, o.cpu_total_ms, fmt_pct(o.self_cpu_frac))
                     for o in ops], numeric=(1, 2, 3, 4))
    modules = ""
    if result.modules:
        mods = result.modules
        groups = _blocks([m.module for m in mods])
        if groups is not None:
            modules = _h3("Time per block") + table(
                ("block", "modules", "forward self ms/step", "backward self ms/step"),
                _per_block([m.module for m in mods], groups, lambda idx: (
                    per_step(result, math.fsum(mods[i].forward_self_ms for i in idx)),
                    per_step(result, math.fsum(mods[i].backward_self_ms for i in idx)))),
                numeric=(1, 2, 3))
        modules += _h3("Time per module") + table(
            ("module", "calls/step", "forward self ms/step", "backward self ms/step"),
            [(m.module or "<root>", round(per_step(result, m.calls)),
              per_step(result, m.forward_self_ms), per_step(result, m.backward_self_ms))
             for m in mods], numeric=(1, 2, 3),
            folded=None if groups is None else _fold_all(len(mods), "modules"))
    return (f'<p class="note">{result.steps} profiled training steps; op times are totals '
            f"over them. {_e(timing_line(result))}</p>" + _h3("Phases") + phases
            + _plots(plots, {"profile-ops": ("Top ops",
                                             "Self CPU time over the profiled steps."),
                             "profile-modules": ("Time per module",
                                                 "Forward and backward time per step of each "
                                                 "module itself (its timed children "
                                                 "excluded).")})
            + _h3("Top ops") + op_rows + modules)


def mode_error(m: ModeResult) -> str:
    """Why a compile mode was not measured (`timeout: ...`); empty when it was."""
    return "" if m.ok else f"{m.status}: {m.error or ''}".strip(": ")


def compile_fragment(report: CompileReport, plots: Mapping[str, str]) -> str:
    """One row per torch.compile mode."""
    def even(v: int | None) -> str:
        return "never" if v is None else f"{v:,}"

    rows = [(m.mode, m.cold_compile_s, m.warm_compile_s, m.eager_ms, m.compiled_ms,
             speed_label(m, report),
             even(m.break_even_calls) if m.ok else "—", len(report.graph_breaks),
             len(m.recompiles), m.max_abs_diff, mode_error(m))
            for m in report.modes]
    nothing = ('<p class="note">Dynamo compiled nothing (0 graphs of the forward): every '
               "mode ran eager code, so no timing here is a verdict on compiling.</p>"
               if report.graph_count == 0 else "")
    return nothing + _plots(plots, {"compile-speedup": (
        "Speedup", "Median speedup over eager with its interval; grey where the interval "
                   "includes 1 (no verdict); left of the dashed line compiled code is "
                   "slower.")}) + _h3("Modes") + table(
        ("mode", "cold compile s", "warm compile s", "eager ms", "compiled ms", "speedup",
         "break-even calls", "graph breaks", "recompiles", "max abs diff", "error"),
        rows, numeric=(1, 2, 3, 4, 5, 6, 7, 8, 9),
        bad_rows=[i for i, m in enumerate(report.modes) if not m.ok])


def lint_fragment(result: LintResult) -> str:
    """One row per violation in the linted source files, and one per file that could not be
    checked."""
    if not result.violations and not result.errors:
        return (f'<p class="note">No trap found in {result.files} source file(s) '
                f"({len(result.codes)} rules).</p>")
    rows = [(f'<span class="sev {v.severity.label}">{v.severity.label}</span>',
             f"<code>{_e(v.code)}</code>", _e(f"{v.path}:{v.line}:{v.col}"), _e(v.message),
             f'<span class="fix">{_e(v.fix)}</span>')
            for v in result.violations]
    rows += [('<span class="sev error">error</span>', "—",
              _e(e.path if e.line is None else f"{e.path}:{e.line}"), _e(e.message), "—")
             for e in result.errors]
    return _h3("Traps in the source") + table(
        ("severity", "rule", "where", "what", "fix"), rows, raw=(0, 1, 2, 3, 4))


# ---------------------------------------------------------------------------- page
def _code_id(code: str) -> str:
    """The page anchor of a code's entry in "What the codes mean"."""
    return "code-" + re.sub(r"[^A-Za-z0-9_.-]", "-", code)


def _finding_rows(findings: Sequence[tuple[str, Finding]]) -> str:
    if not findings:
        return '<p class="note">No findings: nothing looked wrong in the sections that ran.</p>'
    rows = [(f'<span class="sev {f.severity.label}">{f.severity.label}</span>'
             f'<div class="subject">{_e(f.subject.value)}</div>', _e(sec),
             f"{_e(f.summary)}<div class=\"evidence\">{_e(evidence_text(f.evidence))}</div>",
             f'<span class="fix">{_e(f.fix) or "—"}</span>',
             f'<a href="#{_code_id(f.code)}"><code>{_e(f.code)}</code></a>')
            for sec, f in findings]
    return table(("severity", "section", "finding and evidence", "suggested fix", "code"), rows,
                 raw=(0, 1, 2, 3, 4))


def _codes_html(findings: Sequence[tuple[str, Finding]]) -> str:
    """The catalogue's entry of every code on the page (what `torchscope explain` prints),
    so that the page explains itself offline."""
    codes = sorted({f.code for _, f in findings})
    items = []
    for code in codes:
        e = declared(code)
        fixes = "".join(f"<p><b>{_e(k)}:</b> {_e(v)}</p>" for k, v in e.fixes.items())
        lit = f"<p><b>Literature:</b> {_e(e.literature)}</p>" if e.literature else ""
        items.append(
            f'<div class="code-entry" id="{_code_id(code)}"><h3><code>{_e(code)}</code> '
            f"{_e(e.title)}</h3><p class=\"note\">subject: {_e(e.subject.value)} · "
            f"severity: {_e(e.severity)}</p><p>{_e(e.meaning)}</p>"
            f"<p><b>How torchscope decides:</b> {_e(e.criterion)}</p>{lit}"
            f"<p><b>Fix:</b> {_e(e.fix) or 'nothing to fix: this finding informs.'}</p>"
            f"{fixes}</div>")
    return "".join(items)


def _svgs(outcome: SectionOutcome) -> tuple[dict[str, str], list[str]]:
    """The section's plots as inline SVGs (ids prefixed with the section and plot id), or
    the one-line reason of a plot with nothing to draw; and what could not be drawn."""
    from torchscope.report.charts import EmptyPlot, figure_svg

    assert outcome.renderer is not None
    svgs: dict[str, str] = {}
    failed: list[str] = []
    try:
        figures = outcome.renderer.plots(outcome.record)
    except Exception as exc:  # a plot must not cost the user the whole report
        return {}, [f"plots: {type(exc).__name__}: {exc}"]
    for pid, fig in figures.items():
        if isinstance(fig, EmptyPlot):
            svgs[pid] = fig.reason
            continue
        try:
            svgs[pid] = figure_svg(fig, _slug(f"svg-{outcome.name}-{pid}"))
        except Exception as exc:
            failed.append(f"{pid}: {type(exc).__name__}: {exc}")
    return svgs, failed


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]+", "-", text).strip("-")


_PART = re.compile(r'<h3>(?P<h3>.*?)</h3>|<figure class="plot" data-plot="(?P<pid>[^"]*)" '
                   r'data-title="(?P<title>[^"]*)">')


def _anchored(name: str, body: str) -> tuple[str, list[tuple[str, str]]]:
    """`body` with an id on each sub-heading and figure (`<section>-…`, unique on the page),
    and the (id, escaped title) of each, in order, for the contents: a title once, at its
    first place (a plot and the table under it share one, "Top ops")."""
    entries: list[tuple[str, str]] = []
    headings = 0

    def add(a: str, title: str) -> None:
        if all(t != title for _, t in entries):
            entries.append((a, title))

    def anchor(m: re.Match[str]) -> str:
        nonlocal headings
        if m.group("h3") is not None:
            a = f"{_slug(name)}-{headings}"
            headings += 1
            add(a, m.group("h3"))
            return f'<h3 id="{a}">{m.group("h3")}</h3>'
        a = _slug(f"{name}-plot-{m.group('pid')}")
        add(a, m.group("title"))
        return m.group(0).replace("<figure ", f'<figure id="{a}" ', 1)

    return _PART.sub(anchor, body), entries


def _section_html(outcome: SectionOutcome) -> tuple[str, list[tuple[str, str]]]:
    """The section's HTML and its contents entries (id, escaped title)."""
    body = ""
    if outcome.status == "ok" and outcome.renderer is not None:
        svgs, failed = _svgs(outcome)
        body = outcome.renderer.html(outcome.record, svgs) + "".join(
            f'<p class="note">could not draw {_e(f)}</p>' for f in failed)
    body, entries = _anchored(outcome.name, body)
    note = f'<p class="note">{_e(outcome.note)}</p>' if outcome.note else ""
    timing = f" · {outcome.seconds:.1f} s" if outcome.status in ("ok", "failed") else ""
    return (f'<section id="section-{_e(outcome.name)}" class="doctor-section" '
            f'data-section="{_e(outcome.name)}" data-status="{_e(outcome.status)}">'
            f'<h2>{_e(outcome.title)} <span class="status {_e(outcome.status)}">'
            f"{_e(outcome.status)}</span><small class=\"note\">{timing}</small></h2>"
            f"{note}{body}</section>"), entries


def _contents(report: Report, entries: Sequence[list[tuple[str, str]]]) -> str:
    """The table of contents: summary, findings, then each section with its parts."""
    items = ['<li><a href="#verdict">Verdict</a></li>', '<li><a href="#summary">Summary</a></li>',
             f'<li><a href="#findings">Findings</a> <small>{len(report.findings())}</small>'
             "</li>"]
    for o, parts in zip(report.outcomes, entries, strict=True):
        sub = "".join(f'<li><a href="#{a}">{t}</a></li>' for a, t in parts)
        items.append(f'<li><a href="#section-{_e(o.name)}"><span class="dot {_e(o.status)}">'
                     f"</span>{_e(o.title)}</a>{f'<ol>{sub}</ol>' if sub else ''}</li>")
    if report.findings():
        items.append('<li><a href="#codes">What the codes mean</a></li>')
    return f'<nav class="toc" aria-label="Contents"><h2>Contents</h2><ol>{"".join(items)}</ol>' \
           "</nav>"


def render_report(report: Report, title: str = "torchscope doctor") -> str:
    """The whole report.html as a string."""
    t = report.target
    css = resources.files("torchscope.report").joinpath("report.css").read_text()
    sections = [_section_html(o) for o in report.outcomes]
    counts = "".join(f'<span class="count {sev.label}">{report.count(sev)} {sev.label}</span>'
                     for sev in sorted(Severity, reverse=True))
    failed = sum(o.status == "failed" for o in report.outcomes)
    if failed:
        # A section that failed could not look: its findings are missing, not clean.
        counts += (f'<span class="count error">{failed} section{"s" if failed > 1 else ""} '
                   "failed</span>")
    status_rows = [(f'<a href="#section-{_e(o.name)}">{_e(o.title)}</a>',
                    f'<span class="status {_e(o.status)}">{_e(o.status)}</span>',
                    f"{o.seconds:.1f}", _e(o.note) or "—") for o in report.outcomes]
    env = " · ".join(f"{_e(k)} {_e(v)}" for k, v in report.environment.items())
    mode = "training" if report.kind == "run" else \
        "fast" if report.options.get("fast") else "full"
    step = "" if report.step is None else \
        f'<p class="step" data-step>{_e(report.step.describe())}</p>'
    state = verdict_level(report)
    pairs = report.section_findings()
    codes = "" if not pairs else f"""<section id="codes" class="doctor-codes">
<h2>What the codes mean</h2>
{_codes_html(pairs)}
</section>"""
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
<div class="page">
{_contents(report, [entries for _, entries in sections])}
<div class="content">
<header>
<h1>{_e(title)} <small>{_e(t.name)}</small></h1>
<p class="target">{_e(t.model_class)} · {t.parameters:,} parameters ({t.trainable:,} trainable)
 · inputs {_e(t.inputs)} · {_e(t.device)} · {mode} run, {report.seconds:.1f} s</p>
{step}
</header>
<main>
<section id="verdict" class="verdict {state}">
<h2>Verdict</h2>
<p data-verdict>{_e(verdict(report))}</p>
</section>
<section id="summary" class="doctor-summary">
<h2>Summary</h2>
<div class="counts">{counts}</div>
{table(("section", "status", "seconds", "note"), status_rows, numeric=(2,), raw=(0, 1, 3))}
</section>
<section id="findings" class="doctor-findings">
<h2>Findings</h2>
<p class="note">The model's, the loop's and the data's first, a cause before its symptoms,
the most severe first; caveats about this machine and the measurement last.</p>
{_finding_rows(pairs)}
</section>
{"".join(body for body, _ in sections)}
{codes}
</main>
<footer>report.json schema {SCHEMA_VERSION} · created {_e(report.created)} · {env}</footer>
</div>
</div>
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
