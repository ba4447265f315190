"""Module selection shared by every capability: globs, type names, classes, predicates, depth."""

from __future__ import annotations

import difflib
import fnmatch
import functools
import re
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn
from torch.nn.utils import parametrize

from torchscope.errors import SelectionError

__all__ = ["Selector", "holds_parameters", "hookable_modules", "own_parameters",
           "parametrization_owners",
           "select_modules"]

Predicate = Callable[[str, nn.Module], bool]
Selector = str | type[nn.Module] | Predicate | Sequence["str | type[nn.Module]"] | None


def hookable_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """`model.named_modules()` without TorchScript modules and what is inside them: a
    `torch.jit.ScriptModule` runs compiled code that calls no Python hook, and refuses to
    take one (`register_forward_hook` raises). Their parameters still get gradients."""
    out: list[tuple[str, nn.Module]] = []
    scripted: list[str] = []
    for name, module in model.named_modules():
        if any(name == s or name.startswith(s + ".") for s in scripted):
            continue
        if isinstance(module, torch.jit.ScriptModule):
            scripted.append(name)
            continue
        out.append((name, module))
    return out


def parametrization_owners(model: nn.Module) -> dict[str, str]:
    """The modules of `torch.nn.utils.parametrize` in `model` (a parametrized module's
    `parametrizations` dict, its lists and the parametrizations in them: `weight_norm`,
    `spectral_norm`, `orthogonal`), each mapped to the name of the module it parametrizes.

    They compute that module's weight when it reads it, not an activation: the weight and
    the parameters it is computed from belong to that module.
    """
    out: dict[str, str] = {}
    for name, module in model.named_modules():
        if parametrize.is_parametrized(module):
            prefix = f"{name}.parametrizations" if name else "parametrizations"
            dicts = module.parametrizations
            assert isinstance(dicts, nn.Module)
            for sub, _ in dicts.named_modules(prefix=prefix):
                out[sub] = name
    return out


def own_parameters(module: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """A module's own parameters: those registered on it, and for a module parametrized by
    `torch.nn.utils.parametrize`, the ones its weights are computed from
    (`parametrizations.weight.original`), which sit on its submodules."""
    yield from module.named_parameters(recurse=False)
    if parametrize.is_parametrized(module):
        dicts = module.parametrizations
        assert isinstance(dicts, nn.Module)
        yield from dicts.named_parameters(prefix="parametrizations")


def holds_parameters(module: nn.Module) -> bool:
    """Whether `module` has parameters of its own (`own_parameters`), not only in children:
    it computes with them itself, so its output is more than its last child's."""
    return next(own_parameters(module), None) is not None


def _is_layer(module: nn.Module) -> bool:
    # What the default selection hooks: the leaves, and the modules that compute with
    # parameters of their own besides calling children. `nn.MultiheadAttention` does its
    # input projection and attention with its own weights and reads `out_proj`'s weights
    # without calling it; a mixture of experts' stacked expert weights sit on a module whose
    # only child is the activation. Leaves alone would hook neither.
    return _is_leaf(module) or holds_parameters(module)


def _is_leaf(module: nn.Module) -> bool:
    # The deepest module to hook: its children are all TorchScript (unhookable), or its own
    # parametrizations (they compute its weight).
    return all(isinstance(c, torch.jit.ScriptModule) for c in module.children()) or (
        parametrize.is_parametrized(module) and
        all(c is module.parametrizations or isinstance(c, torch.jit.ScriptModule)
            for c in module.children()))


def _depth(name: str) -> int:
    return 0 if name == "" else name.count(".") + 1


@functools.lru_cache(maxsize=256)
def _glob_regex(pattern: str) -> re.Pattern[str]:
    # Names are dotted paths: `*` stays within one level, `**` crosses levels.
    out = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^.]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^.]")
            i += 1
        elif pattern[i] == "[":
            end = pattern.find("]", i + 1)
            if end == -1:
                out.append(re.escape("["))
                i += 1
            else:
                out.append(fnmatch.translate(pattern[i : end + 1]).removeprefix("(?s:")[:-3])
                i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


def _matches_pattern(pattern: str, name: str, module: nn.Module) -> bool:
    if pattern == type(module).__name__:
        return True
    return _glob_regex(pattern).match(name) is not None


def select_modules(
    model: nn.Module,
    select: Selector = None,
    *,
    depth: int | None = None,
    include_root: bool = False,
) -> list[tuple[str, nn.Module]]:
    """Pick the modules of `model` that a capability should hook.

    Args:
        model: the model.
        select: what to pick.
            - None: the layers: the leaf modules (modules without children; a module
              parametrized by `torch.nn.utils.parametrize` counts as one, and its
              parametrizations are left out), and the modules with parameters of their
              own (`holds_parameters`: `nn.MultiheadAttention`, a mixture of experts'
              expert weights), which compute with them besides calling their children.
            - a string: a glob over qualified names (`layer*.conv1`; `*` stays within one
              dotted level, `**` crosses levels) or a type name (`Conv2d`); several may be
              joined with commas.
            - an `nn.Module` subclass: every instance of it.
            - a callable `(name, module) -> bool`.
            - a sequence of strings and classes: their union.
        depth: keep only modules at most this many levels below the root (the root is 0);
            with `select=None`, picks the modules exactly at this depth plus shallower leaves.
        include_root: let the root module be selected too.

    Returns:
        `(qualified_name, module)` pairs in registration order, each module once.

    Raises:
        SelectionError: a pattern matched nothing (the message lists close names), or
            `depth` is negative.
    """
    if depth is not None and depth < 0:
        raise SelectionError(
            f"depth={depth} selects no module; expected 0 (the root) or more levels.",
            fix="pass depth=1 for the root's children, or depth=None for no limit.",
        )
    # A TorchScript submodule takes no hook: left out, and its eager parent, whose only
    # child it may be, counts as a leaf.
    named = [(n, m) for n, m in hookable_modules(model) if include_root or n != ""]
    if select is None:
        # The layers (down to `depth`), and with a depth every module exactly there; never
        # the modules that compute a parametrized weight.
        owned = parametrization_owners(model)
        picked = [(n, m) for n, m in named if n not in owned and (
            _depth(n) == depth or (_is_layer(m) and (depth is None or _depth(n) < depth)))]
        if not picked and not include_root and _is_leaf(model):
            picked = [("", model)]
        return picked

    if depth is not None:
        named = [(n, m) for n, m in named if _depth(n) <= depth]
    if callable(select) and not isinstance(select, type):  # a class is callable too
        picked = [(n, m) for n, m in named if select(n, m)]
        if not picked:
            # A capture over no module would silently record nothing.
            raise SelectionError(
                f"the selection predicate matched no module of {type(model).__name__}"
                + (f" at depth <= {depth}" if depth is not None else "") + ".",
                fix="check the predicate against model.named_modules(); the root is never "
                "selected.",
            )
        return picked
    patterns: list[str | type[nn.Module]]
    if isinstance(select, str):
        patterns = [p.strip() for p in select.split(",") if p.strip()]
    elif isinstance(select, type):
        patterns = [select]
    else:
        patterns = list(select)
    if not patterns:
        raise SelectionError("the selection is an empty list.",
                             fix="pass None for the layers, or name some modules.")

    picked_ids: set[int] = set()
    for pattern in patterns:
        hits = [
            (n, m)
            for n, m in named
            if (isinstance(pattern, type) and isinstance(m, pattern))
            or (isinstance(pattern, str) and _matches_pattern(pattern, n, m))
        ]
        if not hits:
            raise _no_match(model, pattern)
        picked_ids.update(id(m) for _, m in hits)
    return [(n, m) for n, m in named if id(m) in picked_ids]


def _no_match(model: nn.Module, pattern: str | type[nn.Module]) -> SelectionError:
    names = [n for n, _ in model.named_modules() if n]
    types = sorted({type(m).__name__ for m in model.modules()})
    if isinstance(pattern, type):
        return SelectionError(
            f"no module of type {pattern.__name__} in {type(model).__name__}.",
            fix=f"select one of the types present: {', '.join(types[:12])}.",
        )
    close = difflib.get_close_matches(pattern, names + types, n=5, cutoff=0.5)
    hint = (
        f"close matches: {', '.join(close)}."
        if close
        else (f"module names look like: {', '.join(names[:6])}.")
    )
    return SelectionError(
        f"selection {pattern!r} matched no module of {type(model).__name__}.",
        fix=f"{hint} Globs match qualified names (e.g. 'layer*.conv1'); bare words match type "
        "names (e.g. 'Conv2d').",
    )
