"""The fused kernels' build (a child process in a session of its own, running g++) ends with
the process that started it, whatever ends that process: SIGKILL, or SIGTERM to a rank
after its grace period, leaves no build process, no lock and no partial file in the cache.
And a signal that comes while a worker (a doctor rank, whose SIGTERM handler is
`_process.stop_and_exit`) starts a child stops that child too. Real processes and signals;
each test finds what is left by a marker in the environment, which every process the test
starts inherits (orphans re-parented to PID 1 included)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from torchscope import _kernels

from ._processes import cmdlines, kill_all, marked

SRC = Path(__file__).resolve().parents[1] / "src"
_MARK = "TS_BUILD_MARK"

# Starts the kernel build for `dtype` (float32: the native library, g++ run by a child;
# float64: AOTInductor in a child), says so, and waits to be killed.
_STARTER = """
import os, sys, time
from pathlib import Path
import torch
from torchscope import _kernels

_kernels.prepare("stats", getattr(torch, sys.argv[1]))
Path(sys.argv[2]).write_text(str(os.getpid()))
time.sleep(120)
"""


def _left_in(cache: Path) -> list[str]:
    """What a stopped build may not leave: its lock, its temporary file, or a package it
    went on to finish."""
    return sorted(p.name for p in cache.rglob("*") if p.is_file())


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"),
                    reason="a child learns its parent's death on Linux only (PR_SET_PDEATHSIG)")
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_kernel_build_ends_with_the_process_that_started_it(tmp_path: Path,
                                                              dtype: str) -> None:
    """SIGKILL to a process while its kernel build runs g++: before, the build (in a session
    of its own) ran on, and the native build left its lock and temporary .so for good (the
    lock held every later process off the kernel for 20 minutes); the AOTInductor build
    finished a package for a process that was gone."""
    if _kernels._toolchain_reason(torch.device("cpu")):
        pytest.skip("no C++ compiler: no kernel build to stop")
    if dtype == "float32" and not _kernels._native_wanted(torch.float32, torch.device("cpu")):
        pytest.skip("no native kernel on this platform")
    cache, tmp, ready = tmp_path / "cache", tmp_path / "tmp", tmp_path / "ready"
    cache.mkdir()
    tmp.mkdir()
    mark = f"ts-build-{uuid.uuid4().hex}"
    env = {**os.environ, "PYTHONPATH": str(SRC), "TORCHSCOPE_CACHE_DIR": str(cache),
           "TMPDIR": str(tmp), _MARK: mark}
    starter = subprocess.Popen([sys.executable, "-c", _STARTER, dtype, str(ready)], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (ready.exists() and any(
                ("g++" in line or "cc1plus" in line) for line in cmdlines(marked(_MARK, mark)))):
            if starter.poll() is not None:
                pytest.fail(f"the process ended before its build ran g++: {starter.stderr}")
            if time.monotonic() > deadline:
                pytest.fail("no g++ under the kernel build after 120 s")
            time.sleep(0.1)
        starter.kill()
        starter.wait()
        deadline = time.monotonic() + 60  # the build's own clean-up, then its exit
        while (left := marked(_MARK, mark)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert cmdlines(left) == []
        assert _left_in(cache) == []
    finally:
        kill_all(marked(_MARK, mark))
        if starter.poll() is None:
            starter.kill()
        starter.communicate()


# A worker whose SIGTERM handler is `stop_and_exit` (a doctor rank) starts a child; the
# child sends the worker SIGTERM before its exec, so the signal comes while the worker is
# inside `spawn`. `thread`: the child is started from another thread (as the kernel build
# is), else from the main thread.
_WORKER = """
import os, signal, subprocess, sys, threading, time
from torchscope import _process

def poke():
    os.kill(os.getppid(), signal.SIGTERM)

def start():
    _process.spawn([sys.executable, "-c", "import time; time.sleep(120)"], preexec_fn=poke,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

signal.signal(signal.SIGTERM, _process.stop_and_exit)
if sys.argv[1] == "thread":
    threading.Thread(target=start, daemon=True).start()
else:
    start()
    print("spawn returned", flush=True)
time.sleep(60)
print("not stopped", flush=True)
"""


@pytest.mark.parametrize("where", ["thread", "main"])
def test_a_signal_while_a_worker_starts_a_child_stops_both(tmp_path: Path,
                                                           where: str) -> None:
    """From another thread, `stop_and_exit` waits for the child to be registered, then
    stops it (this held already). From the main thread, it used to drop the signal: the
    worker ran on, and when its launcher then killed it, the child (in a session of its
    own) ran on alone. Now the signal is handled once the child is registered."""
    mark = f"ts-build-{uuid.uuid4().hex}"
    env = {**os.environ, "PYTHONPATH": str(SRC), _MARK: mark}
    worker = subprocess.Popen([sys.executable, "-c", _WORKER, where], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        try:
            out, err = worker.communicate(timeout=50)  # it sleeps 60 s unless stopped
        except subprocess.TimeoutExpired:
            worker.kill()  # as its launcher would
            out, err = worker.communicate()
        deadline = time.monotonic() + 10  # a group killed a moment ago may still be exiting
        while (left := marked(_MARK, mark)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert cmdlines(left) == []
        assert worker.returncode == 128 + signal.SIGTERM, (worker.returncode, out, err)
        assert "spawn returned" not in out and "not stopped" not in out
    finally:
        kill_all(marked(_MARK, mark))


@pytest.mark.skipif(not sys.platform.startswith("linux"),
                    reason="the build child's checks of its parent are for Linux")
def test_a_build_child_whose_parent_is_already_gone_removes_the_lock_and_ends(
        tmp_path: Path) -> None:
    """The parent died before the child asked to be told of it (a race `die_with_parent`
    closes by looking at its parent after asking): the child is now someone else's, so it
    removes the lock it was handed, builds nothing and exits 128 + SIGTERM."""
    out, lock = tmp_path / "native.so", tmp_path / "native.so.lock"
    lock.touch()  # taken by the parent (`_with_build_lock`) before it started the child
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that is not this child's parent
    cmd = _kernels._child_cmd("--native", str(out), str(lock), "native", "")
    cmd[4] = str(gone.pid)  # the parent pid: [python, -m, module, mode, pid, ...]
    done = subprocess.run(cmd, env=_kernels._child_env(), capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == []
