"""Checkpointing planner: per-block costs, four plans, and their measured cost.

Each block is measured once during a normal forward: the storages autograd saves inside it,
the storages of its inputs (what a checkpoint keeps instead) and its forward time (what
recomputing it costs). From these, the saved bytes of any plan are computed exactly as a
union of storages, so a storage shared by two blocks (a ReLU output that the next Linear
saves too) is counted once, and only dropped when both savers are checkpointed.

Plans:
    - `none`: nothing checkpointed.
    - `all`: every block checkpointed on its own, the last one included.
    - `sqrt`: ⌈√L⌉ consecutive blocks per checkpoint (Chen et al. 2016, "Training Deep Nets
      with Sublinear Memory Cost"): O(√L) block inputs kept, and at most one extra forward.
    - `budget`: the plan with the least recompute time whose saved bytes fit the budget;
      exhaustive search for up to `exact_limit` blocks, otherwise dynamic programming over
      the blocks (state: whether the previous block is checkpointed), after which long
      segments are split while the budget allows, to lower the recompute peak.
"""

from __future__ import annotations

import math
import re
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from torchscope._timing import (
    Ratio,
    compare,
    median_interval,
    repeat,
    repeat_interleaved,
    timed_ms,
)
from torchscope._util import fmt_bytes
from torchscope.errors import BudgetError, TorchscopeError, VerificationError
from torchscope.hooks.session import HookSession
from torchscope.memory._common import StorageKey, storage_keys
from torchscope.memory.checkpoint import (
    Blocks,
    BlockSpec,
    CheckpointHandle,
    apply,
    resolve_blocks,
)
from torchscope.memory.measure import _measure as _measure_memory
from torchscope.memory.records import (
    BlockProfile,
    CheckpointPlan,
    PlanMeasurement,
    PlanReport,
    Verification,
)
from torchscope.memory.saved import _account, _Accounting
from torchscope.models.target import ModelInputs
from torchscope.step import LossSpec, Step, StepInfo, synchronize

Segments = tuple[tuple[int, int], ...]
_BUDGET_S = 1.0  # seconds of timed steps per plan, once the minimum repeats are done

_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1024, "kib": 1024, "m": 1024**2, "mb": 1024**2,
          "mib": 1024**2, "g": 1024**3, "gb": 1024**3, "gib": 1024**3, "t": 1024**4,
          "tb": 1024**4, "tib": 1024**4}
_BYTES = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int) -> int:
    """Parse a byte budget: `73728`, `64KB`, `1.5 MiB`, `2GB`.

    KB, MB, GB and TB are binary (1024-based), as `torch.cuda.memory_summary` and most GPU
    tools report memory; KiB, MiB, GiB and TiB are accepted as synonyms.

    Raises:
        BudgetError: the text is not a size.
    """
    if isinstance(text, int):
        value = text
    else:
        m = _BYTES.match(text.replace(",", "").replace("_", ""))
        unit = m[2].lower() if m else ""
        if m is None or unit not in _UNITS:
            raise BudgetError(f"budget {text!r} is not a size.",
                              fix="write it like 65536, 64KB, 1.5MiB or 2GB.")
        value = int(float(m[1]) * _UNITS[unit])
    if value < 0:
        raise BudgetError(f"budget {text!r} is negative.", fix="give a size of 0 or more.")
    return value


# --------------------------------------------------------------------------- cost model
@dataclass(frozen=True)
class _Costs:
    """Storages (as indices) and times per block, for exact plan evaluation."""

    nbytes: tuple[int, ...]  # per storage index
    always: frozenset[int]  # saved outside every block: kept whatever the plan
    saves: tuple[frozenset[int], ...]  # per block: storages saved inside it
    inputs: tuple[frozenset[int], ...]  # per block: storages of its positional inputs
    times: tuple[float, ...]  # per block, ms

    def bytes_of(self, items: set[int] | frozenset[int]) -> int:
        return sum(self.nbytes[i] for i in items)

    def evaluate(self, segments: Segments) -> tuple[int, int, float]:
        """(saved bytes, activation peak, recompute ms) of a plan, exactly."""
        ckpt = {i for a, b in segments for i in range(a, b)}
        # Kept: what every block outside a checkpoint saves, and each segment's input.
        retained = set(self.always).union(*(s for i, s in enumerate(self.saves) if i not in ckpt),
                                          *(self.inputs[a] for a, _ in segments))
        saved = self.bytes_of(retained)
        # Recomputing one segment re-creates what its blocks save, on top of what is kept.
        extra = max((self.bytes_of(set().union(*self.saves[a:b]) - retained)
                     for a, b in segments), default=0)
        return saved, saved + extra, sum(self.times[i] for i in sorted(ckpt))


def _costs(step: Step, blocks: Blocks, repeats: int, acc: _Accounting | None = None
           ) -> tuple[_Costs, tuple[BlockProfile, ...], int, StepInfo | None]:
    """Block costs from one accounted step (`acc`, run here when None; it must have watched
    these blocks) and timed forwards: (costs, profiles, saved bytes without checkpointing,
    the accounted step's `StepInfo`)."""
    model = step.model
    named = dict(model.named_modules())
    watch = [(n, named[n]) for n in blocks.names]
    if acc is None:
        acc = _account(step, watch)
    state = storage_keys(list(model.parameters())) | storage_keys(list(model.buffers()))
    index: dict[StorageKey, int] = {}
    nbytes: list[int] = []

    def idx(key: StorageKey, n: int) -> int:
        if key not in index:
            index[key] = len(nbytes)
            nbytes.append(n)
        return index[key]

    def owner(module: str) -> int | None:  # the block that `module` is in, if any
        return next((b for b, name in enumerate(blocks.names)
                     if name in (module, "") or module.startswith(name + ".")), None)

    saves: list[set[int]] = [set() for _ in blocks.names]
    always: set[int] = set()
    first_bytes = [0] * len(blocks.names)
    for key, s in zip(acc.keys, acc.saved.storages, strict=True):
        if s.kind not in ("activation", "input"):
            continue
        i = idx(key, s.nbytes)
        first = owner(s.module)
        if first is not None:
            first_bytes[first] += s.nbytes
        for saver in s.savers:
            b = owner(saver)
            if b is None:
                always.add(i)
            else:
                saves[b].add(i)
    inputs = tuple(frozenset(idx(k, n) for k, n in acc.block_inputs.get(name, ())
                             if k not in state) for name in blocks.names)
    times = _block_times(step, watch, repeats)
    costs = _Costs(tuple(nbytes), frozenset(always), tuple(frozenset(s) for s in saves),
                   inputs, tuple(times))
    profiles = tuple(
        BlockProfile(i, n, type(named[n]).__name__, times[i], first_bytes[i],
                     costs.bytes_of(inputs[i]))
        for i, n in enumerate(blocks.names)
    )
    return costs, profiles, acc.saved.total_bytes, acc.saved.step


def _block_times(step: Step, watch: Sequence[tuple[str, nn.Module]], repeats: int
                 ) -> list[float]:
    """Forward time of each block per step in ms (every call, every micro-batch; grad mode
    on, as in recomputation): the median over `repeats` forwards after a warm-up."""
    device = step.device
    rounds: dict[str, list[float]] = {n: [] for n, _ in watch}
    starts: dict[str, float] = {}
    with step.preserved(clear_grads=True), HookSession(step.model) as session:
        for name, module in watch:

            def pre(_m: nn.Module, _a: tuple[Any, ...], _n: str = name) -> None:
                synchronize(device)
                starts[_n] = time.perf_counter()

            def post(_m: nn.Module, _a: tuple[Any, ...], _o: Any, _n: str = name) -> None:
                synchronize(device)
                rounds[_n][-1] += (time.perf_counter() - starts[_n]) * 1e3

            session.forward_pre_hook(module, pre)
            session.forward_hook(module, post)
        for _ in range(max(repeats, 1) + 1):
            for times in rounds.values():
                times.append(0.0)
            with torch.enable_grad():
                for inputs, _ in step.micro_batches():
                    step.forward(inputs)
    # The first round pays one-time costs (allocator, lazy init): dropped.
    return [statistics.median(r[1:]) for r in rounds.values()]


# --------------------------------------------------------------------------- plans
def _runs(mask: int, n: int, groupable: bool) -> Segments:
    """The blocks set in `mask` as segments: maximal runs when groupable, else one per block."""
    out: list[tuple[int, int]] = []
    for i in range(n):
        if mask >> i & 1:
            if groupable and out and out[-1][1] == i:
                out[-1] = (out[-1][0], i + 1)
            else:
                out.append((i, i + 1))
    return tuple(out)


def _all_segmentations(n: int, groupable: bool) -> Iterator[Segments]:
    """Every plan over n blocks: each block normal, starting a segment or continuing one."""
    if n == 0:
        yield ()
        return
    for segs in _all_segmentations(n - 1, groupable):
        yield segs  # block n-1 normal
        yield (*segs, (n - 1, n))  # block n-1 starts a segment
        if groupable and segs and segs[-1][1] == n - 1:
            yield (*segs[:-1], (segs[-1][0], n))  # block n-1 continues the last segment


def _search_exact(costs: _Costs, groupable: bool, budget: int) -> tuple[Segments | None, int]:
    """Least-recompute plan within budget by enumeration; also the smallest saved bytes."""
    scored = [(costs.evaluate(segs), segs)
              for segs in _all_segmentations(len(costs.times), groupable)]
    # Least recompute, then lowest peak, then fewest segments; the first found on ties.
    fits = [((rec, peak, len(segs)), segs) for (saved, peak, rec), segs in scored
            if saved <= budget]
    best = min(fits, key=lambda f: f[0])[1] if fits else None
    return best, min(saved for (saved, _, _), _ in scored)


def _search_dp(costs: _Costs, groupable: bool, budget: int) -> tuple[Segments | None, int]:
    """Least-recompute set of checkpointed blocks within budget, by dynamic programming.

    Bytes are split into parts that depend on at most two neighbouring blocks: each block's
    interior storages (kept unless it is checkpointed) and each block's input storages (kept
    when the block before or the block itself saves them unchecked, or when a segment starts
    there). Storages that fit neither shape are counted as always kept, so the model never
    under-counts; the chosen plan is then evaluated exactly.
    """
    n = len(costs.times)
    input_of: dict[int, list[int]] = {}
    for j, block_inputs in enumerate(costs.inputs):
        for k in block_inputs:
            input_of.setdefault(k, []).append(j)
    savers: dict[int, set[int]] = {}
    for b, s in enumerate(costs.saves):
        for k in s:
            savers.setdefault(k, set()).add(b)
    const = set(costs.always)
    interior = [0] * n
    boundary: list[list[tuple[int, bool, bool]]] = [[] for _ in range(n)]
    for k in set(savers) | set(input_of):
        if k in const:
            continue
        ins = input_of.get(k, [])
        sv = savers.get(k, set())
        if len(ins) == 1 and sv <= {ins[0] - 1, ins[0]}:
            j = ins[0]
            boundary[j].append((costs.nbytes[k], j - 1 in sv, j in sv))
        elif not ins and len(sv) == 1:
            interior[next(iter(sv))] += costs.nbytes[k]
        else:
            const.add(k)
    base = costs.bytes_of(const)
    # Frontier per state (previous block checkpointed?): (bytes, recompute, ckpt bitmask),
    # keeping only points that no other point beats on both bytes and recompute.
    frontier: dict[bool, list[tuple[int, float, int]]] = {False: [(base, 0.0, 0)]}
    for i in range(n):
        nxt: dict[bool, list[tuple[int, float, int]]] = {False: [], True: []}
        for prev_c, points in frontier.items():
            for x_c in (False, True):
                add = 0 if x_c else interior[i]
                for nb, left, right in boundary[i]:
                    kept = ((i > 0 and not prev_c and left) or (not x_c and right)
                            or (x_c and (not prev_c or not groupable or i == 0)))
                    add += nb if kept else 0
                rec = costs.times[i] if x_c else 0.0
                for b, r, mask in points:
                    nxt[x_c].append((b + add, r + rec, mask | (1 << i) if x_c else mask))
        frontier = {k: _pareto(v) for k, v in nxt.items() if v}
    points = [p for v in frontier.values() for p in v]
    smallest = min(p[0] for p in points)
    feasible = [p for p in points if p[0] <= budget]
    if not feasible:
        # The DP over-counts shared storages; the exact bytes of its leanest plan may fit.
        segs = _runs(min(points, key=lambda p: p[0])[2], n, groupable)
        exact = costs.evaluate(segs)[0]
        return (segs if exact <= budget else None), min(smallest, exact)
    segs = _runs(min(feasible, key=lambda p: (p[1], p[0]))[2], n, groupable)
    return _split(costs, segs, budget), smallest


def _pareto(points: list[tuple[int, float, int]]) -> list[tuple[int, float, int]]:
    out: list[tuple[int, float, int]] = []
    best = float("inf")
    for p in sorted(points, key=lambda p: (p[0], p[1])):
        if p[1] < best:
            out.append(p)
            best = p[1]
    return out


def _split(costs: _Costs, segs: Segments, budget: int) -> Segments:
    """Split segments while the budget allows, to lower the recompute peak (same recompute)."""
    current = segs
    _, peak, _ = costs.evaluate(current)
    while True:
        best: tuple[int, Segments] | None = None
        for k, (a, b) in enumerate(current):
            for cut in range(a + 1, b):
                cand = (*current[:k], (a, cut), (cut, b), *current[k + 1:])
                saved, p, _ = costs.evaluate(cand)
                if saved <= budget and p < peak and (best is None or p < best[0]):
                    best = (p, cand)
        if best is None:
            return current
        peak, current = best


def _plan(name: str, blocks: Blocks, costs: _Costs, segs: Segments,
          budget: int | None = None) -> CheckpointPlan:
    saved, peak, rec = costs.evaluate(segs)
    return CheckpointPlan(name, blocks.names, segs, saved, peak, rec, budget, blocks.parent)


def _keeps_more(plan: CheckpointPlan, saved: int, baseline: int) -> CheckpointPlan:
    """`plan`, marked failed when it keeps `saved` bytes, no fewer than `baseline` (what no
    checkpointing keeps): checkpointing saves a block's inputs, which nothing else may keep."""
    if not plan.segments or saved < baseline or plan.failed:
        return plan
    share = f" ({saved / baseline:.0%} of none)" if baseline else ""
    return replace(plan, status="keeps_more",
                   failed=f"keeps {fmt_bytes(saved)} of saved activations{share}: no less "
                   "than without checkpointing")


CACHE_NOTE = ("model caches were off while planning and verifying (use_cache=False): a KV "
              "cache grows on every forward, so a checkpointed block would not recompute what "
              "it computed; train with use_cache=False under checkpointing, as Hugging Face's "
              "gradient_checkpointing_enable() does.")


@contextmanager
def caches_off(step: Step) -> Iterator[tuple[Step, tuple[str, ...]]]:
    """The step with model caches off, and the notes saying so.

    Every `config.use_cache` that is True on a module of the model (Hugging Face models
    read it when the call does not pass `use_cache`) is set to False inside the block and
    back to True on exit, also on an exception; a `use_cache=True` keyword input is passed as
    False. Nothing changes for a model without caches.
    """
    configs: list[Any] = []
    seen: set[int] = set()
    for module in step.model.modules():
        config = getattr(module, "config", None)
        if config is not None and id(config) not in seen:
            seen.add(id(config))
            if getattr(config, "use_cache", None) is True:
                configs.append(config)
    run = step
    if step.inputs.kwargs.get("use_cache") is True:
        kwargs = {**step.inputs.kwargs, "use_cache": False}
        run = replace(step, inputs=ModelInputs(step.inputs.args, kwargs))
    notes = (CACHE_NOTE,) if configs or run is not step else ()
    try:
        for config in configs:
            config.use_cache = False
        yield run, notes
    finally:
        for config in configs:
            config.use_cache = True


def _candidates(model: nn.Module, blocks: Blocks, acc: _Accounting
                ) -> tuple[Blocks, tuple[tuple[str, str], ...]]:
    """The blocks that hold trainable work, in the order the step first ran them, and the
    others with the reason they are left out."""
    named = dict(model.named_modules())
    keep: list[str] = []
    excluded: list[tuple[str, str]] = []
    for name in acc.block_inputs:  # first-call order
        if name not in blocks.names:
            continue
        trainable = any(p.requires_grad for p in named[name].parameters())
        if trainable or acc.inputs_need_grad.get(name, False):
            keep.append(name)
        else:
            excluded.append((name, "no trainable work: no parameter requires grad and no "
                             "input needs grad, so it saves nothing to drop"))
    excluded += [(n, "did not run in the step") for n in blocks.names
                 if n not in acc.block_inputs]
    return blocks.subset(model, keep), tuple(excluded)


def plan_checkpointing(
    model: nn.Module | Step,
    inputs: Any = None,
    *,
    loss_fn: LossSpec = "auto",
    target: Any = None,
    optimizer: torch.optim.Optimizer | None = None,
    blocks: BlockSpec = None,
    budget: int | str | None = None,
    measure: bool = True,
    repeats: int = 5,
    seed: int = 0,
    exact_limit: int = 8,
) -> PlanReport:
    """Measure every block and plan checkpointing: none, all, √L and (with a budget) the
    least-recompute plan whose saved bytes fit the budget.

    Only blocks that hold trainable work are candidates: a block with no parameter that
    requires grad and no input that needs grad (a frozen backbone's) saves nothing for
    backward, and checkpointing it would only keep its inputs. Model caches are off for
    every step the planner runs (see `caches_off`; `report.notes` says so). A plan that
    would keep no fewer saved bytes than no checkpointing, or that fails its verification,
    is kept in the report with `failed` saying why, and never chosen.

    Args:
        model: the model, left exactly as it was; or a `Step`.
        inputs: tensor, tuple, dict or `ModelInputs`.
        loss_fn: the step's loss (see `torchscope.step`).
        target: its target; None draws seeded targets where the loss needs one.
        optimizer: recorded in `step` (not stepped).
        blocks: which blocks may be checkpointed (see `resolve_blocks`).
        budget: bytes of saved activations the budget plan may keep (int or `"64KB"`);
            `"sqrt"` means as many as the √L plan keeps (the least recompute at √L memory),
            or as the leanest plan when √L keeps no less than none.
        measure: apply each plan for real: verify it (always), count its saved bytes, time
            its step against the step without checkpointing and measure its peak.
        repeats: at least this many timed steps per plan (more, up to 4× or about a second,
            until the median is known to 5 %).
        seed: seed of the verification runs.
        exact_limit: search every plan exhaustively up to this many blocks.

    Raises:
        TorchscopeError: `repeats` is below 1.
        SelectionError: `blocks` matched nothing (or, when None, the model has no block
            sequence).
        BudgetError: the budget is not a size, or is below what the leanest plan keeps; the
            message names that smallest feasible budget.
    """
    if repeats < 1:
        raise TorchscopeError(f"repeats={repeats} times nothing; expected 1 or more.",
                              fix="pass repeats=1 or more.")
    step = Step.of(model, inputs, loss_fn=loss_fn, target=target, optimizer=optimizer)
    limit = None if budget is None or budget == "sqrt" else parse_bytes(budget)
    resolved = resolve_blocks(step.model, blocks)
    with caches_off(step) as (run, notes):
        named = dict(run.model.named_modules())
        acc = _account(run, [(n, named[n]) for n in resolved.names])
        candidates, excluded = _candidates(run.model, resolved, acc)
        baseline = acc.saved.total_bytes
        if not candidates.names:
            none = CheckpointPlan("none", (), (), baseline, baseline, 0.0)
            return PlanReport((), False, baseline, baseline, (none,), (), "exact",
                              acc.saved.step, excluded, notes)
        costs, profiles, baseline, info = _costs(run, candidates, repeats, acc)
        n = len(candidates.names)
        singles = tuple((i, i + 1) for i in range(n))
        k = max(1, math.ceil(math.sqrt(n)))
        sqrt_segs = (tuple((i, min(i + k, n)) for i in range(0, n, k))
                     if candidates.groupable else singles)
        plans = [_plan("none", candidates, costs, ()),
                 _plan("all", candidates, costs, singles),
                 _plan("sqrt", candidates, costs, sqrt_segs)]
        plans = [_keeps_more(p, p.saved_bytes, baseline) for p in plans]
        search = "exact" if n <= exact_limit else "dp"
        lean_segs = ((0, n),) if candidates.groupable else singles
        smallest = min(costs.evaluate(lean_segs)[0], *(p.saved_bytes for p in plans))
        if budget is not None:
            if limit is None:  # "sqrt": what √L keeps, unless that is no saving at all
                limit = plans[2].saved_bytes if plans[2].failed is None else smallest
            # Never more than none keeps: within that, no checkpointing is the cheapest.
            found, least = (_search_exact if search == "exact" else _search_dp)(
                costs, candidates.groupable, min(limit, baseline))
            smallest = min(smallest, least)
            if found is None:
                raise BudgetError(
                    f"a saved-activation budget of {limit:,} B cannot be met: the leanest "
                    f"checkpointing plan over {n} block(s) still keeps {smallest:,} B "
                    f"(without checkpointing: {baseline:,} B).",
                    fix=f"use a budget of at least {smallest:,} B ({fmt_bytes(smallest)}).",
                )
            plans.append(_plan("budget", candidates, costs, found, limit))
        measured: list[PlanMeasurement] = []
        if measure:
            base = _measure(run, plans[0], repeats=repeats, seed=seed)
            assert not isinstance(base, str)
            measured.append(base)
            for i, plan in enumerate(plans[1:], start=1):
                if plan.failed is not None:
                    continue
                m = _measure(run, plan, repeats=repeats, seed=seed)
                if isinstance(m, str):
                    plans[i] = replace(plan, status="unverified", failed=m)
                    continue
                plans[i] = _keeps_more(plan, m.saved_bytes, base.saved_bytes)
                if plans[i].failed is None:
                    measured.append(m)
    return PlanReport(profiles, candidates.groupable, baseline, smallest, tuple(plans),
                      tuple(measured), search, info, excluded, notes)


def apply_plan(model: nn.Module | Step, plan: CheckpointPlan, inputs: Any = None, *,
               loss_fn: LossSpec = "auto", target: Any = None, seed: int = 0,
               require_bitwise: bool = False) -> CheckpointHandle:
    """Install a plan and verify it at once (loss and every gradient of a training step vs
    no checkpointing).

    The verification runs the model as you call it: a Hugging Face model with its KV cache
    on fails it (call it with `use_cache=False`, as the planner does).

    Args:
        model: the model, or a `Step` on it (then pass no inputs or step options).
        plan: a plan of `plan_checkpointing`.
        inputs: tensor, tuple, dict or `ModelInputs` for the verification step.
        loss_fn: the step's loss (see `torchscope.step`).
        target: its target; None draws seeded targets where the loss needs one.
        seed: the seed both verification runs start from.
        require_bitwise: make a verification that is not bitwise equal fail.

    Returns:
        The handle (`remove()` or a `with` block undoes it); its `verification` is set.

    Raises:
        VerificationError: the plan changed the result; it was removed again.
    """
    step = Step.of(model, inputs, loss_fn=loss_fn, target=target)
    return apply(step, Blocks(plan.blocks, plan.parent), segments=plan.segments, seed=seed,
                 require_bitwise=require_bitwise)


def verify_plan(step: Step, plan: CheckpointPlan, *, seed: int = 0) -> Verification | str:
    """Apply `plan` with the model's caches off, verify it, and remove it again.

    Returns:
        The verification, or why it failed (one line) when it did.
    """
    with caches_off(step) as (run, _):
        try:
            with apply_plan(run, plan, seed=seed) as handle:
                assert handle.verification is not None
                return handle.verification
        except VerificationError as exc:
            return exc.one_line()


def _measure(step: Step, plan: CheckpointPlan, *, repeats: int, seed: int
             ) -> PlanMeasurement | str:
    """Apply the plan (verified), count its saved bytes, time its step against the step
    without it, and measure its peak; the reason, when its verification failed."""
    try:
        handle = apply_plan(step, plan, seed=seed) if plan.segments else None
    except VerificationError as exc:
        return exc.one_line()
    with handle if handle is not None else nullcontext():
        saved = _account(step).saved.total_bytes
        device = step.device

        def one() -> float:
            step.zero_grad()
            return timed_ms(step.forward_backward, lambda: synchronize(device))()

        def without() -> float:
            assert handle is not None
            with handle.suspended():
                return one()

        with step.preserved(clear_grads=True):
            one()  # warm-up: one-time costs (allocator, lazy init) out of the figures
            if handle is None:
                samples = repeat(one, min_repeats=repeats, max_repeats=4 * repeats,
                                 budget_s=_BUDGET_S)
                slowdown, base_ms = None, median_interval(samples).median
            else:
                without()
                samples, base = repeat_interleaved(
                    [one, without], min_repeats=repeats, max_repeats=4 * repeats,
                    budget_s=_BUDGET_S)
                slowdown, base_ms = compare(samples, base), median_interval(base).median
        peak = _measure_memory(step).peak_bytes
    step_ms = median_interval(samples).median
    cost, low, high = recompute_cost(slowdown, base_ms)
    return PlanMeasurement(plan.name, saved, step_ms, cost, peak,
                           handle.verification if handle is not None else None, slowdown,
                           len(samples), low, high)


def recompute_cost(slowdown: Ratio | None, base_ms: float) -> tuple[float, float, float]:
    """A plan's extra step time and its interval, in ms: `(slowdown - 1) × base_ms` for the
    median and each end of the slowdown's interval, never below 0 (recomputation adds work;
    a step measured faster with it is noise). `(0, 0, 0)` without a slowdown (`none`)."""
    if slowdown is None:
        return 0.0, 0.0, 0.0
    return tuple(max((r - 1.0) * base_ms, 0.0)  # type: ignore[return-value]
                 for r in (slowdown.value, slowdown.low, slowdown.high))
