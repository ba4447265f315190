"""`torchscope lint PATH...`: find training-loop traps in source code, before it runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from torchscope.cli._common import (
    DebugOpt,
    check_output,
    console,
    err_console,
    fail,
    guarded,
    split_commas,
    writing,
)

_FORMATS = ("text", "json", "sarif")


def register(app: typer.Typer) -> None:
    """Add `lint` to `app`."""
    app.command("lint")(lint)


def lint(
    paths: Annotated[list[str] | None, typer.Argument(
        help="Files or folders to lint (folders recursively; .gitignore is honoured).",
        show_default="the current folder")] = None,
    *,
    fmt: Annotated[str, typer.Option(
        "--format", "-f", help="Output format: text, json or sarif (SARIF 2.1.0).")] = "text",
    rules: Annotated[list[str] | None, typer.Option(
        "--rules", help="Rules to enable, comma-separated codes or prefixes (TS001,TS00); "
                        "replaces the config's select and ignore.")] = None,
    ignore: Annotated[list[str] | None, typer.Option(
        "--ignore", help="Rules to disable, comma-separated codes or prefixes; added to the "
                         "config's ignore.")] = None,
    config: Annotated[str | None, typer.Option(
        "--config", help="pyproject.toml whose tool.torchscope.lint table to use.",
        show_default="the nearest one above the first PATH that has one")] = None,
    no_config: Annotated[bool, typer.Option(
        "--no-config", help="Ignore every pyproject.toml.")] = False,
    output_file: Annotated[str | None, typer.Option(
        "--output-file", help="Write the report to this file instead of stdout.")] = None,
    output: Annotated[str | None, typer.Option(
        "--output", hidden=True, help="Deprecated spelling of --output-file.")] = None,
    no_fixes: Annotated[bool, typer.Option(
        "--no-fixes", help="Text format: do not print the fix under each finding.")] = False,
    exit_zero: Annotated[bool, typer.Option(
        "--exit-zero", help="Exit 0 even when there are findings (files that cannot be "
                            "checked still exit 2); for CI steps that upload SARIF.")] = False,
    debug: DebugOpt = False,
) -> None:
    """Lint PyTorch code for hook leaks, per-step compiles, empty_cache fixes and host syncs.

    Exit status: 0 clean (info notes allowed), 1 a warning or an error, 2 usage error or a
    file that cannot be read or parsed.
    Silence one line with `# noqa: TS001` (or a bare `# noqa`).
    """
    with guarded(debug):
        # -o is --out (a folder) in every command; lint writes one file, so it has none.
        option = "--output" if output is not None and output_file is None else "--output-file"
        output = output_file if output_file is not None else output
        check_output(output, option)
        from torchscope.lint import lint_paths
        from torchscope.report.lint import json_payload, sarif_log, text_lines

        if fmt not in _FORMATS:
            fail(f"unknown --format {fmt!r}; expected one of {', '.join(_FORMATS)}.")
        selected = None if rules is None else split_commas(*rules)
        if selected is not None and not selected:
            fail("--rules lists no rule code; lint would check nothing. Fix: pass codes or "
                 "prefixes such as --rules TS001,TS00, or drop --rules.")
        if config is not None and no_config:
            fail("--config and --no-config contradict each other; pass one.")
        result = lint_paths(
            paths or ["."], select=selected, ignore=split_commas(*ignore or ()),
            config=config if config is not None else not no_config,
        )
        for note in result.notes:
            err_console.print(f"note: {note}", highlight=False, markup=False)
        if fmt == "text":
            lines = text_lines(result, show_fixes=not no_fixes)
            if output:
                with writing(option, output):
                    Path(output).write_text("\n".join(t.plain for t in lines) + "\n")
            else:
                for line in lines:
                    console.print(line, soft_wrap=True, highlight=False)
        else:
            payload = json_payload(result) if fmt == "json" else sarif_log(result)
            text = json.dumps(payload, indent=2) + "\n"
            if output:
                with writing(option, output):
                    Path(output).write_text(text)
            else:
                sys.stdout.write(text)
                sys.stdout.flush()
        if output:
            err_console.print(f"wrote {output}", highlight=False, markup=False)
    code = result.exit_code
    raise typer.Exit(0 if exit_zero and code == 1 else code)
