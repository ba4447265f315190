"""Fused reductions: every statistic torchscope keeps about a tensor, from one pass over it.

Eager PyTorch reads a tensor once per reduction: a mean, a norm, a min/max, a centred sum
of squares and three counts are seven passes over a 16 MiB activation. The kernels here do
it in one pass: `stats` (every statistic, and on request the dead-unit count) and `norm`
(the L2 norm, for gradients). Two backends build them:

- **native** (CPU float32, Linux): torchscope's own C++ (`_native/reduce.cpp`), compiled
  with `-O3 -march=native -ffp-contract=off` against torch's headers and loaded with
  `torch.ops.load_library`. It reads 1024-element spans in the CPU's own float32 vectors
  (16 lanes with AVX-512, 8 with AVX2, 4 otherwise; each lane sums the same 32 elements
  of a span on every CPU, so the numbers do not depend on the machine), goes to float64
  at each span's end by a fixed tree over the lanes, and redoes in float64 any span whose
  float32 sums are not finite (it holds NaN or Inf, where the counts are taken) or may
  have underflowed. On a 2-thread CPU `stats` costs one to two reads of the tensor
  (AVX-512: 0.054 ms per 1M elements, 3.9x faster than the AOTInductor program; AVX2:
  1.1 `sum`s), `norm` one read (1.0 `sum`s on AVX2), and `stats` counts all-zero
  channels in the same pass. Two more ops take a list of tensors, a model's weights
  around an optimizer update: `copy_norms` (a snapshot and its norms from one read) and
  `diff_norms` (each update's norm from two reads, the differences never written).
- **aotinductor** (CUDA, and the other float dtypes or a failed native build): the programs
  below, exported with a dynamic length (`torch.export`, one flattened dimension, so one
  kernel serves every size) and compiled by AOTInductor into a `.pt2` package in a child
  process; float64 sums.

How the compiled kernels stay out of the user's way:

- **Built in the background, ahead of time.** The compiler runs in a child process at low
  priority; this process never runs Dynamo or Inductor for it: the user's Dynamo caches,
  recompile counters, compiler stance, `torch.compile`, Inductor config and environment
  are untouched, and `force_eager` (which torchscope sets on compiled models) does not
  apply.
- **Paid once per machine.** Builds are cached on disk (`TORCHSCOPE_CACHE_DIR`, else
  `$XDG_CACHE_HOME/torchscope`, else `~/.cache/torchscope`), keyed by program, dtype,
  device kind, torch version and CPU/GPU capability; loading one takes milliseconds. The
  first request starts the build in the background and returns None meanwhile, so the
  caller runs its eager path: no step ever waits for a compile. A build ends with the
  process that started it, however that ends (a signal, SIGKILL, a crash, a normal exit;
  on Linux): it leaves no process, lock or partial file, and the next process builds
  again.
- **Checked in a child before it is loaded.** A compiled kernel runs native code inside
  the user's process, where a crash would end the training run (seen: every AOTInductor
  package segfaulted on load, in torch's own loader, with torch 2.11 and GCC 13 on a CUDA
  machine). So a child process loads each new file first, runs it once and compares
  with torch; only a file that passed is loaded here. The verdict is kept beside the
  file (`.ok`, or `.failed` with the reason), so the check costs one child per machine.
- **Bounded.** One kernel per (program, dtype, device): at most 2 programs x 4 float dtypes
  per device, each built once per machine (`kernel_status()` counts them).
- **Never where it cannot run.** Integer, bool and complex tensors, tensor subclasses (fake
  tensors included), functorch/functional wrappers, an active TorchDispatchMode, Dynamo
  tracing, CUDA graph capture, fewer than 2 or more than 2**31 - 2 elements, devices other
  than CPU and CUDA, no C++ compiler (CPU) or no Triton (CUDA): `run` returns None and
  `why_eager` says why. The kernel never syncs with the host (no `.item()`, no copy).

Numbers, against the eager ops: min, max and the counts are exact; a NaN anywhere makes
mean, std and norm NaN, an Inf makes std NaN and the norm Inf, as the eager ops do. The
AOTInductor sums accumulate in float64 from a shift (the first finite element); the native
sums are float32 over at most 32 elements per lane, then float64, shifted only when the
data's mean lies far from zero (so that x - shift is exact where it matters): their error
stays within 1e-6 of float64 truth (1e-7 measured at worst), as good as eager float32
reductions.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from torchscope import _process

__all__ = [
    "DEAD",
    "INFS",
    "MAX",
    "MEAN",
    "MIN",
    "NANS",
    "NORM",
    "N_MOMENTS",
    "PROGRAMS",
    "STD",
    "ZEROS",
    "KernelStatus",
    "cache_dir",
    "copy_norms",
    "diff_norms",
    "disabled",
    "kernel_status",
    "prepare",
    "run",
    "why_eager",
]

Program = Literal["stats", "norm"]
PROGRAMS: tuple[Program, ...] = ("stats", "norm")

# Layout of the float64 vector the `stats` program returns (and the eager path mirrors).
MEAN, STD, MIN, MAX, NORM, ZEROS, NANS, INFS = range(8)
N_MOMENTS = 8
DEAD = 8  # `run("stats", x, dead_units=True)` on the native kernel: all-zero channels

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_MAX_NUMEL = 2**31 - 2  # the counts accumulate in int32
_VERSION = 2  # part of every cache key: bump it when a program or its build changes
_BUILD_TIMEOUT_S = 900.0
_CHECK_TIMEOUT_S = 300.0  # a child loads a new kernel and runs it once (CUDA start-up included)
_STALE_LOCK_S = 1200.0  # a lock older than this belongs to a build that died
_NATIVE_SOURCE = Path(__file__).with_name("_native") / "reduce.cpp"


class _Stats(nn.Module):
    """Every statistic of a flat tensor in one pass: the `stats` program."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (n,), n >= 2
        n = x.shape[0]
        first = x[0].to(torch.float64)
        # Shift by the first finite element: the centred sum of squares then suffers no
        # cancellation unless that element lies far outside the data, and float64 covers
        # even that. A non-finite first element would poison every difference: shift by 0.
        k = torch.where(first.abs() < float("inf"), first, 0.0)
        d = x.to(torch.float64) - k  # (n,)
        s1 = d.sum()
        s2 = (d * d).sum()
        zeros = (x == 0).sum(dtype=torch.int32).to(torch.float64)
        # NaN is the only x != x; Inductor vectorises this compare, not `isnan`.
        nans = (x != x).sum(dtype=torch.int32).to(torch.float64)  # noqa: PLR0124
        infs = (x.abs() == float("inf")).sum(dtype=torch.int32).to(torch.float64)
        nan = torch.full_like(s1, float("nan"))
        mean = k + s1 / n
        ss = (s2 - s1 * s1 / n).clamp_min(0.0)  # centred sum of squares
        std = torch.where(nans + infs > 0, nan, (ss / (n - 1)).sqrt())
        sq = (s2 + 2.0 * k * s1 + n * k * k).clamp_min(0.0)  # sum of x^2
        norm = torch.where(nans > 0, nan,
                           torch.where(infs > 0, torch.full_like(s1, float("inf")), sq.sqrt()))
        return torch.stack([mean, std, x.amin().to(torch.float64), x.amax().to(torch.float64),
                            norm, zeros / n, nans, infs])  # (N_MOMENTS,)


class _Norm(nn.Module):
    """The L2 norm of a flat tensor, accumulated in float64: the `norm` program."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (n,), n >= 2
        d = x.to(torch.float64)
        return (d * d).sum().sqrt()  # ()


_MODULES: dict[str, type[nn.Module]] = {"stats": _Stats, "norm": _Norm}


@dataclass(frozen=True)
class KernelStatus:
    """One fused kernel of this process.

    Attributes:
        program: `stats` or `norm`.
        dtype: the input dtype it reduces, like `torch.float32`.
        device: the device it runs on, like `cpu` or `cuda:0`.
        state: `building` (eager meanwhile), `ready`, or `unavailable`.
        reason: why it is not ready (empty when ready).
        source: `cache` (loaded from the on-disk cache), `built` (compiled by this process's
            child), or empty.
        build_s: seconds the child took to export and compile it (None when loaded).
        load_s: seconds to load the package.
        backend: `native` (torchscope's own vectorised C++ reductions: CPU float32) or
            `aotinductor` (a program compiled by AOTInductor: other dtypes, CUDA).
    """

    program: str
    dtype: str
    device: str
    state: str
    reason: str = ""
    source: str = ""
    build_s: float | None = None
    load_s: float | None = None
    backend: str = ""


class _Kernel:
    """A kernel being prepared, ready, or unavailable (its runner is in `_ready` when ready)."""

    def __init__(self, program: str, dtype: torch.dtype, device: torch.device) -> None:
        self.program = program
        self.dtype = dtype
        self.device = device
        self.state = "building"
        self.reason = "preparing the fused kernel in the background (built once per machine)"
        self.source = ""
        self.build_s: float | None = None
        self.load_s: float | None = None
        self.backend = ""
        self.done = threading.Event()

    def status(self) -> KernelStatus:
        return KernelStatus(self.program, str(self.dtype), str(self.device), self.state,
                            "" if self.state == "ready" else self.reason, self.source,
                            self.build_s, self.load_s, self.backend)


_Key = tuple[str, torch.dtype, torch.device]
_lock = threading.Lock()
_kernels: dict[_Key, _Kernel] = {}
# The hot path reads only this: key -> the loaded runner's `run`.
_Runner = Callable[[torch.Tensor, bool], torch.Tensor]  # (tensor, dead_units)
_ready: dict[_Key, _Runner] = {}


class _Switch:
    """Whether `run` may use fused kernels (`disabled()` turns it off for a block)."""

    enabled = os.environ.get("TORCHSCOPE_FUSED", "1") != "0"


# ---------------------------------------------------------------------------- hot path
def run(program: Program, x: torch.Tensor, *, dead_units: bool = False) -> torch.Tensor | None:
    """`program` over every element of `x` in one fused pass, on `x`'s device; no host sync.

    Returns None where the fused kernel cannot run now (`why_eager` says why): the caller
    runs its eager path. The first call for a (program, dtype, device) starts preparing its
    kernel in the background.

    Args:
        program: `stats` (a float64 vector laid out as MEAN..INFS) or `norm` (a float64 0-d
            tensor).
        x: any tensor; it is read, never written, and no autograd graph is built.
        dead_units: `stats` only: also count the channels (dim 1) of `x` that are zero
            everywhere, in the same pass, where the kernel can (the native CPU kernel, a
            contiguous tensor of 2+ dims whose channels hold 64+ elements per sample). The
            vector then has a ninth slot, DEAD; otherwise it has N_MOMENTS slots and the
            caller counts dead units itself.
    """
    if not _Switch.enabled:
        return None
    fn = _ready.get((program, x.dtype, x.device))
    if fn is None:
        _request(program, x.detach())
        return None
    # Runs once per hooked tensor: the per-key conditions are settled once, in `_request`;
    # what is left is the tensor's own and the moment's (`why_eager` says which failed).
    t = x if type(x) is torch.Tensor and not x.requires_grad else x.detach()
    if _unfit_tensor(t, 2) or _unfit_now(t):
        return None
    return fn(t, dead_units)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """`t` as a contiguous 1-d tensor, without a copy whenever its memory is dense.

    Every statistic ignores element order, so a dense permutation (channels-last, a
    transpose) is read in memory order.
    """
    if t.is_contiguous():
        flat = t.view(-1)  # (n,)
    elif _dense(t):
        flat = t.as_strided((t.numel(),), (1,), t.storage_offset())  # (n,) in memory order
    else:
        # A gather copy; `contiguous` because reshape keeps a view where it can (an
        # expanded gradient flattens to stride 0, a strided 1-d slice stays strided), and
        # the kernel reads exactly n consecutive elements.
        flat = t.reshape(-1).contiguous()  # (n,)
    if flat.is_cuda and flat.data_ptr() % 16:
        flat = flat.clone()  # Triton kernels assume 16-byte aligned inputs
    return flat


def _dense(t: torch.Tensor) -> bool:
    """True when `t`'s elements fill one gap-free block of memory, in some order."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride(), strict=True)
                               if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


# ---------------------------------------------------------------------------- tensor lists
def copy_norms(xs: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    """A copy of each tensor and its L2 norm (0-d float64), from one read of each, by one
    native call over the whole list (parallel over all its elements): a snapshot of a
    model's weights before an update, with their norms.

    Returns None where it cannot run: the native library is not loaded (yet: this starts
    it), fused kernels are off, or a tensor is not a plain contiguous float32 CPU tensor.
    The caller then copies and measures with foreach ops.
    """
    if not _native_list(xs):
        return None
    copies, out = _native_op("copy_norms")(xs)  # n copies, (n,) float64
    return list(copies), list(out.unbind())


def diff_norms(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """‖a[i] - b[i]‖ for each pair (0-d float64), the differences rounded to float32 as a
    subtraction would and never written: an update's size from the weights after and a
    snapshot before, two reads instead of a subtraction's three plus a norm's one. None as
    for `copy_norms`, or when a pair's shapes differ."""
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b, strict=True)) or \
            not _native_list(a) or not _native_list(b):
        return None
    out: torch.Tensor = _native_op("diff_norms")(a, b)  # (n,) float64
    return list(out.unbind())


def norms(xs: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """The L2 norm of each tensor (0-d float64), by one native call over the whole list,
    parallel over all its elements: a model's gradients or weights, where
    `torch._foreach_norm` on the CPU runs one `vector_norm` per tensor, several times
    slower per byte. None as for `copy_norms`."""
    out = norm_vector(xs)
    return None if out is None else list(out.unbind())


def norm_vector(xs: list[torch.Tensor]) -> torch.Tensor | None:
    """`norms` as one (n,) float64 tensor (no list of 0-d views: for a reduction of all
    of them). None as for `copy_norms`."""
    if not _native_list(xs):
        return None
    out: torch.Tensor = _native_op("norms")(xs)  # (n,) float64
    return out


def norms_into(xs: list[torch.Tensor], out: torch.Tensor, largest: torch.Tensor) -> bool:
    """`norm_vector(xs)` written into `out` (a contiguous float64 (n,) CPU tensor the caller
    keeps), and its largest element into `largest` (float64, one element; NaN where a norm
    is NaN), by one native call that allocates nothing: a training step's NaN/Inf check.
    False, with nothing written, where the native op cannot take `xs` now.

    For a caller whose last call took the same parameters' gradients: only the dispatch
    state and the tensors' types are checked here (a set of types, built in C), and what
    their attributes tell (float32, CPU, contiguous, which may change from step to step) by
    the kernel itself, in C++. A Python check of each tensor costs about as much as the
    kernel's read of a tiny model's gradients inside a step."""
    if not _Switch.enabled or _Native.ops is None or not xs or _unfit_now(xs[0]) or \
            set(map(type, xs)) != {_TENSOR}:
        return False
    try:
        _native_op("norms_into")(xs, out, largest)
    except RuntimeError:  # a tensor its check refuses (a sparse or strided gradient)
        return False
    return True


def _native_op(name: str) -> Any:
    """The loaded native op `name`: the C++ callable behind its OpOverload (one Python frame
    less per call)."""
    ops = _Native.ops
    assert ops is not None  # the callers check that the library is loaded
    return getattr(ops[name], "_op", ops[name])


def _native_list(xs: list[torch.Tensor]) -> bool:
    """Whether the native list ops can take `xs` now (see `copy_norms`)."""
    if not _Switch.enabled or not xs:
        return False
    if _Native.ops is None:
        if xs[0].dtype == torch.float32 and xs[0].device.type == "cpu":
            _request("norm", torch.empty(0))  # loads (or builds) the library meanwhile
        return False
    # Runs over a model's parameters three or four times per sampled step: `map` calls
    # `_unfit_tensor` per tensor for no more than a generator expression's step costs. It
    # goes first: a sparse CSR tensor raises on `is_contiguous`, which `_native_takes` asks.
    return not _unfit_now(xs[0]) and not any(map(_unfit_tensor, xs)) and _native_takes(xs)


def why_eager(program: Program, x: torch.Tensor) -> str | None:
    """Why `run(program, x)` returns None for `x` (None when it runs the fused kernel)."""
    if not _Switch.enabled:
        return "fused kernels are disabled (TORCHSCOPE_FUSED=0 or `disabled()`)"
    t = x.detach()
    reason = _static_reason(t)
    if reason is not None:
        return reason
    kernel = _kernels.get((program, t.dtype, t.device))
    if kernel is None or kernel.state != "ready":
        return kernel.reason if kernel is not None else "no kernel requested yet"
    return _unfit_tensor(t, 2) or _unfit_now(t)


# Whether a kernel may read a tensor, each condition once: `_unfit_tensor` (the tensor
# itself), `_unfit_now` (the moment), `_native_takes` (the native list ops' dtype, device and
# layout), `_static_reason` (a dtype and device for good). `run`, `norm_vector` and
# `_native_list` test them at every call; `why_eager` says which failed. Bound once: the
# first and third run per tensor on the hot paths, where each attribute lookup counts
# (module-level names: 28 tensors' checks 4.5 -> 3.8 us, measured).
_TENSOR, _STRIDED, _FLOAT32 = torch.Tensor, torch.strided, torch.float32
_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_functional = torch._is_functional_tensor


def _unfit_tensor(t: torch.Tensor, least: int = 0) -> str | None:
    """Why no fused kernel may read `t` itself (None when one may); `least`: the fewest
    elements the reader takes (the single-tensor programs 2, the list ops any number)."""
    if type(t) is not _TENSOR:  # a subclass (FakeTensor included) or a Parameter
        return f"a tensor subclass ({type(t).__name__})"
    if t.layout != _STRIDED or t.is_neg():
        return "not a plain strided tensor"
    if _wrapped(t) or _functional(t):
        return "inside a functorch transform or functionalization"
    n = t.numel()
    if n > _MAX_NUMEL or n < least:  # the counts accumulate in int32
        return f"{n} elements (the kernel takes {least} to {_MAX_NUMEL})"
    return None


def _native_takes(xs: list[torch.Tensor]) -> bool:
    """Whether the native list ops take every tensor of `xs` by its type, dtype, device and
    layout (plain float32 on the CPU, contiguous), as the kernel's own check does in C++
    (`norms_into` leaves it to that one). One generator over the list: a
    call per tensor would cost more."""
    return all(type(x) is _TENSOR and x.dtype == _FLOAT32 and x.is_cpu and x.is_contiguous()
               for x in xs)


def _unfit_now(t: torch.Tensor) -> str | None:
    """Why no fused kernel may run on `t`'s device at this moment (None when one may)."""
    if torch._C._len_torch_dispatch_stack():
        return "a TorchDispatchMode is active"
    if torch.compiler.is_compiling():
        return "inside torch.compile tracing"
    if t.is_cuda and torch.cuda.is_current_stream_capturing():
        return "during CUDA graph capture"
    return None


def _static_reason(t: torch.Tensor) -> str | None:
    """What rules a (dtype, device) out for good, whatever the kernel's state."""
    if t.dtype not in _DTYPES:
        return f"dtype {t.dtype} (the kernel reduces float16, bfloat16, float32, float64)"
    if t.device.type not in ("cpu", "cuda"):
        return f"device {t.device} (the kernel runs on CPU and CUDA)"
    return None


# ---------------------------------------------------------------------------- preparing
def _request(program: str, t: torch.Tensor) -> _Kernel:
    """The kernel for `t`'s dtype and device; the first request starts preparing it."""
    key = (program, t.dtype, t.device)
    with _lock:
        kernel = _kernels.get(key)
        if kernel is not None:
            return kernel
        kernel = _kernels[key] = _Kernel(program, t.dtype, t.device)
    reason = _static_reason(t)
    if reason is not None:
        _fail(kernel, reason)
        return kernel
    threading.Thread(target=_prepare, args=(kernel,), daemon=True,
                     name=f"torchscope-kernel-{program}-{t.dtype}").start()
    return kernel


def _toolchain_reason(device: torch.device) -> str | None:
    if device.type == "cuda":
        import importlib.util

        if importlib.util.find_spec("triton") is None:
            return "no Triton: AOTInductor needs it to build CUDA kernels"
        return None
    compilers = [os.environ.get("CXX", ""), "g++", "clang++", "c++"]
    if not any(c and shutil.which(c) for c in compilers):
        return "no C++ compiler (g++, clang++ or $CXX): AOTInductor needs one for CPU kernels"
    return None


def _fail(kernel: _Kernel, reason: str) -> None:
    kernel.state = "unavailable"
    kernel.reason = reason
    kernel.done.set()


def _prepare(kernel: _Kernel) -> None:
    """Make the kernel ready on a background thread: the native library for CPU float32,
    else (or when that cannot be built) an AOTInductor package, each loaded from the cache
    and built first (in a child process) when missing."""
    try:
        native_error = None
        if _native_wanted(kernel.dtype, kernel.device):
            native_error = _prepare_native(kernel)
            if native_error is None:
                return
        _prepare_aoti(kernel, native_error)
    except Exception as exc:  # whatever goes wrong here, the eager path stays
        _fail(kernel, f"preparing the fused kernel failed: {type(exc).__name__}: {exc}")
    finally:
        kernel.done.set()


def _prepare_aoti(kernel: _Kernel, native_error: str | None = None) -> None:
    """Make `kernel` ready from an AOTInductor package; `native_error` (why the native
    library could not serve it) leads the reason when this fails too."""
    kernel.backend = "aotinductor"

    def fail(reason: str) -> None:
        both = native_error is not None and native_error != reason
        _fail(kernel, f"{native_error}; {reason}" if both else reason)

    path = _package_path(kernel.program, kernel.dtype, kernel.device)
    error, kernel.source, kernel.build_s = _cached_or_built(
        path, kernel.device, lambda p: _build(p, kernel.program, kernel.dtype, kernel.device))
    if error is None:
        error = _checked(path, "aoti", kernel.program, kernel.dtype, kernel.device)
    if error is not None:
        fail(error)
        return
    t0 = time.perf_counter()
    try:
        loader = _aoti_loader(path, kernel.device)
    except Exception as exc:  # a truncated or foreign package: the next process rebuilds
        _discard(path)
        fail(f"the fused kernel failed to load: {type(exc).__name__}: {exc}")
        return
    kernel.load_s = time.perf_counter() - t0
    aoti_run = loader.run

    def runner(t: torch.Tensor, _dead_units: bool) -> torch.Tensor:
        out: torch.Tensor = aoti_run([_flat(t)])[0]
        return out

    _set_ready(kernel, runner)


def _aoti_loader(path: Path, device: torch.device) -> Any:
    """AOTInductor's loader for the package `path`, on `device`."""
    index = device.index if device.index is not None else (
        torch.cuda.current_device() if device.type == "cuda" else -1)
    return torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, index)


def _cached_or_built(path: Path, device: torch.device, build: Callable[[Path], str | None]
                     ) -> tuple[str | None, str, float | None]:
    """`path` from the cache, or built there by `build` (a cached file needs no compiler):
    (why not, or None; `cache` or `built`; seconds the build took)."""
    if path.exists():
        return None, "cache", None
    reason = _toolchain_reason(device)
    if reason is not None:
        return reason, "", None
    _discard(path)  # a verdict on an earlier file at this path says nothing about the new one
    t0 = time.perf_counter()
    try:
        error = build(path)
    except OSError as exc:
        error = f"the kernel cache {path.parent} is not writable: {exc}"
    return error, "" if error else "built", None if error else time.perf_counter() - t0


def _markers(path: Path) -> tuple[Path, Path]:
    """The verdicts of the child check beside `path`: passed, and failed (with why)."""
    return path.with_name(path.name + ".ok"), path.with_name(path.name + ".failed")


def _discard(path: Path) -> None:
    """Remove `path` and the verdicts on it, so that the next process builds it again."""
    for p in (path, *_markers(path)):
        with contextlib.suppress(OSError):
            p.unlink()


def _checked(path: Path, kind: Literal["native", "aoti"], program: str, dtype: torch.dtype,
             device: torch.device) -> str | None:
    """None when the compiled kernel `path` may be loaded into this process, else why not.

    Loading runs the file's native code inside the user's process, and a kernel that
    crashes there (a C++ runtime that does not match torch's, say) takes the training run
    with it. So a child process loads it first, runs it once and compares with torch; only
    then is it loaded here. The verdict is kept beside the file, so that the check costs
    one child process per machine and file.
    """
    ok, failed = _markers(path)
    if ok.exists():
        return None
    with contextlib.suppress(OSError):
        return failed.read_text() or "the fused kernel failed its check"
    cmd = _child_cmd("--check", kind, str(path), program, str(dtype), _device_arg(device))
    try:
        done = _process.run(cmd, timeout=_CHECK_TIMEOUT_S, env=_child_env())
    except subprocess.TimeoutExpired:
        return f"checking the fused kernel in a child process ran past {_CHECK_TIMEOUT_S:.0f} s"
    rc = done.returncode
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
    if rc == 0:
        with contextlib.suppress(OSError):
            ok.touch()
        return None
    if rc == _CHECK_NO_LOAD:  # a truncated or foreign file: the next process rebuilds it
        _discard(path)
        return f"the fused kernel failed to load: {tail}"
    if rc < 0:
        what = f"crashed ({signal.Signals(-rc).name})" if -rc in signal.valid_signals() \
            else f"was killed by signal {-rc}"
    else:
        what = f"gave wrong results ({tail})" if rc == _CHECK_WRONG else \
            f"failed (exit {rc}: {tail})"
    reason = (f"the compiled kernel {what} in a child process that loaded it, so it is never "
              f"loaded into this one (torch {torch.__version__} and this machine's C++ "
              "toolchain may not work together); delete it to try again: " + str(path))
    # Kept for later processes only when the file itself is at fault (a crash inside it,
    # wrong numbers); a child that was killed, or failed otherwise, is asked again next time.
    if rc == _CHECK_WRONG or -rc in _FAULT_SIGNALS:
        with contextlib.suppress(OSError):
            failed.write_text(reason)
    return reason


def _set_ready(kernel: _Kernel, runner: _Runner) -> None:
    with _lock:
        kernel.state = "ready"
        kernel.reason = ""
        _ready[(kernel.program, kernel.dtype, kernel.device)] = runner


# ---------------------------------------------------------------------------- native
class _Native:
    """This process's native library (both programs live in it): built and loaded at most
    once, since its operators register under one namespace."""

    lock = threading.Lock()
    ops: dict[str, Any] | None = None
    error: str | None = None
    source = ""
    build_s: float | None = None
    load_s: float | None = None


def _native_wanted(dtype: torch.dtype, device: torch.device) -> bool:
    return (device.type == "cpu" and dtype == torch.float32
            and sys.platform.startswith("linux") and _NATIVE_SOURCE.is_file())


# The native library's code generation. -march=native: the CPU's own vector width (the
# source picks its lanes from it). -ffp-contract=off: no fused multiply-add, so that every
# CPU rounds each float32 lane the same way and the statistics do not depend on the
# machine (tested: a baseline x86-64 build, 4 lanes, equals the native one bit for bit).
_NATIVE_FLAGS = ("-O3", "-ffp-contract=off")


def _native_tag() -> str:
    return hashlib.sha256(repr((_VERSION, torch.__version__, sys.platform,
                                torch.compiled_with_cxx11_abi(), _NATIVE_FLAGS,
                                _NATIVE_SOURCE.read_bytes())).encode()).hexdigest()[:16]


def _native_path() -> Path:
    # -march=native: the CPU's identity is part of the name, as for AOTInductor packages.
    return cache_dir() / f"native-{_device_kind(torch.device('cpu'))}-{_native_tag()}.so"


def _prepare_native(kernel: _Kernel) -> str | None:
    """Make `kernel` ready from the native library; None on success, else why not (the
    caller then tries AOTInductor)."""
    kernel.backend = "native"
    with _Native.lock:
        if _Native.ops is None and _Native.error is None:
            _Native.error = _load_native()
    if _Native.ops is None:
        return _Native.error or "the native kernel is unavailable"
    kernel.source, kernel.build_s, kernel.load_s = _Native.source, _Native.build_s, \
        _Native.load_s
    op = _native_op(kernel.program)

    def stats(t: torch.Tensor, dead_units: bool) -> torch.Tensor:
        # Any contiguous shape as it is (the kernel reads the channels from it); a dense
        # permutation in memory order, without dead units.
        out: torch.Tensor = op(t, dead_units) if t.is_contiguous() else op(_flat(t), False)
        return out  # (N_MOMENTS,), or (N_MOMENTS + 1,) with DEAD

    def norm(t: torch.Tensor, _dead_units: bool) -> torch.Tensor:
        out: torch.Tensor = op(t if t.is_contiguous() else _flat(t))  # ()
        return out

    _set_ready(kernel, stats if kernel.program == "stats" else norm)
    return None


def _load_native() -> str | None:
    """Build (once per machine) and load the native library into `_Native`; None on
    success, else why not."""
    path = _native_path()
    error, _Native.source, _Native.build_s = _cached_or_built(
        path, torch.device("cpu"), lambda p: _with_build_lock(p, _compile_native))
    if error is None:
        error = _checked(path, "native", "stats", torch.float32, torch.device("cpu"))
    if error is not None:
        return error
    t0 = time.perf_counter()
    try:
        _Native.ops = _native_ops(path)
    except Exception as exc:  # a truncated or foreign library: the next process rebuilds
        _discard(path)
        return f"the native kernel failed to load: {type(exc).__name__}: {exc}"
    _Native.load_s = time.perf_counter() - t0
    return None


def _native_ops(path: Path) -> dict[str, Any]:
    """Load the native library `path` into this process: its operators by name."""
    torch.ops.load_library(str(path))
    namespace = getattr(torch.ops, _native_namespace())
    return {name: getattr(namespace, name).default
            for name in ("stats", "norm", "copy_norms", "diff_norms", "norms", "norms_into")}


def _native_namespace() -> str:
    return f"torchscope_{_native_tag()}"


def _compile_native(out: Path, *, march: str = "native", namespace: str | None = None
                    ) -> str | None:
    """Compile the native library into `out` in a child process (`_native_child`), which
    ends with this one and then removes its temporary file and `out`'s lock; None on
    success, else why not. `march` and `namespace` are for tests: a build for another CPU
    level, loaded beside this process's own under another operator namespace."""
    cmd = _child_cmd("--native", str(out), str(_lock_path(out)), march, namespace or "")
    try:
        done = _process.run(cmd, timeout=_BUILD_TIMEOUT_S + 60.0, grace=3.0, env=_child_env())
    except subprocess.TimeoutExpired:
        return f"building the native kernel ran past {_BUILD_TIMEOUT_S:.0f} s"
    if done.returncode == 0 and out.exists():
        return None
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return tail if done.returncode == 1 else \
        f"building the native kernel failed (exit {done.returncode}): {tail}"


def _native_child(out: str, march: str, namespace: str) -> int:
    """The child process of `_compile_native`: compile, say why not on stderr (exit 1)."""
    error = _compile_native_here(Path(out), march=march, namespace=namespace or None)
    if error is not None:
        print(error, file=sys.stderr)
        return 1
    return 0


def _compile_native_here(out: Path, *, march: str, namespace: str | None) -> str | None:
    """Compile the native library into `out` (through a temporary name), in this process's
    child g++; None on success, else the compiler's last line."""
    torch_dir = Path(torch.__file__).resolve().parent
    lib = torch_dir / "lib"
    cxx = next((c for c in (os.environ.get("CXX", ""), "g++", "clang++", "c++")
                if c and shutil.which(c)), None)
    if cxx is None:
        return "no C++ compiler (g++, clang++ or $CXX) for the native kernel"
    openmp: list[str] = []
    if "OpenMP" in torch.__config__.parallel_info():
        # at::parallel_for is inline OpenMP: link torch's own libgomp, so that the loader
        # reuses the runtime torch already loaded and its thread pool is shared.
        openmp = ["-fopenmp", *map(str, sorted(lib.glob("libgomp*.so*"))[:1])]
    nice = ["nice", "-n", "10"] if shutil.which("nice") else []  # a background build
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    tail = "no output"
    try:
        for std in ("-std=c++20", "-std=c++17"):
            cmd = [cxx, *_NATIVE_FLAGS, f"-march={march}", "-shared", "-fPIC", std, "-w",
                   f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
                   f"-DTORCHSCOPE_NAMESPACE={namespace or _native_namespace()}",
                   "-I", str(torch_dir / "include"),
                   "-I", str(torch_dir / "include" / "torch" / "csrc" / "api" / "include"),
                   str(_NATIVE_SOURCE), "-o", tmp, "-Wl,--as-needed", *openmp,
                   "-L", str(lib), "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}"]
            try:
                done = _process.run(nice + cmd, timeout=_BUILD_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                return f"building the native kernel ran past {_BUILD_TIMEOUT_S:.0f} s"
            if done.returncode == 0:
                os.replace(tmp, out)
                return None
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"building the native kernel failed: {tail}"
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def cache_dir() -> Path:
    """Where compiled kernels are kept: `TORCHSCOPE_CACHE_DIR`, else the user cache."""
    env = os.environ.get("TORCHSCOPE_CACHE_DIR")
    if env:
        return Path(env) / "kernels"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "torchscope" / "kernels"


def _device_kind(device: torch.device) -> str:
    """What a compiled package depends on: the GPU's architecture, or the CPU's vector ISA
    and exact model (Inductor compiles with -march=native: a cache shared between machines
    must not hand one CPU's code to another)."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda-sm{major}{minor}-cu{torch.version.cuda}"
    return f"cpu-{torch.backends.cpu.get_cpu_capability().lower()}-{_cpu_id()}"


def _cpu_id() -> str:
    """A short hash of this CPU's model and feature flags."""
    ident = platform.processor() + platform.machine()
    with contextlib.suppress(OSError):
        info = Path("/proc/cpuinfo").read_text()
        ident += "".join(sorted({line for line in info.splitlines()
                                 if line.startswith(("model name", "flags", "Features"))}))
    return hashlib.sha256(ident.encode()).hexdigest()[:8]


def _package_path(program: str, dtype: torch.dtype, device: torch.device) -> Path:
    # The program's bytecode, not its source: editing a comment does not rebuild the kernel.
    code = _MODULES[program].forward.__code__
    tag = hashlib.sha256(repr((_VERSION, torch.__version__, sys.version, sys.platform,
                               code.co_code, code.co_consts, code.co_names)).encode()
                         ).hexdigest()[:16]
    name = f"{program}-{str(dtype).removeprefix('torch.')}-{_device_kind(device)}-{tag}.pt2"
    return cache_dir() / name


def _lock_path(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


def _child_cmd(mode: str, *args: str) -> list[str]:
    """A child process of this module (`_main`): `mode`, this process's pid (the child ends
    with this process, `_process.child_of`), then `args`. Linux signals the child when the
    *thread* that started it ends: each is started by `_process.run`, whose thread waits
    for it (the kernel's background thread, `_prepare`)."""
    return [sys.executable, "-m", "torchscope._kernels", mode, str(os.getpid()), *args]


def _child_env(**extra: str) -> dict[str, str]:
    """The environment of a child process of this module: this one's, with torchscope's
    own source on the path."""
    src_root = str(Path(__file__).resolve().parents[1])
    return {**os.environ, **extra, "PYTHONPATH": os.pathsep.join(
        p for p in (src_root, os.environ.get("PYTHONPATH")) if p)}


def _device_arg(device: torch.device) -> str:
    """`device` for a child's command line, with the CUDA index this process uses."""
    if device.index is not None or device.type == "cpu":
        return str(device)
    return f"cuda:{torch.cuda.current_device()}"


def _build(path: Path, program: str, dtype: torch.dtype, device: torch.device) -> str | None:
    """Build the AOTInductor package `path` in a child process (or wait for another
    process's build); None on success, else why not."""

    def child(_path: Path) -> str | None:
        cmd = _child_cmd("--build", str(path), str(_lock_path(path)), program, str(dtype),
                         _device_arg(device))
        try:
            # A new session: a Ctrl-C meant for the user's loop does not reach it. A signal
            # to the command line stops it (`_process.stop_children`): SIGTERM first, on
            # which it removes its temporary file and lock. It also ends when this process
            # does, however (`_process.child_of`): a process that ends before the build is
            # done leaves nothing, and the next one builds again.
            done = _process.run(cmd, timeout=_BUILD_TIMEOUT_S, grace=3.0,
                                env=_child_env(TORCHINDUCTOR_COMPILE_THREADS="1"))
        except subprocess.TimeoutExpired:
            return f"building the kernel ran past {_BUILD_TIMEOUT_S:.0f} s"
        if done.returncode != 0 or not path.exists():
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            return f"building the kernel failed (exit {done.returncode}): {tail}"
        return None

    return _with_build_lock(path, child)


def _with_build_lock(path: Path, build: Callable[[Path], str | None]) -> str | None:
    """Run `build(path)` holding `path`'s lock file, or wait for the process that holds it;
    None on success, else why not. `build` is done with the lock when it returns."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = _lock_path(path)
    deadline = time.monotonic() + _BUILD_TIMEOUT_S
    while True:
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            os.close(fd)
            if path.exists():  # another process finished it before its lock went away
                # A lock may go from under us: a build's child and its parent both remove it.
                with contextlib.suppress(FileNotFoundError):
                    lock.unlink()
                return None
            break
        except FileExistsError:
            # Another process is building it: wait for its result, or take over a stale lock.
            with contextlib.suppress(FileNotFoundError):
                if time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
                    lock.unlink()
                    continue
            if path.exists():
                return None
            if time.monotonic() > deadline:
                return "another process's build of the kernel did not finish"
            time.sleep(0.5)
    try:
        return build(path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()


def _build_child(out: str, program: str, dtype_name: str, device_name: str) -> None:
    """The child process of `_build`: export `program` with a dynamic length and compile it
    with AOTInductor into `out` (written under a temporary name, then moved into place).
    Stopped (SIGTERM, or its parent's death: `_process.child_of`), it leaves through the
    `finally` below, which removes the temporary package (`_main` removes the lock)."""
    with contextlib.suppress(OSError, AttributeError):
        os.nice(10)  # a background build: the user's training runs first
    dtype = getattr(torch, dtype_name.removeprefix("torch."))
    device = torch.device(device_name)
    # Inductor sizes its loops by the example: a large one makes it split the reduction
    # across threads (their number read at run time, as torch.set_num_threads sets it).
    example = torch.randn(1 << 22, device=device).to(dtype)  # (4M,)
    n = torch.export.Dim("n", min=2, max=_MAX_NUMEL)
    exported = torch.export.export(_MODULES[program](), (example,),
                                   dynamic_shapes=({0: n},), strict=False)
    fd, tmp = tempfile.mkstemp(suffix=".pt2", dir=os.path.dirname(out))
    os.close(fd)
    try:
        torch._inductor.aoti_compile_and_package(
            exported, package_path=tmp, inductor_configs={"cpp.dynamic_threads": True})
        os.replace(tmp, out)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


# ---------------------------------------------------------------------------- control
def prepare(program: Program, dtype: torch.dtype = torch.float32,
            device: torch.device | str = "cpu", *, wait: float | None = 0.0) -> KernelStatus:
    """Start preparing a kernel now (building it once per machine), optionally waiting.

    Args:
        program: `stats` or `norm`.
        dtype, device: the tensors it will reduce.
        wait: seconds to wait for it to be ready; None waits as long as it takes.

    Returns:
        Its status after the wait.
    """
    kernel = _request(program, torch.empty(0, dtype=dtype, device=device))
    kernel.done.wait(wait)
    return kernel.status()


def kernel_status() -> tuple[KernelStatus, ...]:
    """Every kernel this process requested: how many, their state, build and load times."""
    with _lock:
        return tuple(k.status() for k in _kernels.values())


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run every reduction eagerly inside the block (process-wide), as before on exit."""
    before = _Switch.enabled
    _Switch.enabled = False
    try:
        yield
    finally:
        _Switch.enabled = before


def _forget() -> None:
    """Drop every kernel of this process (tests: a fresh start against another cache)."""
    with _lock:
        _kernels.clear()
        _ready.clear()


_CHECK_NO_LOAD, _CHECK_WRONG = 3, 4  # the check child's exit codes besides 0
# Signals that say the loaded code itself failed (not the machine or a user killing it).
_FAULT_SIGNALS = frozenset(int(getattr(signal, name)) for name in
                           ("SIGSEGV", "SIGBUS", "SIGILL", "SIGABRT", "SIGFPE")
                           if hasattr(signal, name))


def _check_child(kind: str, path: str, program: str, dtype_name: str, device_name: str
                 ) -> int:
    """The child process of `_checked`: load the kernel `path` as the user's process would,
    run it once, compare with torch. Exit 0 when it may be loaded, `_CHECK_NO_LOAD` when it
    failed to load, `_CHECK_WRONG` on wrong results; a crash ends the child by a signal."""
    dtype = getattr(torch, dtype_name.removeprefix("torch."))
    device = torch.device(device_name)
    runs: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    try:
        if kind == "native":
            ops = _native_ops(Path(path))
            runs["stats"] = lambda t: ops["stats"](t, False)
            runs["norm"] = ops["norm"]
        else:
            loader = _aoti_loader(Path(path), device)
            runs[program] = lambda t: loader.run([t])[0]
    except Exception as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return _CHECK_NO_LOAD
    x = torch.linspace(-3.0, 5.0, 10_001, device=device).to(dtype)  # (n,)
    ref = x.double()
    for name, run_one in runs.items():
        got = run_one(x).double().cpu().reshape(-1)  # (N_MOMENTS,) or (1,)
        want = torch.stack([ref.mean(), ref.min(), ref.max(), ref.norm()]).cpu() \
            if name == "stats" else ref.norm().cpu().reshape(1)
        have = got[[MEAN, MIN, MAX, NORM]] if name == "stats" else got
        if not torch.allclose(have, want, rtol=1e-5, atol=1e-6):
            print(f"{name}: {have.tolist()} against torch's {want.tolist()}", file=sys.stderr)
            return _CHECK_WRONG
    return 0


def _main(argv: list[str]) -> None:
    """A child process of this module (`_child_cmd`): MODE PARENT_PID ARGS..."""
    mode, parent, *args = argv
    if mode == "--check":  # it writes nothing: SIGTERM's default action is the right end
        _process.die_with_parent(int(parent))
        sys.exit(_check_child(*args))
    # A build (OUT LOCK ARGS...): it ends with the process that started it, and removes
    # what it was writing (its own `finally`s). The lock the parent took for it is the
    # parent's to remove, unless the child leaves on a signal or the parent is gone (it
    # may be gone before the child could ask to be told of it): removed here otherwise, a
    # next process could take it before the parent's own removal, which would take that
    # process's lock away.
    out, lock, *rest = args
    stopped = False
    try:
        with _process.child_of(int(parent)):
            if mode == "--native":
                code = _native_child(out, *rest)
            else:
                _build_child(out, *rest)
                code = 0
    except SystemExit:  # `child_of`'s: a signal, or the parent's death
        stopped = True
        raise
    finally:
        if stopped or os.getppid() != int(parent):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock)
    sys.exit(code)


if __name__ == "__main__":
    _main(sys.argv[1:])
