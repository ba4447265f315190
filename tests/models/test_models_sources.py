"""`source_files`: the user's files behind TARGET specs, which the doctor lints."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from torchscope.models.target import source_files


def test_the_user_s_files_and_modules_but_not_built_ins_or_installed_packages(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "train.py"
    script.write_text("def build(): ...\n")
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "models.py").write_text("def build(): ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert source_files(f"{script}:build", f"{script}:inputs", None) == (str(script),)
    assert source_files("mypkg.models:build") == (str(package / "models.py"),)
    # A built-in model, an installed package, and what does not exist: nothing to lint.
    assert source_files("tiny-cnn", "transformers.models.gpt2.modeling_gpt2:GPT2Model",
                        f"{tmp_path / 'missing.py'}:build", "no_such_module_xyz:f") == ()
    sys.modules.pop("mypkg.models", None)
    sys.modules.pop("mypkg", None)
