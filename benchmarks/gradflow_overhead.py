"""Overhead of gradient-flow tracking on resnet-mini training steps.

Runs, side by side in one process and interleaved round by round:
  bare      forward + cross-entropy + backward + SGD step
  gradflow  the same under torchscope.watch_gradients(every=1): per-call grad_output and
            grad_input norms of every leaf module plus every parameter's gradient norm
  per-param the per-parameter logger baseline: `p.grad.norm().item()` for each parameter
            after backward

Prints the median step time of each and the ratios to the bare step (goal: gradflow <= 1.03x).

    python benchmarks/gradflow_overhead.py [--steps 6] [--batch 16] [--size 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn

from torchscope.grads import watch_gradients
from torchscope.models import ResNetMini


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="timed steps per mode")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    model = ResNetMini().to(device).train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(args.batch, 3, args.size, args.size, device=device)
    y = torch.randint(0, 10, (args.batch,), device=device)
    params = [p for p in model.parameters() if p.requires_grad]
    sink: list[float] = []

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def step(log_params: bool) -> None:
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        if log_params:
            sink.extend(p.grad.norm().item() for p in params)  # type: ignore[union-attr]
        opt.step()

    def timed(ctx: Callable[[], AbstractContextManager[object]], log_params: bool
              ) -> tuple[float, float]:
        """Wall and process-CPU seconds of one step (CPU time is less hit by other load)."""
        with ctx():
            sync()
            t0, c0 = time.perf_counter(), time.process_time()
            step(log_params)
            sync()
            return time.perf_counter() - t0, time.process_time() - c0

    modes: dict[str, tuple[Callable[[], AbstractContextManager[object]], bool]] = {
        "bare": (nullcontext, False),
        "gradflow": (lambda: watch_gradients(model, every=1, optimizer=opt), False),
        "per-param": (nullcontext, True),
    }
    for ctx, log in modes.values():  # warm up every path once
        timed(ctx, log)
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in modes}
    # Interleave the modes so that load on the machine hits all of them alike. The watch is
    # opened per step, so its setup (hook registration) is included in its cost.
    for _ in range(args.steps):
        for name, (ctx, log) in modes.items():
            times[name].append(timed(ctx, log))

    print(f"resnet-mini, batch {args.batch}x3x{args.size}x{args.size}, {args.device}, "
          f"{args.threads} threads, {args.steps} interleaved steps per mode")
    print(f"  {'mode':10s} {'median wall':>12s} {'ratio':>7s} {'min wall':>10s} {'ratio':>7s} "
          f"{'median cpu':>11s} {'ratio':>7s}")
    base = times["bare"]
    b_med = statistics.median(w for w, _ in base)
    b_min = min(w for w, _ in base)
    b_cpu = statistics.median(c for _, c in base)
    for name, v in times.items():
        med = statistics.median(w for w, _ in v)
        low = min(w for w, _ in v)
        cpu = statistics.median(c for _, c in v)
        print(f"  {name:10s} {med * 1e3:9.1f} ms {med / b_med:6.3f}x {low * 1e3:7.1f} ms "
              f"{low / b_min:6.3f}x {cpu * 1e3:8.1f} ms {cpu / b_cpu:6.3f}x")


if __name__ == "__main__":
    main()
