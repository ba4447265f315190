"""Load a TARGET (a built-in name, `file.py:factory`, `pkg.module:factory`) and its inputs."""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, TracebackType
from typing import Any

import torch
from torch import nn

from torchscope._process import seeded
from torchscope.errors import InputSpecError, ModelError, TargetError, TorchscopeError, describe
from torchscope.models.spec import parse_spec
from torchscope.models.zoo import BUILTINS

DEFAULT_TARGET = "tiny-cnn"


@dataclass(frozen=True)
class ModelInputs:
    """Example inputs for a model call: `model(*args, **kwargs)`."""

    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    @staticmethod
    def of(value: Any) -> ModelInputs:
        """Wrap what a factory or `make_inputs` returned: a tensor, a tuple/list, or a dict."""
        if isinstance(value, ModelInputs):
            return value
        if isinstance(value, Mapping):
            return ModelInputs((), dict(value))
        if isinstance(value, (tuple, list)):
            return ModelInputs(tuple(value))
        return ModelInputs((value,))

    def to(self, device: torch.device | str) -> ModelInputs:
        """The same inputs with every tensor moved to `device`."""

        def move(v: Any) -> Any:
            return v.to(device) if isinstance(v, torch.Tensor) else v

        return ModelInputs(
            tuple(move(a) for a in self.args), {k: move(v) for k, v in self.kwargs.items()}
        )

    def describe(self) -> str:
        """Shapes for messages: `(32x3x32x32)` or `(input_ids=4x128)`."""

        def one(v: Any) -> str:
            if isinstance(v, torch.Tensor):
                return "x".join(map(str, v.shape)) or "scalar"
            return type(v).__name__

        parts = [one(a) for a in self.args] + [f"{k}={one(v)}" for k, v in self.kwargs.items()]
        return "(" + ", ".join(parts) + ")"


@dataclass(frozen=True)
class LoadedTarget:
    """A model loaded from a TARGET, with the example inputs its factory gave (if any)."""

    name: str
    model: nn.Module
    inputs: ModelInputs | None


def _import_file(path: Path) -> ModuleType:
    mod_name = f"_torchscope_target_{abs(hash(path.resolve()))}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise TargetError(f"cannot import {path} as Python.", fix="point at a .py file.")
    module = importlib.util.module_from_spec(spec)
    # Let the file import its siblings, as `python file.py` would.
    sys.path.insert(0, str(path.resolve().parent))
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise TargetError(
            f"importing {path} raised {type(exc).__name__}: {exc}.",
            fix=f"fix the error in that file (run `python {path}` to see it), or --debug.",
        ) from exc
    finally:
        sys.path.remove(str(path.resolve().parent))
    return module


def _resolve(target: str) -> tuple[ModuleType, str, str]:
    if ":" not in target:
        raise TargetError(
            f"target {target!r} is neither a built-in model nor 'file.py:factory'.",
            fix=f"use one of {', '.join(BUILTINS)}, 'path/to/file.py:build' or 'pkg.mod:build'.",
        )
    where, _, attr = target.rpartition(":")
    if not attr:
        raise TargetError(
            f"target {target!r} names no factory after ':'.", fix="write it as 'file.py:build'."
        )
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where)
        if not path.is_file():
            raise TargetError(
                f"file {where!r} does not exist.",
                fix="check the path, relative to the current directory.",
            )
        return _import_file(path), attr, where
    try:
        module = importlib.import_module(where)
    except ModuleNotFoundError as exc:
        raise TargetError(
            f"module {where!r} cannot be imported ({exc}).",
            fix="check the module path, or install the package.",
        ) from exc
    except Exception as exc:
        raise TargetError(
            f"importing {where!r} raised {type(exc).__name__}: {exc}.",
            fix="fix the error in that module, or rerun with --debug.",
        ) from exc
    return module, attr, where


def _get_callable(module: ModuleType, attr: str, where: str) -> Callable[..., Any]:
    factory = getattr(module, attr, None)
    if factory is None:
        names = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
        # The file's own factories first: its imports (a transformers file's config and
        # model classes) would otherwise fill the list.
        names.sort(key=lambda n: getattr(vars(module)[n], "__module__", None) != module.__name__)
        close = difflib.get_close_matches(attr, names, n=3)
        hint = (
            f"did you mean {', '.join(close)}?"
            if close
            else f"callables there: {', '.join(names[:8])}."
        )
        raise TargetError(f"{where} has no attribute {attr!r}.", fix=hint)
    if not callable(factory):
        raise TargetError(
            f"{where}:{attr} is a {type(factory).__name__}, not a callable.",
            fix="point at a function that builds the model.",
        )
    return factory  # type: ignore[no-any-return]


def _call(spec: str, what: str, fix: str) -> Any:
    """Call the function `spec` names with no arguments, torch's generators seeded with 0.

    Raises:
        TargetError: `spec` names no callable.
        ModelError: the function raised.
    """
    fn = _get_callable(*_resolve(spec))
    try:
        with seeded(0):
            return fn()
    except SystemExit as exc:  # a script's `sys.exit()` reached through its factory
        raise ModelError(f"{what} {spec} called sys.exit({exc.code!r}).",
                         fix=f"{fix} without exiting (keep a script's exit under "
                         "`if __name__ == '__main__':`), or rerun with --debug.") from exc
    except Exception as exc:
        raise ModelError(f"{what} {spec} raised {type(exc).__name__}: {exc}.",
                         fix=f"{fix}, or rerun with --debug.") from exc


def source_files(*specs: str | None) -> tuple[str, ...]:
    """The user's Python files behind TARGET-style specs (`path/to/file.py:fn`, or
    `pkg.mod:fn` for a module outside site-packages), in order, each once; built-in names and
    installed packages give none."""
    out: dict[str, None] = {}
    for spec in specs:
        if spec is None or ":" not in spec:
            continue
        where = spec.rpartition(":")[0]
        if where.endswith(".py") or "/" in where or "\\" in where:
            path = Path(where)
        else:
            try:
                found = importlib.util.find_spec(where)
            except (ImportError, ValueError):
                continue
            if found is None or not found.origin or not found.origin.endswith(".py"):
                continue
            path = Path(found.origin)
            if any(part in ("site-packages", "dist-packages") for part in path.parts):
                continue
        if path.is_file():
            out[str(path)] = None
    return tuple(out)


def load_target(target: str | None = None) -> LoadedTarget:
    """Build the model a TARGET names.

    Args:
        target: a built-in name (`tiny-cnn`, `mlp`, `deep-mlp`, `resnet-mini`),
            `path/to/file.py:factory` or `package.module:factory`; None means `tiny-cnn`.
            The factory takes no arguments and returns a Module or `(Module, example_inputs)`.

    The model is built with torch's generators seeded with 0 (so the same TARGET gives the
    same weights and inputs in every run), inside `torch.random.fork_rng`: the caller's
    random streams continue as if nothing had run, even if the factory reseeds.

    Raises:
        TargetError: the target cannot be found or returns something other than a Module.
        ModelError: the factory raised.
    """
    target = target or DEFAULT_TARGET
    if target in BUILTINS:
        b = BUILTINS[target]
        with seeded(0):
            return LoadedTarget(target, b.build(), ModelInputs.of(b.example_input()))
    built = _call(target, "factory", "fix the factory so it builds the model with no arguments")
    inputs: ModelInputs | None = None
    if isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], nn.Module):
        built, raw = built
        inputs = ModelInputs.of(raw)
    if not isinstance(built, nn.Module):
        raise TargetError(
            f"factory {target} returned {type(built).__name__}, not a torch.nn.Module.",
            fix="return the model, or a (model, example_inputs) tuple.",
        )
    return LoadedTarget(target, built, inputs)


def load_inputs(
    loaded: LoadedTarget, specs: Sequence[str] = (), inputs_fn: str | None = None
) -> ModelInputs:
    """Pick the example inputs: `--inputs fn`, then `--input SPEC`s, then the factory's own.

    Args:
        loaded: the loaded target (its example inputs are the last resort).
        specs: `--input` SPECs, one per positional input.
        inputs_fn: `file.py:fn` or `package.module:fn` returning the inputs.

    Raises:
        InputSpecError: a SPEC is malformed, or no inputs are known for this model.
        TargetError: the `--inputs` function cannot be loaded.
        ModelError: the `--inputs` function raised.
    """
    if inputs_fn:
        return ModelInputs.of(_call(inputs_fn, "inputs function", "fix that function"))
    if specs:
        g = torch.Generator().manual_seed(0)
        return ModelInputs(tuple(parse_spec(s).make(g) for s in specs))
    if loaded.inputs is not None:
        return loaded.inputs
    raise InputSpecError(
        f"no example input is known for {loaded.name}.",
        fix="pass --input SHAPE (e.g. --input 32x3x32x32) or --inputs file.py:make_inputs.",
    )


def _failing_module(model: nn.Module, tb: TracebackType | None) -> str:
    """`name (Type)` of the innermost module of `model` whose forward is in the traceback;
    the model's type name when none is."""
    names = {id(m): n for n, m in model.named_modules()}
    label = type(model).__name__
    for frame, _ in traceback.walk_tb(tb):
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names:
            label = f"{names[id(owner)] or '<root>'} ({type(owner).__name__})"
    return label


def call_model(model: nn.Module, inputs: ModelInputs) -> Any:
    """Run `model(*inputs.args, **inputs.kwargs)`, turning a failure into a `ModelError`.

    The message names the innermost module that raised and the input shapes, so a shape
    mismatch reads as "conv1 (Conv2d) raised ... with inputs (32x4x32x32)".
    """
    try:
        return model(*inputs.args, **inputs.kwargs)
    except TorchscopeError:
        raise  # raised on purpose by a torchscope hook: already says what to do
    except Exception as exc:
        label = _failing_module(model, exc.__traceback__)
        # DDP's reducer raises in the next forward when a parameter got no gradient in the
        # last backward: the inputs are not at fault.
        unused = "Expected to have finished reduction in the prior iteration" in str(exc)
        raise ModelError(
            f"the model raised in {label}: {describe(exc)} "
            f"(inputs {inputs.describe()}).",
            fix="a parameter that requires grad got no gradient in the previous step: wrap "
            "the model with DistributedDataParallel(..., find_unused_parameters=True), or "
            "make every trainable parameter take part in the loss (freeze the others)."
            if unused else
            "pass inputs that fit the model (on the command line: --input SHAPE or --inputs "
            "file.py:fn); the model's own exception is this error's __cause__, and its "
            "traceback what --debug shows.",
        ) from exc
