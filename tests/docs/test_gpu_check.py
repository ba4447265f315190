"""benchmarks/gpu_check.py on a machine without CUDA: one line that says so, exit 0 (the
check itself runs where a GPU is: see its docstring)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "gpu_check.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_without_cuda_it_says_so_in_one_line_and_exits_0() -> None:
    src = str(SCRIPT.parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (src, os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          env=env, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0], done.stdout
    assert done.stderr == ""
