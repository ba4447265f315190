"""`torchscope explain [CODE]`: what a finding code means, from the catalogue of findings."""

from __future__ import annotations

import difflib
from typing import Annotated

import typer

from torchscope.cli._common import DebugOpt, console, fail, guarded


def register(app: typer.Typer) -> None:
    """Add `explain` to `app`."""
    app.command("explain")(explain)


def explain(
    code: Annotated[str | None, typer.Argument(
        help="A finding code from a report (grads.exploding) or a lint rule (TS001). "
        "Without one, every code is listed, one per line.")] = None,
    debug: DebugOpt = False,
) -> None:
    """Explain a finding code: what it means, how it is decided, and how to fix it."""
    with guarded(debug):
        import torchscope.lint  # noqa: F401  (declares the lint rules as lint.TS0xx)
        from torchscope.catalogue import entries
        from torchscope.report.explain import entry_markdown, listing

        if code is None:
            for line in listing(entries()):
                console.print(line, highlight=False, markup=False, soft_wrap=True)
            return
        table = {e.code: e for e in entries()}
        key = code.strip()
        if f"lint.{key.upper()}" in table:  # a lint rule as the linter prints it: TS001
            key = f"lint.{key.upper()}"
        entry = table.get(key)
        if entry is None:
            near = difflib.get_close_matches(key, list(table), n=3)
            hint = f"did you mean {', '.join(near)}? " if near else ""
            fail(f"unknown finding code {code!r}. Fix: {hint}run `torchscope explain` for "
                 "every code.")
        console.print(entry_markdown(entry), highlight=False, markup=False, soft_wrap=True,
                      end="")
