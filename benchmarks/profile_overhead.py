"""Step time with no profiler, with plain torch.profiler, and with torchscope's per-module ranges.

Run: `PYTHONPATH=src python benchmarks/profile_overhead.py [--steps 20] [--rounds 3]`.

All three modes run the same labelled training step (`Step.run()`: forward, backward, SGD)
side by side,
interleaved over several rounds; each figure is the median step time over all rounds. The
goal is per-module attribution <= 1.10x plain torch.profiler. The last column is the one-off
cost of torchscope's module attribution over the recorded events, per profiled step
(torch's own parsing of the events, which `key_averages()` pays as well, is not included).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("KINETO_LOG_LEVEL", "6")

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from torchscope.models import MLP, DeepMLP, ResNetMini, TinyCNN
from torchscope.profiling.attribution import attribute
from torchscope.profiling.module_ranges import ModuleRanges
from torchscope.step import Step


def _cases() -> list[tuple[str, nn.Module, torch.Tensor]]:
    torch.manual_seed(0)
    return [
        ("tiny-cnn 32x3x32x32", TinyCNN(), torch.randn(32, 3, 32, 32)),
        ("mlp 64x128", MLP(), torch.randn(64, 128)),
        ("deep-mlp 32x64", DeepMLP(), torch.randn(32, 64)),
        ("resnet-mini 8x3x32x32", ResNetMini(channels=32, blocks=4), torch.randn(8, 3, 32, 32)),
    ]


def _time(step: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.steps} steps × "
          f"{args.rounds} rounds, median step ms")
    header = (f"{'model':24} {'no profiler':>12} {'torch.profiler':>15} {'torchscope':>11} "
              f"{'prof/none':>10} {'ts/prof':>8} {'attrib ms/step':>15}")
    print(header)
    print("-" * len(header))
    for name, model, x in _cases():
        logits_classes = 10
        y = torch.randint(0, logits_classes, (x.shape[0],))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        step = Step(model, x, loss_fn="cross_entropy", target=y, optimizer=opt).run
        _time(step, 3)  # warm caches and allocator
        times: dict[str, list[float]] = {"none": [], "plain": [], "ts": []}
        analysis: list[float] = []
        for _ in range(args.rounds):
            times["none"] += _time(step, args.steps)
            with profile(activities=acts):
                _time(step, 2)
                times["plain"] += _time(step, args.steps)
            with ModuleRanges(model) as ranges, profile(activities=acts) as prof:
                _time(step, 2)
                times["ts"] += _time(step, args.steps)
            events = prof.events()  # torch's own parsing, paid by any profiler summary
            t0 = time.perf_counter()
            attribute(events, ranges.labels)
            analysis.append((time.perf_counter() - t0) * 1e3 / (args.steps + 2))
        none, plain, ts = (statistics.median(times[k]) for k in ("none", "plain", "ts"))
        print(f"{name:24} {none:12.3f} {plain:15.3f} {ts:11.3f} {plain / none:9.2f}x "
              f"{ts / plain:7.2f}x {statistics.median(analysis):14.3f}")


if __name__ == "__main__":
    main()
