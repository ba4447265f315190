"""Process-wide state that torchscope touches, always scoped: what it changes it puts back.

Three things: the environment (torch's lazy imports write to it: importing `torch._dynamo`,
which the profiler's first trace does, sets `TORCHINDUCTOR_CACHE_DIR`), Kineto's log level
while a profiler starts, and torch's random generators while a measurement draws from them.
Every public function that profiles, compiles or seeds goes through these context managers,
so that after it returns (or raises) the environment and the caller's random streams are
as they were.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

__all__ = ["kept_environment", "quiet_kineto", "seeded"]

_KINETO = "KINETO_LOG_LEVEL"


@contextlib.contextmanager
def kept_environment() -> Iterator[None]:
    """The process environment as it was on entry, again on exit (also on an exception).

    Variables set inside are removed, changed ones get their old value back. What torch
    derives from them (inductor's cache directory) it derives again when it needs it, so
    putting the environment back changes nothing but the environment.
    """
    env = dict(os.environ)
    try:
        yield
    finally:
        for key in [k for k in os.environ if k not in env]:
            del os.environ[key]
        for key, value in env.items():
            if os.environ.get(key) != value:
                os.environ[key] = value


@contextlib.contextmanager
def quiet_kineto() -> Iterator[None]:
    """Keep Kineto's `profiler_start`/`profiler_stop` lines off stderr while a profiler runs;
    the environment is kept (`kept_environment`).

    Kineto reads `KINETO_LOG_LEVEL` once, when the first profiler of the process starts, and
    prints those lines at level 5; only a higher level hides them. The variable is set to 6
    inside the block (unless the user chose a level other than 5) and restored on exit: a
    profiler started inside has read it by then.
    """
    with kept_environment():
        if os.environ.get(_KINETO) in (None, "", "5"):
            os.environ[_KINETO] = "6"
        yield


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
