"""Run a case of `_cases.py` on N real processes (gloo, CPU), the way torchrun would.

Each rank is its own `python _worker.py` process; the ranks meet through a `FileStore` in a
temporary folder (no port to race for). Every rank writes its case's JSON answer; a rank
that does not finish within the timeout is killed, with every other one, so a hung
collective fails the test instead of hanging the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"


def run_ranks(case: str, tmp: Path, *, nproc: int = 2, timeout: float = 90.0,
              **params: Any) -> list[dict[str, Any]]:
    """Run `_cases.<case>(rank, world, out, **params)` on `nproc` ranks; every rank's JSON.

    A rank that raised answers `{"raised": "Type: message"}`.
    """
    tmp.mkdir(parents=True, exist_ok=True)
    store = tmp / "store"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(SRC), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(
        [sys.executable, str(HERE / "_worker.py"), case, str(r), str(nproc), str(store),
         str(tmp), json.dumps(params)], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True) for r in range(nproc)]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    answers = []
    for r, text in enumerate(outputs):
        path = tmp / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote no answer:\n{text[-3000:]}"
        answers.append(json.loads(path.read_text()))
    return answers
