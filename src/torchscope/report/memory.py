"""Terminal rendering of the memory records (rich tables). Formatting only."""

from __future__ import annotations

from rich.table import Table

from torchscope._timing import fmt_ratio
from torchscope._util import fmt_bytes, fmt_pct, fmt_shape
from torchscope.memory.analysis import describe_segments
from torchscope.memory.records import (
    CheckpointPlan,
    LiveTensors,
    MeasuredMemory,
    MemoryTotals,
    PlanMeasurement,
    PlanReport,
    SavedActivations,
    Verification,
)
from torchscope.report.terminal import ModuleName

__all__ = [
    "blocks_table",
    "fmt_recompute",
    "live_table",
    "plans_table",
    "recompute_cost",
    "saved_table",
    "step_time",
    "totals_table",
    "verification_table",
]


def _table(title: str, *columns: str) -> Table:
    """A table titled on the left; a column written `>name` is right-aligned (numbers)."""
    table = Table(title=title, title_justify="left")
    for col in columns:
        table.add_column(col.removeprefix(">"), justify="right" if col[:1] == ">" else "left")
    return table


def saved_table(saved: SavedActivations, title: str = "Saved activations", limit: int = 40
                ) -> Table:
    """One row per module that saved activations; the last row is the total."""
    table = _table(title, "module", "type", ">saved", ">share", ">storages", ">saves", "dtypes")
    total = max(saved.total_bytes, 1)
    rows = saved.modules
    top = sorted(rows, key=lambda r: -r.bytes)[:limit]
    for r in (r for r in rows if r in top):  # the largest, in the order they first saved
        table.add_row(ModuleName(r.module), r.module_type, fmt_bytes(r.bytes),
                      fmt_pct(r.bytes / total), str(r.storages), str(r.saves),
                      ", ".join(d.replace("torch.", "") for d in r.dtypes))
    rest = [r for r in rows if r not in top]
    if rest:
        rest_bytes = sum(r.bytes for r in rest)
        table.add_row(f"… {len(rest)} more", "", fmt_bytes(rest_bytes), fmt_pct(rest_bytes / total),
                      str(sum(r.storages for r in rest)), str(sum(r.saves for r in rest)), "")
    n_storages = sum(r.storages for r in rows)
    table.add_row("[bold]total[/]", "", f"[bold]{fmt_bytes(saved.total_bytes)}[/]", "100.0%",
                  str(n_storages), str(sum(r.saves for r in rows)), "", end_section=True)
    table.caption = (f"{saved.total_bytes:,} B in {n_storages} storages (inputs "
                     f"{fmt_bytes(saved.input_bytes)}); parameters/buffers saved too: "
                     f"{fmt_bytes(saved.state_bytes)}, counted as model state."
                     + (f" Checkpointed by the model itself (their inputs count for them): "
                        f"{', '.join(n or '<root>' for n in saved.checkpointed[:6])}"
                        f"{', ...' if len(saved.checkpointed) > 6 else ''}."
                        if saved.checkpointed else ""))
    return table


def totals_table(totals: MemoryTotals, measured: MeasuredMemory | None = None,
                 title: str = "Training-step memory") -> Table:
    """The parts of a step's memory, the estimated peak and the measurement beside it."""
    table = _table(title, "part", ">bytes", ">")

    def row(label: str, n: int | None, *, bold: bool = False, end_section: bool = False
            ) -> None:
        size = fmt_bytes(n)
        table.add_row(f"[bold]{label}[/]" if bold else label, f"[bold]{size}[/]" if bold else size,
                      "—" if n is None else f"{n:,}", end_section=end_section)

    row("parameters", totals.parameters)
    if totals.buffers:
        row("buffers", totals.buffers)
    row("gradients", totals.gradients)
    if totals.optimizer_state is not None or totals.optimizer_state_source == "unknown":
        row(f"optimizer state ({totals.optimizer_state_source})", totals.optimizer_state)
    row("saved activations", totals.saved_activations)
    if totals.outputs:
        row("outputs (not saved)", totals.outputs)
    row("estimated peak", totals.peak_estimate, bold=True, end_section=True)
    row("estimated: allocated by the step", totals.step_estimate)
    if measured is not None:
        row("measured: peak allocated by the step", measured.peak_above_baseline, bold=True)
        if measured.method == "cuda-allocator":
            row("measured: allocated before the step", measured.baseline_bytes)
            row("measured: peak allocated (absolute)", measured.peak_bytes)
            table.add_row("measured: reserved after / peak", fmt_bytes(measured.reserved_bytes),
                          fmt_bytes(measured.peak_reserved_bytes))
            table.caption = ("measured with torch.cuda.max_memory_allocated after "
                             "reset_peak_memory_stats; reserved = allocated + the caching "
                             "allocator's cache.")
        else:
            table.caption = (
                "CPU: torch.profiler memory events summed in time order; the peak counts only "
                "what the step allocated above what was live when it began (parameters "
                "excluded). Estimates count what the step keeps; transient buffers (unsaved "
                "intermediates, kernel workspaces) add to the measurement, early frees in "
                "backward subtract.")
    return table


def blocks_table(report: PlanReport, title: str = "Checkpointable blocks") -> Table:
    """Per block: forward time (the cost of recomputing it), saved bytes, input bytes."""
    table = _table(title, ">#", "block", "type", ">forward", ">saved inside", ">input kept")
    for b in report.blocks:
        table.add_row(str(b.index), ModuleName(b.name), b.module_type, f"{b.forward_ms:.3f} ms",
                      fmt_bytes(b.saved_bytes), fmt_bytes(b.input_bytes))
    return table


def step_time(m: PlanMeasurement | None) -> str:
    """A plan's measured step time against no checkpointing: `+12% (1.08–1.17×)`, `no
    measurable cost (0.93–1.06×)`, or `—` (not timed, or the `none` plan)."""
    if m is None or m.slowdown is None:
        return "—"
    r = m.slowdown
    if r.above:
        return f"{r.value - 1:+.0%} ({r.low:.2f}–{r.high:.2f}×)"
    return fmt_ratio(r, none="no measurable cost", above=True)


def recompute_cost(plan: CheckpointPlan, m: PlanMeasurement | None
                   ) -> tuple[float | None, float | None, float | None]:
    """A plan's recompute time in ms as report.json gives it: `(ms, low, high)`.

    Measured: the step time the plan adds with its interval, never below 0; `ms` is None
    where the plan is no measurable cost (its interval includes no difference). Not
    measured: the prediction (the forward time of the checkpointed blocks), no interval.
    """
    if m is None:
        return plan.recompute_ms, None, None
    ms = m.recompute_ms if m.recompute_measurable or m.slowdown is None else None
    return ms, m.recompute_low_ms, m.recompute_high_ms


def _ms(x: float) -> str:
    """`4.28`, `501`, `1,816`: three significant digits, whole milliseconds from 1,000."""
    return f"{x:,.0f}" if x >= 1000 else f"{x:.3g}"


def fmt_recompute(plan: CheckpointPlan, m: PlanMeasurement | None) -> str:
    """`4.28 ms (2.10–6.40)`, `no measurable cost (0–10.0 ms)` (or, measured faster with
    the plan, `no measurable cost (0.91–0.95× the step time)`), or `3.100 ms (predicted)`."""
    ms, low, high = recompute_cost(plan, m)
    if low is None or high is None:
        return f"{ms:.3f} ms (predicted)"
    if ms is None:
        r = m.slowdown if m is not None else None
        if high <= 0 and r is not None:  # measured faster with it: noise, and no cost
            return f"no measurable cost ({r.low:.2f}–{r.high:.2f}× the step time)"
        return f"no measurable cost (0–{_ms(high)} ms)"
    if m is not None and m.slowdown is None:
        return f"{_ms(ms)} ms"
    return f"{_ms(ms)} ms ({_ms(low)}–{_ms(high)})"


def plans_table(report: PlanReport, chosen: str | None = None,
                title: str = "Checkpointing plans") -> Table:
    """Each plan: what it checkpoints, saved bytes, recompute time and peak; measured too.
    A plan that is not offered says why instead of its measurements."""
    table = _table(title, "plan", "checkpointed", ">saved", ">vs none", ">peak act. (pred.)",
                   ">recompute pred.", ">saved (meas.)", ">step time vs none", ">peak (meas.)",
                   "gradients")
    base = max(report.baseline_saved_bytes, 1)
    for p in report.plans:
        m = report.measurement(p.name)
        v = m.verification if m is not None else None
        grads = "—" if v is None else ("[green]bitwise equal[/]" if v.bitwise_equal
                                       else f"[yellow]max diff {v.max_abs_diff:.2g}[/]")
        label = f"[bold]{p.name}[/] ←" if p.name == chosen else p.name
        if p.budget is not None:
            label += f" (≤ {fmt_bytes(p.budget)})"
        row = [label, describe_segments(p), fmt_bytes(p.saved_bytes),
               fmt_pct(p.saved_bytes / base), fmt_bytes(p.peak_activation_bytes),
               f"{p.recompute_ms:.3f} ms"]
        if p.status != "ok":
            what = ("keeps more than none" if p.status == "keeps_more"
                    else "failed verification")
            table.add_row(*row, f"[yellow]not offered: {what}[/]", "", "", "")
            continue
        table.add_row(*row, fmt_bytes(m.saved_bytes) if m else "—", step_time(m),
                      fmt_bytes(m.peak_bytes) if m else "—", grads)
    segs = "" if report.groupable else (" Blocks are not children of an nn.Sequential, so "
                                         "each segment is one block.")
    notes = [f"{p.name}: not offered: {p.failed}" for p in report.plans if p.failed]
    if report.excluded:
        notes.append(f"{len(report.excluded)} block(s) left out: "
                     + "; ".join(f"{n} ({r})" for n, r in report.excluded[:3])
                     + (" …" if len(report.excluded) > 3 else ""))
    table.caption = "\n".join([
        f"smallest feasible budget: {report.min_feasible_bytes:,} B; budget search: "
        f"{report.search}.{segs} Step times are medians of interleaved steps with and "
        "without the plan; a difference inside their interval is no measurable cost.",
        *notes, *report.notes])
    return table


def verification_table(v: Verification, limit: int = 12, title: str = "Verification") -> Table:
    """The loss and the gradients that are not bitwise equal (the worst `limit` of them);
    when every gradient is equal, the loss and the first three as a sample."""
    table = _table(title, "tensor", "bitwise equal", ">max |diff|")
    table.add_row("loss", "yes" if v.loss_equal else "[yellow]no[/]", f"{v.loss_abs_diff:.3g}")
    differing = [g for g in v.grads if not g.bitwise_equal]
    worst = (sorted(differing, key=lambda g: -g.max_abs_diff)[:limit] if differing
             else list(v.grads[:3]))
    for g in worst:
        state = ("[red]missing[/]" if g.missing else "[red]extra[/]" if g.extra
                 else "yes" if g.bitwise_equal else "[yellow]no[/]")
        table.add_row(g.name, state, f"{g.max_abs_diff:.3g}")
    table.caption = (f"{len(v.grads)} gradients compared, seed {v.seed}: "
                     + ("all bitwise equal" if v.bitwise_equal else
                        f"max diff {v.max_abs_diff:.3g}") +
                     ("" if v.buffers_equal else "; buffers differ (updated again in recompute)") +
                     ("" if not v.outputs else f"; {len(v.outputs)} returned tensor(s) ended "
                      f"differently, first {v.outputs[0].path}"))
    return table


def live_table(live: LiveTensors, title: str = "Largest live tensors") -> Table:
    """The largest live tensors and what holds them; CUDA cache before/after empty_cache."""
    table = _table(title, "shape", "dtype", "device", ">bytes", ">views", "held by")
    for t in live.tensors:
        kind = " (param)" if t.is_parameter else ""
        table.add_row(fmt_shape(t.shape), t.dtype.replace("torch.", "") + kind, t.device,
                      fmt_bytes(t.nbytes), str(t.views), "; ".join(t.referrers) or "—")
    cap = f"{live.count} live storages, {fmt_bytes(live.total_bytes)} in all."
    if live.reserved_before is not None:
        cap += (f" CUDA allocated {fmt_bytes(live.allocated_before)} → "
                f"{fmt_bytes(live.allocated_after)}, reserved {fmt_bytes(live.reserved_before)}"
                f" → {fmt_bytes(live.reserved_after)} across empty_cache().")
    table.caption = cap
    return table


