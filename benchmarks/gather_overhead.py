"""What torchscope's communication costs per sampled step on 2 ranks (gloo, CPU).

Spawns 2 ranks that meet through a FileStore. On each, side by side and interleaved step by
step, a bare training step of a DDP (or FSDP2) model against the same step of a twin model
under `watch_gradients(every=1)`, whose every sampled step reads the synchronised gradients
and exchanges every rank's norms in one all_gather. Then it times `flow.gather()` alone: the
one gather that joins every rank's `GradFlow` on rank 0 (at the end of a watch block).

Rank 0 prints the median step of each, the overhead per sampled step (ms and ratio), and the
gather's median. Timings are noisy on a shared machine; the README's figures come from a
quiet one.

    python benchmarks/gather_overhead.py [--steps 20] [--strategy ddp|fsdp2] [--model tiny-cnn]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from torchscope.grads import gradient_flow, watch_gradients
from torchscope.models import load_target


def _wrap(model: nn.Module, strategy: str) -> nn.Module:
    if strategy == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for child in model.children():
        if next(child.parameters(), None) is not None:
            fully_shard(child)
    fully_shard(model)
    return model


def _rank(rank: int, world: int, store: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    try:
        loaded = load_target(args.model)
        assert loaded.inputs is not None
        x = loaded.inputs.args[0][rank::world]
        g = torch.Generator().manual_seed(rank)
        out = loaded.model(loaded.inputs.args[0][:1])
        y = torch.randint(0, out.shape[-1], (x.shape[0],), generator=g)
        bare = _wrap(copy.deepcopy(loaded.model), args.strategy)
        watched = _wrap(copy.deepcopy(loaded.model), args.strategy)
        opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3)
                for k, m in (("bare", bare), ("watched", watched))}

        def step(model: nn.Module, opt: torch.optim.Optimizer) -> float:
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            return time.perf_counter() - t0

        times: dict[str, list[float]] = {"bare": [], "watched": []}
        with watch_gradients(watched, every=1, optimizer=opts["watched"]) as watch:
            for i in range(args.steps + 2):  # two warm-up steps each
                for name, model in (("bare", bare), ("watched", watched)):
                    dt = step(model, opts[name])
                    if i >= 2:
                        times[name].append(dt)
        assert watch.samples == args.steps + 2
        flow = gradient_flow(watched, x, loss_fn="cross_entropy", target=y)
        gathers = []
        for _ in range(args.steps):
            dist.barrier()
            t0 = time.perf_counter()
            flow.gather()
            gathers.append(time.perf_counter() - t0)
        if rank == 0:
            b, w = statistics.median(times["bare"]), statistics.median(times["watched"])
            print(f"{args.model}, {args.strategy} on {world} ranks (gloo, 1 thread each), "
                  f"{x.shape[0]} rows per rank, {args.steps} interleaved steps")
            print(f"  bare step                    {b * 1e3:8.2f} ms")
            print(f"  watch_gradients(every=1)     {w * 1e3:8.2f} ms   {w / b:6.3f}x")
            print(f"  overhead per sampled step    {(w - b) * 1e3:8.2f} ms (hooks, norms, "
                  "the synchronised read and one all_gather)")
            print(f"  flow.gather() to rank 0      {statistics.median(gathers) * 1e3:8.2f} ms "
                  "(once, at the end of a watch block)")
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="timed steps per mode")
    ap.add_argument("--strategy", choices=("ddp", "fsdp2"), default="ddp")
    ap.add_argument("--model", default="tiny-cnn", help="a built-in model with example inputs")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(2, str(Path(tmp, "store")), args), nprocs=2)


if __name__ == "__main__":
    main()
