"""What torchscope adds to a training script's start: imports in a fresh interpreter.

Each row is a fresh `python -c` that imports torch, then what the row names, and prints how
long the part after torch took (torch's own import is timed too, as the scale). Rows are
interleaved round by round; medians over the rounds. A watch for the user's loop should add
a small fraction of torch's import: the report's renderers (matplotlib, rich), the doctor
and torch._dynamo are loaded only when a report is written or a compile is measured.

Run: PYTHONPATH=src python benchmarks/import_cost.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys

# Row -> (imported before the clock starts, with torch; what the row times).
ROWS: dict[str, tuple[str, str]] = {
    "nothing more": ("", "pass"),
    "torchscope.monitor": ("", "import torchscope; torchscope.monitor"),
    "watch_gradients": ("", "import torchscope; torchscope.watch_gradients"),
    "watch_activations": ("", "import torchscope; torchscope.watch_activations"),
    "Lightning callback": ("import pytorch_lightning",
                           "import torchscope.integrations.lightning"),
    "run report (renderers)": ("", "from torchscope.monitoring import write_run_report"),
    "doctor": ("", "import torchscope; torchscope.run_doctor"),
}
HEAVY = ("matplotlib", "rich", "torch._dynamo", "torchscope.doctor")


def _probe(pre: str, code: str) -> tuple[float, float, list[str]]:
    """(torch's import in s, the row's import after it in s, the heavy modules that row
    loaded: pytorch_lightning loads matplotlib, rich and torch._dynamo itself)."""
    script = (
        "import time, sys\n"
        "t0 = time.perf_counter(); import torch; t1 = time.perf_counter()\n"
        f"{pre}\n"
        "before = set(sys.modules); t1b = time.perf_counter()\n"
        f"{code}\n"
        "t2 = time.perf_counter()\n"
        f"print(t1 - t0, t2 - t1b, *[m for m in {HEAVY!r}\n"
        "                           if m in sys.modules and m not in before])\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True).stdout.split()
    return float(out[0]), float(out[1]), out[2:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch_s: list[float] = []
    after: dict[str, list[float]] = {name: [] for name in ROWS}
    heavy: dict[str, list[str]] = {}
    for _ in range(args.repeats):
        for name, (pre, code) in ROWS.items():
            if pre and importlib.util.find_spec(pre.split()[-1]) is None:
                continue  # pytorch_lightning is not installed
            t_torch, t_row, loaded = _probe(pre, code)
            torch_s.append(t_torch)
            after[name].append(t_row)
            heavy[name] = loaded
    scale = statistics.median(torch_s)
    print(f"import torch: median {scale:.2f} s over {len(torch_s)} fresh interpreters; each "
          "row after it (the Lightning callback's after pytorch_lightning):")
    for name, times in after.items():
        if not times:
            continue
        med = statistics.median(times)
        print(f"  {name:24s} {med:6.2f} s  {med / scale:5.2f}x torch's import   "
              f"loads: {', '.join(heavy[name]) or '-'}")


if __name__ == "__main__":
    main()
