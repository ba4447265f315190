"""TS009: a per-rank gradient norm logged as if it were the global one.

Conservative: only what is wrong on every run is flagged.

- In a file that trains with FSDP (torch's `fully_shard` or `FullyShardedDataParallel`, or
  Lightning's `strategy="fsdp"` / `FSDPStrategy`), a logged norm of `.grad` with no
  cross-rank reduction: `p.grad.norm()`, `torch.linalg.vector_norm(p.grad)`, Lightning's
  `grad_norm(...)`, or a name assigned from one of those that no `all_reduce`/`reduce`/
  `all_gather` or `.full_tensor()` touches. Each rank holds a shard of every gradient, so
  the norm of its shard under-reports the global one (by about √ranks) and differs per rank.
  (`p.grad.full_tensor().norm()` is global and not flagged.)
- Under DDP or FSDP, the norm of the gradient a tensor hook sees, logged in that hook: a
  `register_hook` callback's argument, or `p.grad` in a `register_post_accumulate_grad_hook`
  callback. Both run before DDP's all-reduce and see only this rank's gradient (FSDP2's
  post-accumulate hooks see this rank's shard).

Under DDP alone `.grad` after backward is already synchronised, so its norm is the global
one and is not flagged.
"""

from __future__ import annotations

import ast

from torchscope.lint._astutil import ImportMap, Tree, dotted, walk_local
from torchscope.lint.fsdp_hooks import FULLY_SHARD

__all__ = ["check_ts009"]

_FSDP = FULLY_SHARD | {
    "torch.distributed.fsdp.FullyShardedDataParallel",
    "torch.distributed.fsdp.fully_sharded_data_parallel.FullyShardedDataParallel",
    "lightning.pytorch.strategies.FSDPStrategy", "pytorch_lightning.strategies.FSDPStrategy",
    "lightning.fabric.strategies.FSDPStrategy",
}
_DDP = frozenset({
    "torch.nn.parallel.DistributedDataParallel",
    "torch.nn.parallel.distributed.DistributedDataParallel",
    "lightning.pytorch.strategies.DDPStrategy", "pytorch_lightning.strategies.DDPStrategy",
})
_NORMS = frozenset({"torch.norm", "torch.linalg.norm", "torch.linalg.vector_norm",
                    "torch.functional.norm"})
_GRAD_NORM = frozenset({"lightning.pytorch.utilities.grad_norm",
                        "pytorch_lightning.utilities.grad_norm",
                        "lightning.pytorch.utilities.grads.grad_norm",
                        "pytorch_lightning.utilities.grads.grad_norm"})
_REDUCERS = frozenset({"all_reduce", "reduce", "all_gather", "all_gather_into_tensor",
                       "all_gather_single", "reduce_scatter", "full_tensor"})
# Calls that log or print their arguments.
_SINKS = frozenset({"print", "log", "log_dict", "log_metrics", "log_metric", "add_scalar",
                    "add_scalars", "info", "debug", "warning"})


def _name(call: ast.Call) -> str | None:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else \
        func.id if isinstance(func, ast.Name) else None


def _strategy(calls: list[ast.Call], imports: ImportMap) -> tuple[bool, bool]:
    """(trains with FSDP, trains with DDP) in this file."""
    fsdp = ddp = False
    for call in calls:
        qual = imports.qualify(call.func) or ""
        fsdp |= qual in _FSDP
        ddp |= qual in _DDP
        for kw in call.keywords:  # Lightning: Trainer(strategy="fsdp") / "ddp_spawn"
            if kw.arg == "strategy" and isinstance(kw.value, ast.Constant) and \
                    isinstance(kw.value.value, str):
                fsdp |= kw.value.value.startswith("fsdp")
                ddp |= kw.value.value.startswith("ddp")
    return fsdp, ddp


def _is_grad(node: ast.AST) -> bool:
    d = dotted(node)
    return d is not None and (d.endswith(".grad") or d.endswith(".grad.data"))


def _local_grad_norm(node: ast.AST, imports: ImportMap) -> bool:
    """A norm of `.grad` taken on this rank alone: `x.grad.norm()`, `torch.norm(x.grad)`,
    Lightning's `grad_norm(module, ...)`."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Attribute) and func.attr == "norm" and _is_grad(func.value):
        return True
    qual = imports.qualify(func)
    if qual in _NORMS and node.args and _is_grad(node.args[0]):
        return True
    return qual in _GRAD_NORM


def _contains(node: ast.AST, imports: ImportMap, tainted: set[str]) -> bool:
    for sub in ast.walk(node):
        if _local_grad_norm(sub, imports):
            return True
        if isinstance(sub, ast.Name) and sub.id in tainted:
            return True
    return False


def _tainted(scope: ast.AST, imports: ImportMap) -> set[str]:
    """Names this scope binds to a local gradient norm and never hands to a reduction."""
    body = getattr(scope, "body", [])
    nodes = list(walk_local(body if isinstance(body, list) else [body]))
    tainted: set[str] = set()
    for _ in range(3):  # norms flow through a few assignments (norms -> total -> text)
        for node in nodes:
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and \
                    node.value is not None and _contains(node.value, imports, tainted):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                tainted |= {t.id for t in targets if isinstance(t, ast.Name)}
    reduced = set()
    for node in nodes:
        if isinstance(node, ast.Call) and _name(node) in _REDUCERS:
            for arg in [*node.args, getattr(node.func, "value", None)]:
                if isinstance(arg, ast.Name):
                    reduced.add(arg.id)
    return tainted - reduced


_HOOKS = {"register_hook": "", "register_post_accumulate_grad_hook": ".grad"}


def _hook_callbacks(tree: Tree, calls: list[ast.Call]
                    ) -> list[tuple[ast.Lambda | ast.FunctionDef | ast.AsyncFunctionDef, str]]:
    """(callback, the dotted name of the gradient it sees) of every `register_hook` (`g`) and
    `register_post_accumulate_grad_hook` (`p.grad`) in this file whose callback is a lambda
    or a function defined here."""
    defs = {f.name: f for f in tree.funcs}
    out: list[tuple[ast.Lambda | ast.FunctionDef | ast.AsyncFunctionDef, str]] = []
    for call in calls:
        suffix = _HOOKS.get(_name(call) or "")
        if suffix is None or not call.args:
            continue
        arg = call.args[0]
        fn: ast.AST = defs.get(arg.id, arg) if isinstance(arg, ast.Name) else arg
        if isinstance(fn, (ast.Lambda, ast.FunctionDef, ast.AsyncFunctionDef)) and \
                fn.args.args:
            out.append((fn, fn.args.args[0].arg + suffix))
    return out


def check_ts009(tree: Tree, imports: ImportMap, calls: list[ast.Call]
                ) -> list[tuple[ast.Call, str]]:
    """`(sink call, message)` for every per-rank gradient norm logged as if global."""
    fsdp, ddp = _strategy(calls, imports)
    if not (fsdp or ddp):
        return []
    found: list[tuple[ast.Call, str]] = []
    if fsdp:
        taint: dict[ast.AST, set[str]] = {}
        for call in calls:
            if _name(call) not in _SINKS:
                continue
            scope = tree.scope(call)
            if scope not in taint:
                taint[scope] = _tainted(scope, imports)
            if any(_contains(a, imports, taint[scope])
                   for a in [*call.args, *(k.value for k in call.keywords)]):
                found.append((call, (
                    "a gradient norm logged under FSDP without a cross-rank reduction: "
                    "each rank holds a shard of every gradient, so this is the norm of "
                    "its shard, smaller than the global one and different on every rank")))
    for fn, grad in _hook_callbacks(tree, calls):
        body: list[ast.AST] = [fn.body] if isinstance(fn, ast.Lambda) else list(fn.body)
        for node in walk_local(body):
            if not (isinstance(node, ast.Call) and _name(node) in _SINKS):
                continue
            for sub in ast.walk(node):
                if isinstance(sub, ast.Call) and (
                        (isinstance(sub.func, ast.Attribute) and sub.func.attr == "norm"
                         and dotted(sub.func.value) == grad)
                        or (imports.qualify(sub.func) in _NORMS and sub.args
                            and dotted(sub.args[0]) == grad)):
                    found.append((node, (
                        "a gradient norm logged from a tensor hook under "
                        f"{'FSDP' if fsdp else 'DDP'}: the hook sees this rank's own "
                        "gradient (under DDP before the all-reduce), not the global one")))
                    break
    return found
