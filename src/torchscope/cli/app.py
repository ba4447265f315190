"""The `torchscope` command: one Typer app; each command lives in its own module."""

from __future__ import annotations

import typer

from torchscope.cli import capture, compile_cmd, doctor, grads, lint_cmd, memory, profile

app = typer.Typer(
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


for _command_module in (capture, grads, memory, profile, compile_cmd, lint_cmd, doctor):
    _command_module.register(app)


def main() -> None:
    """Console-script entry point."""
    app()
