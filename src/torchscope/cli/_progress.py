"""The progress display of long commands: what runs (a section, a mode, a step), step k of
N, the time spent on it and the limit it has, if any; on a terminal only.

Capabilities and compositions never draw anything: they take an optional callback, called
with `(label, k, n)` as work begins on step k (1-based) of n, and the command passes
`Steps` (or a function that calls it). On a terminal, rich's live display shows it and
removes it when the command prints its results (it is transient); into a file or a pipe,
or with `--quiet`, nothing is drawn and nothing is printed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    Task,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text

from torchscope.cli._common import console as _stdout

__all__ = ["Steps", "progress"]


class _StepTime(ProgressColumn):
    """Seconds spent on the current step, and its limit where it has one (`this part 35 s of
    a 600 s limit`); nothing for a step under a second without a limit."""

    def render(self, task: Task) -> Text:
        started = task.fields.get("step_t0")
        if started is None:
            return Text("")
        spent = time.monotonic() - started
        limit = task.fields.get("limit_s")
        if spent < 1 and not limit:  # a quick step: its time says nothing
            return Text("")
        text = f"this part {spent:.0f} s" + (f" of a {limit:.0f} s limit" if limit else "")
        return Text(text + ",", style="progress.elapsed")


class Steps:
    """The callback a command hands to the work it runs: `steps(label, k, n)` says that step
    k (1-based) of n, named `label`, begins; `limit_s` is its time limit, if it has one.
    Drawn by `progress` on a terminal; a no-op elsewhere (`shown` is False)."""

    def __init__(self, bar: Progress | None, task: TaskID | None, title: str) -> None:
        self._bar = bar
        self._task = task
        self._label: str | None = None
        self.title = title

    @property
    def shown(self) -> bool:
        """Whether the display is drawn (a terminal, and no `--quiet`)."""
        return self._bar is not None

    def __call__(self, label: str, k: int, n: int | None = None, *,
                 limit_s: float | None = None) -> None:
        if self._bar is None or self._task is None:
            return
        where = f"{label} ({k}/{n})" if n else label
        description = f"{self.title}: {where}"
        self._bar.update(self._task, description=description, base=description,
                         completed=max(k - 1, 0), total=n, step_t0=time.monotonic(),
                         limit_s=limit_s)
        if label != self._label:  # a new part: drawn now, not at the next tick
            self._label = label
            self._bar.refresh()

    def note(self, detail: str, *, limit_s: float | None = None) -> None:
        """A detail of the step that runs (`measuring in a child process`), shown after its
        label; `limit_s` gives the step a time limit (shown beside the time spent)."""
        if self._bar is None or self._task is None:
            return
        base = self._bar.tasks[self._task].fields.get("base") or self.title
        self._bar.update(self._task, description=f"{base} - {detail}", limit_s=limit_s)

    def done(self) -> None:
        """Every step has finished (the bar full)."""
        if self._bar is not None and self._task is not None:
            total = self._bar.tasks[self._task].total
            self._bar.update(self._task, completed=total or 0)


@contextmanager
def progress(title: str, *, quiet: bool = False, console: Console | None = None
             ) -> Iterator[Steps]:
    """A live progress display for the block, on a terminal and without `--quiet`.

    Args:
        title: what the command does (`compile`, `grads`), first on the line.
        quiet: draw nothing (`--quiet`).
        console: where to draw; the command's standard output by default. Nothing is drawn
            when it is not a terminal.

    Yields:
        The `Steps` callback to hand to the work; until it is first called the line shows
        `title` with a spinner and the time spent.
    """
    out = console or _stdout
    if quiet or not out.is_terminal:
        yield Steps(None, None, title)
        return
    bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(bar_width=20),
                   _StepTime(), TextColumn("[progress.elapsed]in all"), TimeElapsedColumn(),
                   console=out, transient=True)
    with bar:
        task = bar.add_task(title, total=None, step_t0=None, limit_s=None, base=None)
        yield Steps(bar, task, title)
