"""Overhead of gradient-flow tracking on resnet-mini training steps.

Runs, side by side in one process and interleaved round by round:
  bare      forward + cross-entropy + backward + SGD step
  gradflow  the same under torchscope.watch_gradients(every=1): per-call grad_output and
            grad_input norms of every leaf module plus every parameter's gradient norm
  per-param the per-parameter logger baseline: `p.grad.norm().item()` for each parameter
            after backward
  no-inputs gradflow without grad_input (grad_output and parameter norms only)
  every-10  gradflow sampling one step in ten, as in a long training run

Prints the median step time of each and the ratios to the bare step (goal: gradflow <= 1.03x).

    python benchmarks/gradflow_overhead.py [--steps 6] [--batch 16] [--size 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from contextlib import ExitStack

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
    # Two identical models: one never hooked (bare, per-param), one watched for the whole
    # run, as in a real loop where the watch is opened once.
    bare_model = ResNetMini().to(device).train()
    twins = {k: copy.deepcopy(bare_model) for k in ("gradflow", "no-inputs", "every-10")}
    bare_opt = torch.optim.SGD(bare_model.parameters(), lr=1e-3)
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in twins.items()}
    x = torch.randn(args.batch, 3, args.size, args.size, device=device)
    y = torch.randint(0, 10, (args.batch,), device=device)
    sink: list[float] = []

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def step(model: nn.Module, opt: torch.optim.Optimizer, log_params: bool) -> None:
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        if log_params:
            sink.extend(p.grad.norm().item() for p in model.parameters()  # type: ignore[union-attr]
                        if p.grad is not None)
        opt.step()

    def timed(model: nn.Module, opt: torch.optim.Optimizer, log_params: bool
              ) -> tuple[float, float]:
        """Wall and process-CPU seconds of one step (CPU time is less hit by other load)."""
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        step(model, opt, log_params)
        sync()
        return time.perf_counter() - t0, time.process_time() - c0

    modes = {
        "bare": (bare_model, bare_opt, False),
        "gradflow": (twins["gradflow"], opts["gradflow"], False),
        "per-param": (bare_model, bare_opt, True),
        "no-inputs": (twins["no-inputs"], opts["no-inputs"], False),
        "every-10": (twins["every-10"], opts["every-10"], False),
    }
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in modes}
    with ExitStack() as stack:
        full = stack.enter_context(watch_gradients(twins["gradflow"], every=1,
                                                   optimizer=opts["gradflow"]))
        stack.enter_context(watch_gradients(twins["no-inputs"], every=1,
                                            optimizer=opts["no-inputs"], inputs_grad=False))
        stack.enter_context(watch_gradients(twins["every-10"], every=10,
                                            optimizer=opts["every-10"]))
        for model, opt, log in modes.values():  # warm up every path once
            timed(model, opt, log)
        # Interleave the modes so that load on the machine hits all of them alike.
        for _ in range(args.steps):
            for name, (model, opt, log) in modes.items():
                times[name].append(timed(model, opt, log))
    assert full.samples == args.steps + 1, "every step must have been sampled"

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
