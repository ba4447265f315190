"""Findings from a `ProfileResult`: the top op, the phase balance, the costliest module,
exposed communication; and, over every rank's result (`Ranked[ProfileResult]`), the
straggler."""

from __future__ import annotations

import statistics

from torchscope._timing import compare, fmt_ratio
from torchscope.catalogue import entry
from torchscope.distributed.ranked import Ranked, rank_list, ranked_analyzer
from torchscope.findings import Finding, Severity, analyzer, rank
from torchscope.hooks.compiled import ran_eagerly
from torchscope.profiling.comm import is_comm
from torchscope.profiling.loader import LOADER_RANGE_PREFIX
from torchscope.profiling.ops import sort_ops
from torchscope.profiling.records import OWN_SYNC_RANGE, ProfileResult, ProfileThresholds
from torchscope.profiling.syncs import READ_OP, WAIT_OPS

__all__ = ["comm_findings", "mean_step_ms", "own_ms", "profile_findings", "ranked_profile_findings"]

# Ops that block the host until the device (or a queue) has caught up: a tensor read to
# Python (`.item()`, `bool(t)`), and the CUDA runtime's own waits and copies.
_SYNC_OPS = (READ_OP, "aten::item", "cudaDeviceSynchronize", *WAIT_OPS)
_COMPUTE = ("mm", "addmm", "bmm", "matmul", "conv", "convolution", "linear", "baddbmm",
            "scaled_dot_product")

_TOP_OP = entry("profiling.top_op")
_HOST_SYNC = entry("profiling.host_sync")
_HOST_READ = entry("profiling.host_read")
_SCALER_SYNC = entry("profiling.scaler_sync")
_INPUT_WAIT = entry("profiling.input_wait")
_BACKWARD_RATIO = entry("profiling.backward_ratio")
_OPTIMIZER_SHARE = entry("profiling.optimizer_share")
_TOP_MODULE = entry("profiling.top_module")
_OVERHEAD = entry("profiling.overhead")
_NO_PHASES = entry("profiling.no_phases")
_COMPILED_EAGER = entry("profiling.compiled_eager")
_COMM = entry("profiling.comm")
_COMM_EXPOSED = entry("profiling.comm_exposed")
_STRAGGLER = entry("profiling.straggler")


def _op_fix(name: str, mixed: bool) -> str:
    """What makes the top op cheaper; `mixed`: the step already runs under autocast."""
    base = name.rsplit("::", maxsplit=1)[-1]
    if any(k in base for k in _COMPUTE):
        return ("this is the model's arithmetic: " + ("" if mixed else "mixed precision "
                "(torch.autocast), ") + "a larger batch per step or torch.compile make it "
                "cheaper.")
    if base in ("copy_", "to", "_to_copy", "contiguous", "clone"):
        return "look for .to()/.contiguous() copies inside the step and move them out."
    return ""


def uses_accelerator(result: ProfileResult) -> bool:
    """Whether the profiled step ran on an accelerator: the model lives on a non-CPU
    device, or the profiler recorded device kernel time."""
    return result.device != "cpu" or any(o.self_device_ms > 0 for o in result.ops)


def _host_syncs(result: ProfileResult) -> list[Finding]:
    """Host-device synchronisations: a warning only where there is a device to wait for.

    On CPU, `.item()` and `.cpu()` read host memory that is already there: at most an info
    (`profiling.host_read`), since the same line waits for the device on a GPU. On a GPU,
    only the reads of device tensors and the runtime's own waits count
    (`ProfileResult.host_reads`): Adam's `.item()` on its host-side step counters is none.
    A GradScaler's read of its inf check is told apart: on a GPU an info of its own
    (`profiling.scaler_sync`, with the fused optimizer that avoids it), on CPU nothing.
    """
    # Waits that are no part of the step: the watch's own at each step boundary (one
    # cudaDeviceSynchronize in its own range), and torch.profiler's when it stops at the
    # window's end (`profile.__exit__` synchronises the device while still recording).
    own = result.calls(OWN_SYNC_RANGE)
    device_waits = max(result.calls("cudaDeviceSynchronize") - own - (1 if own else 0), 0)
    syncs = [o for o in result.ops if o.name in _SYNC_OPS
             and (device_waits or o.name != "cudaDeviceSynchronize")]
    if not syncs:
        return []
    # One `.item()` shows as aten::item over aten::_local_scalar_dense (over a copy and a
    # stream wait on CUDA): the reads are counted once each, outside DataLoader ranges.
    hr = result.host_reads
    reads = hr.reads if hr is not None else result.calls(READ_OP)
    scaler = hr.scaler if hr is not None else 0
    ops = ", ".join(sorted({o.name for o in syncs}))
    if uses_accelerator(result):
        if hr is not None and hr.linked:
            stalls = hr.device + hr.waits + device_waits
        else:  # the runtime's calls were not nested under the reads: every read counts
            stalls = reads + device_waits or sum(o.calls for o in syncs)
        # The GradScaler's own read is a sync the loop did not write: said on its own.
        scaler_sync = _scaler_sync(scaler, result.steps)
        stalls = max(stalls - scaler, 0)
        if not stalls:
            return scaler_sync
        evidence: dict[str, float | int | str | bool | None] = {
            "calls": stalls, "ops": ops, "device": result.device,
            "host_tensor_reads": reads - (hr.device if hr is not None and hr.linked
                                          else reads)}
        return [_HOST_SYNC.finding(
            Severity.WARNING,
            f"the step synchronises host and device {stalls / result.steps:.3g} time(s) per "
            f"step ({ops}).", evidence,
            fix="drop .item()/.cpu()/print of tensors from the step, or do it every N steps.",
        ), *scaler_sync]
    # torch.optim's Adam family reads its host-side step counters: no wait on a GPU either;
    # the GradScaler's inf check is no read the loop wrote.
    reads -= (hr.optimizer + hr.scaler) if hr is not None else 0
    if reads <= 0:
        return []
    return [_HOST_READ.finding(
        Severity.INFO,
        f"the step reads tensor values to Python {reads / result.steps:.3g} time(s) per step "
        f"({ops}); on CPU that waits for nothing, on a GPU each read of a device tensor "
        "would synchronise host and device.", {"calls": reads, "ops": ops,
                                               "device": result.device},
    )]


def _scaler_sync(reads: int, steps: int) -> list[Finding]:
    """`profiling.scaler_sync`: a GradScaler read its inf check to the host at each step of
    a non-fused optimizer, on an accelerator a sync that the loop's own code did not write."""
    if not reads:
        return []
    return [_SCALER_SYNC.finding(
        Severity.INFO,
        f"the GradScaler synchronises host and device {reads / max(steps, 1):.3g} time(s) "
        "per step: GradScaler.step reads its inf check (found_inf) to decide whether to "
        "step.", {"calls": reads},
        fix=None)]


def _input_wait(result: ProfileResult, th: ProfileThresholds) -> list[Finding]:
    """The share of the profiled steps spent getting the next batch from a DataLoader: a
    warning above `input_wait_high` (the model idles while its input is made), an info
    above a quarter of it, nothing below."""
    wait, total = result.input_wait, result.timing.profiled_total_ms
    if wait is None or total <= 0:
        return []
    share = min(wait.ms / total, 1.0)
    if share < th.input_wait_high / 4:
        return []
    high = share > th.input_wait_high
    how = "waiting for its worker processes" if wait.workers else \
        "loading it in the main process"
    evidence: dict[str, float | int | str | bool | None] = {
        "input_ms": wait.ms, "step_ms": total, "share": share, "batches": wait.calls,
        "workers": wait.workers}
    if wait.workers:
        fix = ("the workers do not keep up: raise num_workers or prefetch_factor, and make "
               "__getitem__ and the transforms cheaper (decode once and cache, or augment on "
               "the accelerator).")
    else:
        fix = ("load in worker processes, which prepare the next batches while the model "
               "computes: DataLoader(..., num_workers=N, persistent_workers=True), with "
               "pin_memory=True for a GPU.")
    return [_INPUT_WAIT.finding(
        Severity.WARNING if high else Severity.INFO,
        f"the loop spends {100 * share:.0f}% of its steps getting the next batch "
        f"({wait.ms / result.steps:.3g} ms per step, {how}).",
        evidence, fix=fix if high else "")]


@analyzer(ProfileResult)
def profile_findings(result: ProfileResult,
                     thresholds: ProfileThresholds | None = None) -> list[Finding]:
    """Conclusions about one profile, most severe first.

    Registered for `ProfileResult`: read it as `result.findings(thresholds)`.

    Args:
        result: the profile.
        thresholds: when figures become warnings; None uses `ProfileThresholds()`.

    Codes: `profiling.top_op`, `profiling.host_sync` and `profiling.scaler_sync` (with an
    accelerator), `profiling.host_read` (on CPU), `profiling.input_wait` (a DataLoader in the
    profiled steps), `profiling.backward_ratio` and `profiling.optimizer_share` (only where
    the profiled steps' phase times are trusted: their overhead over plain steps was
    measured within a narrow interval), `profiling.top_module`, and with collectives
    `profiling.comm` or `profiling.comm_exposed`; the measurement's caveats, info only:
    `profiling.overhead`, `profiling.no_phases`, `profiling.compiled_eager` (a compiled
    model timed per module ran eagerly). Each code's entry: `torchscope explain CODE`.
    """
    th = thresholds or ProfileThresholds()
    out: list[Finding] = []
    on_device = result.device == "cuda" and any(o.self_device_ms > 0 for o in result.ops)
    sort = "self_cuda" if on_device else "self_cpu"
    # Collectives are waits for other ranks, not work (`comm_findings` speaks of them), and
    # FSDP2's own ranges (`FSDP::all_gather (conv1)`) mostly wrap them.
    # A DataLoader's `__next__` is the wait for input, not an op (`_input_wait`); the
    # optimizer's own ranges are judged as a phase (`profiling.optimizer_share`), and under
    # a closure (Lightning) they hold the framework's code too.
    top = sort_ops([o for o in result.ops
                    if not o.name.startswith(("autograd::", "FSDP::", LOADER_RANGE_PREFIX,
                                              "Optimizer."))
                    and not is_comm(o.name)], sort, 1)
    if top:
        o = top[0]
        frac = o.self_device_frac if on_device else o.self_cpu_frac
        ms = o.self_device_ms if on_device else o.self_cpu_ms
        where = "device" if on_device else "CPU"
        out.append(_TOP_OP.finding(
            Severity.INFO,
            f"{o.name} takes {100 * frac:.0f}% of self {where} time "
            f"({o.calls} calls, {ms / result.steps:.3g} ms per step).",
            {"op": o.name, "calls": o.calls, "self_ms": ms, "share": frac},
            fix=_op_fix(o.name, result.step is not None and bool(result.step.autocast)),
        ))
    out += _host_syncs(result)
    out += _input_wait(result, th)
    fwd, bwd, opt = (result.phase(p) for p in ("forward", "backward", "optimizer"))
    # The profiled steps' phase times are sums over a few steps, where one preempted step
    # weighs in full: they are judged as facts only where the profiled steps were measured
    # as fast as plain ones, within a narrow interval (an interval of 0.3-4.2x includes 1
    # and tells nothing). A healthy MLP on a busy machine read 5-9x, and 79% optimizer.
    # Otherwise a ratio or share of them is no finding at all: the phase table shows them.
    slowed = result.timing.overhead_ratio
    trusted = slowed is not None and not slowed.above and slowed.high <= _TRUSTED_OVERHEAD
    # The profiler costs a few µs per op, and a backward of many small ops (a packed RNN's:
    # hundreds of slices and adds) carries more of it: a GRU whose backward is 2.3× its
    # forward unprofiled read 3.5-4.1×. Phases derived from the model's root range and
    # autograd's nodes (a loop that labels none) leave a loss computed outside the model
    # out of the forward but not out of the backward: their ratio is not judged either.
    if trusted and fwd is not None and bwd is not None and fwd.cpu_ms > 0 \
            and not (fwd.derived or bwd.derived):
        ratio = bwd.cpu_ms / fwd.cpu_ms
        # Under DDP/FSDP2 backward also waits for gradient communication: judged without it.
        waited = result.comm.exposed_ms * result.steps if result.comm is not None else 0.0
        high = (bwd.cpu_ms - waited) / fwd.cpu_ms > th.backward_ratio_high
        comm_note = f" (of which up to {waited:.3g} ms waiting for communication)" \
            if waited > 0 else ""
        out.append(_BACKWARD_RATIO.finding(
            Severity.WARNING if high else Severity.INFO,
            f"backward takes {ratio:.2f}× the forward time{comm_note}"
            + (" — more than the usual ~2×." if high else "."),
            {"backward_ms": bwd.cpu_ms, "forward_ms": fwd.cpu_ms, "ratio": ratio,
             "comm_waited_ms": waited},
            fix=None if high else ""))
    total = result.phase_total_ms
    if trusted and opt is not None and total > 0 \
            and opt.cpu_ms / total > th.optimizer_share_high:
        out.append(_OPTIMIZER_SHARE.finding(
            Severity.WARNING,
            f"the optimizer takes {100 * opt.cpu_ms / total:.0f}% of the step.",
            {"optimizer_ms": opt.cpu_ms, "step_ms": total}))
    if result.modules:
        leaf = max(result.modules, key=lambda m: m.total_self_ms)
        mod_total = sum(m.total_self_ms for m in result.modules) or 1.0
        out.append(_TOP_MODULE.finding(
            Severity.INFO,
            f"{leaf.module or '<root>'} ({leaf.module_type}) is the costliest module: "
            f"{leaf.forward_self_ms / result.steps:.3g} ms forward + "
            f"{leaf.backward_self_ms / result.steps:.3g} ms backward per step "
            f"({100 * leaf.total_self_ms / mod_total:.0f}% of module time).",
            {"forward_self_ms": leaf.forward_self_ms, "backward_self_ms": leaf.backward_self_ms,
             "share": leaf.total_self_ms / mod_total},
            module=leaf.module,
        ))
    slow = result.timing.overhead_ratio
    # Only a slowdown beyond the noise: a median above the threshold inside it is no fact.
    if slow is not None and slow.above and slow.value > th.overhead_high:
        out.append(_OVERHEAD.finding(
            Severity.INFO,
            f"steps ran {fmt_ratio(slow)} slower under the profiler; absolute times are "
            "inflated, shares between ops hold better.",
            {"overhead": slow.value, "overhead_low": slow.low, "overhead_high": slow.high,
             "baseline_ms": result.timing.baseline_ms,
             "profiled_ms": result.timing.profiled_ms}))
    if not result.phases:
        out.append(_NO_PHASES.finding(
            Severity.INFO, "the step labelled no forward/backward/optimizer phase.",
            fix="wrap the step's parts in torchscope.profiling.phase('forward') etc.",
        ))
    elif fwd is None and all(p.derived for p in result.phases):
        out.append(_NO_PHASES.finding(
            Severity.INFO,
            "the step labelled no phase, and its forward could not be read from the "
            "model's own ranges (no model given, or its root not timed); "
            + " and ".join(p.name for p in result.phases) + " come from torch's own ranges.",
            fix="pass the model (and no select= that leaves its root out), or wrap the "
            "step's parts in torchscope.profiling.phase('forward') etc.",
        ))
    out.extend(comm_findings(result, th))
    # A caveat about what was measured (the eager model's times), info like every other.
    out += ran_eagerly(
        _COMPILED_EAGER, result.compiled, "the per-module profile",
        also=": these op and module times are the eager model's, not the compiled one's",
        fix=_COMPILED_EAGER.fix)
    return rank(out)


def comm_findings(result: ProfileResult, thresholds: ProfileThresholds | None = None
                  ) -> list[Finding]:
    """How much of the step waits for communication (DDP's all-reduce, FSDP2's all-gather
    and reduce-scatter); nothing when no collective ran."""
    th = thresholds or ProfileThresholds()
    c = result.comm
    step_ms = mean_step_ms(result)  # a mean, as the per-step communication times are
    if c is None or step_ms <= 0:
        return []
    share = c.exposed_ms / step_ms
    ops = ", ".join(f"{o.kind} {o.calls:.3g}× {o.ms:.3g} ms" for o in c.ops)
    evidence: dict[str, float | int | str | bool | None] = {
        "comm_ms": c.comm_ms, "exposed_ms": c.exposed_ms, "compute_ms": c.compute_ms,
        "overlap": c.overlap, "step_ms": step_ms, "exposed_share": share, "ops": ops}
    hidden = "" if c.overlap is None else f", {100 * c.overlap:.0f}% of it hidden behind compute"
    if share > th.comm_exposed_high:
        return [_COMM_EXPOSED.finding(
            Severity.WARNING,
            f"the step waits {c.exposed_ms:.3g} ms of its {step_ms:.3g} ms mean "
            f"({100 * share:.0f}%) for communication ({c.comm_ms:.3g} ms per step{hidden}; {ops}).",
            evidence,
            # The doctor and watch_time have already joined the ranks (and told any
            # straggler); only a caller of profile_steps has a gather left to do.
            fix="if one rank is slower the others wait for it: profiling.straggler names it "
            "once every rank's profile is joined on rank 0 (the doctor and watch_time join "
            "them; after profile_steps, call result.gather() on every rank). Otherwise give "
            "each step more compute (a larger batch, gradient accumulation under no_sync) or "
            "fewer, larger collectives (DDP bucket_cap_mb).")]
    return [_COMM.finding(
        Severity.INFO,
        f"communication takes {c.comm_ms:.3g} ms per step{hidden}; the step waits "
        f"{c.exposed_ms:.3g} ms of its {step_ms:.3g} ms mean for it ({ops}).",
        evidence)]


def own_ms(result: ProfileResult) -> float:
    """A rank's own work per step: its step time less the communication it waited for.

    Both are means over the profiled steps. The median step time would not do: a rank
    that waited once for a late peer (the first step's start-up skew) has that wait in
    its mean exposed time but not in its median step, and its own work would come out
    near zero.
    """
    exposed = result.comm.exposed_ms if result.comm is not None else 0.0
    return max(mean_step_ms(result) - exposed, 0.0)


def own_samples(result: ProfileResult) -> list[float] | None:
    """A rank's own work in each profiled step (its wall time less the communication it
    waited for in that step), or None when the waits per step are not known."""
    comm, walls = result.comm, result.timing.profiled_samples
    waits = comm.exposed_per_step if comm is not None else tuple(0.0 for _ in walls)
    if not walls or len(waits) != len(walls):
        return None
    return [max(w - e, 0.0) for w, e in zip(walls, waits, strict=True)]


def mean_step_ms(result: ProfileResult) -> float:
    """The profiled steps' mean wall time (the per-step communication times are means)."""
    t = result.timing
    return t.profiled_total_ms / t.profiled_steps if t.profiled_steps else t.profiled_ms


# A straggler is told as one (a warning) where the interval of its own work over the
# others' has this coverage (five steps a rank give 0.875: every step of one rank above
# every step of a balanced other happens in 2 runs of 252; three steps give 0.5, 1 in
# 10), or lies wholly at or above `_STRAGGLER_SURE`.
_STRAGGLER_CONFIDENCE = 0.85
# The widest interval of the profiled steps' slowdown over plain ones under which their
# phase times count as facts (`find_profile`'s backward_ratio and optimizer_share).
_TRUSTED_OVERHEAD = 1.25
_STRAGGLER_SURE = 2.0


@ranked_analyzer(ProfileResult)
def ranked_profile_findings(ranked: Ranked[ProfileResult],
                            thresholds: ProfileThresholds | None = None) -> list[Finding]:
    """The straggler among the ranks (`Ranked[ProfileResult].findings()`).

    Collectives make every rank wait for the slowest, so step times come out alike; what
    differs is each rank's own work (step time less the communication it waited for). The
    rank whose own work exceeds the median of the others' by `straggler_ratio` is named,
    when it does so beyond the noise: where the waits per step are known, the interval of
    its per-step own work over the median other rank's (`torchscope._timing.compare`) must
    lie above 1.
    """
    th = thresholds or ProfileThresholds()
    own = [own_ms(r) for r in ranked.results]
    if len(own) < 2:
        return []
    slow = max(range(len(own)), key=lambda i: own[i])
    others = sorted((i for i in range(len(own)) if i != slow), key=lambda i: own[i])
    base = statistics.median(own[i] for i in others)
    if base <= 0 or own[slow] / base < th.straggler_ratio:
        return []
    ratio = own[slow] / base
    # Measured step by step, the slow rank's own work must exceed the median other rank's
    # beyond the noise: an interval that reaches 1 is no measurable straggler.
    typical = others[len(others) // 2]
    a, b = own_samples(ranked.results[slow]), own_samples(ranked.results[typical])
    interval = compare(a, b) if a and b and min(b) > 0 else None
    if interval is not None and interval.low <= 1.0:
        return []
    # Over a few steps (the doctor's --fast profiles 3) the interval is the samples' whole
    # range, and two balanced ranks sharing cores put one rank's every step above the
    # other's in about one run in ten: 1.4-1.7x on identical ranks. Below the timing's
    # own confidence, only a rank at least twice as slow in every step is told for sure.
    sure = interval is None or interval.confidence >= _STRAGGLER_CONFIDENCE or \
        interval.low >= _STRAGGLER_SURE
    waits = [(i, r.comm.exposed_ms) for i, r in enumerate(ranked.results)
             if i != slow and r.comm is not None]
    waited = (f"; the others wait for it in communication (up to "
              f"{max(w for _, w in waits):.3g} ms per step)") if waits else ""
    steps = len(a or ())
    doubt = "" if sure else \
        f" ({steps} profiled steps: too few to tell a small gap from noise; profile more)"
    return [_STRAGGLER.finding(
        Severity.WARNING if sure else Severity.INFO,
        f"{rank_list([slow])} {'is' if sure else 'may be'} a straggler: its own work takes "
        f"{ratio:.2f}× the other ranks' ({own[slow]:.3g} ms vs {base:.3g} ms per "
        f"step){waited}{doubt}.",
        {"rank": slow, "ratio": ratio, "own_ms": own[slow], "others_ms": base,
         "step_ms": mean_step_ms(ranked.results[slow]),
         "ratio_low": None if interval is None else interval.low,
         "ratio_high": None if interval is None else interval.high},
        fix=None)]
