"""What `torchscope.monitor` costs a training run: a tiny GPT-2, in a plain loop and in Lightning.

Side by side in one process, interleaved round by round (each round's order rotated), each
variant on its own copy of the model and its own optimizer, watched for the whole run as a
real loop is:

  plain loop     forward (the model's own loss on its input tokens) + backward + AdamW step
    bare             no torchscope
    every=10         under `torchscope.monitor(every=10, out=None)`: gradient norms,
                     activation statistics and saved bytes on the sampled steps; step time,
                     the NaN/Inf check and the loop checks on every step
    every=1000       the same, sampled once in 1000 steps: what a step that is not sampled
                     costs (a block holds none of the sampled steps but the first)
  Lightning      the same model and optimizer in `Trainer.fit`, blocks of steps timed from
                 `on_train_start` to `on_train_end` (a fresh Trainer per block)
    bare             no callback
    every=10         `TorchscopeCallback(every=10, out=None)`
    every=1000       `TorchscopeCallback(every=1000, out=None)`

Printed per variant: the median wall and CPU time per step, and the paired ratios to the
bare variant of its group in the same round: the median of the per-round ratios with its
95 % order-statistic interval (`torchscope._timing.median_interval`), by wall time and by
the process's CPU time (less hit by other jobs on a shared machine: with one thread, the
step's own work). Goals (issue 45): every=10 at most 1.03x in both; every=1000 (steps not
sampled) at most 1.01x.

    PYTHONPATH=src python benchmarks/monitor_overhead.py [--rounds 15] [--block 50]
        [--layers 2] [--hidden 64] [--batch 8] [--seq 64] [--threads 1] [--no-lightning]

Measured 2026-12-07 on the 2-core CPU machine under a load of about 2, 15 rounds of 50
steps (CPU ratios, median [95 % interval]; wall ratios within 0.01 of them):
  bde1009 (the NaN/Inf check's results in a ring on the device, reduced every 64 steps):
      plain loop every=10 1.084x [1.067-1.112], every=1000 1.026x [0.999-1.043];
      Lightning every=10 1.105x [1.083-1.134], every=1000 1.034x [1.013-1.072]
      (bare steps 13.3 / 14.1 ms CPU)
  1aaace0, run just before it: plain loop 1.114x [1.096-1.126] / 1.049x [1.026-1.063];
      Lightning 1.140x [1.106-1.166] / 1.048x [1.020-1.080]
Earlier, under a load of about 11 (wall ratios mostly noise there), 2 x 64, batch 8 x 64:
  this version (f3cc6a9), 15 rounds of 40 steps: plain loop every=10 1.118x [1.081-1.137],
      every=1000 1.044x [0.997-1.066]; Lightning every=10 1.124x [1.068-1.185],
      every=1000 1.067x [1.023-1.148] (bare steps 14.5 / 15.1 ms CPU)
  before it (9a6a9f2: hooks on every module at every step, the NaN/Inf check by
      `_foreach_norm`), 11 rounds of 40 steps: plain loop every=10 1.161x [1.090-1.197],
      every=1000 1.065x [1.050-1.104]; Lightning every=10 1.145x [1.047-1.221],
      every=1000 1.113x [1.079-1.151]
Goals not met: a sampled step costs about 1.5x a bare one (every=1: gradients alone
1.27x, with activations 1.36x, with memory 1.45x, all three 1.53x), so every=10 stays
near 1.05x from sampling alone.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

import torchscope
from torchscope._timing import Interval, median_interval


def _gpt2(layers: int, hidden: int, seq: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=layers, n_head=max(hidden // 32, 1), n_embd=hidden,
                     vocab_size=512, n_positions=seq, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).train()


def _plain(base: torch.nn.Module, ids: torch.Tensor, block: int, every: int | None
           ) -> tuple[Callable[[], None], contextlib.AbstractContextManager[Any]]:
    """A block of plain-loop steps on a copy of `base`, and its watch (opened once)."""
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def run() -> None:
        for _ in range(block):
            opt.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids).loss.backward()  # ids: (batch, seq)
            opt.step()

    watch: contextlib.AbstractContextManager[Any] = contextlib.nullcontext() \
        if every is None else torchscope.monitor(model, opt, every=every, out=None)
    return run, watch


def _lightning(base: torch.nn.Module, ids: torch.Tensor, block: int, every: int | None
               ) -> Callable[[], tuple[float, float]] | None:
    """A block of Lightning steps on a copy of `base` (a fresh Trainer each time, the same
    module on), timed from on_train_start to on_train_end: (wall, CPU) seconds."""
    try:
        import pytorch_lightning as pl
    except ImportError:
        return None
    import logging

    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)  # its per-fit notes
    from torchscope.integrations.lightning import TorchscopeCallback

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = copy.deepcopy(base)

        def training_step(self, batch: torch.Tensor, _i: int) -> torch.Tensor:
            loss: torch.Tensor = self.model(input_ids=batch, labels=batch).loss
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Clock(pl.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self.spent = (time.perf_counter() - self.t0, time.process_time() - self.c0)

    module = LM()
    data = [ids[i] for i in range(ids.shape[0])] * block  # one batch of all rows per step
    loader = torch.utils.data.DataLoader(data, batch_size=ids.shape[0])

    def run() -> tuple[float, float]:
        clock = Clock()
        callbacks: list[Any] = [clock]
        if every is not None:
            callbacks.insert(0, TorchscopeCallback(every=every, out=None))
        trainer = pl.Trainer(max_steps=block, accelerator="cpu", devices=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=callbacks)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, loader)
        return clock.spent

    return run


def _paired(samples: dict[str, list[tuple[float, float]]], base: str
            ) -> dict[str, tuple[Interval, Interval]]:
    """Per variant: the per-round ratio to `base`, by wall and by CPU, as median intervals."""
    b = samples[base]
    return {name: (median_interval([w / bw for (w, _), (bw, _) in zip(s, b, strict=True)]),
                   median_interval([c / bc for (_, c), (_, bc) in zip(s, b, strict=True)]))
            for name, s in samples.items()}


def _rounds(runs: dict[str, Callable[[], tuple[float, float]]], rounds: int
            ) -> dict[str, list[tuple[float, float]]]:
    names = list(runs)
    for name in names:  # warm up every path (and sample once)
        runs[name]()
    out: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            out[name].append(runs[name]())
    return out


def _timed(fn: Callable[[], None]) -> Callable[[], tuple[float, float]]:
    def run() -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        return time.perf_counter() - t0, time.process_time() - c0

    return run


def _print(title: str, samples: dict[str, list[tuple[float, float]]], block: int) -> None:
    print(title)
    ratios = _paired(samples, "bare")
    for name, s in samples.items():
        wall = statistics.median(w for w, _ in s) / block * 1e3
        cpu = statistics.median(c for _, c in s) / block * 1e3
        rw, rc = ratios[name]
        print(f"  {name:11s} {wall:7.2f} ms/step wall {cpu:7.2f} ms CPU   "
              f"wall {rw.median:.3f}x [{rw.low:.3f}-{rw.high:.3f}]   "
              f"CPU {rc.median:.3f}x [{rc.low:.3f}-{rc.high:.3f}]")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--block", type=int, default=50, help="steps per timed block")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-lightning", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base = _gpt2(args.layers, args.hidden, args.seq)
    ids = torch.randint(0, 512, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    print(f"GPT-2 {args.layers} layers x {args.hidden}, batch {args.batch}x{args.seq} tokens, "
          f"AdamW, CPU, {args.threads} thread(s), {args.rounds} interleaved rounds of "
          f"{args.block} steps")
    variants = {"bare": None, "every=10": 10, "every=1000": 1000}
    runs: dict[str, Callable[[], tuple[float, float]]] = {}
    with contextlib.ExitStack() as stack:
        for name, every in variants.items():
            fn, watch = _plain(base, ids, args.block, every)
            stack.enter_context(watch)
            runs[name] = _timed(fn)
        _print("plain loop", _rounds(runs, args.rounds), args.block)
    if args.no_lightning:
        return
    made = {name: _lightning(base, ids, args.block, every) for name, every in variants.items()}
    if any(fn is None for fn in made.values()):
        print("Lightning: not installed")
        return
    lightning = {name: fn for name, fn in made.items() if fn is not None}
    _print("Lightning", _rounds(lightning, args.rounds), args.block)


if __name__ == "__main__":
    main()
