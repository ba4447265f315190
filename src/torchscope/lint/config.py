"""`[tool.torchscope.lint]` in pyproject.toml: `select`, `ignore` and `exclude`.

```toml
[tool.torchscope.lint]
select = ["TS"]            # codes or prefixes; default: every rule
ignore = ["TS007"]
exclude = ["tests/lint/fixtures/"]   # gitignore syntax, relative to this file's folder
```
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchscope.lint.rules import LintUsageError

_KEYS = ("select", "ignore", "exclude")


@dataclass(frozen=True)
class LintConfig:
    """Lint settings read from a pyproject.toml.

    Attributes:
        select: rule codes or prefixes to enable; None enables every rule.
        ignore: rule codes or prefixes to disable.
        exclude: gitignore-style patterns, relative to `root`.
        root: folder of the pyproject.toml (or the current folder without one).
        source: the pyproject.toml the settings came from, if any.
        notes: remarks for the user (e.g. a config that could not be read on this Python).
    """

    select: tuple[str, ...] | None = None
    ignore: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    root: Path = Path()
    source: Path | None = None
    notes: tuple[str, ...] = ()


def _toml_loader() -> Callable[[str], dict[str, Any]] | None:
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib.loads
    try:  # Python 3.10: the tomli backport, when installed
        import tomli
    except ModuleNotFoundError:
        return None
    loads: Callable[[str], dict[str, Any]] = tomli.loads
    return loads


def find_config(start: Path) -> Path | None:
    """The nearest pyproject.toml at or above `start` that has a `[tool.torchscope.lint]`."""
    folder = start.resolve()
    if folder.is_file():
        folder = folder.parent
    for candidate in (folder, *folder.parents):
        pyproject = candidate / "pyproject.toml"
        try:
            text = pyproject.read_text(encoding="utf-8")
        except OSError:
            continue
        if "torchscope.lint" in text:  # the table, or a dotted key of it
            return pyproject
    return None


def _strings(table: dict[str, Any], key: str, source: Path) -> tuple[str, ...] | None:
    if key not in table:
        return None
    value = table[key]
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise LintUsageError(
            f"{source}: [tool.torchscope.lint] {key} is {value!r}; expected a list of strings.",
            fix=f'write it as {key} = ["TS001"].')
    return tuple(value)


def load_config(path: Path) -> LintConfig:
    """Read `[tool.torchscope.lint]` from one pyproject.toml.

    On Python 3.10 without `tomli` the file cannot be read; the settings are then ignored
    and `notes` says so.

    Raises:
        LintUsageError: the file is unreadable or not TOML, or the table has unknown keys or
            wrong types.
    """
    root = path.resolve().parent
    loads = _toml_loader()
    if loads is None:
        return LintConfig(root=root, notes=(
            f"{path}: [tool.torchscope.lint] ignored: reading pyproject.toml needs Python 3.11+ "
            "(tomllib) or the tomli package.",))
    try:
        data = loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise LintUsageError(f"cannot read {path}: {exc.strerror or exc}.",
                             fix="check the --config path.") from exc
    except ValueError as exc:  # tomllib.TOMLDecodeError subclasses ValueError
        raise LintUsageError(f"{path} is not valid TOML: {exc}.",
                             fix="fix the TOML syntax.") from exc
    table = data.get("tool", {}).get("torchscope", {}).get("lint")
    if table is None:
        return LintConfig(root=root, source=path)
    if not isinstance(table, dict):
        raise LintUsageError(f"{path}: tool.torchscope.lint is not a table.",
                             fix="write it as a [tool.torchscope.lint] table.")
    unknown = sorted(set(table) - set(_KEYS))
    if unknown:
        raise LintUsageError(
            f"{path}: unknown key(s) {', '.join(unknown)} in [tool.torchscope.lint].",
            fix=f"use only {', '.join(_KEYS)}.")
    return LintConfig(
        select=_strings(table, "select", path),
        ignore=_strings(table, "ignore", path) or (),
        exclude=_strings(table, "exclude", path) or (),
        root=root,
        source=path,
    )
