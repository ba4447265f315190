"""The child process that measures a torch.compile mode ends with the process that started
it, and takes its job folder (`torchscope-compile-*`, with inductor's cache and the
compiled kernels) with it: when that process is killed (SIGKILL, as a torchrun launcher
does after its grace period), and when it is a doctor rank that leaves at once on SIGTERM
(`_process.stop_and_exit`, which stops its children and never runs its own `finally`s).
Before, the child ran on re-parented to PID 1, and the folder stayed behind in both cases.
So does the lab's compile-in-the-loop child, with its folder (`torchscope-lab-*`), when the
lab is killed. Real processes and signals; what is left is found by a marker in the
environment that every process the test starts inherits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from .._processes import cmdlines, kill_all, marked

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"),
                       reason="a child learns its parent's death on Linux only "
                              "(PR_SET_PDEATHSIG)"),
]

SRC = Path(__file__).resolve().parents[2] / "src"
_MARK = "TS_COMPILE_MARK"

# Measures one mode of a model whose forward takes half a second, in a child process
# (a measurement that runs for minutes); `rank`: SIGTERM is handled as a doctor rank handles
# it.
_STARTER = """
import signal, sys
from torchscope import _process
from torchscope.compile import compile_report
from torchscope.models import load_target

if sys.argv[1] == "rank":
    signal.signal(signal.SIGTERM, _process.stop_and_exit)
loaded = load_target(sys.argv[2])
compile_report(loaded.model, loaded.inputs, modes=("default",), iters=200,
               factory=sys.argv[2], timeout_s=600)
print("done", flush=True)
"""


# The lab's compile-in-the-loop trap, whose child compiles tiny-cnn three times in a fresh
# inductor folder.
_LAB_STARTER = """
from torchscope.lab.milestones import _compile_loop

_compile_loop()
print("done", flush=True)
"""


def _job_folders(tmp: Path) -> list[Path]:
    return sorted([*tmp.glob("torchscope-compile-*"), *tmp.glob("torchscope-lab-*")])


def _at_work(tmp: Path, who: str) -> bool:
    """Whether the child is at work: the compile child's log says it compiles (or times)
    the model; the lab's child has written to its inductor folder."""
    if who == "lab":
        return any(any(f.rglob("*")) for f in tmp.glob("torchscope-lab-*"))
    logs = [f / "log" for f in tmp.glob("torchscope-compile-*")]
    return any("[torchscope]" in log.read_text(errors="replace") for log in logs if log.exists())


@pytest.mark.parametrize(("who", "how"), [("compile", "sigkill"), ("compile", "rank-sigterm"),
                                          ("lab", "sigkill")])
def test_the_compile_child_ends_with_its_parent_and_removes_its_folder(
        tmp_path: Path, who: str, how: str) -> None:
    mark = f"ts-compile-{uuid.uuid4().hex}"
    env = {**os.environ, "PYTHONPATH": str(SRC), "TMPDIR": str(tmp_path),
           _MARK: mark}
    cmd = [sys.executable, "-c", _LAB_STARTER] if who == "lab" else \
        [sys.executable, "-c", _STARTER, "rank" if how == "rank-sigterm" else "plain",
         f"{Path(__file__).parent / 'compile_targets.py'}:slow"]
    starter = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        deadline = time.monotonic() + 180
        while not _at_work(tmp_path, who):
            if starter.poll() is not None:
                out, err = starter.communicate()
                pytest.fail(f"the run ended (exit {starter.returncode}) before its compile "
                            f"child worked: {out[-1000:]} {err[-2000:]}")
            if time.monotonic() > deadline:
                pytest.fail("no compile child at work after 180 s")
            time.sleep(0.2)
        child = "_loop_child" if who == "lab" else "child_main"
        assert any(child in line for line in cmdlines(marked(_MARK, mark)))
        if how == "sigkill":
            starter.kill()
        else:
            starter.send_signal(signal.SIGTERM)
        starter.wait(timeout=60)
        if how == "rank-sigterm":
            assert starter.returncode == 128 + signal.SIGTERM
        deadline = time.monotonic() + 30  # the child's own clean-up, then its exit
        while ((left := marked(_MARK, mark)) or _job_folders(tmp_path)) \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        assert cmdlines(left) == []
        assert _job_folders(tmp_path) == []
    finally:
        kill_all(marked(_MARK, mark))  # never leave them running when the test fails
        if starter.poll() is None:
            starter.kill()
        starter.communicate()
