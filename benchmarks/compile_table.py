"""Is torch.compile worth it? The compile table for tiny-cnn and resnet-mini, inference and
training, measured side by side in one run (each mode in its own child process).

    PYTHONPATH=src python benchmarks/compile_table.py [--modes default,max-autotune]
        [--models tiny-cnn,resnet-mini] [--iters 20] [--threads 1] [--json out.json]

Prints one table per (model, inference|training) and a summary line per mode: speedup
(eager ms / compiled ms), cold and warm compile seconds, and calls to break even.
"""

from __future__ import annotations

import argparse
import time

import torch
from rich.console import Console

from torchscope._util import write_json
from torchscope.compile import compile_report
from torchscope.models import BUILTINS
from torchscope.report.compile import compile_table
from torchscope.report.findings import findings_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="default,reduce-overhead,max-autotune")
    parser.add_argument("--models", default="tiny-cnn,resnet-mini")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    console = Console(width=170)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    reports = []
    summary = []
    t_all = time.perf_counter()
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        builtin = BUILTINS[name]
        for measure in ("forward", "step"):
            torch.manual_seed(0)
            report = compile_report(
                builtin.build(), builtin.example_input(), measure=measure, modes=modes,
                iters=args.iters, warmup=3, timeout_s=args.timeout, name=name,
                progress=lambda line, _limit_s: console.print(f"[dim]{line}[/]"))
            reports.append(report)
            if report.step is not None:
                console.print(report.step.describe(), highlight=False, markup=False)
            console.print(compile_table(report))
            console.print(findings_table(report.findings()))
            for m in report.modes:
                kind = "training" if measure == "step" else "inference"
                if not m.ok:
                    summary.append(f"{name:12s} {kind:9s} {m.mode:16s} {m.status}: {m.error}")
                    continue
                be = "never" if m.break_even_calls is None else f"{m.break_even_calls:,}"
                summary.append(
                    f"{name:12s} {kind:9s} {m.mode:16s} speedup {m.speedup:5.2f}x  "
                    f"eager {m.eager_ms:8.2f} ms  compiled {m.compiled_ms:8.2f} ms  "
                    f"cold {m.cold_compile_s:6.1f} s  warm {m.warm_compile_s:5.2f} s  "
                    f"break-even {be} calls  recompiles {len(m.recompiles)}  "
                    f"max diff {m.max_abs_diff:.1e}"
                    + (f" (grads {m.grad_max_abs_diff:.1e})"
                       if m.grad_max_abs_diff is not None else ""))
    console.print(f"\ntorch {torch.__version__}, {args.threads} threads, "
                  f"{args.iters} timed calls each; total {time.perf_counter() - t_all:.0f} s")
    for line in summary:
        console.print(line, highlight=False, markup=False)
    if args.json:
        write_json(args.json, {"reports": reports})


if __name__ == "__main__":
    main()
