"""Benchmark: checkpointing plans on a 32-block model against Chen et al. (2016).

Chen et al., "Training Deep Nets with Sublinear Memory Cost": checkpointing √L segments of
an L-layer chain keeps O(√L) activations for at most one extra forward pass. This script
plans checkpointing for a 32-block MLP-residual-style chain (each block
Linear(w, 4w) → GELU → Linear(4w, w) → LayerNorm), applies each plan (verified: gradients
bitwise identical), and prints side by side, in one run:

- saved activations kept for backward, and the reduction vs no checkpointing;
- the predicted activation peak during backward (saved + one segment recomputed);
- measured recompute overhead: extra step time, as a fraction of one forward pass.

Run: PYTHONPATH=src python benchmarks/memory_plan.py [--blocks 32] [--width 256] [--batch 64]
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from torch import nn

import torchscope.memory as ckpt
from torchscope._util import fmt_bytes
from torchscope.memory import (
    Blocks,
    CheckpointPlan,
    apply_plan,
    plan_checkpointing,
    saved_activations,
)
from torchscope.step import Step


def build(blocks: int, width: int) -> nn.Sequential:
    return nn.Sequential(*[
        nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width),
                      nn.LayerNorm(width))
        for _ in range(blocks)
    ])


def step_ms(model: nn.Module, x: torch.Tensor) -> float:
    for p in model.parameters():
        p.grad = None
    t0 = time.perf_counter()
    model(x).sum().backward()
    return (time.perf_counter() - t0) * 1e3


def forward_ms(model: nn.Module, x: torch.Tensor) -> float:
    t0 = time.perf_counter()
    with torch.enable_grad():
        model(x)
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build(args.blocks, args.width).train()
    x = torch.randn(args.batch, args.width)
    # The step timed below: the sum of the output, which saves nothing for backward itself.
    step = Step(model, x, loss_fn="sum")
    base = saved_activations(step).total_bytes
    plans: dict[str, CheckpointPlan] = {}
    first = plan_checkpointing(step, measure=False, repeats=3)
    for name in ("none", "all", "sqrt"):
        plans[name] = first.plan(name)
    for pct in (50, 25):
        report = plan_checkpointing(step, budget=base * pct // 100, measure=False, repeats=3)
        plans[f"budget {pct}%"] = report.plan("budget")
    # Verify each plan once (apply_plan always does), and count what it really keeps.
    grads: dict[str, str] = {"none": "—"}
    saved: dict[str, int] = {"none": base}
    for name, plan in plans.items():
        if plan.segments:
            with apply_plan(step, plan) as h:
                v = h.verification
                assert v is not None
                grads[name] = "bitwise" if v.bitwise_equal else f"diff {v.max_abs_diff:.1g}"
                saved[name] = saved_activations(step).total_bytes
    # Time round-robin, so that load on a shared machine hits every plan alike; keep the best.
    best = dict.fromkeys(plans, float("inf"))
    fwd = float("inf")
    for _ in range(args.repeats):
        fwd = min(fwd, forward_ms(model, x))
        for name, plan in plans.items():
            handle = (ckpt.apply(model, Blocks(plan.blocks, plan.parent), segments=plan.segments)
                      if plan.segments else None)
            try:
                best[name] = min(best[name], step_ms(model, x))
            finally:
                if handle is not None:
                    handle.remove()
    n_blocks = args.blocks
    k = math.ceil(math.sqrt(n_blocks))
    print(f"model: {n_blocks} blocks of Linear({args.width},{4 * args.width})→GELU→"
          f"Linear→LayerNorm, batch {args.batch}, {args.threads} thread(s), torch "
          f"{torch.__version__}, best of {args.repeats}")
    print(f"one forward pass: {fwd:.2f} ms; without checkpointing autograd keeps "
          f"{fmt_bytes(base)} ({base:,} B)")
    print(f"Chen et al.: √L plan = {math.ceil(n_blocks / k)} segments of ≤{k} blocks; memory "
          f"O(√L), recompute ≤ 1 forward\n")
    head = (f"{'plan':<12}{'segments':>9}{'saved':>12}{'vs none':>9}{'peak act.':>12}"
            f"{'step ms':>9}{'recompute':>11}{'/ forward':>10}{'grads':>9}")
    print(head)
    print("-" * len(head))
    for name, plan in plans.items():
        extra = best[name] - best["none"]
        print(f"{name:<12}{len(plan.segments):>9}{fmt_bytes(saved[name]):>12}"
              f"{saved[name] / base:>9.1%}{fmt_bytes(plan.peak_activation_bytes):>12}"
              f"{best[name]:>9.2f}{extra:>9.2f}ms{extra / fwd:>10.2f}{grads[name]:>9}")


if __name__ == "__main__":
    main()
