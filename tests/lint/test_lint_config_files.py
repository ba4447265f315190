"""File discovery (.gitignore, excludes), pyproject config, and unreadable files."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchscope.lint import IgnoreRules, LintUsageError, discover, lint_paths, load_config
from torchscope.lint import config as config_mod

LEAK = "for x in data:\n    model.fc.register_forward_hook(save)\n"
CLEAN = "x = 1\n"


def _tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _rel(paths: list[Path], root: Path) -> list[str]:
    return sorted(p.resolve().relative_to(root.resolve()).as_posix() for p in paths)


def test_discover_recurses_and_honours_nested_gitignores(tmp_path: Path) -> None:
    (tmp_path / ".git").mkdir()
    _tree(tmp_path, {
        ".gitignore": "build/\n*_gen.py\n/top_only.py\n!keep_gen.py\n",
        "a.py": CLEAN, "top_only.py": CLEAN, "keep_gen.py": CLEAN, "x_gen.py": CLEAN,
        "pkg/b.py": CLEAN, "pkg/top_only.py": CLEAN, "pkg/y_gen.py": CLEAN,
        "pkg/.gitignore": "secret/\n", "pkg/secret/c.py": CLEAN,
        "build/d.py": CLEAN, ".venv/lib/e.py": CLEAN, "pkg/__pycache__/f.py": CLEAN,
        "notes.txt": "not python",
    })
    found = _rel(list(discover([tmp_path])), tmp_path)
    assert found == ["a.py", "keep_gen.py", "pkg/b.py", "pkg/top_only.py"]


def test_gitignore_of_parent_folders_applies_to_a_subfolder(tmp_path: Path) -> None:
    (tmp_path / ".git").mkdir()
    _tree(tmp_path, {".gitignore": "**/generated/\n", "src/generated/g.py": CLEAN,
                     "src/m.py": CLEAN})
    assert _rel(list(discover([tmp_path / "src"])), tmp_path) == ["src/m.py"]


def test_explicit_file_is_linted_even_if_ignored(tmp_path: Path) -> None:
    _tree(tmp_path, {".gitignore": "*.py\n", "a.py": LEAK})
    (tmp_path / ".git").mkdir()
    assert list(discover([tmp_path])) == []
    assert list(discover([tmp_path / "a.py"])) == [tmp_path / "a.py"]


@pytest.mark.parametrize(("pattern", "path", "is_dir", "ignored"), [
    ("*.py", "a/b.py", False, True),
    ("/b.py", "a/b.py", False, False),
    ("a/*.py", "a/b.py", False, True),
    ("a/*.py", "a/c/b.py", False, False),
    ("a/**/b.py", "a/x/y/b.py", False, True),
    ("a/**", "a/x/y/b.py", False, True),
    ("out/", "out", False, False),
    ("out/", "out", True, True),
    ("b?.py", "b1.py", False, True),
    ("b[0-9].py", "b7.py", False, True),
    ("b[!0-9].py", "b7.py", False, False),
    ("\\#x.py", "#x.py", False, True),
])
def test_gitignore_pattern_semantics(tmp_path: Path, pattern: str, path: str, is_dir: bool,
                                     ignored: bool) -> None:
    rules = IgnoreRules().add_lines([pattern], tmp_path)
    assert rules.ignored((tmp_path / path).resolve(), is_dir=is_dir) is ignored


def test_config_select_ignore_and_exclude(tmp_path: Path) -> None:
    _tree(tmp_path, {
        "pyproject.toml": '[tool.torchscope.lint]\nignore = ["TS002"]\n'
                          'exclude = ["vendored/"]\n',
        "src/a.py": LEAK, "vendored/v.py": LEAK,
    })
    result = lint_paths([tmp_path])
    assert [(Path(v.path).name, v.code) for v in result.violations] == [("a.py", "TS001")]
    assert result.files == 1
    assert result.root == str(tmp_path.resolve())
    # The command line adds to `ignore`; an explicit `select` replaces the config's choice.
    assert lint_paths([tmp_path], ignore=["TS001"]).violations == ()
    chosen = lint_paths([tmp_path], select=["TS002"]).violations
    assert [v.code for v in chosen] == ["TS002"]
    assert [v.code for v in lint_paths([tmp_path], config=False).violations] == [
        "TS001", "TS002", "TS001", "TS002"]


def test_nearest_pyproject_with_the_table_wins(tmp_path: Path) -> None:
    _tree(tmp_path, {
        "pyproject.toml": '[tool.torchscope.lint]\nselect = ["TS002"]\n',
        "sub/pyproject.toml": "[project]\nname = 'x'\n",
        "sub/a.py": LEAK,
    })
    assert [v.code for v in lint_paths([tmp_path / "sub"]).violations] == ["TS002"]


def test_bad_config_is_a_usage_error(tmp_path: Path) -> None:
    bad = tmp_path / "pyproject.toml"
    bad.write_text('[tool.torchscope.lint]\nselect = "TS999"\n')
    with pytest.raises(LintUsageError, match="TS999"):
        lint_paths([tmp_path])
    bad.write_text('[tool.torchscope.lint]\nselekt = ["TS001"]\n')
    with pytest.raises(LintUsageError, match="unknown key"):
        load_config(bad)
    bad.write_text('[tool.torchscope.lint\n')
    with pytest.raises(LintUsageError, match="not valid TOML"):
        load_config(bad)


def test_config_without_toml_reader_is_ignored_with_a_note(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # What Python 3.10 without tomli sees.
    monkeypatch.setattr(config_mod, "_toml_loader", lambda: None)
    _tree(tmp_path, {"pyproject.toml": '[tool.torchscope.lint]\nselect = ["TS003"]\n',
                     "a.py": LEAK})
    result = lint_paths([tmp_path])
    assert {v.code for v in result.violations} == {"TS001", "TS002"}
    assert len(result.notes) == 1 and "tomli" in result.notes[0]


def test_unknown_rule_and_missing_path_are_usage_errors(tmp_path: Path) -> None:
    with pytest.raises(LintUsageError, match="matches no rule"):
        lint_paths([tmp_path], select=["XY1"])
    with pytest.raises(LintUsageError, match="does not exist"):
        lint_paths([tmp_path / "nope"])


def test_parse_error_names_file_and_line_and_other_files_are_still_linted(
        tmp_path: Path) -> None:
    _tree(tmp_path, {"a_bad.py": "x = 1\ndef f(:\n    pass\n", "b.py": LEAK,
                     "c_bin.py": "", "d_enc.py": ""})
    (tmp_path / "c_bin.py").write_bytes(b"x = '\xff\xfe'\n")
    result = lint_paths([tmp_path], config=False)
    assert [Path(e.path).name for e in result.errors] == ["a_bad.py", "c_bin.py"]
    bad = result.errors[0]
    assert bad.line == 2 and "cannot parse" in bad.message
    assert "cannot decode" in result.errors[1].message
    assert {v.code for v in result.violations} == {"TS001", "TS002"}
    assert result.files == 4
    assert result.exit_code == 2


def test_unreadable_path_is_an_error_not_a_crash(tmp_path: Path) -> None:
    from torchscope.lint import lint_file

    violations, error = lint_file(tmp_path)  # a folder cannot be read as a file
    assert violations == []
    assert error is not None and error.message.startswith("cannot read")
    (tmp_path / "nul.py").write_bytes(b"x = 1\x00\n")
    _, error = lint_file(tmp_path / "nul.py")
    assert error is not None and error.message.startswith("cannot parse")


def test_encoding_cookie_and_bom_are_honoured(tmp_path: Path) -> None:
    from torchscope.lint import lint_file

    (tmp_path / "latin.py").write_bytes(
        b"# -*- coding: latin-1 -*-\ns = '\xe9'; m.register_forward_hook(f)\n")
    (tmp_path / "bom.py").write_bytes(b"\xef\xbb\xbfm.register_forward_hook(f)\n")
    (v,), err = lint_file(tmp_path / "latin.py")
    assert err is None and (v.line, v.col) == (2, 12)
    (w,), err = lint_file(tmp_path / "bom.py")
    assert err is None and (w.line, w.col) == (1, 3)


def test_a_checker_crash_is_reported_per_file(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from torchscope.lint import engine

    def boom(*args: object, **kwargs: object) -> list[object]:
        raise KeyError("bug")

    monkeypatch.setattr(engine, "check_tree", boom)
    _tree(tmp_path, {"a.py": LEAK})
    result = lint_paths([tmp_path], config=False)
    assert result.exit_code == 2
    assert "internal error" in result.errors[0].message
