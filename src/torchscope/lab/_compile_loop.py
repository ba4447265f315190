"""Child process of the lab's compile milestone: `python -m torchscope.lab._compile_loop N`.

Reproduces the lesson's trap, `torch.compile` called inside the training loop, on tiny-cnn
for N iterations and prints one JSON line: how many distinct wrappers the calls returned,
how many graphs Dynamo compiled, and each iteration's wall time. It runs in a child process
so that the lab's own process never compiles: the caller's Dynamo caches, recompile counts
and compiler state stay exactly as they were.
"""

from __future__ import annotations

import json
import sys
import time

__all__ = ["main"]


def main(argv: list[str]) -> int:
    """Run the trap; returns the exit code."""
    import torch
    from torch._dynamo.utils import counters

    from torchscope.models.zoo import TinyCNN

    iterations, threads = int(argv[0]), int(argv[1])
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = TinyCNN().eval()
    x = torch.randn(32, 3, 32, 32)  # (B, C, H, W), the lesson's batch
    wrappers, times = [], []
    with torch.no_grad():
        for _ in range(iterations):
            t0 = time.perf_counter()
            compiled = torch.compile(model)  # noqa: TS004 - the lesson's trap, on purpose
            compiled(x)
            times.append(time.perf_counter() - t0)
            wrappers.append(compiled)
    print(json.dumps({"wrappers": len({id(w) for w in wrappers}),
                      "graphs": int(counters["stats"]["unique_graphs"]), "times": times}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
