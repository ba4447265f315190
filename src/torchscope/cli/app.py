"""The `torchscope` command: one Typer app; each command lives in its own module."""

from __future__ import annotations

import sys
from typing import Any

import typer
from rich.text import Text
from typer.core import TyperGroup

from torchscope.cli import (
    capture,
    compile_cmd,
    doctor,
    explain,
    grads,
    lint_cmd,
    memory,
    profile,
)
from torchscope.cli._common import err_console, interrupted_exit


def _flags_without_value(params: list[Any]) -> list[Any]:
    """A flag takes no value, so its help shows none (`--fast`, not `--fast <bool>`)."""
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
    return params


class _OneLineUsageErrors(TyperGroup):
    """Usage errors (an unknown option, a value of the wrong type) as one line, exit code 2;
    and flags shown without a value in `--help`.

    Click would print a usage banner and a boxed message; every other torchscope error is one
    `error:` line, so these are too.
    """

    def get_params(self, ctx: Any) -> Any:
        return _flags_without_value(super().get_params(ctx))

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            _flags_without_value(command.get_params(ctx))  # --help included
        return command

    def main(self, *args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("standalone_mode", True):
            return super().main(*args, **kwargs)
        try:
            rv = super().main(*args, **{**kwargs, "standalone_mode": False})
        except typer.Abort as exc:
            if isinstance(exc.__cause__, KeyboardInterrupt):  # a signal outside `guarded`
                try:
                    interrupted_exit(exc.__cause__)
                except typer.Exit as done:
                    sys.exit(done.exit_code)
            err_console.print("Aborted!", highlight=False, markup=False)
            sys.exit(1)
        except typer.TyperException as exc:
            # Click's exceptions derive from TyperException.
            show = getattr(exc, "show", None)
            if show is None:
                raise
            if type(exc).__name__ == "NoArgsIsHelpError":  # a bare `torchscope`: the help
                show()
                sys.exit(getattr(exc, "exit_code", 2))
            ctx = getattr(exc, "ctx", None)
            where = ctx.command_path if ctx is not None else "torchscope"
            message = " ".join(exc.format_message().split())
            if not message.endswith((".", "?", "!")):
                message += "."
            err_console.print(Text.assemble(("error:", "bold red"),
                                            f" {message} Fix: see `{where} --help`."))
            sys.exit(getattr(exc, "exit_code", 2))
        sys.exit(rv if isinstance(rv, int) else 0)


app = typer.Typer(
    cls=_OneLineUsageErrors,
    name="torchscope",
    help="See inside any PyTorch model's training step: activations, gradient flow, memory, "
    "time and torch.compile.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """See inside any PyTorch model's training step."""


for _command_module in (capture, grads, memory, profile, compile_cmd, lint_cmd, doctor,
                        explain):
    _command_module.register(app)


def main() -> None:
    """Console-script entry point. SIGINT and SIGTERM end it with one line and exit code
    128 + the signal, after every child process it started is stopped and every temporary
    folder removed (`torchscope._process.interruptible`); the handlers are put back after."""
    from torchscope._process import interruptible

    with interruptible():
        app()
