"""`compile_report`: is torch.compile worth it for this model? One child process per mode."""

from __future__ import annotations

import importlib.machinery
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchscope._process import seeded, spawn, stop
from torchscope.compile._isolate import fresh_inductor_cache
from torchscope.compile._measure import MeasureJob, run_job
from torchscope.compile.breaks import BreakScan
from torchscope.compile.records import MEASURES, CompileMeasure, CompileReport, ModeResult
from torchscope.compile.watch import recompile_limit
from torchscope.errors import CompileError
from torchscope.hooks.compiled import compiled_parts, unwrap_compiled
from torchscope.models.target import ModelInputs
from torchscope.step import LossSpec, Step, StepInfo

__all__ = ["DEFAULT_MODES", "compile_report", "cpp_compiler", "known_modes"]

DEFAULT_MODES = ("default", "reduce-overhead", "max-autotune")
_NO_CXX = ("inductor on CPU compiles C++ kernels and found no C++ compiler ({cxx!r} is not "
           "on PATH or does not run). Install one (apt install g++, or xcode-select --install) "
           "or point CXX at it.")
_HERE = "measured in this process without a timeout: {}."
# SIGTERM, then SIGKILL this much later: a compiler stopped by SIGTERM removes its own
# temporary files (g++'s in TMPDIR); SIGKILL would leave them.
_GRACE_S = 2.0
_CHILD = ("import sys; from torchscope.compile._measure import child_main; "
          "sys.exit(child_main(sys.argv[1:]))")


def known_modes() -> tuple[str, ...]:
    """The `mode=` values this torch's `torch.compile` accepts."""
    from torch._inductor import list_mode_options

    return tuple(list_mode_options().keys())


def cpp_compiler() -> str | None:
    """The C++ compiler inductor would use on CPU (`$CXX`, else g++/clang++), or None."""
    wanted = os.environ.get("CXX") or ("clang++" if sys.platform == "darwin" else "g++")
    path = shutil.which(wanted)
    if path is None:
        return None
    try:
        subprocess.run([path, "--version"], capture_output=True, check=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return path


def _importable(module_name: str) -> bool:
    """Whether a fresh interpreter with this `sys.path` can import `module_name`."""
    top = module_name.split(".", 1)[0]
    if top == "__main__":
        return False
    if top in sys.builtin_module_names:
        return True
    try:
        # PathFinder searches sys.path only: modules loaded from a file path under a made-up
        # name (TARGET files, pytest's importlib mode) are not found, as in the child.
        return importlib.machinery.PathFinder.find_spec(top, sys.path) is not None
    except (ImportError, ValueError):
        return False


def _not_sendable(model: nn.Module) -> str | None:
    """Why a child process could not rebuild `model` from a pickle, or None."""
    for name, m in model.named_modules():
        mod = type(m).__module__
        if not _importable(mod):
            return (f"{name or 'the model'} is a {type(m).__name__} defined in {mod}, which "
                    "a child process cannot import")
    return None


def _not_sendable_loss(loss_fn: Any) -> str | None:
    """Why a child process could not get this loss function, or None."""
    if not callable(loss_fn):
        return None
    name = getattr(loss_fn, "__qualname__", None) or type(loss_fn).__name__
    try:
        pickle.dumps(loss_fn)
    except Exception as exc:
        return f"the loss function {name} cannot be pickled ({type(exc).__name__})"
    module = getattr(loss_fn, "__module__", None) or type(loss_fn).__module__
    if not _importable(module):
        return f"the loss function {name} is defined in {module}, which a child process " \
               "cannot import"
    return None


# ---------------------------------------------------------------------- running
def _read_log(log: Path) -> tuple[str, str]:
    """The child's last progress step (`start-up` before any), and its last three other
    output lines joined."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        lines = []
    steps = [ln.removeprefix("[torchscope] ") for ln in lines if ln.startswith("[torchscope]")]
    other = [ln for ln in lines if not ln.startswith("[torchscope]")]
    return (steps[-1] if steps else "start-up"), " | ".join(other[-3:])


def _run_child(job: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Measure one mode in a fresh interpreter with a fresh inductor cache dir; returns
    `run_job`'s payload, or the status `timeout`, `crashed` or `not_sent` (the child could
    not get the model: its `error` says why)."""
    # The child removes this folder when a signal or this process's death stops it
    # (`child_main`), and so does `stop_children` after a signal to this process: it may be
    # gone by the time this process leaves the block.
    with tempfile.TemporaryDirectory(prefix="torchscope-compile-",
                                     ignore_cleanup_errors=True) as tmp:
        tmpdir = Path(tmp)
        job_path, result_path, log_path = tmpdir / "job.pt", tmpdir / "result.pkl", tmpdir / "log"
        try:
            torch.save(job, job_path)
        except (pickle.PickleError, TypeError, AttributeError, RuntimeError) as exc:
            # A local class or a lambda hook: the model cannot travel to a child; nor can a
            # TorchScript submodule (torch.save raises RuntimeError: no __getstate__).
            return {"status": "not_sent", "error": "the model or its inputs cannot be "
                                                   f"pickled ({type(exc).__name__}: {exc})"}
        # The child imports what this process imports: same torchscope, same user modules.
        paths = dict.fromkeys(p or os.getcwd() for p in sys.path)
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmpdir / "inductor"),
               "TRITON_CACHE_DIR": str(tmpdir / "inductor" / "triton"),
               "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(paths)}
        cmd = [sys.executable, "-c", _CHILD, str(job_path), str(result_path), str(os.getpid())]
        with open(log_path, "wb") as log:
            # Its own process group: a timeout, an exception or a signal (SIGINT, SIGTERM)
            # ends it and the compilers it started, before this folder is removed. This
            # thread waits for it: Linux tells the child when the thread that started it
            # ends (`_process.die_with_parent`).
            proc = spawn(cmd, folder=tmpdir, stdout=log, stderr=subprocess.STDOUT, env=env)
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                during = _read_log(log_path)[0]  # before the stopped child removes the log
                stop(proc, _GRACE_S)
                return {"status": "timeout",
                        "error": f"no result after {timeout_s:.0f} s (during: {during}); "
                                 "the child process was killed."}
            except BaseException:
                stop(proc, _GRACE_S)
                raise
            stop(proc)  # whatever it left running in its group
        if result_path.exists():
            # Written by our own worker, in a directory only this call knows.
            return pickle.loads(result_path.read_bytes())  # type: ignore[no-any-return]
        why = f"exit code {rc}"
        if rc < 0:
            try:
                why = f"killed by {signal.Signals(-rc).name}"
            except ValueError:
                why = f"killed by signal {-rc}"
        during, tail = _read_log(log_path)
        return {"status": "crashed",
                "error": f"the child process died ({why}) during {during}"
                         + (f": {tail}" if tail else "")}


def _run_here(model: nn.Module, inputs: ModelInputs, job: MeasureJob) -> dict[str, Any]:
    """Measure in this process on private code and a fresh inductor cache; the caller's
    random streams, environment and compiler stance are given back."""
    with seeded(None), fresh_inductor_cache(), torch.compiler.set_stance("default"):
        return run_job(model, inputs, job)


def _check(modes: Sequence[str], measure: str, iters: int, warmup: int, timeout_s: float,
           batch_sizes: Sequence[int]) -> None:
    if not modes:
        raise CompileError("no mode to measure.", fix="pass modes=('default',) or more.")
    valid = known_modes()
    if bad := [m for m in modes if m not in valid]:
        raise CompileError(f"unknown torch.compile mode(s) {', '.join(map(repr, bad))}.",
                           fix=f"use some of: {', '.join(valid)}.")
    if measure not in MEASURES:
        raise CompileError(f"measure={measure!r} is not something compile_report times.",
                           fix="pass measure='forward' (inference) or measure='step' "
                           "(forward, loss and backward of the training step).")
    if iters < 1:
        raise CompileError(f"iters={iters} times no call.", fix="pass iters=20 or more "
                           "(--iters).")
    if warmup < 0:
        raise CompileError(f"warmup={warmup} is below zero.", fix="pass warmup=0 or more "
                           "(--warmup).")
    if not timeout_s > 0:
        raise CompileError(f"timeout_s={timeout_s} leaves no time to compile.",
                           fix="pass --timeout 600 (seconds per mode) or another positive value.")
    if any(b < 1 for b in batch_sizes):
        raise CompileError(f"batch sizes {list(batch_sizes)} must be positive.",
                           fix="pass e.g. --batch-sizes 16,8.")


def compile_report(
    model: nn.Module | Step,
    inputs: Any = None,
    *,
    loss_fn: LossSpec = "auto",
    target: Any = None,
    measure: CompileMeasure = "forward",
    modes: Sequence[str] = DEFAULT_MODES,
    iters: int = 30,
    warmup: int = 3,
    timing_budget_s: float = 10.0,
    timeout_s: float = 600.0,
    batch_sizes: Sequence[int] = (),
    dynamic: bool | None = None,
    options: dict[str, Any] | None = None,
    isolate: bool = True,
    name: str | None = None,
    factory: str | None = None,
    progress: Callable[[str, float | None], None] | None = None,
    on_mode: Callable[[str, int, int], None] | None = None,
    proposed: bool = False,
) -> CompileReport:
    """Measure what each `torch.compile` mode costs and gains on a model and its inputs.

    Each mode runs in its own child process with a fresh inductor cache: cold and warm
    compile, eager and compiled calls timed interleaved, speedup, break-even, output (and
    gradient) drift, recompiles with their failing guards (see `ModeResult`). Graph breaks
    come from one Dynamo trace of the forward. A mode that crashes, hangs past `timeout_s`
    or finds no C++ compiler is reported in its `status`; the other modes still run. Your
    model is never called: every figure comes from private copies.

    When the model (or a callable loss) cannot be sent to a child, the modes are measured
    in this process without a timeout (the notes say why), and the process is left as
    found: what you compiled stays compiled (no `torch._dynamo.reset()`), and the
    environment, random generators and compiler stance are restored.

    Args:
        model: the eager model (a `torch.compile` wrapper is unwrapped to its module), or a
            `Step` (its loss, target, autocast and accumulation are used; its optimizer
            is not stepped: it belongs to your model's parameters, not to the copies).
        inputs: a tensor, tuple, dict or `ModelInputs`, on the model's device (not with a
            `Step`).
        loss_fn: the step's loss (see `torchscope.step`); used with `measure="step"`.
        target: the loss target; None draws seeded targets for the named losses.
        measure: `forward`: inference under `torch.no_grad()` in eval mode; `step`: the
            training step's forward, loss and backward in train mode.
        modes: `torch.compile` modes; `default` means no `mode=`.
        iters: timed calls of each of eager and compiled, at least.
        timing_budget_s: seconds of timing a mode may spend in all (its `iters` pairs of
            calls always run) while its speedup's interval still includes 1 (no verdict
            yet); what is still undecided after it is reported as not measurable here.
        warmup: untimed calls of each before timing.
        timeout_s: per-mode limit for the child process.
        batch_sizes: after timing, call the compiled model once per batch size (inputs cut
            or tiled along dim 0) to show shape recompiles and their guards.
        dynamic: `torch.compile(dynamic=...)`; False recompiles for every new shape.
        options: `torch.compile(options=...)` (inductor options; not with `modes`).
        isolate: measure in child processes (False: in this process, without timeout).
        name: the model's name in the report.
        factory: a TARGET (`file.py:factory`) the child can rebuild the model from when
            the model cannot be pickled.
        progress: called before each step with a short line (`MODE: measuring in a child
            process`) and the step's time limit in seconds (`timeout_s` for a child, None
            where nothing limits it).
        on_mode: called with `(mode, k, n)` as mode k (1-based) of n begins (a progress
            display; each mode may take up to `timeout_s`).
        proposed: compiling is an offer the user did not ask for (the doctor's): a mode
            that is slower than eager is then a note, not a warning.

    Returns:
        A `CompileReport`; `report.findings()` says whether compile pays off.

    Raises:
        CompileError: an unknown mode or bad settings, or a model already compiled.
    """
    say = progress or (lambda _line, _limit_s: None)
    _check(modes, measure, iters, warmup, timeout_s, batch_sizes)
    if not timing_budget_s >= 0:
        raise CompileError(f"timing_budget_s={timing_budget_s} is below zero.",
                           fix="pass timing_budget_s=10 (seconds per mode) or 0 for "
                               "exactly `iters` calls.")
    step = Step.of(model, inputs, loss_fn=loss_fn, target=target)
    notes: list[str] = []
    net = unwrap_compiled(step.model)
    if net is not step.model:
        notes.append("measured the original module of the torch.compile wrapper.")
        step = step.with_model(net)
    if inner := compiled_parts(net):
        raise CompileError(
            f"compile_report needs the eager model, but {', '.join(p or '<root>' for p in inner)} "
            "is already compiled, so the eager baseline would run compiled code.",
            fix="pass the model as it was before torch.compile / module.compile().")
    if measure == "step" and (step.optimizer is not None or step.scaler is not None):
        notes.append("the step's optimizer and GradScaler were not used: the measured step "
                     "is forward, loss and backward on private copies of the model.")
    mi, device = step.inputs, step.device
    limit = recompile_limit()
    base = MeasureJob(mode="default", measure=measure, iters=iters, warmup=warmup,
                      dynamic=dynamic, explain=True, batch_sizes=tuple(batch_sizes),
                      options=dict(options or {}), loss_fn=step.loss_fn, target=step.target,
                      autocast=step.autocast, accumulate=step.accumulate, seed=step.seed,
                      budget_s=timing_budget_s)
    label = name or type(net).__name__

    if device.type == "cpu" and cpp_compiler() is None:
        msg = _NO_CXX.format(cxx=os.environ.get("CXX") or "g++")
        failed = tuple(ModeResult(m, "no_compiler", error=msg, recompile_limit=limit)
                       for m in modes)
        return CompileReport(label, mi.describe(), str(device), measure, failed, (), None,
                             limit, torch.__version__, (msg,))

    if device.type != "cuda" and any(m.startswith("reduce-overhead") for m in modes):
        notes.append("reduce-overhead removes launch overhead with CUDA graphs; on "
                     f"{device.type} there are none, so it compiles like default.")
    in_process = not isolate
    send_factory = False
    if isolate:
        why = _not_sendable_loss(step.loss_fn)
        if why is None and (why := _not_sendable(net)) is not None and factory is not None:
            # A model the child cannot unpickle, it rebuilds from its TARGET.
            send_factory, why = True, None
        if why is not None:
            in_process = True
            notes.append(_HERE.format(why))

    results: list[ModeResult] = []
    scan: BreakScan | None = None
    info: StepInfo | None = None
    for k, mode in enumerate(modes, 1):
        if on_mode is not None:
            on_mode(mode, k, len(modes))
        job = replace(base, mode=mode, explain=scan is None)
        t0 = time.perf_counter()
        if in_process:
            say(f"{mode}: measuring in this process", None)
            payload = _run_here(net, mi, job)
        else:
            say(f"{mode}: measuring in a child process (timeout {timeout_s:.0f} s)", timeout_s)
            payload = _run_child({"model": None if send_factory else net,
                                  "factory": factory, "inputs": mi, "job": job,
                                  "threads": torch.get_num_threads()}, timeout_s)
            if payload["status"] == "not_sent":
                in_process = True
                notes.append(_HERE.format(payload["error"]))
                say(f"{mode}: measuring in this process", None)  # no time limit now
                payload = _run_here(net, mi, job)
        wall = time.perf_counter() - t0
        scan = scan or payload.get("scan")
        info = info or payload.get("step")
        result = payload.get("result") or ModeResult(
            mode, payload["status"], error=payload.get("error") or "no result",
            recompile_limit=limit, iters=iters)
        results.append(replace(result, isolated=not in_process, wall_s=wall))
    if scan is None:
        notes.append("graph breaks were not scanned: the scan failed in every mode.")
    return CompileReport(
        model=label,
        inputs=mi.describe(),
        device=str(device),
        measure=measure,
        modes=tuple(results),
        graph_breaks=scan.breaks if scan else (),
        graph_count=scan.graph_count if scan else None,
        recompile_limit=limit,
        torch_version=torch.__version__,
        notes=tuple(notes),
        step=info,
        proposed=proposed,
    )
