"""Command-line interface (`torchscope ...`)."""

from torchscope.cli.app import app, main

__all__ = ["app", "main"]
