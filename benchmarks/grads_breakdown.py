"""Where gradient flow's overhead goes: `watch_gradients` with parts of it left out.

Per model, side by side in one process, interleaved round by round (medians, and paired
ratios to the bare step in the same round with their 95 % intervals), each watch
opened once for the whole run on its own copy of the model:

  bare                  forward, loss, backward, SGD step
  whole watch           `watch_gradients(every=1, optimizer=opt)`: grad_output and
                        grad_input of every leaf, every parameter, update ratios
  no update ratios      the same with `updates=False`
  outputs only          ... and `inputs_grad=False`: no grad_input
  torch.nn leaves only  no update ratios, only the leaves whose class is torch.nn's (read
                        on autograd's graph after their first call)
  user leaves only      no update ratios, only the other leaves (the user's or a library's
                        own classes, which take input aliases), every parameter still
  read floor            tensor hooks that only `sum` each leaf's grad_output once

The differences between rows say what each part costs on this machine; the goal of issue
15 is gradient flow <= 1.03x of the bare step.

Run: PYTHONPATH=src python benchmarks/grads_breakdown.py [--repeats 9] [--threads 2]
     [--models resnet-deep,llama-tiny] [--device cuda]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from _timing import interleaved_paired
from watch_overhead import (
    MODELS,
    _batch,
    _grads_read_floor,
    _loss,
    _model_names,
    _parser,
    _Timed,
    fmt_paired,
    heap_line,
)

from torchscope import _kernels
from torchscope.grads import watch_gradients


def _torch_leaf(_name: str, m: nn.Module) -> bool:
    return type(m).__module__.startswith("torch.nn.") and next(m.children(), None) is None


def _user_leaf(name: str, m: nn.Module) -> bool:
    return next(m.children(), None) is None and not _torch_leaf(name, m)


# Each watched variant: the keyword arguments of its `watch_gradients` besides every=1 and
# the optimizer.
VARIANTS: dict[str, dict[str, Any]] = {
    "whole watch": {},
    "no update ratios": {"updates": False},
    "outputs only": {"updates": False, "inputs_grad": False},
    "torch.nn leaves only": {"updates": False, "select": _torch_leaf},
    "user leaves only": {"updates": False, "select": _user_leaf},
}


def _rows(name: str, args: argparse.Namespace, device: torch.device
          ) -> dict[str, _Timed]:
    torch.manual_seed(0)
    base = MODELS[name]().to(device).train()
    x, y = _batch(name, args, device)
    # A selection that matches no leaf of this model (ResNets have no user leaves) is left
    # out rather than timed as a watch of parameters alone.
    watched = {v: kw for v, kw in VARIANTS.items()
               if "select" not in kw or any(kw["select"](n, m) for n, m in base.named_modules()
                                            if n)}
    names = ["bare", *watched, "read floor"]
    models = {v: base if v == "bare" else copy.deepcopy(base) for v in names}
    opts = {v: torch.optim.SGD(m.parameters(), lr=1e-3) for v, m in models.items()}
    reads: list[torch.Tensor] = []

    def step(variant: str) -> Callable[[], None]:
        model, opt = models[variant], opts[variant]

        def run() -> None:
            opt.zero_grad(set_to_none=True)
            _loss(model, x, y).backward()
            opt.step()
            reads.clear()
            if device.type == "cuda":
                torch.cuda.synchronize()

        return run

    with contextlib.ExitStack() as stack:
        for v, kwargs in watched.items():
            stack.enter_context(watch_gradients(models[v], every=1, optimizer=opts[v],
                                                **kwargs))
        _grads_read_floor(models["read floor"], reads, stack)
        return interleaved_paired({v: step(v) for v in names}, repeats=args.repeats,
                                  warmup=2)


def main() -> None:
    ap = _parser(__doc__, "resnet-deep,llama-tiny")
    args = ap.parse_args()
    names = _model_names(ap, args)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    heap = heap_line(args)
    for program in _kernels.PROGRAMS:  # the fused kernels, as a watch has them after a while
        _kernels.prepare(program, torch.float32, device, wait=None)
    print(f"torch {torch.__version__}, {device}, {args.threads} thread(s), {args.repeats} "
          "interleaved rounds: median wall, median process CPU, min wall, over the bare step;"
          " the median of each round's wall ratio to bare [95 % interval]")
    print(heap)
    for name in names:
        rows = _rows(name, args, device)
        bare = rows["bare"][0]
        for v, (t, paired) in rows.items():
            w, c, m = (a / b for a, b in zip(t, bare, strict=True))
            print(f"{name:14} {v:22} {t[0] * 1e3:9.1f} ms {w:7.3f} {c:7.3f} {m:7.3f}  "
                  f"{fmt_paired(paired)}")


if __name__ == "__main__":
    main()
