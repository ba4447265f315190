"""The benchmark scripts are not run by the suite (they take minutes), but every name they
import from torchscope must exist, so that `make bench` does not fail on a renamed helper."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

BENCHMARKS = sorted((Path(__file__).parents[2] / "benchmarks").glob("*.py"))


def _is_submodule(name: str) -> bool:
    """`from package import module` names a submodule, which need not be imported yet."""
    try:
        importlib.import_module(name)
    except ModuleNotFoundError:
        return False
    return True


def test_there_are_benchmarks() -> None:
    assert len(BENCHMARKS) >= 5


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.name)
def test_every_torchscope_name_a_benchmark_imports_exists(path: Path) -> None:
    tree = ast.parse(path.read_text(), filename=str(path))
    missing = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torchscope"):
            module = importlib.import_module(node.module or "")
            missing += [f"{node.module}.{a.name}" for a in node.names
                        if not hasattr(module, a.name)
                        and not _is_submodule(f"{node.module}.{a.name}")]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("torchscope"):
                    importlib.import_module(a.name)
    assert not missing, missing
