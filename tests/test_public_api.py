"""The public API: one table in `torchscope/__init__.py`, the docs' API list, parallel names
and signatures, and one way to read findings from every result."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
import typing
from pathlib import Path

import pytest

import torchscope
from torchscope.findings import Analyzed

ROOT = Path(__file__).resolve().parents[1]
API_PAGE = ROOT / "docs" / "api.md"
INIT = ROOT / "src" / "torchscope" / "__init__.py"
SUBPACKAGES = ("capture", "grads", "memory", "profiling", "compile", "lint", "doctor", "lab",
               "monitoring", "hooks", "models", "errors", "findings", "step", "report")


def _docs_api() -> list[str]:
    return re.findall(r"^\| `([A-Za-z_]+)`", API_PAGE.read_text(), flags=re.M)


def test_all_is_small_and_generated_from_one_table() -> None:
    assert len(torchscope.__all__) <= 25
    assert list(torchscope.__all__) == list(torchscope._API)
    assert len(set(torchscope.__all__)) == len(torchscope.__all__)


def test_the_docs_list_exactly_the_public_api() -> None:
    assert sorted(_docs_api()) == sorted(torchscope.__all__)


def test_type_checking_imports_match_the_table() -> None:
    tree = ast.parse(INIT.read_text())
    typed: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom)
                for alias in imp.names:
                    typed[alias.name] = str(imp.module)
    assert typed == torchscope._API


@pytest.mark.parametrize("name", torchscope.__all__)
def test_every_name_resolves_to_where_the_table_says(name: str) -> None:
    value = getattr(torchscope, name)
    module = importlib.import_module(torchscope._API[name])
    assert getattr(module, name) is value


def _public_objects() -> dict[int, list[str]]:
    """id(object) -> the subpackage `__all__` entries that export it."""
    found: dict[int, list[str]] = {}
    for sub in SUBPACKAGES:
        module = importlib.import_module(f"torchscope.{sub}")
        for name in getattr(module, "__all__", ()):
            value = getattr(module, name)
            if inspect.isclass(value) or inspect.isfunction(value):
                found.setdefault(id(value), []).append(f"torchscope.{sub}.{name}")
    return found


def test_each_public_object_has_one_subpackage_path() -> None:
    twice = [paths for paths in _public_objects().values() if len(paths) > 1]
    assert not twice, f"exported by more than one subpackage: {twice}"


def _public_callables() -> list[tuple[str, typing.Any]]:
    out = []
    for sub in SUBPACKAGES:
        module = importlib.import_module(f"torchscope.{sub}")
        for name in getattr(module, "__all__", ()):
            value = getattr(module, name)
            if inspect.isfunction(value):
                out.append((f"torchscope.{sub}.{name}", value))
            elif inspect.isclass(value) and (
                    not dataclasses.is_dataclass(value) or name.endswith("Options")):
                # Records name what they hold (`StepInfo.loss` is a description); only
                # callables and option objects take the parallel parameters.
                out.append((f"torchscope.{sub}.{name}", value.__init__))
    return out


def test_parameter_names_are_parallel() -> None:
    odd = []
    for path, fn in _public_callables():
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            continue
        for bad, good in (("targets", "target"), ("loss", "loss_fn")):
            if bad in params:
                odd.append(f"{path}({bad}=) should be {good}=")
    assert not odd, odd


ONE_SHOT_RESULTS = {
    "capture_activations": "ActivationCapture",
    "gradient_flow": "GradFlow",
    "analyze_memory": "MemoryReport",
    "profile_steps": "ProfileResult",
    "compile_report": "CompileReport",
    "lint_paths": "LintResult",
    "run_doctor": "DoctorReport",
    "run_lab": "LabResult",
}


@pytest.mark.parametrize(("name", "result"), sorted(ONE_SHOT_RESULTS.items()))
def test_every_result_gives_findings_the_same_way(name: str, result: str) -> None:
    fn = getattr(torchscope, name)
    hints = typing.get_type_hints(fn)
    returned = hints["return"]
    assert returned.__name__ == result
    assert issubclass(returned, Analyzed), f"{result} does not derive from Analyzed"


LOOP_MANAGERS = ("watch_activations", "watch_gradients", "watch_memory", "watch_time")


@pytest.mark.parametrize("name", LOOP_MANAGERS)
def test_loop_managers_share_select_and_depth(name: str) -> None:
    params = inspect.signature(getattr(torchscope, name)).parameters
    assert "select" in params and "depth" in params


@pytest.mark.parametrize("name", ["capture_activations", "gradient_flow", "analyze_memory",
                                  "profile_steps", "compile_report"])
def test_one_shot_functions_take_a_step_or_model_and_the_same_step_options(name: str) -> None:
    params = inspect.signature(getattr(torchscope, name)).parameters
    first = next(iter(params.values()))
    assert "Step" in str(first.annotation)
    if name != "capture_activations":  # a forward needs no loss
        # compile measures forward, loss and backward on private copies: no optimizer step.
        options = ("loss_fn", "target") if name == "compile_report" else (
            "loss_fn", "target", "optimizer")
        for option in options:
            assert option in params, f"{name} lacks {option}="
            assert params[option].kind is inspect.Parameter.KEYWORD_ONLY
    for option in ("select", "depth"):
        if name != "compile_report":  # compile measures the whole model
            assert option in params, f"{name} lacks {option}="


def test_every_error_derives_from_torchscope_error() -> None:
    errors = []
    for sub in SUBPACKAGES:
        module = importlib.import_module(f"torchscope.{sub}")
        for name in getattr(module, "__all__", ()):
            value = getattr(module, name)
            if inspect.isclass(value) and issubclass(value, BaseException) and \
                    not issubclass(value, Warning):
                errors.append(value)
    assert errors
    for err in errors:
        assert issubclass(err, torchscope.TorchscopeError), err
