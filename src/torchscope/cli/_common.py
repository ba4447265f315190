"""What every CLI command shares: TARGET/--input options, one-line errors, output paths
checked before any work, and the console."""

from __future__ import annotations

import math
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console, ConsoleDimensions

from torchscope._util import output_problem
from torchscope.errors import TorchscopeError, describe

if TYPE_CHECKING:
    import torch
    from torch import nn

    from torchscope.models.target import LoadedTarget, ModelInputs

__all__ = [
    "DebugOpt",
    "DepthOpt",
    "DeviceOpt",
    "InputOpt",
    "InputsFnOpt",
    "JsonOpt",
    "LossOpt",
    "ModesOpt",
    "OutputError",
    "SelectOpt",
    "TargetArg",
    "check_output",
    "choice",
    "console",
    "device_of",
    "err_console",
    "fail",
    "guarded",
    "is_tty",
    "load",
    "save_json",
    "split_commas",
    "writing",
]

C = TypeVar("C", bound=str)

PIPE_WIDTH = 150  # columns of output to a file or pipe when COLUMNS does not say


class _Console(Console):
    """rich's console, as wide as `COLUMNS` says whenever it is set (read at each print, so
    a test or wrapper may set it late); on a terminal as wide as the terminal; into a file or
    pipe `PIPE_WIDTH` wide, so logs keep whole rows. Tables are fitted to that width."""

    def __init__(self) -> None:
        super().__init__()
        # rich reads COLUMNS once, when the console is made (at import); `size` reads it at
        # each print instead, so a width set later (by a wrapper, a test) is honoured.
        self._width = None

    @property
    def size(self) -> ConsoleDimensions:
        dims = super().size
        if self._width is not None:
            return dims
        columns = os.environ.get("COLUMNS", "")
        if columns.isdigit():
            return ConsoleDimensions(int(columns), dims.height)
        return dims if self.is_terminal else ConsoleDimensions(PIPE_WIDTH, dims.height)

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        self._width, self._height = new_size

    def print(self, *objects: Any, **kwargs: Any) -> None:
        """`Console.print`, with every table fitted to the width (`report.terminal.Fitted`:
        module names shortened from the middle, other cells folded, nothing cut)."""
        from rich.table import Table

        from torchscope.report.terminal import Fitted

        super().print(*(Fitted(o) if isinstance(o, Table) else o for o in objects), **kwargs)


console = _Console()
err_console = Console(stderr=True, soft_wrap=True)

TargetArg = Annotated[
    str | None,
    typer.Argument(
        help="Built-in model (tiny-cnn, mlp, deep-mlp, resnet-mini), path/to/file.py:factory "
        "or package.module:factory.",
        show_default="tiny-cnn",
    ),
]
InputOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--input",
        "-i",
        help="An input's shape (32x3x32x32), optionally with a dtype and a range "
        "(int64[0,1000):4x128 for token ids). Repeat for several positional inputs.",
    ),
]
InputsFnOpt = Annotated[
    str | None,
    typer.Option("--inputs", help="file.py:make_inputs returning a tensor, tuple or dict."),
]
JsonOpt = Annotated[str | None, typer.Option("--json", help="Write the records to this file.")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show the full traceback on errors.")]
QuietOpt = Annotated[bool, typer.Option(
    "--quiet", "-q", help="No progress display (it is drawn on a terminal only, and gone "
    "once the results print).")]
VerboseOpt = Annotated[bool, typer.Option(
    "--verbose", "-v", help="Also print each finding's evidence, the sections table and the "
    "step (report.json and report.html always have them).")]
SelectOpt = Annotated[
    str | None,
    typer.Option("--select", "-s",
                 help="Modules to hook: a glob over names (layer*.conv1) or a type (Conv2d)."),
]
DepthOpt = Annotated[int | None, typer.Option(help="Only modules this deep or shallower.")]
DeviceOpt = Annotated[str, typer.Option(
    "--device", help="cpu, cuda, cuda:N or auto (CUDA when torch sees it, else the CPU).")]
"""Every command that runs a model takes `--device`, with the default `auto`."""
ModesOpt = Annotated[str, typer.Option(
    "--modes", "-m", help="torch.compile modes to measure, comma-separated: default, "
    "reduce-overhead, max-autotune, max-autotune-no-cudagraphs.")]
"""`compile` and `doctor` name the compile modes alike."""
LossOpt = Annotated[str, typer.Option(
    "--loss", help="The training step's loss: auto (the model's own loss, else cross-entropy "
    "for logits, else mean squared error; targets seeded), cross_entropy, mse or sum.")]


AutocastOpt = Annotated[str | None, typer.Option(
    "--autocast", help="Run the step's forward and loss under torch.autocast in this "
    "precision, as your training does: bf16, or fp16 (with a GradScaler, as fp16 training "
    "has).", show_default="the model's own precision")]


def autocast_name(value: str | None) -> str | None:
    """`--autocast`, checked (one line and exit 2 for an unknown precision)."""
    from torchscope.step import AUTOCAST

    return None if value is None else choice("--autocast", value, tuple(AUTOCAST))


def fail(message: str, *, code: int = 2) -> NoReturn:
    """Print one error line to stderr and exit."""
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, markup=True)
    raise typer.Exit(code)


@contextmanager
def guarded(debug: bool) -> Iterator[None]:
    """Turn every failure into one line and exit code 2; `--debug` re-raises for a traceback.

    A SIGINT or SIGTERM that came is the exit's reason (128 + the signal), also where the
    code it interrupted turned its `Interrupted` into another exception (an import does,
    inside a class body) or swallowed it and finished: its results are not trusted.
    """
    from torchscope._process import Interrupted, interrupted

    try:
        yield
    except typer.Exit:
        raise
    except (KeyboardInterrupt, Exception) as exc:
        if debug:
            raise
        if isinstance(exc, KeyboardInterrupt):
            interrupted_exit(exc)
        if (signum := interrupted()) is not None:
            interrupted_exit(Interrupted(signum))
        if isinstance(exc, TorchscopeError):
            fail(_escape(exc.one_line()))
        fail(_escape(f"unexpected {describe(exc)}. Fix: rerun with --debug for the traceback."))
    if (signum := interrupted()) is not None:
        interrupted_exit(Interrupted(signum))


def interrupted_exit(exc: KeyboardInterrupt) -> NoReturn:
    """One line for SIGINT (Ctrl-C) or SIGTERM, and exit 128 + the signal's number."""
    from torchscope._process import Interrupted

    signum = exc.signum if isinstance(exc, Interrupted) else int(signal.SIGINT)
    name = exc.name if isinstance(exc, Interrupted) else "SIGINT"
    fail(f"interrupted by {name}; every hook was removed and every child process stopped.",
         code=128 + signum)


def choice(option: str, value: str, choices: Sequence[C]) -> C:
    """`value` as the one of `choices` it equals; fails before any work when there is none."""
    for c in choices:
        if c == value:
            return c
    fail(f"{option} {value!r} is not one of {', '.join(choices)}. Fix: pick one of those.")


def at_least(option: str, value: float | None, least: int, effect: str) -> None:
    """Fail before any work when a numeric option is below `least` (None passes: the option
    was not given). The line names the option as typed, not the Python argument behind it.

    Args:
        option: the option, e.g. `--steps`.
        value: what was given.
        least: the smallest value that does something.
        effect: what `value` would do, e.g. "profiles no step".
    """
    if value is not None and not value >= least:  # NaN included
        fail(f"{option} {value:g} {effect}. Fix: pass {option} {least} or more.")


def check_lr(lr: float) -> None:
    """`--lr`, checked before any work: a finite positive learning rate (SGD takes 0 and
    trains nothing, and inf turns every weight NaN)."""
    if not (math.isfinite(lr) and lr > 0):
        fail(f"--lr {lr} is not a positive learning rate. Fix: pass e.g. --lr 0.01.")


def split_commas(*values: str | None) -> list[str]:
    """The items of comma-separated option values (`a,b` and `c` give a, b, c), blanks dropped."""
    return [p.strip() for v in values if v for p in v.split(",") if p.strip()]


def device_of(name: str) -> str:
    """The device `--device NAME` means: `auto` is CUDA when torch sees it, else the CPU."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        fail(f"--device {name} asked for CUDA, but torch sees no CUDA device. Fix: use "
             "--device cpu (or auto).")
    if name != "cpu" and not name.startswith("cuda"):
        fail(f"--device {name!r} is not cpu, cuda, cuda:N or auto. Fix: use one of those.")
    return name


class OutputError(TorchscopeError):
    """An output file or folder could not be written (found late: the disk filled up, say)."""


# File systems the kernel fills itself: nothing of ours can be created in them.
def check_output(path: str | None, option: str, *, folder: bool = False,
                 suffixes: tuple[str, ...] = ()) -> None:
    """Fail before any work when an output option cannot be written where it points: one
    line, exit 2 (see `torchscope._util.output_problem` for what is checked).

    Args:
        path: the option's value; None (option not given) passes.
        option: the option's name as the user typed it, e.g. `--json`.
        folder: the option names a folder to create (`doctor --out`), not a file.
        suffixes: the file endings the writer supports (lower case), e.g. `(".png", ".svg")`.
    """
    problem = output_problem(path, option, folder=folder, suffixes=suffixes)
    if problem is not None:
        fail(f"{problem[0]} Fix: {problem[1]}")


@contextmanager
def writing(option: str, path: str | None) -> Iterator[None]:
    """Turn a failure to write an output found late (a full disk, a folder removed meanwhile)
    into one `OutputError` line naming the option and the path.

    An `OSError` counts when it names no file (a failed write) or a file in the output's
    folder; any other propagates unchanged.
    """
    try:
        yield
    except OSError as exc:
        if path is None or not _concerns(exc, Path(path)):
            raise
        reason = exc.strerror or describe(exc)
        raise OutputError(f"could not write {option} {path}: {reason}.",
                          fix=f"free space or fix permissions there, or pass {option} "
                          "another path.") from exc


def save_json(path: str, payload: object, option: str = "--json") -> None:
    """Write `payload` as JSON to the output option's path (failures as one line), then say
    so."""
    from torchscope._util import write_json

    with writing(option, path):
        write_json(path, payload)
    console.print(f"wrote {path}", highlight=False, markup=False)


def _concerns(exc: OSError, out: Path) -> bool:
    if exc.filename is None:
        return True
    folder = Path(os.path.abspath(out if out.is_dir() else out.parent))
    hit = Path(os.path.abspath(os.fsdecode(exc.filename)))
    return hit == folder or folder in hit.parents


def _escape(text: str) -> str:
    return text.replace("[", r"\[")


def load(
    target: str | None, specs: list[str] | None, inputs_fn: str | None
) -> tuple[LoadedTarget, ModelInputs]:
    """Load a TARGET and its example inputs (raises `TorchscopeError` subclasses)."""
    # Imported here: loading torch is the slow part of starting the CLI, and `lint` never needs it.
    from torchscope.models.target import load_inputs, load_target

    loaded = load_target(target)
    return loaded, load_inputs(loaded, specs or (), inputs_fn)


def is_tty() -> bool:
    """Whether stdout is a terminal (progress bars only then)."""
    return sys.stdout.isatty()


def trainable_sgd(model: nn.Module, lr: float, name: str) -> torch.optim.Optimizer:
    """Plain SGD over the parameters that require grad: what `grads` and `profile` train with.

    Raises:
        TorchscopeError: no parameter requires grad.
    """
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise TorchscopeError(f"{name} has no parameter that requires grad, so there is no "
                              "training step.", fix="unfreeze some parameters.")
    return torch.optim.SGD(params, lr=lr)
