"""TS012: a training loop that never zeroes the gradients it steps on. TS016: gradients
zeroed between the backward that makes them and the step that should use them. TS017:
gradients clipped after the step that used them.

`loss.backward()` adds to `.grad`; only `zero_grad()` (or `p.grad = None`) starts a step
from zero. A loop that backpropagates and steps an optimizer on every iteration without
zeroing updates with the sum of every gradient since the loop began. The rule is
conservative:

- the loop's own body (not a nested loop's, not a nested function's) backpropagates
  (`loss.backward()`, `scaler.scale(loss).backward()`, `accelerator.backward(loss)`,
  `self.manual_backward(loss)`, `torch.autograd.backward`: Accelerate's prepared optimizer
  steps without zeroing, like torch's) and calls an optimizer's `step()`: a receiver whose
  name says optimizer (`optimizer`, `opt_g`, `self.optim`), or `scaler.step(opt)`
  (DeepSpeed's `engine.step()`, which does zero, is not an optimizer's by its name);
- nothing in the loop's body, nested blocks and loops included, zeroes: a `zero_grad()`
  call on anything, `p.grad = None`, `p.grad.zero_()`; nor does a function of this file
  that the body calls (one call deep, by name).

A loop that makes a new optimizer on each iteration (one step on each of several setups) is
not a training loop and is not judged. Zeroing once before the loop does not count: the
gradients still pile up across its iterations.

TS016 reads each block of statements in order: a statement that backpropagates, then
`opt.zero_grad()` (a statement of its own, not under a condition of its own), then
`opt.step()` on that same optimizer with no backward in between. A model's `zero_grad()`
(`model.zero_grad()`) there clears the gradients too, as TS012 counts it as zeroing; it is
judged where the function steps one optimizer only, so that the model is the one stepped.
A branch's block starts from the backward before the branch (`if (i + 1) % n == 0:` around
the zeroing and the step). A `zero_grad()` of another optimizer (a GAN's other player), or
of a model where the function steps two, is not judged.

TS017 reads the same blocks: a backward, an optimizer's `step()`, then a clip
(`clip_grad_norm_`/`clip_grad_value_`) before the next backward, with no step after the clip
in the block (a GAN clips its other player's gradients between two steps).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from torchscope.lint._astutil import (
    FUNCS,
    LOOPS,
    ImportMap,
    Tree,
    dotted,
    is_backward,
    loops_around,
    uses_torch,
    walk_local,
)
from torchscope.lint.loss_inputs import is_clip

__all__ = ["called_names", "check_ts012", "check_ts016", "check_ts017"]


def _own(body: list[ast.stmt]) -> Iterator[ast.AST]:
    """The nodes of a loop body that run once per iteration of that loop: not inside a
    nested loop, function, lambda or class."""
    stack: list[ast.AST] = list(reversed(body))
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, (*LOOPS, *FUNCS, ast.Lambda, ast.ClassDef)):
            continue
        stack.extend(reversed(list(ast.iter_child_nodes(node))))


def _optimizer_named(node: ast.AST | None) -> bool:
    return _optimizer_name(dotted(node) if node is not None else None)


def _optimizer_name(name: str | None) -> bool:
    last = (name or "").rpartition(".")[2].lower()
    return "opt" in last and "sched" not in last


def _is_step(call: ast.Call) -> bool:
    """`optimizer.step()` (a receiver named for an optimizer) or `scaler.step(optimizer)`."""
    func = call.func
    if not isinstance(func, ast.Attribute) or func.attr != "step":
        return False
    return _optimizer_named(func.value) or (bool(call.args) and _optimizer_named(call.args[0]))


def _zeroes(node: ast.AST) -> bool:
    """`x.zero_grad(...)`, `p.grad = None` (or any value), `p.grad.zero_()`."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if node.func.attr == "zero_grad":
            return True
        receiver = node.func.value
        return node.func.attr in ("zero_", "detach_") and isinstance(receiver, ast.Attribute) \
            and receiver.attr == "grad"
    if isinstance(node, ast.Assign):
        return any(isinstance(t, ast.Attribute) and t.attr == "grad" for t in node.targets)
    return False


def _optimizer_of(step: ast.Call) -> set[str]:
    """The dotted names of the optimizer a step call steps: its receiver, or `scaler.step`'s
    argument."""
    assert isinstance(step.func, ast.Attribute)
    names = {dotted(step.func.value)} | ({dotted(step.args[0])} if step.args else set())
    return {n for n in names if n is not None}


def _bound(nodes: list[ast.AST]) -> set[str]:
    """Dotted names assigned in `nodes` (`opt = ...`, `self.opt = ...`)."""
    out: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Assign):
            out |= {d for t in node.targets if (d := dotted(t)) is not None}
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and \
                (d := dotted(node.target)) is not None:
            out.add(d)
    return out


def called_names(nodes: list[ast.AST]) -> set[str]:
    """The names `nodes` call: a function's, or a method's attribute."""
    out: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name):
                out.add(func.id)
            elif isinstance(func, ast.Attribute):
                out.add(func.attr)
    return out


def check_ts012(tree: Tree, imports: ImportMap, calls: list[ast.Call]
                ) -> list[tuple[ast.Call, str]]:
    """Each optimizer step of a loop that backpropagates and never zeroes, with its
    message."""
    if not uses_torch(imports, calls):
        return []
    backwards = [c for c in calls if is_backward(c, imports)]
    if not backwards:
        return []
    zeroing_funcs = {f.name for f in tree.funcs if any(map(_zeroes, walk_local(f.body)))}
    found: list[tuple[ast.Call, str]] = []
    for loop in loops_around(tree, backwards):
        own = [n for n in _own(loop.body) if isinstance(n, ast.Call)]
        backward = next((c for c in own if is_backward(c, imports)), None)
        step = next((c for c in own if _is_step(c)), None)
        if backward is None or step is None:
            continue
        everything = list(walk_local(loop.body))
        if any(map(_zeroes, everything)) or called_names(everything) & zeroing_funcs:
            continue
        if _optimizer_of(step) & _bound(everything):
            continue  # a new optimizer (and model) each iteration: one step each, not a loop
        found.append((step, (
            f"`{ast.unparse(step)}` runs on every iteration of this loop and nothing in the loop "
            f"zeroes the gradients `{ast.unparse(backward)}` adds to: each step updates with "
            "the sum of every gradient since the loop began")))
    return found


_BRANCHES = (ast.If, ast.With, ast.AsyncWith, ast.Try)


def _blocks_of(stmt: ast.stmt) -> Iterator[list[ast.stmt]]:
    """The blocks of statements a compound statement holds."""
    for field in ("body", "orelse", "finalbody"):
        block = getattr(stmt, field, None)
        if isinstance(block, list) and block:
            yield block
    for handler in getattr(stmt, "handlers", []):
        yield handler.body


def _zero_grad_of(stmt: ast.stmt) -> tuple[ast.Call, str | None] | None:
    """`x.zero_grad(...)` as a statement of its own, with `x`'s dotted name."""
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) and \
            isinstance(stmt.value.func, ast.Attribute) and stmt.value.func.attr == "zero_grad":
        return stmt.value, dotted(stmt.value.func.value)
    return None


def _stepped(body: list[ast.stmt]) -> set[frozenset[str]]:
    """The optimizers a function's (or the module's) own code steps, each as the names of
    one step (`{"opt"}`, `{"scaler", "opt_d"}`)."""
    return {frozenset(_optimizer_of(n)) for n in walk_local(body)
            if isinstance(n, ast.Call) and _is_step(n)}


def _clears_for(zeroed: str | None, step: ast.Call, scope: list[ast.stmt]) -> bool:
    """Whether `zeroed.zero_grad()` clears the gradients `step` is about to use: it is that
    optimizer's, or a model's (`model.zero_grad()`, which clears all of that model's) in a
    function (`scope`, its body) that steps one optimizer, whose model it then is. With two
    optimizers (a GAN), a model's may be the other player's."""
    if zeroed is None:
        return False
    return zeroed in _optimizer_of(step) or (
        not _optimizer_name(zeroed) and len(_stepped(scope)) == 1)


def _scan(block: list[ast.stmt], backward: ast.Call | None, imports: ImportMap,
          found: list[tuple[ast.Call, str]], scope: list[ast.stmt]) -> None:
    """TS016 over one block, in order; `backward` is the one that ran before it (in the
    enclosing block, with no step since), `scope` the body of the function (or module)
    that holds it. A branch's blocks start from the state before the branch; a loop's or a
    function's from none."""
    zeroed: tuple[ast.Call, str | None] | None = None  # a zero_grad() after `backward`
    for stmt in block:
        if isinstance(stmt, (*LOOPS, *FUNCS, ast.ClassDef)):
            inner_scope = scope if isinstance(stmt, LOOPS) else stmt.body
            for inner in _blocks_of(stmt):
                _scan(inner, None, imports, found, inner_scope)
            continue
        if isinstance(stmt, _BRANCHES) and zeroed is None:
            for inner in _blocks_of(stmt):
                _scan(inner, backward, imports, found, scope)
        own = [n for n in _own([stmt]) if isinstance(n, ast.Call)]
        step = next((c for c in own if _is_step(c)), None)
        here = next((c for c in own if is_backward(c, imports)), None)
        if step is not None and zeroed is not None and backward is not None and \
                here is None and _clears_for(zeroed[1], step, scope) and \
                not _steps_a_closure(step):
            found.append((zeroed[0], (
                f"`{ast.unparse(zeroed[0])}` clears the gradients that "
                f"`{ast.unparse(backward)}` has just made, before `{ast.unparse(step)}` "
                "uses them: the update uses no gradient")))
        if step is not None:
            backward = zeroed = None
        if here is not None:
            backward, zeroed = here, None
        elif backward is not None and (zero := _zero_grad_of(stmt)) is not None:
            zeroed = zero


def _steps_a_closure(step: ast.Call) -> bool:
    """`optimizer.step(closure)`: the closure makes the gradients again (LBFGS)."""
    assert isinstance(step.func, ast.Attribute)
    return _optimizer_named(step.func.value) and bool(step.args or step.keywords)


def check_ts016(tree: Tree, imports: ImportMap, calls: list[ast.Call]
                ) -> list[tuple[ast.Call, str]]:
    """Each `opt.zero_grad()` that runs between a backward and `opt.step()`, with its
    message."""
    if not uses_torch(imports, calls) or not any(is_backward(c, imports) for c in calls):
        return []
    found: list[tuple[ast.Call, str]] = []
    _scan(tree.module.body, None, imports, found, tree.module.body)
    return found


def _scan_clips(block: list[ast.stmt], imports: ImportMap,
                found: list[tuple[ast.Call, str]]) -> None:
    """TS017 over one block and the blocks inside it, in order."""
    stepped: ast.Call | None = None  # a step after a backward, with no backward since
    backward = False
    late: tuple[ast.Call, ast.Call] | None = None  # (clip, the step before it), unconfirmed
    for stmt in block:
        for inner in _blocks_of(stmt) if isinstance(stmt, (*LOOPS, *FUNCS, ast.ClassDef,
                                                           *_BRANCHES)) else ():
            _scan_clips(inner, imports, found)
        if isinstance(stmt, (*LOOPS, *FUNCS, ast.ClassDef)):
            continue
        own = [n for n in _own([stmt]) if isinstance(n, ast.Call)]
        step = next((c for c in own if _is_step(c)), None)
        here = any(is_backward(c, imports) for c in own)
        clip = next((c for c in own if is_clip(c, imports) and not _measures_only(c)), None)
        if late is not None and (here or step is not None):
            if here and step is None:
                found.append((late[0], _late_message(*late)))
            late = None
        if here:
            backward, stepped = True, None
        if step is not None:
            stepped = step if backward and not here else None
        elif clip is not None and stepped is not None and not here:
            late = (clip, stepped)
    if late is not None:
        found.append((late[0], _late_message(*late)))


def _measures_only(clip: ast.Call) -> bool:
    """`clip_grad_norm_(params, float("inf"))`: the total norm, read to be logged; no clip."""
    bound = clip.args[1] if len(clip.args) > 1 else next(
        (k.value for k in clip.keywords if k.arg in ("max_norm", "clip_value")), None)
    return bound is not None and "inf" in ast.unparse(bound)


def _late_message(clip: ast.Call, step: ast.Call) -> str:
    return (f"`{ast.unparse(clip.func)}` runs after `{ast.unparse(step)}`, which has already "
            "updated with the unclipped gradients: the clip bounds nothing")


def check_ts017(tree: Tree, imports: ImportMap, calls: list[ast.Call]
                ) -> list[tuple[ast.Call, str]]:
    """Each gradient clip that runs after the optimizer step it should bound, with its
    message."""
    if not uses_torch(imports, calls) or not any(is_clip(c, imports) for c in calls) or \
            not any(is_backward(c, imports) for c in calls):
        return []
    found: list[tuple[ast.Call, str]] = []
    _scan_clips(tree.module.body, imports, found)
    return found
