"""TS008: `register_hook` on a parameter of a module that `fully_shard` sharded.

FSDP2 replaces every parameter of a sharded module with a DTensor that is not on the
autograd graph (the graph runs on the all-gathered copy), so a tensor hook registered on it
never fires, silently. The rule is precise rather than broad: it flags a `register_hook` whose
tensor is reached, in the same function (or module body), from a name that a `fully_shard`
call there received (`model` after `fully_shard(model)`): `model.fc.weight.register_hook`,
`for p in model.parameters(): p.register_hook(...)` (or a comprehension), `for n, p in
model.named_parameters(): ...`, and `w = model.fc.weight; w.register_hook(...)`.
"""

from __future__ import annotations

import ast

from torchscope.lint._astutil import ImportMap, Tree, dotted

__all__ = ["FULLY_SHARD", "check_ts008"]

#: The qualified names of FSDP2's `fully_shard`, current and older.
FULLY_SHARD = frozenset({
    "torch.distributed.fsdp.fully_shard",
    "torch.distributed._composable.fsdp.fully_shard",
    "torch.distributed._composable.fsdp.fully_shard.fully_shard",
    "torch.distributed.fsdp._fully_shard.fully_shard",
})
_PARAM_ITERS = frozenset({"parameters", "named_parameters"})


def _under(path: str, roots: dict[str, int]) -> tuple[str, int] | None:
    """The sharded root that `path` is, or lies under (`model.fc.weight` under `model`)."""
    for root, line in roots.items():
        if path == root or path.startswith(root + "."):
            return root, line
    return None


def _param_source(tree: Tree, name: str, at: ast.AST) -> str | None:
    """What a bare name holds at `at`, when its scope binds it from a module path: the
    iterated module of an enclosing `for p in M.parameters()` loop (`M`), or the value of a
    plain `name = M.x.weight` assignment (`M.x.weight`)."""
    for child, parent in tree.edges(at):
        if isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.Module)):
            break
        loops: list[tuple[ast.AST, ast.AST]] = []
        if isinstance(parent, (ast.For, ast.AsyncFor)) and child in parent.body:
            loops.append((parent.target, parent.iter))
        elif isinstance(parent, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            loops.extend((g.target, g.iter) for g in parent.generators)
        for target, it in loops:
            targets = target.elts if isinstance(target, ast.Tuple) else [target]
            bound = {t.id for t in targets if isinstance(t, ast.Name)}
            if name in bound and isinstance(it, ast.Call) and \
                    isinstance(it.func, ast.Attribute) and it.func.attr in _PARAM_ITERS:
                return dotted(it.func.value)
    scope = tree.scope(at)
    for node in ast.walk(scope):
        if isinstance(node, ast.Assign) and node.lineno < getattr(at, "lineno", 0) and \
                len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) and \
                node.targets[0].id == name and tree.scope(node) is scope:
            return dotted(node.value)
    return None


def check_ts008(tree: Tree, imports: ImportMap, calls: list[ast.Call]
                ) -> list[tuple[ast.Call, str]]:
    """`(call, message)` for every `register_hook` on a parameter of a sharded module."""
    sharded: dict[ast.AST, dict[str, int]] = {}
    for call in calls:
        if imports.qualify(call.func) in FULLY_SHARD and call.args:
            root = dotted(call.args[0])
            if root is not None:
                sharded.setdefault(tree.scope(call), {}).setdefault(root, call.lineno)
    if not sharded:
        return []
    found = []
    for call in calls:
        func = call.func
        if not (isinstance(func, ast.Attribute) and func.attr == "register_hook"):
            continue
        roots = sharded.get(tree.scope(call))
        if not roots:
            continue
        receiver = dotted(func.value)
        if receiver is None:
            continue
        path = receiver
        if "." not in receiver:
            source = _param_source(tree, receiver, call)
            if source is None:
                continue
            path = source
        hit = _under(path, roots)
        if hit is None or receiver == hit[0]:
            continue  # a hook on the sharded name itself is no parameter's
        found.append((call, (
            f"`register_hook` on a parameter of `{hit[0]}`, which `fully_shard` sharded at "
            f"line {hit[1]}: FSDP2's DTensor parameters are not on the autograd graph, so "
            "this hook never fires")))
    return found
