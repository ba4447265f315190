"""Overhead of `torchscope.monitor` on a training loop: resnet-mini, sampled every 10 steps.

Times blocks of steps (a block holds sampled and unsampled steps, so the cost of sampling is
in it), round by round, interleaved so that load on the machine hits every mode alike:
  bare        forward + cross-entropy + backward + SGD step
  monitor     the same under torchscope.monitor(every=10): gradient norms, activation
              statistics and saved-activation bytes on sampled steps; hooks, step time and a
              NaN/Inf check on every step (no report written)
  grads-only  monitor(every=10, activations=False, memory=False)
  watch-grads watch_gradients(every=10) alone, for reference

Prints the median block time of each and the ratio to bare (goal: monitor <= 1.03x).

    python benchmarks/monitor_overhead.py [--rounds 5] [--block 20] [--batch 16] [--size 64]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from contextlib import AbstractContextManager, ExitStack, nullcontext

import torch
from torch import nn

import torchscope
from torchscope.models import ResNetMini


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="timed blocks per mode")
    ap.add_argument("--block", type=int, default=20, help="steps per block (a multiple of 10)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    base = ResNetMini().to(device).train()
    models = {k: copy.deepcopy(base) for k in ("bare", "monitor", "grads-only", "watch-grads")}
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    x = torch.randn(args.batch, 3, args.size, args.size, device=device)
    y = torch.randint(0, 10, (args.batch,), device=device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def block(name: str) -> float:
        model, opt = models[name], opts[name]
        sync()
        t0 = time.perf_counter()
        for _ in range(args.block):
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        sync()
        return time.perf_counter() - t0

    watches: dict[str, AbstractContextManager[object]] = {
        "bare": nullcontext(),
        "monitor": torchscope.monitor(models["monitor"], opts["monitor"], every=10, out=None),
        "grads-only": torchscope.monitor(models["grads-only"], opts["grads-only"], every=10,
                                         out=None, activations=False, memory=False),
        "watch-grads": torchscope.watch_gradients(models["watch-grads"], every=10,
                                                  optimizer=opts["watch-grads"]),
    }
    times: dict[str, list[float]] = {k: [] for k in models}
    with ExitStack() as stack:
        for w in watches.values():
            stack.enter_context(w)
        for name in models:  # warm up every path (and sample once)
            block(name)
        for _ in range(args.rounds):
            for name in models:
                times[name].append(block(name))
    print(f"resnet-mini, batch {args.batch}x3x{args.size}x{args.size}, {args.device}, "
          f"{args.threads} threads, {args.rounds} interleaved blocks of {args.block} steps, "
          "sampled every 10 steps")
    b = statistics.median(times["bare"])
    for name, v in times.items():
        med = statistics.median(v)
        print(f"  {name:12s} {med / args.block * 1e3:9.2f} ms/step   {med / b:6.3f}x   "
              f"(min {min(v) / min(times['bare']):.3f}x)")


if __name__ == "__main__":
    main()
