"""TS010: a model called after `model.eval()` with gradients on.

`eval()` switches dropout and batch norm to inference; it does not stop autograd. A forward
run after it with gradients on builds the graph and keeps every activation it saves until
its output is dropped: evaluation pays training's memory. The rule is conservative:

- the call is `M(...)` or `M.forward(...)` after `M.eval()` in the same function (or module
  body), with no `M.train(...)` in between;
- no `torch.no_grad()`, `torch.inference_mode()`, `torch.enable_grad()` or
  `torch.set_grad_enabled(...)` encloses it, or decorates the function;
- the function runs no backward (`.backward()`, `torch.autograd.grad`) and asks for no
  gradient (`requires_grad_`): gradients there are meant (saliency, adversarial inputs);
- a function is judged only when this file calls it, and not when every such call runs with
  gradients off; module-level code always is.
"""

from __future__ import annotations

import ast

from torchscope.lint._astutil import (
    FUNCS,
    ImportMap,
    Tree,
    dotted,
    grad_mode_decorated,
    in_grad_mode,
    uses_torch,
)

__all__ = ["check_ts010"]

_GRAD_USES = frozenset({"backward", "requires_grad_", "manual_backward"})
_AUTOGRAD_GRAD = frozenset({"torch.autograd.grad"})


def _uses_grad(call: ast.Call, imports: ImportMap) -> bool:
    func = call.func
    if isinstance(func, ast.Attribute) and func.attr in _GRAD_USES:
        return True
    return imports.qualify(func) in _AUTOGRAD_GRAD


def _callers_with_grad(tree: Tree, imports: ImportMap, calls: list[ast.Call],
                       func: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Whether this file calls `func` (by its name) somewhere with gradients on."""
    for call in calls:
        f = call.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) \
            else None
        if name != func.name:
            continue
        scope = tree.scope(call)
        if in_grad_mode(tree, imports, call, scope) or grad_mode_decorated(scope, imports):
            continue
        return True
    return False


def _receiver(call: ast.Call, method: str) -> str | None:
    f = call.func
    return dotted(f.value) if isinstance(f, ast.Attribute) and f.attr == method else None


def check_ts010(tree: Tree, imports: ImportMap, calls: list[ast.Call]
                ) -> list[tuple[ast.Call, str]]:
    """Each model call after `.eval()` that runs with gradients on, with its message."""
    if not uses_torch(imports, calls):
        return []
    by_scope: dict[ast.AST, list[ast.Call]] = {}
    for call in calls:
        by_scope.setdefault(tree.scope(call), []).append(call)
    found: list[tuple[ast.Call, str]] = []
    for scope, local in by_scope.items():
        if not isinstance(scope, (ast.Module, *FUNCS)) or grad_mode_decorated(scope, imports) or \
                any(_uses_grad(c, imports) for c in local):
            continue
        if isinstance(scope, FUNCS) and not _callers_with_grad(tree, imports, calls, scope):
            continue
        for ev in local:
            model = _receiver(ev, "eval")
            if model is None or ev.args or ev.keywords:
                continue
            trains = [c.lineno for c in local if _receiver(c, "train") == model
                      and c.lineno > ev.lineno]
            until = min(trains, default=None)
            for call in local:
                if call.lineno <= ev.lineno or (until is not None and call.lineno >= until):
                    continue
                if dotted(call.func) != model and _receiver(call, "forward") != model:
                    continue
                if in_grad_mode(tree, imports, call, scope):
                    continue
                found.append((call, (
                    f"`{model}(...)` runs after `{model}.eval()` (line {ev.lineno}) with "
                    "gradients on: eval() changes dropout and batch norm, not autograd, so "
                    "this forward builds the graph and keeps its activations as in training")))
                break  # one finding per eval()
    return found
