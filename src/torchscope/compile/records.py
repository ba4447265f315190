"""Frozen records of the torch.compile doctor: numbers and torch's own texts, never formatted."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from torchscope._timing import Ratio
from torchscope.findings import Analyzed
from torchscope.step import StepInfo

__all__ = [
    "CompileMeasure",
    "CompileReport",
    "GraphBreak",
    "ModeResult",
    "Recompile",
    "ShapeCall",
    "derive_speed",
]

#: What `compile_report` times: the forward under `no_grad` in eval mode, or the shared
#: training step's forward, loss and backward in train mode.
CompileMeasure = Literal["forward", "step"]
MEASURES: tuple[CompileMeasure, ...] = ("forward", "step")


@dataclass(frozen=True)
class GraphBreak:
    """One place where Dynamo had to split the graph and fall back to Python.

    Attributes:
        kind: a short class of the break: `print() call`, `data-dependent branch`,
            `Tensor.item()`, `unsupported call` or `other`.
        reason: the first line of torch's reason, e.g. `Failed to trace builtin operator`.
        explanation: torch's `Explanation:` line when it gives one, else "".
        file: the user's source file of the break (the innermost frame outside torch).
        line: its line number.
        function: the function the break is in.
        hook: `"<module> <kind> hook <name>"` when the break is inside a registered hook.
        detail: torch's full reason text.
    """

    kind: str
    reason: str
    explanation: str
    file: str | None
    line: int | None
    function: str | None
    hook: str | None = None
    detail: str = ""

    @property
    def where(self) -> str:
        """`file:line` (just the file name), or `?` when torch gave no user frame."""
        if self.file is None:
            return "?"
        name = self.file.replace("\\", "/").rsplit("/", 1)[-1]
        return f"{name}:{self.line}"


@dataclass(frozen=True)
class Recompile:
    """One recompilation of an already compiled frame, with the guard that failed.

    Attributes:
        compile_id: Dynamo's id, `frame/attempt` (`0/1` is the first recompile of frame 0).
        function: the recompiled code object's name.
        file: its file.
        line: its first line.
        guard: the failing guard of the most recent cached graph, e.g.
            `tensor 'x' size mismatch at index 0. expected 32, actual 16`.
        reasons: one failure text per cached graph tried, most recent first.
        source: `file:line` of the user code the guard came from, when torch names it.
    """

    compile_id: str
    function: str
    file: str
    line: int
    guard: str
    reasons: tuple[str, ...]
    source: str | None = None

    @property
    def where(self) -> str:
        """`function (file.py:line)`."""
        return f"{self.function} ({self.file.rsplit('/', 1)[-1]}:{self.line})"


@dataclass(frozen=True)
class ShapeCall:
    """A compiled call with another batch size, made to show shape recompiles.

    Attributes:
        batch_size: the first dimension of the inputs of this call.
        call_s: the wall time of the call, compile included.
        compiled: whether the call made Dynamo compile a frame.
    """

    batch_size: int
    call_s: float
    compiled: bool


@dataclass(frozen=True)
class ModeResult:
    """What one `torch.compile` mode costs and gains, measured in one child process.

    Times are seconds (`*_s`) or milliseconds (`*_ms`). Fields are None when the mode did
    not get that far (see `status` and `error`).

    Attributes:
        mode: the `torch.compile(mode=...)` value.
        status: `ok`, `error` (the model or compile raised), `crashed` (the child died),
            `timeout`, or `no_compiler` (inductor on CPU found no C++ compiler).
        error: what went wrong, one line.
        cold_compile_s: first compiled call with an empty inductor cache, minus one
            steady-state call.
        warm_compile_s: the same for a fresh copy of the code (Dynamo traces again) with
            inductor's in-memory caches cleared and the cold compile's on-disk cache reused.
        eager_ms: median steady-state eager call (the forward, or the step's forward, loss
            and backward with `measure="step"`).
        compiled_ms: median steady-state compiled call, timed interleaved with eager.
        speedup: `eager_ms / compiled_ms`.
        break_even_calls: calls until the cold compile is paid back by the time saved per
            call; None ("never") when compiled is not measurably faster.
        break_even_calls_warm: the same for the warm compile.
        max_abs_diff: largest |compiled - eager| over every output element.
        max_rel_diff: `max_abs_diff` divided by the largest |eager output|.
        grad_max_abs_diff: largest |compiled - eager| over every parameter gradient
            (`measure="step"`).
        grad_max_rel_diff: that divided by the largest |eager gradient|.
        graphs: graphs compiled by the cold call (1 + graph breaks, per frame).
        recompiles: every recompile seen in this mode's child.
        recompile_limit: torch's recompile limit per frame at the time.
        limit_hit: whether a frame hit that limit (torch then runs it eagerly).
        shape_calls: the extra calls with other batch sizes.
        iters: timed calls of each kind (the calls asked for, or more: see `timing_s`).
        isolated: measured in a child process (False: in this process).
        wall_s: wall time of the whole measurement, process start included.
        speedup_ratio: the speedup with its interval (eager over compiled call times; see
            `torchscope._timing`); a speedup whose interval includes 1 is no measurable
            speedup, whatever its median.
        timing_s: seconds spent timing the steady-state calls (`iters` pairs, more while
            the interval included 1 and the budget allowed).
        timing_budget_s: the timing budget those extra calls were given.
    """

    mode: str
    status: str
    error: str | None = None
    cold_compile_s: float | None = None
    warm_compile_s: float | None = None
    eager_ms: float | None = None
    compiled_ms: float | None = None
    speedup: float | None = None
    break_even_calls: int | None = None
    break_even_calls_warm: int | None = None
    max_abs_diff: float | None = None
    max_rel_diff: float | None = None
    grad_max_abs_diff: float | None = None
    grad_max_rel_diff: float | None = None
    graphs: int | None = None
    recompiles: tuple[Recompile, ...] = ()
    recompile_limit: int = 8
    limit_hit: bool = False
    shape_calls: tuple[ShapeCall, ...] = ()
    iters: int = 0
    isolated: bool = True
    wall_s: float | None = None
    speedup_ratio: Ratio | None = None
    timing_s: float | None = None
    timing_budget_s: float | None = None

    @property
    def slower(self) -> bool:
        """True when compiled calls are slower than eager beyond the timing noise (by the
        median alone when no interval was measured)."""
        if self.speedup_ratio is not None:
            return self.speedup_ratio.below
        return self.speedup is not None and self.speedup < 1.0

    @property
    def undecided(self) -> bool:
        """True when the speedup was timed but its interval includes 1: neither faster nor
        slower is a fact on this machine."""
        return self.ok and self.speedup_ratio is not None and not self.speedup_ratio.measurable

    @property
    def ok(self) -> bool:
        """True when every figure was measured."""
        return self.status == "ok"

    @property
    def faster(self) -> bool:
        """True when compiled steady-state calls beat eager ones beyond the timing noise
        (by the median alone when no interval was measured)."""
        if self.speedup_ratio is not None:
            return self.speedup_ratio.above
        return self.speedup is not None and self.speedup > 1.0


# Modes from the simplest: the choice among modes whose speedups the noise cannot tell apart.
_SIMPLEST = {"default": 0, "reduce-overhead": 1, "max-autotune-no-cudagraphs": 2,
             "max-autotune": 3}


@dataclass(frozen=True)
class CompileReport(Analyzed):
    """The torch.compile doctor's answer for one model and input.

    Findings: `report.findings()` (pays off or not per mode, numerics, recompiles, graph
    breaks, the best mode).

    Attributes:
        model: the model's name.
        inputs: the input shapes, e.g. `(32x3x32x32)`.
        device: where the model ran (`cpu`, `cuda:0`).
        measure: `forward` (inference under `no_grad`, eval mode) or `step` (the training
            step's forward, loss and backward, train mode).
        modes: one result per mode, in the order asked.
        graph_breaks: every graph break in the forward.
        graph_count: graphs Dynamo produced for one forward.
        recompile_limit: torch's per-frame recompile limit.
        torch_version: `torch.__version__`.
        notes: plain sentences about how the figures were obtained (fallbacks).
        step: the training step measured (`measure="step"`), with the loss of the eager
            copy's first step; None for `measure="forward"` or when no mode ran it.
        proposed: measured unasked, as an offer (the doctor measures compile for every
            model, whether its user compiles or not): that compiling is slower is then a
            note, not a warning.
    """

    model: str
    inputs: str
    device: str
    measure: CompileMeasure
    modes: tuple[ModeResult, ...]
    graph_breaks: tuple[GraphBreak, ...]
    graph_count: int | None
    recompile_limit: int
    torch_version: str
    notes: tuple[str, ...] = ()
    step: StepInfo | None = None
    proposed: bool = False

    def mode(self, name: str) -> ModeResult:
        """The result of mode `name`.

        Raises:
            KeyError: that mode was not measured.
        """
        for m in self.modes:
            if m.mode == name:
                return m
        raise KeyError(f"mode {name!r} was not measured (measured: "
                       f"{', '.join(m.mode for m in self.modes)})")

    @property
    def best(self) -> ModeResult | None:
        """The mode to use, among those that beat eager: the fastest, or where other modes
        are as fast within the timing noise (`as_fast_as_best`), the simplest of them
        (default, then reduce-overhead, then max-autotune-no-cudagraphs, then
        max-autotune: no CUDA graphs to keep static, no autotuning to wait for).

        Speedups are ratios timed side by side within one child, so they compare across
        modes even when the machine's load changed between children; raw times do not.
        """
        tied = self._tied()
        return min(tied, key=lambda m: (_SIMPLEST.get(m.mode, len(_SIMPLEST)),
                                        self.modes.index(m))) if tied else None

    @property
    def as_fast_as_best(self) -> tuple[ModeResult, ...]:
        """The other modes whose speedup is the best one's within the timing noise: their
        intervals overlap the fastest mode's (none where either was measured without an
        interval: the fastest median then decides)."""
        best = self.best
        return tuple(m for m in self._tied() if m is not best)

    def _tied(self) -> list[ModeResult]:
        fast = [m for m in self.modes if m.ok and m.faster]
        if not fast:
            return []
        top = max(fast, key=lambda m: m.speedup or -math.inf)
        a = top.speedup_ratio
        return [m for m in fast if m is top or (
            a is not None and m.speedup_ratio is not None and m.speedup_ratio.high >= a.low)]


def derive_speed(
    eager_ms: float | None, compiled_ms: float | None, compile_s: float | None,
    ratio: Ratio | None = None,
) -> tuple[float | None, int | None]:
    """Speedup (`eager_ms / compiled_ms`, one call each) and the calls that pay back the
    one-time `compile_s`: `ceil(compile_s / time saved per call)`, None ("never") when the
    compiled call is not faster, or, given the speedup's `ratio`, not measurably faster."""
    if eager_ms is None or compiled_ms is None or compiled_ms <= 0:
        return None, None
    speedup = eager_ms / compiled_ms
    saved_s = (eager_ms - compiled_ms) / 1e3
    if compile_s is None or saved_s <= 0 or (ratio is not None and not ratio.above):
        return speedup, None
    return speedup, max(1, math.ceil(compile_s / saved_s))
