"""torchscope._kernels: built once per machine in a child process, loaded from the on-disk
cache, never recompiled for a new size, and eager wherever it cannot be."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from torchscope import _kernels


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


def test_no_compiler_means_eager_with_a_reason(fresh: Path, monkeypatch: pytest.MonkeyPatch
                                               ) -> None:
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(_kernels.shutil, "which", lambda _name: None)
    status = _kernels.prepare("stats", torch.float64, wait=None)
    assert status.state == "unavailable" and "no C++ compiler" in status.reason
    x = torch.randn(10, dtype=torch.float64)
    assert _kernels.run("stats", x) is None
    assert "no C++ compiler" in (_kernels.why_eager("stats", x) or "")


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
