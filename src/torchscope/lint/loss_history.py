"""TS011: a loss accumulated across loop iterations with its autograd history.

`total += loss` keeps `loss` as a tensor: the sum is a new node of the graph, which holds
the previous sum, which holds the step before, so every iteration's graph stays reachable
until the loop ends (the PyTorch FAQ's first out-of-memory cause). After `backward()` the
graph's saved tensors are freed and what grows is the nodes. The rule is conservative:

- inside a `for`/`while` body: `acc += L`, `acc = acc + L` (any arithmetic, `L` an
  operand, not inside a call) or `acc.append(L)`, `acc` a name, an attribute or a slot of a
  container (`metrics["loss"] += L`), where `acc` (or its container) is not rebound in the body
  and the function does not backpropagate `acc` itself (a sum of micro-batches' losses);
- `L` is a name the same body backpropagates (`L.backward()`, `scaler.scale(L).backward()`,
  `accelerator.backward(L)`, `self.manual_backward(L)`), so it is a training step's loss
  (loss terms summed in a loop inside a forward, and returned, are not), and the body does
  not rebind it detached (`L = L.item()`, `L.detach()`, `float(L)`);
- no `torch.no_grad()`/`torch.inference_mode()` encloses it or decorates the function.
"""

from __future__ import annotations

import ast

from torchscope.lint._astutil import (
    BACKWARD_METHODS,
    ImportMap,
    Tree,
    all_loops,
    dotted,
    grad_mode_decorated,
    in_grad_mode,
    refs,
    target_names,
    uses_torch,
    walk_local,
)

__all__ = ["check_ts011"]

# What leaves a tensor without history: methods (`.cpu()` and `.float()` keep it), and
# functions that make a Python number of it.
_DETACHING_METHODS = frozenset({"item", "detach", "tolist", "numpy"})
_DETACHING_FUNCTIONS = frozenset({"float", "int"})


def _detached(value: ast.AST, name: str) -> bool:
    """`value` is `name` without history: `name.item()`, `name.detach()`, `float(name)`."""
    if not isinstance(value, ast.Call):
        return isinstance(value, ast.Attribute) and value.attr == "data" and \
            dotted(value.value) == name
    func = value.func
    if isinstance(func, ast.Attribute) and func.attr in _DETACHING_METHODS:
        return name in {dotted(func.value)}
    if isinstance(func, ast.Name) and func.id in _DETACHING_FUNCTIONS:
        return any(dotted(a) == name for a in value.args)
    return False


def _carries(expr: ast.AST, name: str) -> bool:
    """`expr` is `name`, or arithmetic with `name` as an operand (no call in between: a
    call may detach it)."""
    if isinstance(expr, ast.Name):
        return expr.id == name
    if isinstance(expr, ast.BinOp):
        return _carries(expr.left, name) or _carries(expr.right, name)
    if isinstance(expr, ast.UnaryOp):
        return _carries(expr.operand, name)
    if isinstance(expr, ast.Subscript):
        return _carries(expr.value, name)
    return False


def _backpropagated(call: ast.Call) -> set[str]:
    """The names a backward call may backpropagate: `L.backward()`,
    `scaler.scale(L).backward()`, `accelerator.backward(L)`, `self.manual_backward(L)` (the
    receiver and the first argument: `out.backward(grad)` and `fabric.backward(loss)` read
    the same)."""
    func = call.func
    if not isinstance(func, ast.Attribute) or func.attr not in BACKWARD_METHODS:
        return set()
    out: set[str] = set()
    receiver = func.value
    if isinstance(receiver, ast.Name):
        out.add(receiver.id)
    elif isinstance(receiver, ast.Call) and isinstance(receiver.func, ast.Attribute) and \
            receiver.func.attr == "scale" and receiver.args and \
            isinstance(receiver.args[0], ast.Name):
        out.add(receiver.args[0].id)
    if call.args and isinstance(call.args[0], ast.Name):
        out.add(call.args[0].id)
    return out


def _feeds_backward(local: list[ast.AST], acc: str) -> bool:
    """The function backpropagates `acc`, or what it reads from it (`loss = losses[i]`,
    `for loss in losses:`, `torch.stack(losses).sum()`): the losses are kept for a backward
    on purpose (a sum of micro-batches' losses, passes run later)."""
    derived = {acc}
    grown = True
    while grown:  # what is read from `acc`, and from that, in any order
        before = len(derived)
        for node in local:
            if isinstance(node, ast.Assign) and refs(node.value) & derived:
                for t in node.targets:
                    derived |= target_names(t)
            elif isinstance(node, (ast.For, ast.AsyncFor)) and refs(node.iter) & derived:
                derived |= target_names(node.target)
        grown = len(derived) > before
    for node in local:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in BACKWARD_METHODS and \
                (refs(node.func.value) | set().union(*map(refs, node.args))) & derived:
            return True
    return False


def _held_in(node: ast.AST) -> str | None:
    """The accumulator `node` names, as written: `total`, `self.total`, `metrics["loss"]`
    (a slot of a container on a name); None for anything else."""
    if isinstance(node, ast.Subscript):
        return None if _held_in(node.value) is None else ast.unparse(node)
    return dotted(node)


def _container(node: ast.AST) -> str | None:
    """The name that holds the accumulator: `metrics` for `metrics["loss"]`."""
    while isinstance(node, ast.Subscript):
        node = node.value
    return dotted(node)


def _accumulation(stmt: ast.stmt) -> tuple[str, str, ast.AST] | None:
    """`(acc, its container, value)` for `acc += value`, `acc = acc <op> value` or
    `acc.append(value)`; `acc` a name, an attribute or a slot (`metrics["loss"]`)."""
    target: ast.AST | None = None
    value: ast.AST | None = None
    if isinstance(stmt, ast.AugAssign):
        target, value = stmt.target, stmt.value
    elif isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and \
            isinstance(stmt.value, ast.BinOp):
        target = stmt.targets[0]
        acc = _held_in(target)
        for side, other in ((stmt.value.left, stmt.value.right),
                            (stmt.value.right, stmt.value.left)):
            if acc is not None and _held_in(side) == acc:
                value = other
    elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
        call = stmt.value
        if isinstance(call.func, ast.Attribute) and call.func.attr == "append" and \
                len(call.args) == 1 and not call.keywords:
            target, value = call.func.value, call.args[0]
    if target is None or value is None:
        return None
    acc, container = _held_in(target), _container(target)
    return None if acc is None or container is None else (acc, container, value)


def check_ts011(tree: Tree, imports: ImportMap, calls: list[ast.Call]
                ) -> list[tuple[ast.stmt, str]]:
    """Each accumulation of a loss with its history inside a loop, with its message."""
    if not uses_torch(imports, calls):
        return []
    found: list[tuple[ast.stmt, str]] = []
    seen: set[int] = set()
    for loop in all_loops(tree):
        body = list(walk_local(loop.body))
        losses = set().union(*(_backpropagated(c) for c in body if isinstance(c, ast.Call)))
        bound: dict[str, list[ast.AST]] = {}
        for node in body:
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if (d := _held_in(t)) is not None:
                        bound.setdefault(d, []).append(node.value)
        # Rebound detached somewhere in the body: judged no further.
        losses = {n for n in losses if not any(_detached(v, n) for v in bound.get(n, []))}
        if not losses:
            continue
        scope = tree.scope(loop)
        if grad_mode_decorated(scope, imports):
            continue
        local = list(walk_local(getattr(scope, "body", [])))
        for node in body:
            if not isinstance(node, ast.stmt):
                continue
            acc_value = _accumulation(node)
            if acc_value is None or id(node) in seen:
                continue
            acc, container, value = acc_value
            loss = next((n for n in sorted(losses) if _carries(value, n)), None)
            if loss is None or acc == loss or _feeds_backward(local, container):
                continue
            # Rebound to a fresh value in the body (not by itself), or its container is: it
            # spans one iteration.
            if any(not (isinstance(v, ast.BinOp) and acc in {_held_in(v.left),
                                                             _held_in(v.right)})
                   for v in bound.get(acc, [])) or \
                    (container != acc and bound.get(container)):
                continue
            if in_grad_mode(tree, imports, node, scope):
                continue
            seen.add(id(node))
            found.append((node, (
                f"`{acc}` accumulates `{loss}` across the loop's iterations with its autograd "
                f"history: each iteration's graph stays reachable from `{acc}` until the loop "
                f"ends; accumulate `{loss}.item()` or `{loss}.detach()`")))
    return found
