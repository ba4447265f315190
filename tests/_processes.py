"""Finding the processes a test started, by a marker in their environment that every
process inherits (orphans re-parented to PID 1 included): for the tests of signals and of
child processes that must end with their parent."""

from __future__ import annotations

import contextlib

import psutil


def marked(variable: str, mark: str) -> list[psutil.Process]:
    """Every live process (zombies aside) whose environment sets `variable` to `mark`."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.environ().get(variable) == mark:
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


def cmdlines(procs: list[psutil.Process]) -> list[str]:
    """The command lines of `procs` still alive."""
    lines = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            lines.append(" ".join(p.cmdline()))
    return lines


def kill_all(procs: list[psutil.Process]) -> None:
    """SIGKILL to each of `procs` (a failing test leaves nothing running)."""
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()
