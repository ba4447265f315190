"""A training run watched by `torchscope.monitor`: a built-in model on a synthetic task.

    python -m torchscope.examples.train_monitor               # deep-mlp, 200 steps
    python -m torchscope.examples.train_monitor --model tiny-cnn --every 5
    python -m torchscope.examples.train_monitor --lr 2        # too high: see it diverge

The task needs no data: a frozen teacher (the same architecture, drawn with another seed)
labels seeded random inputs, and the student learns to reproduce its outputs (mean squared
error). The run report goes to `--out` (report.html, report.json); the findings are printed.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from rich.console import Console
from torch import nn

from torchscope.errors import TorchscopeError
from torchscope.models import BUILTINS
from torchscope.monitoring import Monitor, monitor
from torchscope.report.findings import finding_lines

__all__ = ["main", "train"]


def train(model_name: str = "deep-mlp", *, steps: int = 200, every: int = 10,
          lr: float = 0.05, accumulate: int = 1, out: str | None = "torchscope-run",
          profile: int = 5, seed: int = 0) -> Monitor:
    """Train a built-in model for `steps` optimizer steps under `torchscope.monitor`.

    Returns:
        The finished `Monitor` (`.result`, `.paths`).

    Raises:
        TorchscopeError: an unknown model or a bad option.
    """
    if model_name not in BUILTINS:
        raise TorchscopeError(f"--model {model_name!r} is not a built-in model.",
                              fix=f"use one of {', '.join(BUILTINS)}.")
    spec = BUILTINS[model_name]
    torch.manual_seed(seed)
    student = spec.build().train()
    torch.manual_seed(seed + 1)
    teacher = spec.build().eval().requires_grad_(False)
    data = torch.Generator().manual_seed(seed + 2)  # a data loader's own stream
    opt = torch.optim.SGD(student.parameters(), lr=lr, momentum=0.9)
    with monitor(student, opt, every=every, out=out, profile=profile,
                 name=f"{model_name} on a synthetic teacher task") as mon:
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            for _ in range(accumulate):
                x = torch.randn(spec.input_shape, generator=data)
                with torch.no_grad():
                    target = teacher(x)
                loss = nn.functional.mse_loss(student(x), target) / accumulate
                loss.backward()
            opt.step()
    return mon


def main(argv: list[str] | None = None) -> int:
    """Run the example; exit code 2 on bad options."""
    ap = argparse.ArgumentParser(prog="python -m torchscope.examples.train_monitor",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="deep-mlp", choices=sorted(BUILTINS))
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps")
    ap.add_argument("--every", type=int, default=10, help="sample one step in EVERY")
    ap.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (momentum 0.9)")
    ap.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    ap.add_argument("--profile", type=int, default=5, help="profiled steps (0: none)")
    ap.add_argument("--out", default="torchscope-run", help="folder of the run report")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    console = Console()
    t0 = time.perf_counter()
    try:
        if args.steps < 1 or args.accumulate < 1:
            raise TorchscopeError(f"--steps {args.steps} / --accumulate {args.accumulate} "
                                  "train nothing.", fix="pass 1 or more.")
        mon = train(args.model, steps=args.steps, every=args.every, lr=args.lr,
                    accumulate=args.accumulate, out=args.out, profile=args.profile,
                    seed=args.seed)
    except TorchscopeError as exc:
        console.print(f"[red]error:[/] {exc.one_line()}", highlight=False, soft_wrap=True)
        return 2
    record = mon.result
    assert record is not None
    console.print(f"{record.steps} steps, {record.samples} samples, median step "
                  f"{record.median_step_ms or 0:.2f} ms, {time.perf_counter() - t0:.1f} s")
    for line in finding_lines(record.findings()):
        console.print(line)
    if mon.paths is not None:
        console.print(f"run report: {mon.paths[0]} and {mon.paths[1].name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
