"""Process settings the doctor and the lab need before any profiler starts."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

__all__ = ["quiet_kineto", "seeded"]


def quiet_kineto() -> None:
    """Keep Kineto's `profiler_start`/`profiler_stop` lines off stderr.

    Kineto reads `KINETO_LOG_LEVEL` once, when the first profiler of the process starts, and
    prints those lines at level 5; only a higher level hides them. Several sections profile
    (memory on CPU reads profiler memory events), so this must run before the first one. A
    user's own level wins unless it is the 5 that does not hide them.
    """
    if os.environ.get("KINETO_LOG_LEVEL") in (None, "", "5"):
        os.environ["KINETO_LOG_LEVEL"] = "6"


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Seed torch's RNGs (CPU and every CUDA device) inside; the caller's states come back.

    Sections and milestones are seeded for reproducible numbers, but a user's script that
    calls `run_doctor` or `run_lab` must not find its random stream reset afterwards.
    """
    import torch

    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        yield
