"""What torchscope's gradient watch costs per sampled step on 2 ranks (gloo, CPU).

Spawns 2 ranks that meet through a FileStore. On each, interleaved round by round (each
round's order rotated), a bare training step of a DDP (or FSDP2) model against the same
step of a twin model under `watch_gradients(every=1)`, whose every sampled step reads the
synchronised gradients and exchanges every rank's norms in one all_gather (started at the
step, waited for when the step's records are built, a step later); and the same pair on
this rank's model alone (no wrapper, no exchange), which tells the watch's own cost from
the ranks' share. Both ranks run the same rounds in the same order, so their collectives
line up. Then it times `flow.gather()` alone: the one gather that joins every rank's
`GradFlow` on rank 0 (at the end of a watch block).

Rank 0 prints the median step of each, its ratio to the bare DDP step in the same round
(the median of those paired ratios, with its 95 % interval), the watch's cost per sampled
step with and without ranks and the ranks' share of it (the median of each round's
differences, with its 95 % interval), and the gather's median. Timings are noisy on a
shared machine; the README's figures come from a quiet one.

    python benchmarks/gather_overhead.py [--steps 30] [--strategy ddp|fsdp2]
        [--model llama|tiny-cnn|...]

`llama` is a small `transformers` Llama (6 layers of width 128, 4 heads, 16 tokens of a
128-word vocabulary per row, 4 rows per rank); any other name is a built-in model with its
example inputs.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import interleaved_samples, paired

from torchscope._timing import Interval, median_interval
from torchscope.grads import watch_gradients
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


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256,
                                        num_hidden_layers=6, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=32))


def _task(name: str, rank: int, world: int
          ) -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor], torch.Tensor]:
    """The model, its loss on this rank's rows, and those rows."""
    g = torch.Generator().manual_seed(rank)
    if name == "llama":
        ids = torch.randint(0, 128, (4, 16), generator=g)  # (rows, tokens)

        def lm_loss(m: nn.Module) -> torch.Tensor:
            logits = m(input_ids=ids).logits  # (rows, tokens, vocab)
            return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 128),
                                               ids[:, 1:].reshape(-1))

        return _llama(), lm_loss, ids
    loaded = load_target(name)
    assert loaded.inputs is not None
    x = loaded.inputs.args[0][rank::world]
    out = loaded.model(loaded.inputs.args[0][:1])
    y = torch.randint(0, out.shape[-1], (x.shape[0],), generator=g)

    def ce_loss(m: nn.Module) -> torch.Tensor:
        return nn.functional.cross_entropy(m(x), y)

    return loaded.model, ce_loss, x


def _rank(rank: int, world: int, store: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=300))
    try:
        model, loss_of, rows = _task(args.model, rank, world)
        bare = _wrap(copy.deepcopy(model), args.strategy)
        watched = _wrap(copy.deepcopy(model), args.strategy)
        # The same model on this rank alone (no wrapper, no collective): what the watch
        # costs without any exchange between ranks.
        alone, alone_watched = copy.deepcopy(model), copy.deepcopy(model)
        models = {"bare": bare, "watched": watched, "alone": alone,
                  "alone_watched": alone_watched}
        opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}

        def step(name: str) -> Callable[[], None]:
            def run() -> None:
                opts[name].zero_grad(set_to_none=True)
                loss_of(models[name]).backward()
                opts[name].step()
            return run

        with watch_gradients(watched, every=1, optimizer=opts["watched"]) as watch, \
                watch_gradients(alone_watched, every=1, optimizer=opts["alone_watched"]):
            samples = interleaved_samples({name: step(name) for name in models},
                                          repeats=args.steps, warmup=3)
        timed = paired(samples)
        assert watch.samples == args.steps + 3
        flow = watch.last
        assert flow is not None
        gathers = []
        for _ in range(args.steps):
            dist.barrier()
            t0 = time.perf_counter()
            flow.gather()
            gathers.append(time.perf_counter() - t0)
        if rank == 0:
            ms = {k: v[0][0] * 1e3 for k, v in timed.items()}
            print(f"{args.model}, {args.strategy} on {world} ranks (gloo, 1 thread each), "
                  f"{rows.shape[0]} rows per rank, {args.steps} interleaved rounds; ratios "
                  "are medians of each round's step over the bare one's, with 95% intervals")
            for name, label in (("bare", f"bare {args.strategy} step"),
                                ("watched", "  under watch_gradients(every=1)"),
                                ("alone", "bare step, this rank alone"),
                                ("alone_watched", "  under watch_gradients(every=1)")):
                r = timed[name][1]
                print(f"  {label:34s} {ms[name]:8.2f} ms   {r.median:.3f}x "
                      f"({r.low:.3f}-{r.high:.3f}x of the bare {args.strategy} step)")
            rounds = [dict(zip(samples, walls, strict=True)) for walls in
                      zip(*([w for w, _ in s] for s in samples.values()), strict=True)]

            def cost(of: Callable[[dict[str, float]], float]) -> Interval:
                """`of` each round's wall seconds (by variant) in ms: median, 95% interval."""
                return median_interval([of(r) * 1e3 for r in rounds])

            def fmt(c: Interval) -> str:
                return f"{c.median:.2f} ms [{c.low:.2f}, {c.high:.2f}]"

            ranked_ms = cost(lambda r: r["watched"] - r["bare"])
            alone_ms = cost(lambda r: r["alone_watched"] - r["alone"])
            share_ms = cost(lambda r: r["watched"] - r["bare"] - (r["alone_watched"] - r["alone"]))
            print(f"  watch per sampled step (the median of each round's difference, with its "
                  f"95% interval), {args.strategy} {fmt(ranked_ms)}; alone {fmt(alone_ms)}; the "
                  f"ranks' share {fmt(share_ms)} (the synchronised read and the exchange)")
            print(f"  flow.gather() to rank 0            {statistics.median(gathers) * 1e3:8.2f}"
                  " ms (once, at the end of a watch block)")
    finally:
        dist.destroy_process_group()
    # Skip interpreter teardown, where torch can abort a rank that did all its work (a gloo
    # worker thread releasing a finished collective while Python shuts down).
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="interleaved rounds")
    ap.add_argument("--strategy", choices=("ddp", "fsdp2"), default="ddp")
    ap.add_argument("--model", default="llama",
                    help="llama (a small transformers Llama) or a built-in model")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(2, str(Path(tmp, "store")), args), nprocs=2)


if __name__ == "__main__":
    main()
