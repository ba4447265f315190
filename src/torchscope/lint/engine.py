"""Run the checker over files: read, parse, check, apply noqa, collect results."""

from __future__ import annotations

import ast
import io
import tokenize
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path

from torchscope.lint.checker import check_tree
from torchscope.lint.config import LintConfig, find_config, load_config
from torchscope.lint.files import discover
from torchscope.lint.noqa import noqa_map, suppressed
from torchscope.lint.records import LintError, LintResult, LintViolation
from torchscope.lint.rules import RULES, LintUsageError, resolve_codes


def _applies(source: str, codes: frozenset[str]) -> bool:
    """Whether any enabled rule can find something in `source` (its trigger words occur)."""
    return any(not RULES[c].triggers or any(w in source for w in RULES[c].triggers)
               for c in codes)


def _check(source: str, path: str, codes: frozenset[str]) -> list[LintViolation]:
    with warnings.catch_warnings():
        # Invalid escape sequences and the like are the user's linter's business, not ours.
        warnings.simplefilter("ignore")
        module = ast.parse(source, filename=path)
    if not _applies(source, codes):
        return []
    found = check_tree(module, source.splitlines(), path, codes)
    if not found or "noqa" not in source.lower():
        return found
    noqa = noqa_map(source)
    return [v for v in found if not suppressed(noqa, v.code, (v.line, v.end_line))]


def lint_source(source: str, path: str = "<string>", *, select: Iterable[str] | None = None,
                ignore: Iterable[str] = ()) -> list[LintViolation]:
    """Lint one piece of source code.

    Args:
        source: Python source text.
        path: name to put in the violations.
        select: rule codes or prefixes to enable (default: all).
        ignore: rule codes or prefixes to disable.

    Returns:
        Violations sorted by position, noqa comments applied.

    Raises:
        SyntaxError: the source does not parse.
        LintUsageError: `select`/`ignore` name no rule.
    """
    return _check(source, path, resolve_codes(select, ignore))


def lint_file(path: str | Path, codes: Iterable[str] | None = None
              ) -> tuple[list[LintViolation], LintError | None]:
    """Lint one file; a file that cannot be read or parsed gives a `LintError` instead."""
    shown = str(path)
    enabled = resolve_codes(None) if codes is None else frozenset(codes)
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        return [], LintError(shown, f"cannot read: {exc.strerror or exc}")
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(raw).readline)
        source = raw.decode(encoding)
    except (SyntaxError, UnicodeDecodeError, LookupError) as exc:
        return [], LintError(shown, f"cannot decode: {exc}")
    try:
        return _check(source, shown, enabled), None
    except SyntaxError as exc:
        return [], LintError(shown, f"cannot parse: {exc.msg}", exc.lineno, exc.offset)
    except (ValueError, RecursionError, MemoryError) as exc:
        return [], LintError(shown, f"cannot parse: {type(exc).__name__}: {exc}")
    except Exception as exc:  # a checker bug must not stop the other files
        return [], LintError(shown, f"internal error in torchscope lint "
                                    f"({type(exc).__name__}: {exc}); please report it")


def lint_paths(paths: Sequence[str | Path], *, select: Iterable[str] | None = None,
               ignore: Iterable[str] = (), config: str | Path | bool = True,
               use_gitignore: bool = True) -> LintResult:
    """Lint files and folders (recursively), the way `torchscope lint PATH...` does.

    Args:
        paths: files and folders.
        select: rule codes or prefixes to enable; replaces the config's `select` and
            `ignore`.
        ignore: rule codes or prefixes to disable, on top of the config's `ignore`.
        config: True finds the nearest pyproject.toml with `[tool.torchscope.lint]` above the
            first path; a path reads that file; False reads none.
        use_gitignore: honour `.gitignore` files.

    Returns:
        A `LintResult`; a file that cannot be read or parsed is an entry of `errors` and the
        other files are still linted.

    Raises:
        LintUsageError: no paths, a path that does not exist, paths that hold no Python
            file to lint, an unknown rule code, or an unusable config.
    """
    if not paths:
        raise LintUsageError("no PATH given.", fix="pass files or folders, e.g. `src`.")
    if config is True:
        found = find_config(Path(paths[0]))
        cfg = load_config(found) if found is not None else LintConfig(root=Path.cwd())
    elif config is False:
        cfg = LintConfig(root=Path.cwd())
    else:
        cfg = load_config(Path(config))
    if select is not None:
        # An explicit selection asks for exactly these rules: the config's choice is replaced.
        codes = resolve_codes(list(select), ignore)
    else:
        codes = resolve_codes(cfg.select, [*cfg.ignore, *ignore])
    violations: list[LintViolation] = []
    errors: list[LintError] = []
    files = 0
    for path in discover(paths, exclude=cfg.exclude, exclude_base=cfg.root,
                         use_gitignore=use_gitignore):
        files += 1
        found_v, error = lint_file(path, codes)
        violations.extend(found_v)
        if error is not None:
            errors.append(error)
    if not files:
        # Nothing checked is no pass: a mistyped or empty folder would let CI go green.
        shown = ", ".join(repr(str(p)) for p in paths)
        raise LintUsageError(
            f"{shown} {'holds' if len(paths) == 1 else 'hold'} no Python file to lint "
            "(.py, outside excluded and .gitignore'd paths).",
            fix="pass the folder or the files that hold your code, or check the path for "
                "a typo.")
    violations.sort(key=lambda v: (v.path, v.line, v.col, v.code))
    return LintResult(tuple(violations), tuple(errors), files, codes, cfg.notes,
                      str(cfg.root))
