"""`compile_report`: is torch.compile worth it for this model? One child process per mode."""

from __future__ import annotations

import importlib.machinery
import json
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

from torchscope._process import seeded
from torchscope.compile._isolate import fresh_inductor_cache
from torchscope.compile._measure import MeasureJob, StepSpec, run_job
from torchscope.compile.breaks import BreakScan
from torchscope.compile.records import (
    MEASURES,
    CompileMeasure,
    CompileReport,
    GraphBreak,
    ModeResult,
    Recompile,
    ShapeCall,
    derive_speed,
)
from torchscope.compile.watch import recompile_limit
from torchscope.errors import CompileError
from torchscope.hooks.compiled import compiled_parts, unwrap_compiled
from torchscope.models.target import ModelInputs
from torchscope.step import LossSpec, Step

__all__ = ["DEFAULT_MODES", "compile_report", "cpp_compiler", "known_modes"]

DEFAULT_MODES = ("default", "reduce-overhead", "max-autotune")
_NO_CXX = ("inductor on CPU compiles C++ kernels and found no C++ compiler ({cxx!r} is not "
           "on PATH or does not run). Install one (apt install g++, or xcode-select --install) "
           "or point CXX at it.")


def known_modes() -> tuple[str, ...]:
    """The `mode=` values this torch's `torch.compile` accepts."""
    try:
        from torch._inductor import list_mode_options

        return tuple(list_mode_options().keys())
    except Exception:  # pragma: no cover - very old torch
        return DEFAULT_MODES


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
        if mod == "__main__" or not _importable(mod):
            return (f"{name or 'the model'} is a {type(m).__name__} defined in {mod}, which "
                    "a child process cannot import")
    return None


# ---------------------------------------------------------------------- JSON -> records
def _scan_from(data: Any) -> BreakScan | None:
    if not isinstance(data, dict):
        return None
    return BreakScan(int(data["graph_count"]), tuple(GraphBreak(**b) for b in data["breaks"]))


def _mode_from(mode: str, payload: dict[str, Any], wall_s: float, isolated: bool) -> ModeResult:
    limit = recompile_limit()
    raw = payload.get("raw")
    if payload.get("status") != "ok" or not isinstance(raw, dict):
        return ModeResult(mode, str(payload.get("status", "error")),
                          error=payload.get("error") or "no result", recompile_limit=limit,
                          isolated=isolated, wall_s=wall_s)
    compiled_ms = float(raw["compiled_ms"])
    eager_ms = float(raw["eager_ms"])
    cold = max(float(raw["cold_first_s"]) - compiled_ms / 1e3, 0.0)
    warm = max(float(raw["warm_first_s"]) - compiled_ms / 1e3, 0.0)
    speedup, break_even = derive_speed(eager_ms, compiled_ms, cold)
    _, break_even_warm = derive_speed(eager_ms, compiled_ms, warm)
    recompiles = tuple(Recompile(**{**r, "reasons": tuple(r["reasons"])})
                       for r in raw["recompiles"])
    return ModeResult(
        mode=mode,
        status="ok",
        cold_compile_s=cold,
        warm_compile_s=warm,
        eager_ms=eager_ms,
        compiled_ms=compiled_ms,
        speedup=speedup,
        break_even_calls=break_even,
        break_even_calls_warm=break_even_warm,
        max_abs_diff=raw["max_abs_diff"],
        max_rel_diff=raw["max_rel_diff"],
        grad_max_abs_diff=raw["grad_max_abs_diff"],
        grad_max_rel_diff=raw["grad_max_rel_diff"],
        graphs=raw["graphs"],
        recompiles=recompiles,
        recompile_limit=int(raw["recompile_limit"]),
        limit_hit=bool(raw["limit_hit"]),
        shape_calls=tuple(ShapeCall(**s) for s in raw["shape_calls"]),
        iters=0,
        isolated=isolated,
        wall_s=wall_s,
    )


def _jsonable(payload: dict[str, Any]) -> dict[str, Any]:
    from torchscope._util import to_jsonable

    return json.loads(json.dumps(to_jsonable(payload)))  # type: ignore[no-any-return]


# ---------------------------------------------------------------------- running
class _UnpicklableError(Exception):
    """The job (model, inputs) cannot be pickled for the child process."""


def _tail(log: Path, n: int = 3) -> str:
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines()
                 if ln.strip() and not ln.startswith("[torchscope]")]
    except OSError:
        return ""
    return " | ".join(lines[-n:])


def _last_step(log: Path) -> str:
    try:
        steps = [ln for ln in log.read_text(errors="replace").splitlines()
                 if ln.startswith("[torchscope]")]
    except OSError:
        return "start-up"
    return steps[-1].removeprefix("[torchscope] ") if steps else "start-up"


def _kill(proc: subprocess.Popen[bytes]) -> None:
    try:
        if hasattr(os, "killpg"):
            os.killpg(proc.pid, signal.SIGKILL)
        else:  # pragma: no cover - Windows
            proc.kill()
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _run_child(payload: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Measure one mode in a fresh interpreter with a fresh inductor cache dir."""
    with tempfile.TemporaryDirectory(prefix="torchscope-compile-") as tmp:
        tmpdir = Path(tmp)
        job_path, result_path, log_path = tmpdir / "job.pt", tmpdir / "result.json", tmpdir / "log"
        try:
            torch.save(payload, job_path)
        except (pickle.PickleError, TypeError, AttributeError) as exc:
            raise _UnpicklableError(f"{type(exc).__name__}: {exc}") from exc
        env = dict(os.environ)
        env["TORCHINDUCTOR_CACHE_DIR"] = str(tmpdir / "inductor")
        env["TRITON_CACHE_DIR"] = str(tmpdir / "inductor" / "triton")
        env["PYTHONUNBUFFERED"] = "1"
        # The child imports what this process imports: same torchscope, same user modules.
        paths = [p or os.getcwd() for p in sys.path]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        cmd = [sys.executable, "-m", "torchscope.compile._worker", str(job_path),
               str(result_path)]
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _kill(proc)
                return {"status": "timeout",
                        "error": f"no result after {timeout_s:.0f} s (during: "
                                 f"{_last_step(log_path)}); the child process was killed."}
            except BaseException:
                _kill(proc)
                raise
        if result_path.exists():
            return json.loads(result_path.read_text())  # type: ignore[no-any-return]
        why = f"exit code {rc}"
        if rc < 0:
            try:
                why = f"killed by {signal.Signals(-rc).name}"
            except ValueError:
                why = f"killed by signal {-rc}"
        tail = _tail(log_path)
        return {"status": "crashed",
                "error": f"the child process died ({why}) during {_last_step(log_path)}"
                         + (f": {tail}" if tail else "")}


def _run_here(model: nn.Module, inputs: ModelInputs, job: MeasureJob) -> dict[str, Any]:
    """Measure in this process: private code objects, a fresh inductor cache, the caller's
    random streams, environment and compiler stance given back (no `torch._dynamo.reset()`:
    what the caller compiled stays compiled)."""
    with seeded(None), fresh_inductor_cache(), torch.compiler.set_stance("default"):
        return _jsonable(run_job(model, inputs, job))


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
    if module == "__main__" or not _importable(module):
        return f"the loss function {name} is defined in {module}, which a child process " \
               "cannot import"
    return None


def _check(modes: Sequence[str], measure: str, iters: int, warmup: int, timeout_s: float,
           batch_sizes: Sequence[int]) -> None:
    if not modes:
        raise CompileError("no mode to measure.", fix="pass modes=('default',) or more.")
    valid = known_modes()
    bad = [m for m in modes if m not in valid]
    if bad:
        raise CompileError(f"unknown torch.compile mode(s) {', '.join(map(repr, bad))}.",
                           fix=f"use some of: {', '.join(valid)}.")
    if measure not in MEASURES:
        raise CompileError(f"measure={measure!r} is not something compile_report times.",
                           fix="pass measure='forward' (inference) or measure='step' "
                           "(forward, loss and backward of the training step).")
    if iters < 1 or warmup < 0:
        raise CompileError(f"iters={iters}, warmup={warmup}: need iters >= 1, warmup >= 0.",
                           fix="pass --iters 20 or more.")
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
    timeout_s: float = 600.0,
    batch_sizes: Sequence[int] = (),
    dynamic: bool | None = None,
    options: dict[str, Any] | None = None,
    isolate: bool = True,
    name: str | None = None,
    factory: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> CompileReport:
    """Measure what each `torch.compile` mode costs and gains on a model and its inputs.

    For every mode, in its own child process with a fresh inductor cache: the cold compile,
    the warm compile (same on-disk cache, Dynamo tracing again), the median eager and
    compiled call timed interleaved, the speedup, the calls needed to pay the compile back,
    the largest output difference (and gradient difference with `measure="step"`), and
    every recompile with its failing guard. Graph breaks come from one Dynamo trace of the
    forward.

    A mode that crashes, hangs past `timeout_s` or finds no C++ compiler is reported in its
    `ModeResult.status`; the other modes still run. Your model is never called here: every
    figure comes from private copies.

    When the model (or a callable loss) cannot be sent to a child process, the modes are
    measured in this process, without a timeout, and the report's notes say why. That path
    leaves this process as it found it: your own compiled functions and models stay
    compiled (no `torch._dynamo.reset()`; the copies run private code objects), and the
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
        iters: timed calls of each of eager and compiled.
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
        progress: called with a short line before each step.

    Returns:
        A `CompileReport`; `report.findings()` says whether compile pays off.

    Raises:
        CompileError: an unknown mode or bad settings, or a model already compiled.
    """
    say = progress or (lambda _s: None)
    _check(modes, measure, iters, warmup, timeout_s, batch_sizes)
    step = Step.of(model, inputs, loss_fn=loss_fn, target=target)
    notes: list[str] = []
    if isinstance(step.model, torch._dynamo.eval_frame.OptimizedModule):
        notes.append("measured the original module of the torch.compile wrapper.")
        step = step.with_model(unwrap_compiled(step.model))
    inner = compiled_parts(step.model)
    if inner:
        raise CompileError(
            f"compile_report needs the eager model, but {', '.join(p or '<root>' for p in inner)} "
            "is already compiled, so the eager baseline would run compiled code.",
            fix="pass the model as it was before torch.compile / module.compile().")
    train = measure == "step"
    if train and (step.optimizer is not None or step.scaler is not None):
        notes.append("the step's optimizer and GradScaler were not used: the measured step "
                     "is forward, loss and backward on private copies of the model.")
    net, mi, device = step.model, step.inputs, step.device
    limit = recompile_limit()
    base = MeasureJob(mode="default", measure=measure, iters=iters, warmup=warmup,
                      dynamic=dynamic, explain=True, step=StepSpec.of(step),
                      batch_sizes=tuple(batch_sizes), options=dict(options or {}))
    label = name or type(net).__name__

    results: list[ModeResult] = []
    scan: BreakScan | None = None
    if device.type == "cpu" and cpp_compiler() is None:
        cxx = os.environ.get("CXX") or "g++"
        msg = _NO_CXX.format(cxx=cxx)
        results = [ModeResult(m, "no_compiler", error=msg, recompile_limit=limit) for m in modes]
        return CompileReport(label, mi.describe(), str(device), measure, tuple(results), (),
                             None, limit, torch.__version__, (msg,))

    if device.type != "cuda" and any(m.startswith("reduce-overhead") for m in modes):
        notes.append("reduce-overhead removes launch overhead with CUDA graphs; on "
                     f"{device.type} there are none, so it compiles like default.")
    in_process = not isolate
    send_factory = False
    if isolate:
        why = _not_sendable_loss(step.loss_fn)
        if why is not None:
            in_process = True
            notes.append(f"measured in this process without a timeout: {why}.")
        else:
            why = _not_sendable(net)
            if why is not None and factory is not None:
                send_factory = True
            elif why is not None:
                in_process = True
                notes.append(f"measured in this process without a timeout: {why}.")
    loss_text: str | None = None
    loss_value: float | None = None
    for mode in modes:
        job = replace(base, mode=mode, explain=scan is None)
        t0 = time.perf_counter()
        if in_process:
            say(f"{mode}: measuring in this process")
            payload = _run_here(net, mi, job)
        else:
            say(f"{mode}: measuring in a child process (timeout {timeout_s:.0f} s)")
            job_payload: dict[str, Any] = {"model": None if send_factory else net,
                                           "factory": factory, "inputs": mi, "job": job,
                                           "threads": torch.get_num_threads()}
            try:
                payload = _run_child(job_payload, timeout_s)
            except _UnpicklableError as exc:
                # A local class or a lambda hook: the model cannot travel to a child.
                in_process = True
                notes.append(f"measured in this process without a timeout: the model or "
                             f"its inputs cannot be pickled ({exc}).")
                payload = _run_here(net, mi, job)
            if payload.get("status") == "load_error":
                in_process = True
                notes.append(f"measured in this process without a timeout: the child could "
                             f"not load the model ({payload.get('error')}).")
                payload = _run_here(net, mi, job)
        wall = time.perf_counter() - t0
        if scan is None:
            scan = _scan_from(payload.get("scan"))
        raw = payload.get("raw")
        if train and loss_value is None and isinstance(raw, dict) and \
                raw.get("loss_value") is not None:
            loss_text, loss_value = raw.get("loss"), float(raw["loss_value"])
        results.append(replace(_mode_from(mode, payload, wall, not in_process), iters=iters))
    if scan is None:
        notes.append("graph breaks were not scanned: the scan failed in every mode.")
    info = None
    if train and loss_value is not None:
        measured = replace(step, optimizer=None, scaler=None).info(loss_value)
        info = replace(measured, loss=loss_text or measured.loss)
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
    )
