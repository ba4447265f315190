"""The progress display of long commands: drawn on a terminal (a pseudo-terminal here) with
the part that runs, step k of N and the time; nothing of it into a pipe, or with --quiet.
Each command runs as a real `python -m torchscope` process."""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
from pathlib import Path

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _env() -> dict[str, str]:
    return {**os.environ, "TERM": "xterm-256color", "COLUMNS": "200", "LINES": "50"}


def _on_terminal(args: list[str], cwd: Path) -> tuple[int, str, str]:
    """Run the command with its standard output on a pseudo-terminal: (exit code, what the
    terminal got without its escape sequences, standard error)."""
    main, sub = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "torchscope", *args], stdout=sub,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=_env(),
                            cwd=cwd)
    os.close(sub)
    chunks = []
    while True:
        try:
            data = os.read(main, 65536)
        except OSError:  # EIO: the command closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(main)
    assert proc.stderr is not None
    err = proc.stderr.read().decode()
    code = proc.wait(timeout=600)
    return code, ANSI.sub("", b"".join(chunks).decode(errors="replace")), err


def _in_a_pipe(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "torchscope", *args], capture_output=True,
                          text=True, env=_env(), cwd=cwd, timeout=600, check=False)


def test_grads_shows_its_steps_on_a_terminal(tmp_path: Path) -> None:
    code, shown, err = _on_terminal(["grads", "tiny-cnn", "--steps", "40"], tmp_path)
    assert code == 0, err
    assert "grads: step (1/40)" in shown
    assert "in all" in shown  # the time spent
    assert "Gradient flow of tiny-cnn" in shown  # the results follow


def test_no_progress_into_a_pipe_or_with_quiet(tmp_path: Path) -> None:
    piped = _in_a_pipe(["grads", "tiny-cnn", "--steps", "40"], tmp_path)
    assert piped.returncode == 0, piped.stderr
    assert "grads: step" not in piped.stdout and "in all" not in piped.stdout
    assert not ANSI.search(piped.stdout) and piped.stderr == ""
    code, shown, err = _on_terminal(["grads", "tiny-cnn", "--steps", "40", "--quiet"],
                                    tmp_path)
    assert code == 0, err
    assert "grads: step" not in shown and "Gradient flow of tiny-cnn" in shown
    assert err == ""


def test_profile_shows_the_steps_under_the_profiler(tmp_path: Path) -> None:
    code, shown, err = _on_terminal(["profile", "tiny-cnn", "--steps", "2"], tmp_path)
    assert code == 0, err
    assert "profile: warm-up step" in shown
    # The profiler's schedule: 1 wait + 1 warm-up + 2 active steps.
    assert "profile: step under the profiler (1/4)" in shown


def test_doctor_shows_its_sections_and_quiet_drops_the_section_lines(tmp_path: Path) -> None:
    args = ["doctor", "mlp", "--fast", "--skip", "activations,memory,profile", "--out",
            str(tmp_path / "report")]
    code, shown, err = _on_terminal(args, tmp_path)
    assert code == 0, err
    assert "doctor: Gradient flow (gradients) (2/6)" in shown
    assert "[2/6] Gradient flow: ok" in shown  # the line each finished section leaves
    code, shown, err = _on_terminal([*args, "--quiet"], tmp_path)
    assert code == 0, err
    assert "doctor:" not in shown and "[2/6]" not in shown
    assert "report.json" in shown  # the results still print


def test_compile_shows_the_mode_and_its_time_limit(tmp_path: Path) -> None:
    # A limit the mode cannot meet: the display shows it running out, and the run is short.
    code, shown, err = _on_terminal(["compile", "tiny-cnn", "--modes", "default", "--iters",
                                     "1", "--warmup", "0", "--timeout", "4"], tmp_path)
    assert code == 0, err
    assert "compile: mode default (1/1) - measuring in a child process" in shown
    assert re.search(r"this part [1-4] s of a 4 s limit", shown), shown[-2000:]
    assert "timeout" in shown  # the table says how the mode ended
