"""TS013: a training loop that puts its model in eval mode and never back in train mode.

The classic: an evaluation at the end of each epoch calls `model.eval()`, and nothing calls
`model.train()` again, so every later epoch trains with dropout off and BatchNorm frozen on
its running statistics. The rule is conservative:

- a loop (any nesting, not a nested function) backpropagates: `loss.backward()`,
  `accelerator.backward(loss)`, `self.manual_backward(loss)` or `torch.autograd.backward`;
- in that loop, `m.eval()` (or `m.train(False)`) is called on a model that the loop also
  calls with gradients on (outside `torch.no_grad()`: a distillation teacher called under
  it and kept in eval mode is not flagged), or a function of this file that calls `.eval()`
  and never `.train()` is called with that model among its arguments;
- nothing in the loop calls `.train()` (or `.train(True)`), nor does a function of this file
  that the loop calls (one call deep, by name).
"""

from __future__ import annotations

import ast

from torchscope.lint._astutil import (
    ImportMap,
    Tree,
    dotted,
    in_grad_mode,
    is_backward,
    loops_around,
    uses_torch,
    walk_local,
)
from torchscope.lint.zero_grad import called_names

__all__ = ["check_ts013"]


def _mode_arg(call: ast.Call) -> bool | None:
    """The mode a `.train(...)` call sets: True without an argument, else its constant."""
    arg = call.args[0] if call.args else next(
        (k.value for k in call.keywords if k.arg == "mode"), None)
    if arg is None:
        return True
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, bool) else None


def _sets_eval(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return False
    if node.func.attr == "eval":
        return not node.args and not node.keywords
    return node.func.attr == "train" and _mode_arg(node) is False


def _sets_train(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
        node.func.attr == "train" and _mode_arg(node) is not False


def check_ts013(tree: Tree, imports: ImportMap, calls: list[ast.Call]
                ) -> list[tuple[ast.Call, str]]:
    """Each call that leaves a trained model in eval mode inside its training loop, with
    its message."""
    if not uses_torch(imports, calls):
        return []
    backwards = [c for c in calls if is_backward(c, imports)]
    if not backwards:
        return []
    evaluators: set[str] = set()  # functions of the file that call .eval() and not .train()
    trainers: set[str] = set()  # ...that call .train()
    for f in tree.funcs:
        body = list(walk_local(f.body))
        if any(map(_sets_train, body)):
            trainers.add(f.name)
        elif any(map(_sets_eval, body)):
            evaluators.add(f.name)
    found: list[tuple[ast.Call, str]] = []
    for loop in loops_around(tree, backwards):
        nodes = list(walk_local(loop.body))
        loop_calls = [n for n in nodes if isinstance(n, ast.Call)]
        if any(map(_sets_train, loop_calls)) or called_names(nodes) & trainers:
            continue
        scope = tree.scope(loop)
        # Models the loop runs with gradients on: those it trains (a teacher runs without).
        trained = {d for c in loop_calls
                   if (d := dotted(c.func)) is not None
                   and not in_grad_mode(tree, imports, c, scope)}
        for c in loop_calls:
            if _sets_eval(c):
                assert isinstance(c.func, ast.Attribute)
                model = dotted(c.func.value)
                if model not in trained:
                    continue
                what = f"`{ast.unparse(c)}`"
            elif isinstance(c.func, ast.Name) and c.func.id in evaluators:
                model = next((d for a in c.args if (d := dotted(a)) in trained), None)
                if model is None:
                    continue
                what = f"`{ast.unparse(c.func)}(...)`, which calls `.eval()`,"
            else:
                continue
            found.append((c, (
                f"{what} puts `{model}` in eval mode inside the loop that trains it, and "
                f"nothing in the loop calls `{model}.train()` again: every later step trains "
                "with dropout off and BatchNorm frozen on its running statistics")))
    return found
