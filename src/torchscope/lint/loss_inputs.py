"""TS014 and TS015: a loss or a clip fed the wrong thing.

TS014, probabilities where the loss expects logits or log-probabilities: `cross_entropy`
(or an `nn.CrossEntropyLoss`) given the output of `softmax`, which it then passes through
`log_softmax` again, and `nll_loss` (or an `nn.NLLLoss`) given `softmax`'s probabilities
where it expects `log_softmax`'s log-probabilities. The input is the softmax call itself, or
a name that every assignment of the function binds to one.

TS015, gradients clipped while a GradScaler still scales them: a function that calls
`scaler.scale(...)` and `scaler.step(...)` (one receiver, a GradScaler by its use) clips
with `torch.nn.utils.clip_grad_norm_`/`clip_grad_value_` and never calls
`scaler.unscale_(...)`, so the clip compares `max_norm` with the norm times the scale (65536
at the start).
"""

from __future__ import annotations

import ast

from torchscope.lint._astutil import (
    FUNCS,
    ImportMap,
    Tree,
    dotted,
    uses_torch,
    walk_local,
)

__all__ = ["check_ts014", "check_ts015", "is_clip"]

_SOFTMAX = frozenset({"torch.softmax", "torch.nn.functional.softmax", "torch.special.softmax"})
_CROSS_ENTROPY = ("torch.nn.functional.cross_entropy", "torch.nn.CrossEntropyLoss")
_NLL = ("torch.nn.functional.nll_loss", "torch.nn.NLLLoss")
_CLIPS = frozenset({"torch.nn.utils.clip_grad_norm_", "torch.nn.utils.clip_grad_value_",
                    "torch.nn.utils.clip_grad.clip_grad_norm_",
                    "torch.nn.utils.clip_grad.clip_grad_value_"})


def is_clip(call: ast.Call, imports: ImportMap) -> bool:
    """`torch.nn.utils.clip_grad_norm_`/`clip_grad_value_`, or a framework's method of that
    name (`accelerator.clip_grad_norm_`)."""
    func = call.func
    return imports.qualify(func) in _CLIPS or (
        isinstance(func, ast.Attribute) and func.attr in ("clip_grad_norm_", "clip_grad_value_"))


def _is_softmax(node: ast.AST, imports: ImportMap) -> bool:
    """`F.softmax(x)`, `torch.softmax(x)`, `x.softmax(dim)` or `nn.Softmax(dim)(x)`."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if imports.qualify(func) in _SOFTMAX:
        return True
    if isinstance(func, ast.Attribute) and func.attr == "softmax":
        # A tensor's method, on a name or on a call's result; not a module's function.
        root = (dotted(func.value) or "").partition(".")[0]
        return not imports.is_import(root)
    return isinstance(func, ast.Call) and imports.qualify(func.func) == "torch.nn.Softmax"


def _loss_modules(tree: Tree, imports: ImportMap) -> dict[str, str]:
    """Names bound to a loss module somewhere in the file (`criterion = nn.CrossEntropyLoss()`,
    `self.loss_fn = nn.NLLLoss()`), each with the module's qualified class."""
    out: dict[str, str] = {}
    for node in walk_local(tree.module.body):
        _bind_losses(node, imports, out)
    for func in tree.funcs:
        for node in walk_local(func.body):
            _bind_losses(node, imports, out)
    return out


def _bind_losses(node: ast.AST, imports: ImportMap, out: dict[str, str]) -> None:
    if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
        cls = imports.qualify(node.value.func)
        if cls in (_CROSS_ENTROPY[1], _NLL[1]):
            for t in node.targets:
                if (d := dotted(t)) is not None:
                    out[d] = cls


def check_ts014(tree: Tree, imports: ImportMap, calls: list[ast.Call]
                ) -> list[tuple[ast.Call, str]]:
    """Each loss call given softmax probabilities, with its message."""
    if not uses_torch(imports, calls) or not any(_is_softmax(c, imports) for c in calls):
        return []
    modules = _loss_modules(tree, imports)
    found: list[tuple[ast.Call, str]] = []
    for call in calls:
        if not call.args:
            continue
        kind = imports.qualify(call.func)
        kind = modules.get(dotted(call.func) or "", kind)
        if kind not in (*_CROSS_ENTROPY, *_NLL):
            continue
        arg = call.args[0]
        if isinstance(arg, ast.Name):
            scope = tree.scope(call)
            values = [n.value for n in walk_local(getattr(scope, "body", []))
                      if isinstance(n, ast.Assign)
                      and any(isinstance(t, ast.Name) and t.id == arg.id for t in n.targets)]
            if not values or not all(_is_softmax(v, imports) for v in values):
                continue
        elif not _is_softmax(arg, imports):
            continue
        loss, given = ast.unparse(call.func), ast.unparse(arg)
        if kind in _CROSS_ENTROPY:
            message = (f"`{loss}` gets `{given}`, softmax probabilities: cross-entropy "
                       "applies log_softmax itself, so the softmax is applied twice and the "
                       "gradient shrinks as the outputs saturate; pass the logits")
        else:
            message = (f"`{loss}` gets `{given}`, softmax probabilities: NLL loss expects "
                       "log-probabilities, so it computes -p instead of -log p; use "
                       "log_softmax, or cross_entropy on the logits")
        found.append((call, message))
    return found


def check_ts015(tree: Tree, imports: ImportMap, calls: list[ast.Call]
                ) -> list[tuple[ast.Call, str]]:
    """Each gradient clip in a function that scales the loss and steps through the same
    GradScaler without unscaling, with its message."""
    clips = [c for c in calls if imports.qualify(c.func) in _CLIPS]
    if not uses_torch(imports, calls) or not clips:
        return []
    found: list[tuple[ast.Call, str]] = []
    for func in {id(f): f for c in clips if isinstance(f := tree.scope(c), FUNCS)}.values():
        body = [n for n in walk_local(func.body) if isinstance(n, ast.Call)]
        by_method: dict[str, set[str]] = {}
        for c in body:
            if isinstance(c.func, ast.Attribute) and (r := dotted(c.func.value)) is not None:
                by_method.setdefault(c.func.attr, set()).add(r)
        scalers = by_method.get("scale", set()) & by_method.get("step", set())
        scalers -= by_method.get("unscale_", set())
        if not scalers:
            continue
        scaler = sorted(scalers)[0]
        for c in body:
            if imports.qualify(c.func) in _CLIPS:
                found.append((c, (
                    f"`{ast.unparse(c.func)}` clips gradients that `{scaler}.scale(...)` "
                    f"scaled, with no `{scaler}.unscale_(optimizer)` before it: max_norm is "
                    "compared with the norm times the loss scale (65536 at the start), so "
                    "every step is clipped far harder than meant")))
    return found
