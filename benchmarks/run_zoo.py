"""Precision and recall of the run-level findings over the labelled run zoo.

Trains every run of `tests/runzoo/cases.py` (13 healthy runs of real architectures in the
plain loop, Lightning and the HF Trainer; faulted runs each with the code, module and step
an expert expects) under `torchscope.monitor`, and prints, per run, what was expected,
what was found and the false alarms, then precision and recall at warning and above.

    python benchmarks/run_zoo.py [NAME ...]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.runzoo.cases import ZOO, Diagnosis, diagnose, precision_recall


def main(names: list[str]) -> None:
    done: list[Diagnosis] = []
    print(f"{'run':32} {'s':>5}  expected found  false alarms")
    for run in ZOO:
        if names and run.name not in names:
            continue
        t0 = time.perf_counter()
        d = diagnose(run)
        seconds = time.perf_counter() - t0
        done.append(d)
        found = sum(d.found(e) for e in run.expected)
        fps = ", ".join(f"{f.code}@{f.module}" for f in d.false_positives()) or "-"
        print(f"{run.name:32} {seconds:5.1f}  {len(run.expected):8} {found:5}  {fps}")
    precision, recall, tp, fp, expected, found = precision_recall(done)
    healthy = sum(d.run.healthy for d in done)
    print(f"\n{healthy} healthy and {len(done) - healthy} faulted runs: precision "
          f"{precision:.2f} ({tp} true, {fp} false positives at warning and above), "
          f"recall {recall:.2f} ({found} of {expected} expected findings at their code, "
          "module and step)")


if __name__ == "__main__":
    main(sys.argv[1:])
