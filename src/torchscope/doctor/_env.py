"""Process settings the doctor and the lab need before any profiler starts."""

from __future__ import annotations

import os

__all__ = ["quiet_kineto"]


def quiet_kineto() -> None:
    """Keep Kineto's `profiler_start`/`profiler_stop` lines off stderr.

    Kineto reads `KINETO_LOG_LEVEL` once, when the first profiler of the process starts, and
    prints those lines at level 5; only a higher level hides them. Several sections profile
    (memory on CPU reads profiler memory events), so this must run before the first one. A
    user's own level wins unless it is the 5 that does not hide them.
    """
    if os.environ.get("KINETO_LOG_LEVEL") in (None, "", "5"):
        os.environ["KINETO_LOG_LEVEL"] = "6"
