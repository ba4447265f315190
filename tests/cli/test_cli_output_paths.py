"""Output paths are checked before any work (defect 7): one line naming the option, the path
and why, exit code 2, and the model never loaded; a failure found late while writing (a full
disk) is one line too, never "unexpected ..."."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from torchscope.cli import app

runner = CliRunner()
LINUX_PROC = Path("/proc/self/mountinfo").is_file()

FACTORY = '''
from pathlib import Path

import torch
from torch import nn


def build():
    Path(__file__).with_name("loaded").write_text("the model was loaded")
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), torch.randn(4, 4)
'''


@pytest.fixture
def target(tmp_path: Path) -> str:
    factory = tmp_path / "factory.py"
    factory.write_text(FACTORY)
    return f"{factory}:build"


def _one_line(argv: list[str], code: int = 2) -> str:
    result = runner.invoke(app, argv)
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert result.exit_code == code, result.output
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    assert "unexpected" not in lines[0] and "Traceback" not in result.output
    return " ".join(lines[0].split())


@pytest.mark.skipif(not LINUX_PROC, reason="needs Linux's /proc")
@pytest.mark.parametrize(("argv", "option", "path"), [
    (["capture", "{t}", "--json", "/proc/x/acts.json"], "--json", "/proc/x/acts.json"),
    (["grads", "{t}", "--json", "/proc/grads.json"], "--json", "/proc/grads.json"),
    (["grads", "{t}", "--plot", "/proc/x/flow.png"], "--plot", "/proc/x/flow.png"),
    (["memory", "{t}", "--json", "/proc/x/m.json"], "--json", "/proc/x/m.json"),
    (["memory", "{t}", "--plot", "/proc/mem.svg"], "--plot", "/proc/mem.svg"),
    (["profile", "{t}", "--trace", "/proc/x/trace.json.gz"], "--trace",
     "/proc/x/trace.json.gz"),
    (["profile", "{t}", "--text", "/proc/x/t.txt"], "--text", "/proc/x/t.txt"),
    (["profile", "{t}", "--json", "/sys/x/p.json"], "--json", "/sys/x/p.json"),
    (["compile", "{t}", "--json", "/proc/x/c.json"], "--json", "/proc/x/c.json"),
    (["doctor", "{t}", "--out", "/proc/x"], "--out", "/proc/x"),
    (["diff", "a.json", "b.json", "--json", "/proc/x/d.json"], "--json", "/proc/x/d.json"),
    (["lab", "--json", "/proc/x/lab.json"], "--json", "/proc/x/lab.json"),
    (["lint", "--no-config", "--output-file", "/proc/x/lint.txt", "{d}"], "--output-file",
     "/proc/x/lint.txt"),
])
def test_a_path_on_a_pseudo_file_system_fails_first(target: str, tmp_path: Path,
                                                    argv: list[str], option: str,
                                                    path: str) -> None:
    line = _one_line([a.format(t=target, d=tmp_path) for a in argv])
    assert f"{option} {path}" in line
    assert "file system, where no file can be created" in line and "Fix: pass" in line
    if path.count("/") > 2:  # a folder to create
        assert "needs the folder" in line
    assert not (tmp_path / "loaded").exists()  # nothing was loaded, let alone run


def test_a_path_under_a_file_fails_first(target: str, tmp_path: Path) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("keep")
    line = _one_line(["doctor", target, "--out", str(blocker / "report")])
    assert f"lies under {blocker}, which is a file" in line
    assert not (tmp_path / "loaded").exists() and blocker.read_text() == "keep"


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0,
                    reason="root may write anywhere; needs an ordinary user")
def test_a_folder_without_write_permission_fails_first(target: str, tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        line = _one_line(["capture", target, "--json", str(locked / "sub" / "a.json")])
    finally:
        locked.chmod(0o755)
    assert f"needs the folder {locked / 'sub'}" in line and "is not writable" in line
    assert not (tmp_path / "loaded").exists()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize(("argv", "option"), [
    (["capture", "{t}", "--json", "/dev/full"], "--json"),
    (["profile", "{t}", "--steps", "1", "--wait", "0", "--text",
      "/dev/full"], "--text"),
    (["lint", "--no-config", "--output-file", "/dev/full", "{d}"], "--output-file"),
    (["lint", "--no-config", "--output", "/dev/full", "{d}"], "--output"),  # the old spelling
])
def test_a_full_disk_found_late_is_one_line(target: str, tmp_path: Path, argv: list[str],
                                            option: str) -> None:
    # /dev/full accepts the open and fails every write with ENOSPC: the disk filling up
    # after the checks passed and the work was done.
    result = runner.invoke(app, [a.format(t=target, d=tmp_path) for a in argv])
    assert result.exit_code == 2, result.output
    errors = [ln for ln in result.output.splitlines() if ln.startswith("error:")]
    assert errors == [f"error: could not write {option} /dev/full: No space left on device. "
                      f"Fix: free space or fix permissions there, or pass {option} another "
                      "path."], result.output
    assert "unexpected" not in result.output


def test_good_paths_still_pass_and_write(target: str, tmp_path: Path) -> None:
    out = tmp_path / "new" / "deeper" / "acts.json"
    result = runner.invoke(app, ["capture", target, "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert out.is_file() and f"wrote {out}" in result.output
