"""SIGTERM and SIGINT at several points of a real `torchscope` run (a child process of the
test): the command exits 128 + the signal with one line on stderr, no process it started
(compile child, g++, torchrun rank, kernel build) is left running, and no temporary folder
or kernel build file is left behind. The library leaves the signal handlers as it found
them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import typer

from torchscope import _process

from .._processes import marked

pytestmark = pytest.mark.slow

# A factory that says when the model build has begun, then takes its time (a big model).
SLOW_BUILD = '''
import os, time
from pathlib import Path
from torchscope.models.zoo import TinyCNN

def build():
    Path(os.environ["TS_SIGNAL_MARK_FILE"]).write_text("building")
    time.sleep(120)
    return TinyCNN()
'''

# A factory that starts the fused kernels' background build (g++ in a child), then waits.
KERNEL_BUILD = '''
import os, time
from pathlib import Path
from torchscope import _kernels
from torchscope.models.zoo import TinyCNN

def build():
    _kernels.prepare("stats")
    Path(os.environ["TS_SIGNAL_MARK_FILE"]).write_text("building kernels")
    time.sleep(120)
    return TinyCNN()
'''


class Run:
    """`python -m torchscope ARGS` with its own TMPDIR, kernel cache and a marker in its
    environment that every process it starts inherits."""

    def __init__(self, tmp: Path, args: list[str]) -> None:
        self.tmp = tmp / "tmp"
        self.cache = tmp / "cache"
        self.tmp.mkdir()
        self.cache.mkdir()
        self.mark = f"ts-signal-{uuid.uuid4().hex}"
        self.mark_file = tmp / "mark"
        env = {**os.environ, "TMPDIR": str(self.tmp), "TORCHSCOPE_CACHE_DIR": str(self.cache),
               "TS_SIGNAL_MARK": self.mark, "TS_SIGNAL_MARK_FILE": str(self.mark_file),
               "COLUMNS": "150"}
        self.proc = subprocess.Popen([sys.executable, "-m", "torchscope", *args], env=env,
                                     cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)

    def ours(self) -> list[psutil.Process]:
        """Every live process carrying the marker (orphans re-parented to PID 1 included)."""
        return marked("TS_SIGNAL_MARK", self.mark)

    def wait_for(self, what: str, ready: Callable[[], bool], timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if self.proc.poll() is not None:
                out, err = self.proc.communicate()
                pytest.fail(f"the command ended (exit {self.proc.returncode}) before {what}: "
                            f"{out[-2000:]} {err[-2000:]}")
            if time.monotonic() > deadline:
                self.proc.kill()
                pytest.fail(f"no {what} after {timeout:.0f} s")
            time.sleep(0.2)

    def children_named(self, *needles: str) -> bool:
        for p in self.ours():
            if p.pid == self.proc.pid:
                continue
            try:
                line = " ".join(p.cmdline())
            except psutil.Error:
                continue
            if any(n in line for n in needles):
                return True
        return False

    def signal_and_check(self, sig: signal.Signals) -> str:
        """Send `sig` to the command alone, then check the exit, the one line, and that
        nothing is left behind; returns the line."""
        self.proc.send_signal(sig)
        try:
            _, err = self.proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"still running 120 s after {sig.name}")
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert self.proc.returncode == 128 + sig, (self.proc.returncode, err)
        assert len(lines) == 1, err
        assert f"interrupted by {sig.name}" in lines[0]
        deadline = time.monotonic() + 10  # a group killed a moment ago may still be exiting
        while (left := self.ours()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, [" ".join(p.cmdline()) for p in left]
        # Inductor's own cache folder (torchinductor_USER) is there after any run that
        # imports it, interrupted or not: a cache, not a temporary folder of the run.
        assert [p.name for p in self.tmp.iterdir()
                if not p.name.startswith("torchinductor_")] == []
        leftovers = [p.name for p in self.cache.rglob("*")
                     if p.name.endswith(".lock") or p.name.startswith("tmp")]
        assert leftovers == []
        return lines[0]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_during_the_model_build(tmp_path: Path, sig: signal.Signals) -> None:
    factory = tmp_path / "slow_factory.py"
    factory.write_text(SLOW_BUILD)
    run = Run(tmp_path, ["grads", f"{factory}:build", "-i", "2x3x32x32"])
    run.wait_for("model build", run.mark_file.exists)
    run.signal_and_check(sig)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_during_a_compile_child(tmp_path: Path, sig: signal.Signals) -> None:
    run = Run(tmp_path, ["compile", "tiny-cnn", "--iters", "1", "--warmup", "0"])
    run.wait_for("compile child", lambda: run.children_named("child_main"))
    # The child at work: a compiler under it where inductor has started one.
    deadline = time.monotonic() + 60
    while not run.children_named("cc1plus", "g++", "c++") and time.monotonic() < deadline \
            and run.proc.poll() is None:
        time.sleep(0.2)
    run.signal_and_check(sig)


def test_sigterm_during_the_kernel_build(tmp_path: Path) -> None:
    factory = tmp_path / "kernel_factory.py"
    factory.write_text(KERNEL_BUILD)
    run = Run(tmp_path, ["grads", f"{factory}:build", "-i", "2x3x32x32"])
    run.wait_for("kernel build", lambda: run.mark_file.exists()
                 and run.children_named("cc1plus", "g++", "torchscope._kernels"))
    run.signal_and_check(signal.SIGTERM)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_during_a_torchrun_doctor(tmp_path: Path, sig: signal.Signals) -> None:
    factory = tmp_path / "slow_factory.py"
    factory.write_text(SLOW_BUILD)
    run = Run(tmp_path, ["doctor", f"{factory}:build", "-i", "4x3x32x32", "--nproc", "2",
                         "--fast", "--out", str(tmp_path / "report")])
    # The ranks building the model (each writes the mark; one is enough to know they run).
    run.wait_for("ranks", lambda: run.mark_file.exists()
                 and sum(_is_rank(p) for p in run.ours()) >= 2)
    run.signal_and_check(sig)
    assert not (tmp_path / "report").exists()


def test_sigterm_during_a_rank_s_kernel_build(tmp_path: Path) -> None:
    """The ranks of `--nproc` start the fused kernels' build (a child in a session of its
    own, out of the rank's process group): a SIGTERM to the command stops it too."""
    factory = tmp_path / "kernel_factory.py"
    factory.write_text(KERNEL_BUILD)
    run = Run(tmp_path, ["doctor", f"{factory}:build", "-i", "4x3x32x32", "--nproc", "2",
                         "--fast", "--out", str(tmp_path / "report")])
    run.wait_for("ranks building kernels", lambda: run.mark_file.exists()
                 and sum(_is_rank(p) for p in run.ours()) >= 2
                 and run.children_named("cc1plus", "g++", "torchscope._kernels"))
    run.signal_and_check(signal.SIGTERM)
    assert not (tmp_path / "report").exists()


def _is_rank(p: psutil.Process) -> bool:
    try:
        line = " ".join(p.cmdline())
    except psutil.Error:
        return False
    return "_rank_main" in line or "spawn" in line


def test_interruptible_puts_the_handlers_back() -> None:
    before = {s: signal.getsignal(s) for s in _process.SIGNALS}
    with _process.interruptible():
        assert all(signal.getsignal(s) not in (before[s],) for s in _process.SIGNALS)
        with pytest.raises(_process.Interrupted) as caught:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises before this ends
        assert caught.value.signum == signal.SIGTERM and caught.value.name == "SIGTERM"
    assert {s: signal.getsignal(s) for s in _process.SIGNALS} == before
    assert _process.interrupted() is None


@pytest.mark.parametrize("how", ["convert", "swallow"])
def test_a_signal_the_command_did_not_end_on_still_sets_its_exit(
        how: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The code a signal interrupts may turn its `Interrupted` into another exception (an
    import does, inside a class body) or catch it and finish: the command still leaves
    with 128 + the signal and the one line, not with "unexpected RuntimeError" (exit 2) or
    a result it did not finish."""
    from torchscope.cli._common import guarded

    with _process.interruptible(), pytest.raises(typer.Exit) as ended, guarded(False):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises before this ends
        except KeyboardInterrupt:
            if how == "convert":
                raise RuntimeError("Error calling __set_name__") from None
    assert ended.value.exit_code == 128 + signal.SIGTERM
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "interrupted by SIGTERM" in lines[0], lines


def test_stop_ends_the_whole_group(tmp_path: Path) -> None:
    """A child's own child (as g++ under the compile child) goes with it."""
    script = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', " \
             "'import time; time.sleep(60)']); print('up', flush=True); time.sleep(60)"
    proc = _process.spawn([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
    grandchildren = psutil.Process(proc.pid).children()
    assert len(grandchildren) == 1
    _process.stop(proc, grace=1.0)
    assert proc.returncode == -signal.SIGTERM
    psutil.wait_procs(grandchildren, timeout=5)
    assert not any(g.is_running() and g.status() != psutil.STATUS_ZOMBIE for g in grandchildren)


def test_a_rank_killed_during_its_kernel_build_leaves_no_build(tmp_path: Path) -> None:
    """SIGKILL to one rank of `--nproc 2` while the ranks build the kernels (as a launcher
    does after its grace period): that rank's build, in a session of its own, never heard
    of it and ran on, leaving its lock and temporary file. It now ends with its rank; the
    doctor names the dead rank and stops the other, and nothing is left."""
    factory = tmp_path / "kernel_factory.py"
    factory.write_text(KERNEL_BUILD)
    run = Run(tmp_path, ["doctor", f"{factory}:build", "-i", "4x3x32x32", "--nproc", "2",
                         "--fast", "--out", str(tmp_path / "report")])

    def building_rank() -> psutil.Process | None:
        for p in run.ours():
            if not _is_rank(p):
                continue
            try:
                under = [" ".join(c.cmdline()) for c in p.children(recursive=True)]
            except psutil.Error:
                continue
            if any("g++" in line or "cc1plus" in line for line in under):
                return p
        return None

    found: list[psutil.Process] = []

    def building() -> bool:
        rank = building_rank()
        found.extend([rank] if rank is not None else [])
        return run.mark_file.exists() and rank is not None

    run.wait_for("a rank running g++", building)
    found[-1].kill()
    try:
        _, err = run.proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        run.proc.kill()
        pytest.fail("the doctor still ran 120 s after a rank was killed")
    assert run.proc.returncode == 2, err
    assert "died" in err and "SIGKILL" in err, err
    deadline = time.monotonic() + 30  # a build stopped a moment ago may still be exiting
    while (left := run.ours()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, [" ".join(p.cmdline()) for p in left]
    leftovers = [p.name for p in run.cache.rglob("*")
                 if p.name.endswith(".lock") or p.name.startswith("tmp")]
    assert leftovers == []
    assert not (tmp_path / "report").exists()
