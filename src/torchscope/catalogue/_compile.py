"""The catalogue's `compile.*` entries: what `compile_report` finds per `torch.compile` mode
and in the forward's graph (`CompileReport.findings()`), and what the compile hygiene checks
find about hooks on a compiled model (`check_compiled_hooks`)."""

from __future__ import annotations

from torchscope.catalogue._base import ERROR, INFO, INFO_WARNING, WARNING, WARNING_ERROR
from torchscope.findings import Entry, Subject

# How a mode's speedup is judged: shared by the verdicts of one mode.
_SPEEDUP = ("Eager and compiled calls are timed interleaved in one child process (warm-up "
            "first); the speedup is the ratio of their medians with the order-statistic "
            "interval of torchscope._timing.compare (about 90% coverage). Timing goes on past "
            "the calls asked for until the interval excludes 1 or the timing budget is spent "
            "(compile_report's timing_budget_s, 10 s by default; the doctor's too), and at "
            "most 400 to 500 pairs.")


def _failed(status: str, title: str, meaning: str, fix: str, example: str) -> Entry:
    """The entry of `compile.<status>`: a mode that did not get to a measurement."""
    return Entry(
        code=f"compile.{status}",
        title=title,
        subject=Subject.ENVIRONMENT,
        levels=ERROR,
        severity="error: the mode could not be measured, and training with it would meet "
                 "the same failure.",
        meaning=meaning,
        criterion="The mode's child process reported this status (ModeResult.status); the "
                  "other modes still run.",
        fix=fix,
        example=example,
    )


ENTRIES: tuple[Entry, ...] = (
    Entry(
        code="compile.no_compiler",
        title="No C++ compiler for inductor",
        subject=Subject.ENVIRONMENT,
        levels=ERROR,
        severity="error: no mode can compile on the CPU of this machine.",
        meaning="On the CPU, inductor writes C++ kernels and compiles them with the system's "
                "C++ compiler; without one, torch.compile fails at the first call.",
        criterion="$CXX (else g++, or clang++ on macOS) is not on PATH or does not run "
                  "`--version`, or the mode failed with inductor's InvalidCxxCompiler.",
        fix="install g++ (or clang++) or set CXX to a working C++ compiler.",
        example="mode 'default' could not compile: inductor on CPU found no C++ compiler.",
    ),
    _failed("error", "A compile mode failed",
            "Compiling or running the model under this mode raised: Dynamo could not trace "
            "it, inductor could not lower it, or the compiled code failed.",
            "rerun with --debug, or fix the error shown.",
            "mode 'max-autotune' failed (error): BackendCompilerFailed: ..."),
    _failed("crashed", "A compile mode crashed its process",
            "The child process measuring this mode died (a signal, an abort) before it "
            "wrote a result: a crash in torch's compiler or in the compiled kernels.",
            "rerun that mode alone with TORCH_LOGS=+dynamo to see the crash; report it to "
            "PyTorch with the model.",
            "mode 'default' failed (crashed): the child process died (killed by SIGSEGV) "
            "during cold compile."),
    _failed("timeout", "A compile mode ran past its timeout",
            "The mode's child process gave no result within the timeout (the doctor allows "
            "300 s per mode) and was killed; max-autotune compiles for long on the CPU.",
            "raise the timeout, or skip this mode (max-autotune compiles for long on CPU).",
            "mode 'max-autotune' failed (timeout): no result after 300 s (during: cold "
            "compile); the child process was killed."),
    Entry(
        code="compile.nothing_compiled",
        title="torch.compile compiled nothing",
        subject=Subject.MODEL,
        levels=INFO_WARNING,
        severity="warning where compiling was asked for: torch.compile on this model runs "
                 "eager code, whatever it measured; info where the doctor only offers it.",
        meaning="Dynamo traced one call of the forward and produced no graph: the whole "
                "forward runs as ordinary Python, so every mode's 'compiled' calls are eager "
                "ones, and their timings compare eager with eager. A forward under "
                "torch.compiler.disable, or code Dynamo skips, does this.",
        criterion="The graph scan (one Dynamo trace of the forward with a collecting "
                  "backend) counted 0 graphs (CompileReport.graph_count == 0).",
        fix="check that forward is not wrapped in torch.compiler.disable / "
            "torch._dynamo.disable and that its module is not skipped by Dynamo "
            "(TORCH_LOGS=+dynamo names the skip).",
        example="torch.compile compiled nothing: Dynamo made 0 graphs of the forward, so "
                "every mode ran eager code.",
    ),
    Entry(
        code="compile.no_measurable_speedup",
        title="A compile speedup that could not be measured here",
        subject=Subject.MEASUREMENT,
        levels=INFO,
        severity="always info: an interval that includes 1 is no verdict, neither faster "
                 "nor slower.",
        meaning="After timing as many calls as the budget allowed, the interval of the "
                "speedup still includes 1: on this machine, at this load, compiled and eager "
                "calls cannot be told apart, and neither 'pays off after N calls' nor "
                "'slower' is a fact. Busy or shared machines widen the interval.",
        criterion=_SPEEDUP,
        fix="rerun on an idle machine, or time more calls (--iters, timing_budget_s=).",
        example="mode 'default': no speedup could be measured here: compiled calls take 57.2 "
                "ms vs 69.8 ms eager, and the interval (0.36–5.76×) still includes 1 (no "
                "difference) after 46 calls each in 10.7 s (timing budget 10 s in all).",
    ),
    Entry(
        code="compile.pays_off",
        title="torch.compile pays off",
        subject=Subject.ENVIRONMENT,
        levels=INFO,
        severity="always info: good news, with its break-even.",
        meaning="Compiled calls are measurably faster than eager ones, and the compile time "
                "is paid back after the stated number of calls (with a cold and a warm "
                "inductor cache).",
        criterion=_SPEEDUP + " Pays off: the interval lies above 1; break-even is "
                             "ceil(compile s / time saved per call).",
        fix="compile once before the loop; the first call pays the compile.",
        example="mode 'default' pays off after 1,204 calls: 1.84× (1.61–2.10) faster "
                "(4.1 → 2.2 ms per call) for a 2.3 s cold compile.",
    ),
    Entry(
        code="compile.never_pays_off",
        title="Compiled calls are slower than eager",
        subject=Subject.ENVIRONMENT,
        levels=INFO_WARNING,
        severity="warning when the speedup's interval lies wholly below 1 (decidedly "
                 "slower) and compiling was asked for (compile_report, torchscope compile); "
                 "info where the doctor only offers it, or no interval was measured and only "
                 "the median is slower.",
        meaning="Compiled calls take longer than eager ones, so the compile is never paid "
                "back. Small work per call (launch and guard overhead dominate) and "
                "graph breaks are the usual causes.",
        criterion=_SPEEDUP + " Never pays off: the interval lies below 1.",
        fix="keep this model eager, or compile a larger piece of work (bigger batch, the "
            "whole training step).",
        example="mode 'max-autotune' never pays off: compiled calls take 3.1 ms vs 2.4 ms "
                "eager (0.77× (0.71–0.83)), after a 41.0 s compile.",
    ),
    Entry(
        code="compile.no_gain",
        title="No compile mode beats eager",
        subject=Subject.ENVIRONMENT,
        levels=INFO_WARNING,
        severity="warning: every mode measured is decidedly slower than eager, and compiling "
                 "was asked for; info where the doctor only offers it.",
        meaning="Several modes were measured and every one is slower than eager beyond the "
                "noise: torch.compile does not pay off for this model at these inputs on "
                "this machine. One finding for all the modes, in place of one per mode.",
        criterion="Two or more modes measured, and each one's speedup interval lies wholly "
                  "below 1. " + _SPEEDUP,
        fix="keep the model eager; compile pays off for larger work per call.",
        example="no measured mode beats eager on (32x3x32x32) (cpu): default 0.81× "
                "(0.74–0.88), max-autotune 0.62× (0.55–0.70).",
    ),
    Entry(
        code="compile.best_mode",
        title="The compile mode to use",
        subject=Subject.ENVIRONMENT,
        levels=INFO,
        severity="always info.",
        meaning="Among the modes that measurably beat eager, the fastest; where others are "
                "as fast within the noise, the simplest of them (default, then "
                "reduce-overhead, then max-autotune-no-cudagraphs, then max-autotune).",
        criterion="Modes whose speedup interval lies above 1; tied where a mode's interval "
                  "reaches the fastest one's low end.",
        fix="torch.compile(model, mode=...) with the mode named.",
        example="best mode: 'default', 1.84× eager, paid back after 1,204 calls.",
    ),
    Entry(
        code="compile.numerics",
        title="Compiled outputs or gradients differ from eager",
        subject=Subject.ENVIRONMENT,
        levels=WARNING,
        severity="warning: beyond rounding, the compiled model computes something else.",
        meaning="The compiled model's outputs (or, timing the training step, its gradients) "
                "differ from eager ones by more than rounding: lower-precision kernels, "
                "reordered reductions or a lowering bug.",
        criterion="Largest |compiled − eager| over every output element (parameter "
                  "gradient) above 1e-3 of the largest |eager| value.",
        fix="check the model with torch._dynamo.utils.same / lower-precision ops; try "
            "mode='default' or options={'fallback_random': True}.",
        example="mode 'max-autotune' changes the outputs: max abs diff 0.031, 0.42% of the "
                "largest eager value.",
    ),
    Entry(
        code="compile.recompiles",
        title="A compiled function recompiles",
        subject=Subject.MODEL,
        levels=WARNING_ERROR,
        severity="error when a frame hit torch's recompile limit (it then runs eagerly) or "
                 "recompiled as often as the limit; warning otherwise.",
        meaning="A guard of the compiled graph failed on a later call (a new input shape, a "
                "changed Python value), so Dynamo compiled the function again, paying the "
                "compile each time; at the limit it gives up and runs the frame eagerly.",
        criterion="Dynamo's guard failures seen while the mode ran (its recompile callback), "
                  "per function, against torch._dynamo.config.recompile_limit.",
        fix="mark the varying dimension dynamic (torch._dynamo.mark_dynamic(x, 0)) or compile "
            "with dynamic=True; keep guarded Python values constant across calls.",
        example="mode 'default' recompiled forward (model.py:12) 2× (limit 8); last failing "
                "guard: tensor 'x' size mismatch at index 0. expected 32, actual 16",
    ),
    Entry(
        code="compile.graph_break",
        title="A graph break",
        subject=Subject.MODEL,
        levels=WARNING,
        severity="warning: each break splits the compiled graph and runs Python between the "
                 "pieces.",
        meaning="Dynamo could not trace past this line (a print, a data-dependent branch, "
                ".item(), an unsupported call), so the graph ends there and Python runs the "
                "rest until the next graph: less fusion, more overhead per call.",
        criterion="One Dynamo trace of the forward with a collecting backend; each graph "
                  "compiled for a graph break, located at the innermost user frame.",
        fix="remove the break's cause (the finding names the fix for its kind), or wrap the "
            "code in torch.compiler.disable if it must stay Python.",
        example="graph break at model.py:31 in forward: print() call (Failed to trace "
                "builtin operator).",
    ),
    Entry(
        code="compile.ddp_buckets",
        title="DDP's bucket boundaries split the compiled graph",
        subject=Subject.ENVIRONMENT,
        levels=INFO,
        severity="always info: expected under DistributedDataParallel.",
        meaning="Under DDP, torch.compile's DDPOptimizer splits the graph where DDP's "
                "gradient buckets end, so that each bucket's all-reduce overlaps the rest of "
                "backward. These breaks are intended, not faults.",
        criterion="Graph breaks whose reason names DDPOptimizer or that come from "
                  "torch/_dynamo/backends/distributed.py (pytorch/pytorch#108966).",
        fix="nothing to fix; DDP's bucket_cap_mb sets how many pieces.",
        example="DDPOptimizer cut the compiled graph at DDP's gradient buckets (3 graph "
                "breaks it reports): expected.",
    ),
    Entry(
        code="compile.hooks_untracked",
        title="A compiled model's first call was not observed",
        subject=Subject.MEASUREMENT,
        levels=INFO,
        severity="always info: a limit of the hook check, not a fault.",
        meaning="The model was compiled without torchscope seeing its first call, so hooks "
                "registered after it cannot be told from hooks registered before.",
        criterion="No record of the wrapper's first call (compile_once or track_compiled "
                  "were not used).",
        fix="compile with torchscope.compile_once(model) or call "
            "torchscope.compile.track_compiled(compiled) before the first call.",
        example="the model was compiled without torchscope seeing its first call, so hooks "
                "added after it cannot be told apart.",
    ),
    Entry(
        code="compile.late_hook",
        title="A hook registered after the first compiled call",
        subject=Subject.LOOP,
        levels=WARNING_ERROR,
        severity="error when Dynamo does not guard on module hooks (the hook never fires); "
                 "warning when it does (the next call recompiles to include it).",
        meaning="Hooks on a compiled module are traced into the graph at the first call. A "
                "hook added later either never fires (torch's default, "
                "skip_nnmodule_hook_guards) or forces a recompile.",
        criterion="The module's hooks compared with those present at the wrapper's first "
                  "call (compile_once / track_compiled record them).",
        fix="register hooks before the first compiled call, or call torch._dynamo.reset() "
            "after registering; for inspection run the model eagerly "
            "(torch.compiler.set_stance('force_eager')).",
        example="forward hook log on encoder.0 was registered after the first compiled call "
                "and will never fire.",
    ),
    Entry(
        code="compile.hook_recompiles",
        title="A hook forces a recompile on every call",
        subject=Subject.LOOP,
        levels=ERROR,
        severity="error: every call pays a compile until the limit, then the frame runs "
                 "eagerly.",
        meaning="A hook's Python state (a list it appends to, a counter) is part of the "
                "compiled graph's guards, so each call changes it and fails the guard: "
                "Dynamo recompiles every call until its limit, then gives up.",
        criterion="Recompiles whose failing guard's source line lies inside a registered "
                  "module hook (hook_at).",
        fix="keep hook state out of the guards: wrap the hook body with "
            "torch.compiler.disable, store results in a preallocated tensor, or capture with "
            "torchscope.activations on the eager model.",
        example="forward hook record on fc forces a recompile on every call (8 seen, limit "
                "8).",
    ),
)
