"""Analysis: pure functions from memory records to `Finding`s (no formatting of tables).

Each is registered with `@analyzer` for its record type, so `record.findings()` runs it.
The memory area has no thresholds object: the `thresholds` argument is accepted for the
common signature and ignored.
"""

from __future__ import annotations

from collections import Counter

from torchscope._timing import fmt_ratio
from torchscope._util import fmt_bytes, fmt_names
from torchscope.catalogue import entry
from torchscope.findings import Finding, Severity, analyzer
from torchscope.hooks.compiled import ran_eagerly
from torchscope.memory.records import (
    CheckpointPlan,
    LiveTensors,
    MeasuredMemory,
    MemoryHistory,
    MemoryReport,
    MemoryTotals,
    PlanMeasurement,
    PlanReport,
    SavedActivations,
)

_SAVED_BY_TYPE = entry("memory.saved_by_type")
_LARGEST_SAVER = entry("memory.largest_saver")
_ACTIVATIONS_DOMINATE = entry("memory.activations_dominate")
_OPTIMIZER_STATE = entry("memory.optimizer_state")
_ESTIMATE_VS_MEASURED = entry("memory.estimate_vs_measured")
_COMPILED_EAGER = entry("memory.compiled_eager")
_NO_PLAN = entry("memory.no_plan")
_BLOCKS_EXCLUDED = entry("memory.blocks_excluded")
_PLAN_NOTE = entry("memory.plan_note")
_PLAN_KEEPS_MORE = entry("memory.plan_keeps_more")
_CHECKPOINT_FAILED = entry("memory.checkpoint_failed")
_CHECKPOINT_PLAN = entry("memory.checkpoint_plan")
_NOT_BITWISE = entry("memory.not_bitwise")
_BUFFERS_RECOMPUTED = entry("memory.buffers_recomputed")
_EMPTY_CACHE = entry("memory.empty_cache")
_LARGEST_LIVE = entry("memory.largest_live")
_SAVED_GROWTH = entry("memory.saved_growth")
_PEAK_GROWTH = entry("memory.peak_growth")

_GROWTH = 1.5  # a later sample this many times the first one's bytes is worth a finding


_CHECKPOINT_BY_HAND = ("checkpoint parts of forward yourself with "
                       "torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False), or "
                       "lower the batch or sequence size.")


def _already_checkpointed(names: tuple[str, ...]) -> str:
    """The fix for activation-dominated memory in a model that checkpoints itself."""
    shown = ", ".join(n or "<root>" for n in names[:3]) + (", ..." if len(names) > 3 else "")
    return (f"the model already checkpoints {len(names)} part(s) itself ({shown}): what stays "
            "saved is mostly their inputs. Lower the batch or sequence size, checkpoint "
            "longer stretches per call, or keep saved tensors on the host "
            "(torch.autograd.graph.save_on_cpu).")


@analyzer(MemoryReport)
def analyze_report(report: MemoryReport, thresholds: object = None) -> list[Finding]:
    """Saved activations, the step's totals against its measurement, and the chosen plan.

    The fix for activation-dominated memory names only what works for this model: the
    verified plan where it lowers the measured peak (its caveat too, where it updates
    buffers twice); for a model that checkpoints itself, what is left to do; the planner
    when the model has blocks to checkpoint; else checkpointing by hand. A plan whose
    measured peak did not fall is never recommended. A plan the user did not ask for
    (`report.proposed`, the doctor's) gives notes, never warnings.
    """
    plan = report.chosen_plan
    by_hand = _already_checkpointed(report.saved.checkpointed) if report.saved.checkpointed \
        else _CHECKPOINT_BY_HAND
    lowers = None if report.plans is None or report.chosen is None else \
        lowers_peak(report.plans, report.chosen)
    if plan is not None and plan.status == "ok" and plan.segments and lowers is False:
        fix = ("checkpointing lowers the measured peak by nothing on this step (the peak "
               "comes after the saved activations are freed, in backward): a smaller batch "
               "or sequence lowers it.")
    elif plan is not None and plan.status == "ok" and plan.segments:
        v = report.verification
        caveat = "" if v is None or v.buffers_equal else \
            ", though it updates buffers such as BatchNorm's running stats twice"
        fix = f"apply the verified plan ({report.chosen}{caveat}): {apply_hint(plan)}"
    elif report.saved.checkpointed:
        fix = by_hand
    elif report.plans is None and not report.no_plan and report.checkpointable:
        fix = ("gradient checkpointing trades recompute for this memory: torchscope memory "
               f"--checkpoint auto plans it over {len(report.checkpointable)} blocks.")
    else:
        fix = by_hand
    out = analyze_saved(report.saved) + _totals(report.totals, report.measured, fix)
    if report.no_plan:
        # Blocks that all hold no trainable work have nothing to give; without a block
        # sequence, checkpointing by hand still can.
        out.append(_NO_PLAN.finding(Severity.INFO,
                                    f"no checkpoint plan: {report.no_plan}",
                                    {"reason": report.no_plan},
                                    fix="" if report.checkpointable else by_hand))
    if report.plans is not None:
        out += _plans(report.plans, report.chosen, asked=not report.proposed)
    return out


def lowers_peak(plans: PlanReport, name: str) -> bool | None:
    """Whether plan `name`, applied, measured a lower step peak than no checkpointing;
    None where either peak was not measured."""
    m, none = plans.measurement(name), plans.measurement("none")
    if m is None or none is None or none.peak_bytes <= 0:
        return None
    return m.peak_bytes < none.peak_bytes


@analyzer(SavedActivations)
def analyze_saved(saved: SavedActivations, thresholds: object = None) -> list[Finding]:
    """Which module types hold the saved activations, and the largest single holder."""
    compiled = ran_eagerly(
        _COMPILED_EAGER, saved.compiled, "the saved-activation count",
        also=": these are the bytes the eager model saves; the compiled graph keeps what "
             "its partitioner chose (often less, recomputing cheap ops in backward)",
        fix="compare the compiled step's own peak (torch.cuda.max_memory_allocated around "
            "it, no torchscope hooks open) with the eager one; per-module saved bytes need "
            "hooks, which need eager code.")
    total = saved.total_bytes
    if total <= 0:
        return compiled
    by_type: Counter[str] = Counter()
    for row in saved.modules:
        by_type[row.module_type or "(no module)"] += row.bytes
    kind, nbytes = max(by_type.items(), key=lambda kv: kv[1])
    share = nbytes / total
    top = max(saved.modules, key=lambda r: r.bytes)
    # One module of that type holds all of it (a ReLU module reused by every layer): one
    # finding names it, rather than a second one repeating the same bytes.
    alone = (top.module_type or "(no module)") == kind and top.bytes == nbytes
    out = [_SAVED_BY_TYPE.finding(Severity.INFO,
        f"{kind} outputs hold {share:.0%} of saved activations "
        f"({fmt_bytes(nbytes)} of {fmt_bytes(total)})"
        + (f", all of them {top.module or '<root>'}'s." if alone else "."),
        {"module_type": kind, "bytes": nbytes, "total_bytes": total, "share": share},
        module=top.module if alone else None,
    )]
    if len(saved.modules) > 2 and top.bytes / total >= 0.25 and not alone:
        out.append(_LARGEST_SAVER.finding(Severity.INFO,
            f"{top.module or '<root>'} ({top.module_type}) alone keeps "
            f"{top.bytes / total:.0%} of saved activations ({fmt_bytes(top.bytes)}).",
            {"bytes": top.bytes, "share": top.bytes / total, "storages": top.storages},
            fix=("it is checkpointed already, and these are the inputs its checkpoint keeps: "
                 "checkpoint a longer stretch in one call, or lower its batch or sequence "
                 "size." if top.module in saved.checkpointed else
                 "checkpoint the block containing it, or lower its batch or sequence size."),
            module=top.module,
        ))
    return compiled + out


@analyzer(MemoryTotals)
def analyze_totals(totals: MemoryTotals, thresholds: object = None) -> list[Finding]:
    """What dominates the step's memory."""
    return _totals(totals, None, "gradient checkpointing trades recompute for this memory "
                   "(torchscope.memory.plan_checkpointing plans it over the model's blocks).")


def _totals(totals: MemoryTotals, measured: MeasuredMemory | None, fix: str) -> list[Finding]:
    """What dominates the step's memory, and how the estimate compares to the measurement;
    `fix` is what to do when activations dominate."""
    out: list[Finding] = []
    state = totals.parameters + totals.gradients + (totals.optimizer_state or 0)
    if totals.saved_activations > state and totals.saved_activations > 0:
        out.append(_ACTIVATIONS_DOMINATE.finding(Severity.INFO,
            f"saved activations ({fmt_bytes(totals.saved_activations)}) exceed parameters, "
            f"gradients and optimizer state together ({fmt_bytes(state)}).",
            {"saved_activations": totals.saved_activations, "state": state},
            fix=fix,
        ))
    if totals.optimizer_state and totals.parameters and (
            totals.optimizer_state >= 1.5 * totals.parameters):
        ratio = totals.optimizer_state / totals.parameters
        out.append(_OPTIMIZER_STATE.finding(Severity.INFO,
            f"optimizer state is {ratio:.1f}× the parameters "
            f"({fmt_bytes(totals.optimizer_state)}, {totals.optimizer_state_source}).",
            {"optimizer_state": totals.optimizer_state, "ratio": ratio},
        ))
    if measured is not None and measured.peak_above_baseline > 0:
        meas = measured.peak_above_baseline
        ratio = meas / max(totals.step_estimate, 1)
        extra = (f"; transient buffers (unsaved intermediates, kernel workspaces) add "
                 f"{fmt_bytes(meas - totals.step_estimate)} at the peak"
                 if meas > totals.step_estimate else
                 "; backward frees activations while it writes gradients")
        out.append(_ESTIMATE_VS_MEASURED.finding(Severity.INFO,
            f"the step keeps {fmt_bytes(totals.step_estimate)} by count (saved activations, "
            f"outputs, gradients); its measured peak is {fmt_bytes(meas)} "
            f"({ratio:.2f}×){extra}.",
            {"estimate": totals.step_estimate, "measured": meas, "ratio": ratio,
             "method": measured.method},
        ))
    return out


def describe_segments(plan: CheckpointPlan) -> str:
    """`blocks 2–7` / `all 8 blocks in 3 segments` / `blocks 1, 3` for a plan."""
    n = len(plan.blocks)
    ckpt = [i for a, b in plan.segments for i in range(a, b)]
    if not ckpt:
        return "no blocks"
    if len(ckpt) == n:
        return (f"all {n} blocks" if len(plan.segments) == n
                else f"all {n} blocks in {len(plan.segments)} segments")
    runs: list[tuple[int, int]] = []
    for i in ckpt:
        if runs and runs[-1][1] == i - 1:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    parts = [str(a) if a == b else f"{a}–{b}" for a, b in runs]
    word = "block" if len(ckpt) == 1 else "blocks"
    return f"{word} {', '.join(parts)} of {n}"


def apply_hint(plan: CheckpointPlan) -> str:
    """The call that installs `plan` in the user's code."""
    if all(b - a == 1 for a, b in plan.segments):
        return f"torchscope.memory.apply(model, blocks={list(plan.checkpointed)!r})"
    # Segments of several blocks run inside their nn.Sequential: name it, with the segments
    # counted among its children (the plan's blocks may start after a frozen first one).
    prefix = f"{plan.parent}." if plan.parent else ""
    keys = [n.removeprefix(prefix) for n in plan.blocks]
    if plan.parent is not None and all(k.isdigit() for k in keys):
        first = int(keys[0])
        segments = [(a + first, b + first) for a, b in plan.segments]
        container = repr(plan.parent) if plan.parent else "model"
        return f"torchscope.memory.apply(model, blocks={container}, segments={segments})"
    return f"torchscope.memory.apply_plan(model, <the {plan.name!r} plan>, inputs)"


@analyzer(PlanReport)
def analyze_plans(report: PlanReport, thresholds: object = None) -> list[Finding]:
    """One finding per plan: saving, cost, verification."""
    return _plans(report, None)


def _cost(m: PlanMeasurement | None) -> tuple[str, dict[str, float | int | str | bool | None]]:
    """` at +12% step time (1.08–1.17×)` or ` at no measurable cost in step time (...)`, and the
    evidence; nothing without a timing. A cost inside the noise is never given a sign."""
    if m is None or m.slowdown is None:
        return "", {}
    r = m.slowdown
    evidence: dict[str, float | int | str | bool | None] = {
        "step_ms": m.step_ms, "slowdown": r.value, "slowdown_low": r.low,
        "slowdown_high": r.high, "measurable": r.above, "repeats": m.repeats,
        "recompute_ms": m.recompute_ms if m.recompute_measurable else None,
        "recompute_low_ms": m.recompute_low_ms, "recompute_high_ms": m.recompute_high_ms}
    if r.above:
        return f" at {r.value - 1:+.0%} step time ({r.low:.2f}–{r.high:.2f}×)", evidence
    return f" at {fmt_ratio(r, none='no measurable cost in step time', above=True)}", evidence


def _plans(report: PlanReport, chosen: str | None, *, asked: bool = True) -> list[Finding]:
    """One finding per plan (or the chosen one): saving, cost, verification; plans that are
    not offered (they keep more, or failed their verification) say why. A plan whose
    measured peak did not fall carries no fix: it is not recommended. Its caveats (a failed
    verification, gradients not bitwise equal, buffers updated twice) are warnings where
    checkpointing was `asked` for, notes where the plan is only an offer."""
    caveat = Severity.WARNING if asked else Severity.INFO
    out: list[Finding] = []
    if report.excluded:
        names = [n for n, _ in report.excluded]
        shown = fmt_names(names, 4)
        reasons = "; ".join(sorted({r for _, r in report.excluded}))
        out.append(_BLOCKS_EXCLUDED.finding(Severity.INFO,
            f"{len(names)} block(s) left out of checkpoint planning ({shown}): {reasons}.",
            {"blocks": len(names), "first": names[0]},
        ))
    for note in report.notes:
        out.append(_PLAN_NOTE.finding(Severity.INFO, note, {}))
    # A plan that keeps more than none is said whichever plan was asked for: it explains
    # why the others were not offered.
    for plan in report.plans:
        if plan.status == "keeps_more":
            out.append(_PLAN_KEEPS_MORE.finding(Severity.INFO,
                f"{plan.name}: checkpointing {describe_segments(plan)} is not offered: it "
                f"{plan.failed}.",
                {"plan": plan.name, "saved_bytes": plan.saved_bytes,
                 "baseline_bytes": report.baseline_saved_bytes},
            ))
    names = [chosen] if chosen else [p.name for p in report.plans if p.name != "none"]
    saves = any(p.status == "ok" and p.segments and p.saved_bytes < report.baseline_saved_bytes
                for p in report.plans)
    for name in names:
        if not report.has(name):
            continue
        plan = report.plan(name)
        base = max(report.baseline_saved_bytes, 1)
        if plan.status == "keeps_more":
            continue
        if plan.status == "unverified":
            out.append(_CHECKPOINT_FAILED.finding(caveat,
                f"{name}: checkpointing {describe_segments(plan)} failed its verification, "
                f"so it is not offered: {plan.failed}",
                {"plan": name},
                fix="leave out the blocks that change state in forward (blocks=...), or make "
                "their forward recompute exactly what it computed.",
            ))
            continue
        m = report.measurement(name)
        saved = m.saved_bytes if m is not None else plan.saved_bytes
        saving = report.baseline_saved_bytes - saved
        evidence: dict[str, float | int | str | bool | None] = {
            "plan": name, "saved_bytes": saved, "saving_bytes": saving,
            "predicted_recompute_ms": plan.recompute_ms}
        if not plan.segments:
            budget = ("" if plan.budget is None else
                      f", within the budget of {fmt_bytes(plan.budget)}")
            out.append(_CHECKPOINT_PLAN.finding(Severity.INFO,
                f"{name}: no checkpointing needed: the step keeps {fmt_bytes(saved)} of "
                f"saved activations{budget}." if saves else
                f"{name}: no checkpointing plan keeps fewer saved activations than none "
                f"({fmt_bytes(saved)}): there is nothing to gain from checkpointing here.",
                evidence))
            continue
        cost, timing = _cost(m)
        evidence.update(timing)
        verified = ""
        v = m.verification if m is not None else None
        if v is not None:
            verified = (", gradients verified identical" if v.bitwise_equal
                        else f", gradients verified within tolerance (max diff "
                        f"{v.max_abs_diff:.2g})")
            evidence.update(bitwise_equal=v.bitwise_equal, max_abs_diff=v.max_abs_diff)
        # What the saved activations give back is not always the step's peak: where the
        # peak comes later in backward (the gradients being written), it does not fall.
        none = report.measurement("none")
        peak = ""
        lowers = lowers_peak(report, name)
        if m is not None and none is not None and lowers is not None:
            evidence.update(peak_bytes=m.peak_bytes, baseline_peak_bytes=none.peak_bytes)
            peak = f"; measured peak {fmt_bytes(none.peak_bytes)} → {fmt_bytes(m.peak_bytes)}"
            if not lowers:
                peak += (": no lower, so on this step the saved activations do not set the "
                         "peak and this plan lowers it by nothing (not recommended)")
        out.append(_CHECKPOINT_PLAN.finding(Severity.INFO,
            f"{name}: checkpointing {describe_segments(plan)} saves {fmt_bytes(saving)} "
            f"of saved activations ({saving / base:.0%}){cost}{verified}{peak}.",
            evidence,
            fix="" if lowers is False else apply_hint(plan),
        ))
        if v is not None and not v.bitwise_equal:
            out.append(_NOT_BITWISE.finding(caveat,
                f"{name}: gradients are within tolerance but not bitwise equal "
                f"(max diff {v.max_abs_diff:.3g}).",
                {"max_abs_diff": v.max_abs_diff},
                fix="nondeterministic kernels (atomic adds on GPU) can cause this; "
                "torch.use_deterministic_algorithms(True) makes runs comparable bitwise.",
            ))
        if v is not None and not v.buffers_equal:
            out.append(_BUFFERS_RECOMPUTED.finding(caveat,
                f"{name}: buffers (e.g. BatchNorm running stats) end differently with "
                "checkpointing: recomputation runs their forward, and its update, again.",
                {"plan": name},
                fix="keep BatchNorm outside checkpointed blocks, or accept the double update.",
            ))
    return out


@analyzer(LiveTensors)
def analyze_live(live: LiveTensors, thresholds: object = None) -> list[Finding]:
    """The lesson's trap: `empty_cache()` cannot free what is still referenced."""
    out: list[Finding] = []
    if live.reserved_before is not None and live.reserved_after is not None:
        released = live.reserved_before - live.reserved_after
        held = live.allocated_after or 0
        out.append(_EMPTY_CACHE.finding(Severity.WARNING if held > released else Severity.INFO,
            f"empty_cache() released {fmt_bytes(released)} of cached memory; "
            f"{fmt_bytes(held)} stays allocated by {live.count} live tensor storages.",
            {"released": released, "still_allocated": held, "live_storages": live.count},
            fix="del the tensors (and anything referring to them) first, then empty_cache().",
        ))
    if live.tensors:
        top = live.tensors[0]
        who = top.referrers[0] if top.referrers else "no Python referrer (held from C++)"
        out.append(_LARGEST_LIVE.finding(Severity.INFO,
            f"the largest live tensor {tuple(top.shape)} {top.dtype.replace('torch.', '')} "
            f"({fmt_bytes(top.nbytes)}) is held by {who}.",
            {"bytes": top.nbytes, "device": top.device},
        ))
    return out


@analyzer(MemoryHistory)
def analyze_history(history: MemoryHistory, thresholds: object = None) -> list[Finding]:
    """Growth across a watch's samples: saved activations, and the CUDA peak."""
    out: list[Finding] = []
    totals = history.total_bytes
    saved_grew = len(totals) >= 2 and totals[0] > 0 and totals[-1] >= _GROWTH * totals[0]
    if saved_grew:
        out.append(_SAVED_GROWTH.finding(Severity.INFO,
            f"saved activations grew from {fmt_bytes(totals[0])} (forward "
            f"{history.forwards[0]}) to {fmt_bytes(totals[-1])} (forward "
            f"{history.forwards[-1]}): the inputs grew (batch or sequence length), or "
            "more of the model ran.",
            {"first": totals[0], "last": totals[-1], "ratio": totals[-1] / totals[0]},
        ))
    peaks = [(f, p) for f, p in zip(history.forwards, history.peak_bytes, strict=True)
             if p is not None]
    if len(peaks) >= 2 and peaks[0][1] > 0 and peaks[-1][1] >= _GROWTH * peaks[0][1]:
        (f0, p0), (f1, p1) = peaks[0], peaks[-1]
        # Without more saved activations, a growing peak is memory kept across steps.
        out.append(_PEAK_GROWTH.finding(Severity.INFO if saved_grew else Severity.WARNING,
            f"the peak allocated per step grew from {fmt_bytes(p0)} (forward {f0}) to "
            f"{fmt_bytes(p1)} (forward {f1})"
            + ("." if saved_grew else
               " while saved activations did not: something keeps tensors across steps."),
            {"first": p0, "last": p1, "ratio": p1 / p0},
            fix="" if saved_grew else "keep no graph across steps: log loss.item() or "
            "loss.detach(), not loss; do not collect outputs that require grad.",
        ))
    return out
