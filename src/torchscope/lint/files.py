"""Find the Python files to lint: recurse into folders, honour `.gitignore`-style excludes."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from torchscope.lint.rules import LintUsageError

__all__ = ["DEFAULT_EXCLUDES", "IgnoreRules", "discover"]

# Folders nobody wants linted (tool caches, virtual environments, vendored packages).
DEFAULT_EXCLUDES: tuple[str, ...] = (
    ".bzr/", ".direnv/", ".eggs/", ".git/", ".hg/", ".mypy_cache/", ".nox/", ".pytest_cache/",
    ".ruff_cache/", ".svn/", ".tox/", ".venv/", "venv/", "__pypackages__/", "__pycache__/",
    "_build/", "buck-out/", "dist/", "node_modules/", "site-packages/", "*.egg-info/",
)


@dataclass(frozen=True)
class _Pattern:
    base: Path
    regex: re.Pattern[str]
    negate: bool
    dir_only: bool


def _translate(glob: str) -> str:
    """A gitignore glob (already stripped of `!`, leading and trailing `/`) as a regex."""
    out: list[str] = []
    i, n = 0, len(glob)
    while i < n:
        c = glob[i]
        if glob.startswith("**/", i) and (i == 0 or glob[i - 1] == "/"):
            out.append("(?:.*/)?")
            i += 3
        elif glob.startswith("**", i) and i + 2 == n and (i == 0 or glob[i - 1] == "/"):
            out.append(".*")
            i += 2
        elif c == "*":
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[":
            j = glob.find("]", i + 2 if glob[i + 1:i + 2] in ("!", "^") else i + 1)
            if j == -1:
                out.append(re.escape(c))
                i += 1
                continue
            body = glob[i + 1:j]
            if body[:1] in ("!", "^"):
                body = "^" + body[1:]
            out.append(f"[{body.replace(chr(92), chr(92) * 2)}]")
            i = j + 1
        elif c == "\\" and i + 1 < n:
            out.append(re.escape(glob[i + 1]))
            i += 2
        else:
            out.append(re.escape(c))
            i += 1
    return "".join(out)


def _parse_line(line: str, base: Path) -> _Pattern | None:
    line = line.rstrip("\n").rstrip("\r")
    if not line.endswith("\\ "):
        line = line.rstrip(" ")
    if not line or line.startswith("#"):
        return None
    negate = line.startswith("!")
    if negate or line.startswith(("\\!", "\\#")):
        line = line[1:]
    dir_only = line.endswith("/")
    line = line.rstrip("/")
    if not line:
        return None
    anchored = "/" in line
    line = line.lstrip("/")
    regex = _translate(line)
    if not anchored:
        regex = "(?:.*/)?" + regex
    return _Pattern(base, re.compile(regex + r"\Z"), negate, dir_only)


class IgnoreRules:
    """An ordered list of gitignore patterns, each relative to the folder it came from."""

    def __init__(self, patterns: Iterable[_Pattern] = ()) -> None:
        self._patterns: list[_Pattern] = list(patterns)

    def add_lines(self, lines: Iterable[str], base: Path) -> IgnoreRules:
        """A copy with the patterns in `lines` (gitignore syntax) appended, relative to `base`."""
        new = [p for p in (_parse_line(line, base.resolve()) for line in lines) if p is not None]
        return IgnoreRules([*self._patterns, *new]) if new else self

    def add_file(self, path: Path) -> IgnoreRules:
        """A copy with the patterns of a `.gitignore` file appended (unreadable: unchanged)."""
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return self
        return self.add_lines(text.splitlines(), path.parent)

    def ignored(self, path: Path, *, is_dir: bool) -> bool:
        """Whether `path` (absolute) is excluded; the last matching pattern wins, as in git."""
        resolved = path if path.is_absolute() else path.resolve()
        verdict = False
        for pattern in self._patterns:
            if pattern.dir_only and not is_dir:
                continue
            try:
                rel = resolved.relative_to(pattern.base).as_posix()
            except ValueError:
                continue
            if rel != "." and pattern.regex.match(rel):
                verdict = not pattern.negate
        return verdict


def _inherited(start: Path, rules: IgnoreRules) -> IgnoreRules:
    """Add the `.gitignore` files of `start`'s parents, from the repository root down."""
    chain = [start, *start.parents]
    root = next((i for i, folder in enumerate(chain) if (folder / ".git").exists()), None)
    for folder in reversed(chain[1:root + 1] if root is not None else []):
        rules = rules.add_file(folder / ".gitignore")
    return rules


def discover(paths: Iterable[str | Path], *, exclude: Iterable[str] = (),
             exclude_base: Path | None = None, use_gitignore: bool = True) -> Iterator[Path]:
    """Yield the `.py` files under `paths`, sorted within each folder.

    Files named explicitly are always yielded. Inside folders, `DEFAULT_EXCLUDES`, `exclude`
    (gitignore syntax, relative to `exclude_base`, default the current folder) and every
    `.gitignore` from the repository root down are honoured.

    Args:
        paths: files and folders.
        exclude: extra gitignore-style patterns to skip inside folders.
        exclude_base: the folder `exclude` patterns are relative to.
        use_gitignore: honour `.gitignore` files.

    Raises:
        LintUsageError: a path does not exist.
    """
    base_rules = IgnoreRules().add_lines(DEFAULT_EXCLUDES, Path("/"))
    base_rules = base_rules.add_lines(exclude, exclude_base or Path.cwd())
    seen: set[Path] = set()
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise LintUsageError(f"path {str(raw)!r} does not exist.",
                                 fix="pass existing files or folders.")
        if path.is_file():
            if path.resolve() not in seen:
                seen.add(path.resolve())
                yield path
            continue
        absolute = path.resolve()
        rules = _inherited(absolute, base_rules) if use_gitignore else base_rules
        for found, found_abs in _walk(path, absolute, rules, use_gitignore):
            if found_abs not in seen:
                seen.add(found_abs)
                yield found


def _walk(folder: Path, absolute: Path, rules: IgnoreRules, use_gitignore: bool
          ) -> Iterator[tuple[Path, Path]]:
    """(path as shown, absolute path) of every file to lint under `folder`."""
    if use_gitignore:
        rules = rules.add_file(absolute / ".gitignore")
    try:
        entries = sorted(os.scandir(absolute), key=lambda e: e.name)
    except OSError:
        return
    for entry in entries:
        try:
            is_dir = entry.is_dir(follow_symlinks=False)
        except OSError:
            continue
        entry_abs = absolute / entry.name
        if rules.ignored(entry_abs, is_dir=is_dir):
            continue
        if is_dir:
            yield from _walk(folder / entry.name, entry_abs, rules, use_gitignore)
        elif entry.name.endswith(".py") and entry.is_file():
            yield folder / entry.name, entry_abs
