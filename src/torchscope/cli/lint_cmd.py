"""Placeholder: this command's module registers nothing until its capability lands."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add this module's command to `app`."""
