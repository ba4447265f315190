"""torchscope._kernels: built once per machine in a child process, loaded from the on-disk
cache, never recompiled for a new size, and eager wherever it cannot be."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from torchscope import _kernels
from torchscope._kernels import INFS, MAX, MEAN, MIN, NANS, NORM, STD, ZEROS


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """An empty kernel cache and no kernel in this process; the process's kernels come back
    after the test."""
    monkeypatch.setenv("TORCHSCOPE_CACHE_DIR", str(tmp_path))
    with _kernels._lock:
        saved = dict(_kernels._kernels), dict(_kernels._ready)
    _kernels._forget()
    yield tmp_path / "kernels"
    with _kernels._lock:
        _kernels._kernels.clear()
        _kernels._ready.clear()
        _kernels._kernels.update(saved[0])
        _kernels._ready.update(saved[1])


@pytest.mark.slow
def test_built_once_then_loaded_from_the_cache(fresh: Path) -> None:
    x = torch.randn(1000, dtype=torch.float64)
    assert _kernels.run("norm", x) is None  # the first request starts the build...
    assert "background" in (_kernels.why_eager("norm", x) or "")
    status = _kernels.prepare("norm", torch.float64, wait=None)  # ...and this waits for it
    assert status.state == "ready", status.reason
    assert status.source == "built" and status.build_s is not None and status.build_s > 0
    (package,) = fresh.glob("norm-float64-*.pt2")
    assert not list(fresh.glob("*.lock"))
    # A child process loaded it and checked its numbers before this process did.
    assert package.with_name(package.name + ".ok").exists()
    # Another process (here: this one, forgetting its kernels) loads it without building.
    _kernels._forget()
    status = _kernels.prepare("norm", torch.float64, wait=None)
    assert status.source == "cache" and status.build_s is None and status.load_s is not None
    # One kernel serves every length: no new kernel, no rebuild.
    for n in (2, 3, 17, 100_003):
        t = torch.randn(n, dtype=torch.float64)
        got = _kernels.run("norm", t)
        assert got is not None and torch.allclose(got, t.norm(), rtol=1e-12, atol=0)
    assert len(_kernels.kernel_status()) == 1
    # A broken package is deleted on load, so that the next process rebuilds it.
    package.write_bytes(b"not a package")
    _kernels._forget()
    status = _kernels.prepare("norm", torch.float64, wait=None)
    assert status.state == "unavailable" and "failed to load" in status.reason
    assert not package.exists()
    assert not package.with_name(package.name + ".ok").exists()  # no verdict for a rebuild


def test_no_compiler_means_eager_with_a_reason(fresh: Path, monkeypatch: pytest.MonkeyPatch
                                               ) -> None:
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(_kernels.shutil, "which", lambda _name: None)
    status = _kernels.prepare("stats", torch.float64, wait=None)
    assert status.state == "unavailable" and "no C++ compiler" in status.reason
    x = torch.randn(10, dtype=torch.float64)
    assert _kernels.run("stats", x) is None
    assert "no C++ compiler" in (_kernels.why_eager("stats", x) or "")


def test_no_compiler_for_float32_says_so_once(fresh: Path, monkeypatch: pytest.MonkeyPatch
                                              ) -> None:
    """CPU float32 tries the native library, then AOTInductor: one reason, not two."""
    monkeypatch.setattr(_kernels._Native, "ops", None)
    monkeypatch.setattr(_kernels._Native, "error", None)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(_kernels.shutil, "which", lambda _name: None)
    status = _kernels.prepare("norm", torch.float32, wait=None)
    assert status.state == "unavailable"
    assert status.reason.count("no C++ compiler") == 1, status.reason
    assert _kernels.run("norm", torch.randn(10)) is None


def test_an_unsupported_dtype_is_never_built(fresh: Path) -> None:
    status = _kernels.prepare("stats", torch.int64, wait=None)
    assert status.state == "unavailable" and "dtype" in status.reason
    assert not fresh.exists() or not list(fresh.iterdir())


def test_another_process_building_is_waited_for(fresh: Path) -> None:
    path = _kernels._package_path("norm", torch.float32, torch.device("cpu"))
    path.parent.mkdir(parents=True)
    lock = path.with_name(path.name + ".lock")
    lock.touch()  # a build in progress elsewhere

    def finish_elsewhere() -> None:
        time.sleep(0.3)
        path.write_bytes(b"placeholder")
        lock.unlink()

    other = threading.Thread(target=finish_elsewhere)
    other.start()
    t0 = time.perf_counter()
    assert _kernels._build(path, "norm", torch.float32, torch.device("cpu")) is None
    other.join()
    assert 0.25 < time.perf_counter() - t0 < 30  # waited for it; built nothing itself
    assert path.read_bytes() == b"placeholder"


def test_disabled_is_scoped() -> None:
    x = torch.randn(10)
    with _kernels.disabled():
        assert _kernels.run("stats", x) is None
        assert "disabled" in (_kernels.why_eager("stats", x) or "")
    assert _kernels._Switch.enabled


# ---------------------------------------------------------------------------- native kernel
def _native_ready() -> None:
    for program in _kernels.PROGRAMS:
        status = _kernels.prepare(program, torch.float32, wait=None)
        if status.state != "ready" or status.backend != "native":
            pytest.skip(f"no native kernel here: {status.reason or status.backend}")


def _span_cases() -> Iterator[tuple[str, torch.Tensor]]:
    """What the native kernel's spans (1024 elements, float32 lanes, float64 redo) meet."""
    g = torch.Generator().manual_seed(0)

    def randn(n: int) -> torch.Tensor:
        return torch.randn(n, generator=g)

    for n in (2, 31, 33, 1023, 1024, 1025, 65_537, 300_001):  # tails, span edges, workers
        yield f"{n} elements", randn(n)
    yield "mean far from zero", 1e4 + randn(50_000)
    yield "outlier first", torch.cat([torch.tensor([1e4]), randn(100_000)])
    overflow = randn(5000)
    overflow[4000] = 3e19  # its float32 square is Inf: that span is redone in float64
    yield "square past float32", overflow
    yield "all huge", randn(5000) * 1e30
    yield "tiny (squares underflow float32)", randn(5000) * 1e-25
    yield "denormal", randn(3000) * 1e-40
    late = randn(70_000)
    late[66_666] = float("nan")  # in another worker's range than the first span
    late[3] = float("-inf")
    yield "NaN in a late span", late
    yield "all zero", torch.zeros(4096)
    yield "ReLU output", randn(200_000).clamp_min(0)
    signed = randn(70_000).abs()  # zeros of both signs: the minimum is a zero
    signed[::5], signed[1::7] = -0.0, 0.0
    yield "zeros of both signs", signed


def test_native_kernel_is_exact_where_it_must_be() -> None:
    _native_ready()
    for name, t in _span_cases():
        got = _kernels.run("stats", t)
        norm = _kernels.run("norm", t)
        assert got is not None and norm is not None, name
        f = got.tolist()
        ref = t.double()
        # Exact: min, max and the counts (NaN makes min/max NaN, as aminmax does).
        nans = int(ref.isnan().sum())
        lo, hi = (math.nan, math.nan) if nans else (float(ref.min()), float(ref.max()))
        assert f[MIN] == lo or (math.isnan(f[MIN]) and nans), name
        assert f[MAX] == hi or (math.isnan(f[MAX]) and nans), name
        assert f[ZEROS] == float((ref == 0).sum()) / t.numel(), name
        assert (f[NANS], f[INFS]) == (nans, int(ref.isinf().sum())), name
        if nans or int(ref.isinf().sum()):
            assert math.isnan(f[STD]) and math.isnan(f[MEAN]) == bool(nans), name
            assert math.isnan(norm.item()) == bool(nans), name
            continue
        rms = math.sqrt(float((ref * ref).mean()))
        std = float(ref.std()) if t.numel() > 1 else 0.0
        assert abs(f[MEAN] - float(ref.mean())) <= 1e-6 * rms, name
        assert abs(f[STD] - std) <= 1e-6 * max(std, 1e-300), (name, f[STD], std)
        for value in (f[NORM], norm.item()):
            assert abs(value - float(ref.norm())) <= 1e-6 * float(ref.norm()), name


def test_native_dead_units_equal_the_eager_count() -> None:
    from torchscope.capture.stats import dead_unit_count

    _native_ready()
    g = torch.Generator().manual_seed(1)
    for shape in ((8, 16, 32, 32), (4, 8, 9, 9), (3, 5, 100), (2, 6, 8, 8, 2)):
        x = torch.randn(shape, generator=g).clamp_min(0)
        x[:, 1] = 0  # dead everywhere
        x[0, 2] = 0  # dead in one sample only: alive
        x[:, 4] = 0
        x[-1, 4].view(-1)[-1] = 1e-30  # one element in the last plane keeps it alive
        got = _kernels.run("stats", x, dead_units=True)
        assert got is not None and got.shape == (_kernels.N_MOMENTS + 1,), shape
        assert got[_kernels.DEAD].item() == dead_unit_count(x).item() == 1, shape
        x[1, 1].view(-1)[0] = float("nan")  # NaN is not zero: that channel is alive now
        got = _kernels.run("stats", x, dead_units=True)
        assert got is not None and got[_kernels.DEAD].item() == dead_unit_count(x).item() == 0
    # Where the pass cannot count them, the vector has no DEAD slot: the caller counts.
    for why, x in (("channels-last", torch.rand(4, 8, 16, 16).to(
            memory_format=torch.channels_last)), ("short planes", torch.rand(64, 32)),
                   ("not asked", torch.rand(4, 8, 16, 16))):
        got = _kernels.run("stats", x, dead_units=why != "not asked")
        assert got is not None and got.shape == (_kernels.N_MOMENTS,), why


def test_native_list_ops_against_float64() -> None:
    """`copy_norms`, `diff_norms` and `norms` over a list (a model's weights before and after
    an update, its gradients): copies bitwise equal and separate, norms within 1e-6 of
    float64 truth (NaN and Inf exact), across empty, one-element and multi-piece tensors and
    the span cases."""
    _native_ready()
    g = torch.Generator().manual_seed(2)
    xs = [torch.empty(0), torch.tensor([-3.0]), torch.randn(16, 3, 3, 3, generator=g),
          torch.randn(300_001, generator=g)] + [t for _, t in _span_cases()]
    made = _kernels.copy_norms(xs)
    assert made is not None
    copies, norms = made
    steps = [x + 1e-3 * torch.randn(x.shape, generator=g) for x in xs]
    steps[2] = xs[2].clone()  # an unchanged tensor: exactly 0
    diffs = _kernels.diff_norms(steps, xs)
    alone = _kernels.norms(xs)
    assert diffs is not None and alone is not None
    assert len(copies) == len(norms) == len(diffs) == len(alone) == len(xs)
    for i, (x, c, n, d, a) in enumerate(zip(xs, copies, norms, diffs, alone, strict=True)):
        assert c.shape == x.shape and c.dtype == x.dtype, i
        assert torch.equal(c.nan_to_num(), x.nan_to_num()) and torch.equal(c.isnan(), x.isnan())
        assert x.numel() == 0 or c.data_ptr() != x.data_ptr(), i
        for got, want in ((n, x.double().norm()), (d, (steps[i] - x).double().norm()),
                          (a, x.double().norm())):
            assert got.dtype == torch.float64 and got.shape == (), i
            if not want.isfinite():
                assert got.isnan() == want.isnan() and got.isinf() == want.isinf(), i
            else:
                assert abs(got.item() - want.item()) <= 1e-6 * want.item(), (i, got, want)
    assert diffs[2].item() == 0.0
    # `norms_into`: the same norms bitwise, written into a row of a ring, and their largest
    # (NaN where one is, else Inf where one is) into a slot of another.
    rows = torch.zeros(3, len(xs), dtype=torch.float64)
    slots = torch.zeros(3, dtype=torch.float64)
    vector = torch.stack(alone)  # (n,)
    assert _kernels.norms_into(xs, rows[1], slots[1])
    assert torch.equal(rows[1].view(torch.int64), vector.view(torch.int64))
    assert not rows[0].any() and not rows[2].any()
    if vector.isnan().any():
        assert slots[1].isnan()
    else:
        assert slots[1] == vector.max()
    finite = [x for x, n in zip(xs, alone, strict=True) if n.isfinite()]
    assert _kernels.norms_into(finite, rows[2, :len(finite)], slots[2])
    assert slots[2] == max(n for n in alone if n.isfinite()) and slots[0] == 0
    overflow = [torch.full((4,), 3e38)]  # finite elements, a norm past float32's range
    assert _kernels.norms_into(overflow, rows[0, :1], slots[0])
    assert math.isfinite(slots[0].item()) and slots[0].item() > 3e38
    # What they do not take, they leave to foreach ops: None.
    assert _kernels.copy_norms([torch.randn(4, dtype=torch.float64)]) is None
    assert _kernels.copy_norms([torch.randn(4, 4).t()]) is None  # not contiguous
    assert _kernels.diff_norms([torch.randn(4)], [torch.randn(5)]) is None
    assert _kernels.norms([torch.randn(4), torch.randn(4, dtype=torch.float16)]) is None
    with _kernels.disabled():
        assert _kernels.copy_norms([torch.randn(4)]) is None
        assert _kernels.norms([torch.randn(4)]) is None


@pytest.mark.slow
def test_native_numbers_do_not_depend_on_the_cpus_vector_width(tmp_path: Path) -> None:
    """The library built for baseline x86-64 (SSE2: 4 float32 lanes) gives the very bits
    this machine's own build gives (8 lanes with AVX2, 16 with AVX-512): each lane sums the
    same elements in the same order on every CPU, and no multiply-add is fused. So a
    figure in a report does not depend on the machine it was taken on, and the widths this
    machine cannot run follow the same code."""
    import platform

    _native_ready()
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"a baseline x86-64 build needs an x86-64 machine, not {platform.machine()}")
    namespace = "torchscope_baseline_test"
    error = _kernels._compile_native(tmp_path / "baseline.so", march="x86-64",
                                     namespace=namespace)
    assert error is None, error
    torch.ops.load_library(str(tmp_path / "baseline.so"))
    base = getattr(torch.ops, namespace)

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:  # bitwise, NaN included
        return torch.equal(a.view(torch.int64), b.view(torch.int64))

    g = torch.Generator().manual_seed(3)
    cases = [t for _, t in _span_cases()] + [torch.randn(8, 16, 32, 32, generator=g).relu()]
    for i, t in enumerate(cases):
        for dead in (False, True):
            got = _kernels.run("stats", t, dead_units=dead)
            assert got is not None and same(got, base.stats(t, dead)), (i, dead)
        norm = _kernels.run("norm", t)
        assert norm is not None and same(norm, base.norm(t)), i
    steps = [t + 1e-3 * torch.randn(t.shape, generator=g) for t in cases]
    made, diffs, alone = (_kernels.copy_norms(cases), _kernels.diff_norms(steps, cases),
                          _kernels.norms(cases))
    assert made is not None and diffs is not None and alone is not None
    assert same(torch.stack(made[1]), base.copy_norms(cases)[1])  # (n,) each
    assert same(torch.stack(diffs), base.diff_norms(steps, cases))
    assert same(torch.stack(alone), base.norms(cases))
    # Lanes keep a -0 or a +0 by their order, which differs by width: a zero bound is +0.
    signed = dict(_span_cases())["zeros of both signs"]
    low = _kernels.run("stats", signed)
    assert low is not None and float(low[MIN]) == 0.0
    assert math.copysign(1.0, float(low[MIN])) == 1.0


@pytest.mark.slow
def test_native_build_is_locked_and_leaves_only_the_library(fresh: Path) -> None:
    """A fresh build into an empty cache; a second process finds it there (this process
    already holds the library, whose operators register once per process)."""
    import subprocess
    import sys

    if not _kernels._native_wanted(torch.float32, torch.device("cpu")) or \
            _kernels._toolchain_reason(torch.device("cpu")):
        pytest.skip("no native build here (not Linux, or no C++ compiler)")
    path = _kernels._native_path()
    assert not path.exists()
    assert _kernels._with_build_lock(path, _kernels._compile_native) is None
    assert path.is_file() and [p.name for p in fresh.iterdir()] == [path.name]
    code = ("import torch, sys; from torchscope import _kernels; "
            "s = _kernels.prepare('stats', wait=None); x = torch.arange(10.0); "
            "print(s.backend, s.source, _kernels.run('stats', x).tolist())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=120)
    backend, source, values = done.stdout.split(" ", 2)
    assert (backend, source) == ("native", "cache")
    assert values.startswith("[4.5, ")


@pytest.mark.slow
def test_a_failed_native_build_falls_back_to_aotinductor(fresh: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    if _kernels._toolchain_reason(torch.device("cpu")):
        pytest.skip("no C++ compiler: neither backend can build")
    monkeypatch.setattr(_kernels._Native, "ops", None)
    monkeypatch.setattr(_kernels._Native, "error", None)
    monkeypatch.setattr(_kernels, "_compile_native",
                        lambda _out: "building the native kernel failed: no such header")
    status = _kernels.prepare("norm", torch.float32, wait=None)
    assert status.state == "ready" and status.backend == "aotinductor", status.reason
    x = torch.randn(1000)
    got = _kernels.run("norm", x)
    assert got is not None and math.isclose(got.item(), float(x.double().norm()), rel_tol=1e-9)


_CRASHING_LIBRARY = """
#include <csignal>
// Loading this library ends the process, as a kernel built against a C++ runtime that
// does not match torch's can.
__attribute__((constructor)) static void crash_on_load() { std::raise(SIGNAL); }
"""


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGSEGV", "SIGKILL"])
def test_a_kernel_that_crashes_when_loaded_is_never_loaded_here(
        sig: str, fresh: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A compiled kernel in the cache that kills the process that loads it: a child process
    loads it first, so this one lives on, runs eagerly and says why. A crash inside the
    file is remembered for the next process; a kill (the machine's, or a user's) is not."""
    import shutil
    import subprocess

    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None or not _kernels._native_wanted(torch.float32, torch.device("cpu")):
        pytest.skip("no C++ compiler, or no native kernel on this platform")
    for field in ("ops", "error", "source", "build_s", "load_s"):
        monkeypatch.setattr(_kernels._Native, field, getattr(_kernels._Native, field))
    source = tmp_path / "crash.cpp"
    source.write_text(_CRASHING_LIBRARY)
    path = _kernels._native_path()
    path.parent.mkdir(parents=True)
    subprocess.run([cxx, "-shared", "-fPIC", f"-DSIGNAL={sig}", str(source), "-o",
                    str(path)], check=True, timeout=120)
    _kernels._Native.ops = None
    _kernels._Native.error = None
    error = _kernels._load_native()  # had it loaded the library here, the test would die
    assert error is not None and f"crashed ({sig}) in a child process" in error
    assert _kernels._Native.ops is None
    ok, failed = path.with_name(path.name + ".ok"), path.with_name(path.name + ".failed")
    assert not ok.exists()
    if sig == "SIGKILL":
        assert not failed.exists()  # the next process asks a child again
        return
    assert failed.read_text() == error
    # The next process reads the verdict: no child, the same reason.
    assert _kernels._checked(path, "native", "stats", torch.float32,
                             torch.device("cpu")) == error


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_every_path_refuses_the_same_tensors() -> None:
    """One set of checks decides where a kernel may read a tensor: `run` is eager exactly
    where `why_eager` names a reason, and the native list ops (`norms`, `norm_vector`, and
    `norms_into` for what a step may change) refuse the same tensors."""
    _native_ready()
    x = torch.randn(6, 4)

    class Sub(torch.Tensor):
        pass

    refused = {
        "a subclass": (x.as_subclass(Sub), "subclass"),
        "a parameter in a list": (torch.nn.Parameter(x.clone()), "subclass"),
        "a negative view": (torch._neg_view(x), "strided"),
        "sparse CSR": (x.to_sparse_csr(), "strided"),
        "one element": (x[:1, :1], "elements"),
    }
    for name, (t, words) in refused.items():
        if name != "a parameter in a list":  # `run` reads a parameter's detached tensor
            assert _kernels.run("norm", t) is None, name
            assert words in (_kernels.why_eager("norm", t) or ""), name
        if name != "one element":  # the list ops take tensors of any size
            assert _kernels.norms([x, t]) is None, name
            assert _kernels.norm_vector([x, t]) is None, name
    assert _kernels.norms([x[:1, :1]]) is not None
    for t in (x, torch.nn.Parameter(x.clone()).detach(), x.t()):  # a transpose: dense
        assert _kernels.run("norm", t) is not None and _kernels.why_eager("norm", t) is None
    # What may change between two steps' gradients of the same parameters, `norms_into`
    # checks (dtype, layout and contiguity in the kernel's own check, in C++), writing
    # nothing where it refuses.
    out, largest = torch.full((2,), -1.0, dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    assert _kernels.norms_into([x, x], out, largest)
    assert torch.equal(out, _kernels.norm_vector([x, x])) and largest == out[0]
    out.fill_(-1.0)
    for t in (x.double(), x.t(), x.as_subclass(Sub), x.to_sparse()):
        assert not _kernels.norms_into([x, t], out, largest)
        assert _kernels.norm_vector([x, t]) is None
    assert not _kernels.norms_into([x, x], out[:1], largest)  # a row of the wrong length
    assert (out == -1.0).all()
    # Inside a functorch transform: wrapped tensors, for `run` and the list ops alike.
    seen: list[tuple[bool, str | None, bool]] = []

    def probe(t: torch.Tensor) -> torch.Tensor:
        seen.append((_kernels.run("norm", t) is None, _kernels.why_eager("norm", t),
                     _kernels.norms([t]) is None))
        return t

    torch.func.vmap(probe)(x)
    [(eager, why, listed_eager)] = seen
    assert eager and listed_eager and "functorch" in (why or "")
