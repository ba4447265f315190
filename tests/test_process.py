"""`torchscope._process`'s child processes on real processes and real signals: every child
is signalled before any is killed (one grace period for all), and a signal that comes while
a child starts still stops it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil

from torchscope import _process

SRC = Path(__file__).resolve().parents[1] / "src"

# A child that, on SIGTERM, writes which of its siblings are still alive, and stays: only
# SIGKILL ends it. Child 0 also starts a grandchild in its group, and says its pid.
_STUBBORN = """
import os, signal, subprocess, sys, time
from pathlib import Path

folder, me = Path(sys.argv[1]), int(sys.argv[2])

def on_term(signum, frame):
    alive = []
    for pid in (folder / "pids").read_text().split():
        try:
            os.kill(int(pid), 0)
            alive.append(int(pid))
        except ProcessLookupError:
            pass
    (folder / f"term{me}").write_text(" ".join(map(str, alive)))

signal.signal(signal.SIGTERM, on_term)
if me == 0:
    grandchild = subprocess.Popen(["sleep", "120"])
    (folder / "grandchild").write_text(str(grandchild.pid))
(folder / f"ready{me}").write_text("ready")
while True:
    time.sleep(0.05)
"""


def _wait_for(path: Path, limit: float = 60.0) -> None:
    end = time.monotonic() + limit
    while not path.exists():
        assert time.monotonic() < end, f"{path.name} never appeared"
        time.sleep(0.02)


def _gone(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def test_stop_children_signals_every_child_before_it_kills_any(tmp_path: Path) -> None:
    """Three children that ignore SIGTERM: each must get it while the other two still run
    (stopped one after the other, the second got SIGTERM only after the first had been
    killed and reaped), and SIGKILL then ends them and the grandchild of the first."""
    script = tmp_path / "stubborn.py"
    script.write_text(_STUBBORN)
    procs = [_process.spawn([sys.executable, str(script), str(tmp_path), str(i)])
             for i in range(3)]
    pids = [p.pid for p in procs]
    (tmp_path / "pids").write_text(" ".join(map(str, pids)))
    for i in range(3):
        _wait_for(tmp_path / f"ready{i}")
    _wait_for(tmp_path / "grandchild")
    grandchild = int((tmp_path / "grandchild").read_text())
    _process.stop_children(grace=1.0)
    for i in range(3):
        seen = sorted(int(p) for p in (tmp_path / f"term{i}").read_text().split())
        assert seen == sorted(pids), f"child {i} got SIGTERM after a sibling was killed"
    # Each ignored SIGTERM: SIGKILL ended it, and the whole group (the grandchild) with it.
    assert [p.returncode for p in procs] == [-signal.SIGKILL] * 3
    assert _gone(grandchild)
    assert not _process._CHILDREN.live


_SPAWN_UNDER_A_SIGNAL = """
import json, os, signal, subprocess, sys, time
from torchscope import _process

def poke():  # in the child, before exec: the parent is inside Popen when it arrives
    os.kill(os.getppid(), signal.SIGTERM)

answer = {"returned": False}
try:
    with _process.interruptible():
        proc = _process.spawn([sys.executable, "-c", "import time; time.sleep(120)"],
                              preexec_fn=poke, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
        answer["returned"] = True
        time.sleep(60)
except _process.Interrupted as exc:
    answer["signum"] = exc.signum
print(json.dumps(answer))
"""


def test_a_signal_while_a_child_starts_still_stops_that_child(tmp_path: Path) -> None:
    """SIGTERM reaches the parent while `spawn` is inside Popen (the child sends it before
    its exec): raised there, Interrupted left the child unregistered, and it ran on in a
    session of its own. It is now raised once the child is registered, which
    `interruptible` then stops."""
    mark = f"ts-spawn-{uuid.uuid4().hex}"
    env = {**os.environ, "PYTHONPATH": str(SRC), "TS_SPAWN_MARK": mark}
    res = subprocess.run([sys.executable, "-c", _SPAWN_UNDER_A_SIGNAL], env=env, check=False,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    answer = json.loads(res.stdout.strip().splitlines()[-1])
    assert answer == {"returned": False, "signum": int(signal.SIGTERM)}
    left = []
    for p in psutil.process_iter():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and \
                    p.environ().get("TS_SPAWN_MARK") == mark:
                left.append(p)
        except (psutil.Error, OSError):
            continue
    for p in left:  # do not leave it running if the test fails
        p.kill()
    assert left == []


# A child (`child_of`, with a folder to remove on a signal) whose body swallows the signal's
# `Interrupted` as library code may: `swallow` catches it and works on for a minute;
# `convert` turns it into another exception, as a class body in an import does.
_SWALLOWING = """
import shutil, subprocess, sys, time
from pathlib import Path
from torchscope import _process

how, folder, parent = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
(folder / "work").write_text("partial")
with _process.child_of(parent, cleanup=lambda: shutil.rmtree(folder)):
    grandchild = subprocess.Popen(["sleep", "120"])
    (folder / "grandchild").write_text(str(grandchild.pid))
    try:
        time.sleep(60)
    except KeyboardInterrupt:
        if how == "convert":
            raise RuntimeError("Error calling __set_name__") from None
        late = subprocess.Popen(["sleep", "120"])  # started after the signal
        (folder.parent / f"{how}-late").write_text(str(late.pid))
    time.sleep(60)
print("ran on", flush=True)
"""


def test_a_child_whose_body_swallows_the_signal_still_ends_and_cleans_up(
        tmp_path: Path) -> None:
    """Before, an `Interrupted` turned into another exception (an import's class body does
    this) or caught by library code let the compile child run on, or end without its
    clean-up: its job folder stayed behind."""
    for how in ("swallow", "convert"):
        folder = tmp_path / how
        folder.mkdir()
        child = _process.spawn([sys.executable, "-c", _SWALLOWING, how, str(folder),
                                str(os.getpid())],
                               env={**os.environ, "PYTHONPATH": str(SRC)},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            _wait_for(folder / "grandchild")
            grandchild = int((folder / "grandchild").read_text())
            started = time.monotonic()
            child.send_signal(signal.SIGTERM)
            out, err = child.communicate(timeout=30)
            took = time.monotonic() - started
            # Looked at before `stop` below, whose SIGKILL to the group would end them too.
            deadline = time.monotonic() + 10
            late = [int((tmp_path / f"{how}-late").read_text())] if how == "swallow" else []
            while not all(_gone(p) for p in (grandchild, *late)) and \
                    time.monotonic() < deadline:
                time.sleep(0.05)
            # swallow: the child's last stop reaches what it started after the signal
            assert all(_gone(p) for p in (grandchild, *late)), how
        finally:
            _process.stop(child)
        assert child.returncode == 128 + signal.SIGTERM, (how, child.returncode, err[-2000:])
        assert "ran on" not in out
        # swallowed: the child leaves on its own `_LEAVE_S` after the signal, not after 60 s
        assert took < _process._LEAVE_S + 10, (how, took)
        assert not folder.exists()
