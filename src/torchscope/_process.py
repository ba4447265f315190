"""Process-wide state that torchscope touches, always scoped: what it changes it puts back.

Two things only: Kineto's log level while a profiler starts, and torch's random generators
while a measurement draws from them. Every public function that profiles or seeds goes
through these two context managers, so that after it returns (or raises) the environment
and the caller's random streams are as they were.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

__all__ = ["quiet_kineto", "seeded"]

_KINETO = "KINETO_LOG_LEVEL"


@contextlib.contextmanager
def quiet_kineto() -> Iterator[None]:
    """Keep Kineto's `profiler_start`/`profiler_stop` lines off stderr while a profiler runs.

    Kineto reads `KINETO_LOG_LEVEL` once, when the first profiler of the process starts, and
    prints those lines at level 5; only a higher level hides them. The variable is set to 6
    inside the block (unless the user chose a level other than 5) and restored on exit: a
    profiler started inside has read it by then, and the process environment is unchanged.
    """
    old = os.environ.get(_KINETO)
    if old in (None, "", "5"):
        os.environ[_KINETO] = "6"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(_KINETO, None)
        else:
            os.environ[_KINETO] = old


@contextlib.contextmanager
def seeded(seed: int | None) -> Iterator[None]:
    """Seed torch's CPU and CUDA generators inside; the caller's states come back on exit.

    Args:
        seed: the seed; None forks the states without reseeding (draws inside are not
            reproducible, but the caller's stream still continues as if nothing had run).
    """
    import torch

    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=cuda):
        if seed is not None:
            torch.manual_seed(seed)
        yield
