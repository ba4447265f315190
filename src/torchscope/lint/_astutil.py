"""AST plumbing for the checker: parents, scopes, loops, names, and import aliases."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef, ast.Module)
FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)
_COMPS = (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)
# Load/Store and operator nodes: shared singletons with nothing below them.
_LEAVES = (ast.expr_context, ast.operator, ast.boolop, ast.cmpop, ast.unaryop)
# Calls that hand out the next item of a worklist: in a `while` loop their results change
# every iteration, like a `for` target does.
_WORKLIST_METHODS = frozenset({"pop", "popleft", "popitem", "get", "get_nowait"})


def dotted(node: ast.AST) -> str | None:
    """`a.b.c` for a chain of attribute accesses on a name, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def refs(node: ast.AST | None) -> set[str]:
    """Names an expression reads, plus every dotted prefix (`self`, `self.fc`, `self.fc.w`)."""
    out: set[str] = set()
    if node is None:
        return out
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            out.add(sub.id)
        elif isinstance(sub, ast.Attribute):
            d = dotted(sub)
            if d is not None:
                out.add(d)
    return out


def target_names(node: ast.AST) -> set[str]:
    """Names (and dotted attribute targets) bound by an assignment target."""
    if isinstance(node, (ast.Tuple, ast.List)):
        out: set[str] = set()
        for elt in node.elts:
            out |= target_names(elt)
        return out
    if isinstance(node, ast.Starred):
        return target_names(node.value)
    if isinstance(node, ast.Subscript):
        return target_names(node.value)
    d = dotted(node)
    return {d} if d is not None else set()


def walk_local(nodes: list[ast.stmt] | list[ast.AST]) -> Iterator[ast.AST]:
    """Every node under `nodes`, not descending into nested functions, lambdas or classes."""
    stack: list[ast.AST] = list(reversed(nodes))
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, (*FUNCS, ast.Lambda, ast.ClassDef)):
            continue
        stack.extend(reversed(list(ast.iter_child_nodes(node))))


LOOPS = (ast.For, ast.AsyncFor, ast.While)


# Top-level packages whose users write torch training code without importing torch: a
# Lightning module, an Accelerate or transformers loop, a timm model.
_TORCH_PACKAGES = frozenset({
    "torch", "torchvision", "torchaudio", "lightning", "lightning_fabric", "pytorch_lightning",
    "accelerate", "transformers", "timm", "deepspeed", "peft",
})


# Methods that backpropagate a loss: a tensor's `backward(gradient=None)`, and the
# frameworks' `accelerator.backward(loss)`, `fabric.backward(loss)`,
# `engine.backward(loss)`, `self.manual_backward(loss)`.
BACKWARD_METHODS = frozenset({"backward", "manual_backward"})


def is_backward(call: ast.Call, imports: ImportMap) -> bool:
    """A backward pass: `loss.backward()`, `scaler.scale(loss).backward()`,
    `out.backward(grad)`, `accelerator.backward(loss)`, `self.manual_backward(loss)`, or
    `torch.autograd.backward`. Each adds to `.grad` and none zeroes it (Accelerate's,
    Fabric's and Lightning's leave that to the optimizer's `zero_grad()`, as torch does)."""
    func = call.func
    if isinstance(func, ast.Attribute) and func.attr in BACKWARD_METHODS:
        return True
    return imports.qualify(func) == "torch.autograd.backward"


def uses_torch(imports: ImportMap, calls: Iterable[ast.Call]) -> bool:
    """Whether the file is torch code: it imports torch or a package built on it, or it
    backpropagates: a training script can get its model, optimizer and data from a module
    of its own project and import nothing of torch's."""
    if any(q.split(".")[0] in _TORCH_PACKAGES for q in imports.aliases.values()):
        return True
    return any(is_backward(c, imports) for c in calls)


def loops_around(tree: Tree, nodes: Iterable[ast.AST]
                 ) -> list[ast.For | ast.AsyncFor | ast.While]:
    """The loops that enclose any of `nodes` (in their bodies, nested ones too, up to the
    module), each once, in first-seen order: the loops a rule about those nodes needs to
    look at, without walking every loop of the file."""
    out: dict[int, ast.For | ast.AsyncFor | ast.While] = {}
    for node in nodes:
        for _child, parent in tree.edges(node):
            if isinstance(parent, LOOPS):
                out.setdefault(id(parent), parent)
    return list(out.values())


def all_loops(tree: Tree) -> list[ast.For | ast.AsyncFor | ast.While]:
    """Every loop of the file: at module level and in each function, nested ones too."""
    loops = [n for n in walk_local(tree.module.body) if isinstance(n, LOOPS)]
    for func in tree.funcs:
        loops += [n for n in walk_local(func.body) if isinstance(n, LOOPS)]
    return loops


@dataclass(frozen=True)
class Loop:
    """A loop that encloses a node: its AST node, body, and the names that vary per iteration."""

    node: ast.AST
    body: tuple[ast.AST, ...]
    varying: frozenset[str]
    targets: frozenset[str] = frozenset()
    counted: bool = False
    """Whether it counts steps (`while`, `for ... in range(...)`) rather than walking items."""
    counters: frozenset[str] = frozenset()
    """Names that take a new value on each iteration and never one they had: a `range`
    loop's target, `enumerate`'s index, a name the body increments (`step += 1`)."""

    @property
    def line(self) -> int:
        """Line of the loop header."""
        return int(getattr(self.node, "lineno", 0))


class Tree:
    """A parsed module with parent links and per-loop analysis, computed once."""

    def __init__(self, module: ast.Module) -> None:
        self.module = module
        self._parent: dict[ast.AST, ast.AST] = {}
        self.calls: list[ast.Call] = []
        self.funcs: list[ast.FunctionDef | ast.AsyncFunctionDef] = []
        self.imports: list[ast.Import | ast.ImportFrom] = []
        # One traversal collects everything the rules need.
        stack: list[ast.AST] = [module]
        while stack:
            node = stack.pop()
            if isinstance(node, ast.Call):
                self.calls.append(node)
            elif isinstance(node, FUNCS):
                self.funcs.append(node)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                self.imports.append(node)
            for field in node._fields:
                value = getattr(node, field, None)
                if isinstance(value, list):
                    for child in value:
                        if isinstance(child, ast.AST) and not isinstance(child, _LEAVES):
                            self._parent[child] = node
                            stack.append(child)
                elif isinstance(value, ast.AST) and not isinstance(value, _LEAVES):
                    self._parent[value] = node
                    stack.append(value)
        self._loops: dict[ast.AST, Loop] = {}

    def parent(self, node: ast.AST) -> ast.AST | None:
        """The node's parent, None for the module."""
        return self._parent.get(node)

    def edges(self, node: ast.AST) -> Iterator[tuple[ast.AST, ast.AST]]:
        """(child, parent) pairs from `node` up to the module."""
        child = node
        parent = self._parent.get(child)
        while parent is not None:
            yield child, parent
            child, parent = parent, self._parent.get(parent)

    def scope(self, node: ast.AST) -> ast.AST:
        """The function, lambda, class or module whose body holds `node`."""
        return self.scopes(node)[0]

    def scopes(self, node: ast.AST) -> list[ast.AST]:
        """Enclosing scopes, innermost first, ending with the module."""
        return [p for _c, p in self.edges(node) if isinstance(p, SCOPES)] or [self.module]

    def enclosing_class(self, node: ast.AST) -> ast.ClassDef | None:
        """The class whose method contains `node`, if any."""
        return next((p for _c, p in self.edges(node) if isinstance(p, ast.ClassDef)), None)

    def loops(self, node: ast.AST) -> list[Loop]:
        """Loops whose every iteration runs `node`, innermost first, within its scope."""
        found: list[Loop] = []
        for child, parent in self.edges(node):
            if isinstance(parent, SCOPES):
                break
            in_body = (
                (isinstance(parent, (ast.For, ast.AsyncFor)) and child in parent.body)
                or (isinstance(parent, ast.While) and (child in parent.body
                                                       or child is parent.test))
                or (isinstance(parent, _COMPS) and child in _comp_parts(parent))
            )
            if in_body:
                found.append(self._loop(parent))
        return found

    def _loop(self, node: ast.AST) -> Loop:
        cached = self._loops.get(node)
        if cached is None:
            cached = _analyze_loop(node)
            self._loops[node] = cached
        return cached

    def statement(self, node: ast.AST) -> ast.stmt | None:
        """The innermost statement containing `node`."""
        if isinstance(node, ast.stmt):
            return node
        return next((p for _c, p in self.edges(node) if isinstance(p, ast.stmt)), None)

    def block(self, stmt: ast.stmt) -> list[ast.stmt]:
        """The statement list that holds `stmt` (empty for the module itself)."""
        parent = self._parent.get(stmt)
        if parent is None:
            return []
        for field in ("body", "orelse", "finalbody", "handlers"):
            block = getattr(parent, field, None)
            if isinstance(block, list) and stmt in block:
                return [s for s in block if isinstance(s, ast.stmt)]
        return []

    def block_before(self, stmt: ast.stmt) -> list[ast.stmt]:
        """Statements before `stmt` in the statement list that holds it."""
        block = self.block(stmt)
        return block[: block.index(stmt)] if stmt in block else []


def _comp_parts(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.DictComp):
        return [node.key, node.value]
    if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp)):
        return [node.elt]
    return []


def bindings(body: list[ast.AST]) -> list[tuple[set[str], ast.AST | None, bool]]:
    """(bound names, value, always varies) for every binding under `body` (a loop body, a
    function body), nested functions excluded."""
    out: list[tuple[set[str], ast.AST | None, bool]] = []
    for node in walk_local(body):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                out.append((target_names(t), node.value, False))
        elif isinstance(node, ast.AugAssign):
            out.append((target_names(node.target), node.value, True))
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            out.append((target_names(node.target), node.value, False))
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            out.append((target_names(node.target), node.iter, False))
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                if item.optional_vars is not None:
                    out.append((target_names(item.optional_vars), item.context_expr, False))
        elif isinstance(node, ast.NamedExpr):
            out.append((target_names(node.target), node.value, False))
    return out


def _is_worklist_call(value: ast.AST | None) -> bool:
    if not isinstance(value, ast.Call):
        return False
    func = value.func
    if isinstance(func, ast.Attribute):
        return func.attr in _WORKLIST_METHODS
    return isinstance(func, ast.Name) and func.id == "next"


def _analyze_loop(node: ast.AST) -> Loop:
    seeds: set[str] = set()
    body: list[ast.AST]
    counted = False
    if isinstance(node, (ast.For, ast.AsyncFor)):
        seeds |= target_names(node.target)
        body = list(node.body)
        counted = isinstance(node.iter, ast.Call) and dotted(node.iter.func) == "range"
    elif isinstance(node, ast.While):
        body = [*node.body, node.test]
        counted = True
    else:
        for gen in getattr(node, "generators", []):
            seeds |= target_names(gen.target)
        body = _comp_parts(node)
    targets = frozenset(seeds)
    counters = _counters(node, body)
    binds = bindings(body)
    for names, value, always in binds:
        if always or (isinstance(node, ast.While) and _is_worklist_call(value)):
            seeds |= names
    changed = True
    while changed:
        changed = False
        for names, value, _always in binds:
            if names - seeds and refs(value) & seeds:
                seeds |= names
                changed = True
    return Loop(node, tuple(body), frozenset(seeds), targets, counted, counters)


def _counters(node: ast.AST, body: list[ast.AST]) -> frozenset[str]:
    out: set[str] = set()
    if isinstance(node, (ast.For, ast.AsyncFor)) and isinstance(node.iter, ast.Call):
        called = dotted(node.iter.func)
        if called == "range":
            out |= target_names(node.target)
        elif called == "enumerate" and isinstance(node.target, ast.Tuple) and \
                node.target.elts and (d := dotted(node.target.elts[0])) is not None:
            out.add(d)
    for sub in walk_local(body):
        # `step += 1`: a constant step, so each value comes once (`total += loss` is no count).
        if isinstance(sub, ast.AugAssign) and isinstance(sub.op, ast.Add) and \
                isinstance(sub.value, ast.Constant) and isinstance(sub.value.value, int) and \
                sub.value.value > 0 and (d := dotted(sub.target)) is not None:
            out.add(d)
    return frozenset(out)


class ImportMap:
    """What each imported name refers to, so `cp.checkpoint` resolves to its torch path."""

    def __init__(self, imports: list[ast.Import | ast.ImportFrom]) -> None:
        self.aliases: dict[str, str] = {}
        for node in imports:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        self.aliases[alias.asname] = alias.name
                    else:
                        root = alias.name.split(".")[0]
                        self.aliases[root] = root
            elif isinstance(node, ast.ImportFrom):
                # Relative imports keep their dots: bound names, but never torch's.
                base = "." * node.level + (node.module or "")
                for alias in node.names:
                    if alias.name != "*":
                        self.aliases[alias.asname or alias.name] = f"{base}.{alias.name}"

    def qualify(self, node: ast.AST) -> str | None:
        """The fully qualified dotted name of `node` (`torch.cuda.empty_cache`), or None."""
        d = dotted(node)
        if d is None:
            return None
        root, dot, rest = d.partition(".")
        base = self.aliases.get(root, root)
        return f"{base}{dot}{rest}"

    def is_import(self, name: str) -> bool:
        """Whether `name` was bound by an import statement."""
        return name in self.aliases


# Context managers and decorators that set the grad mode (enable_grad: a stated intent).
GRAD_MODES = frozenset({
    "torch.no_grad", "torch.inference_mode", "torch.enable_grad", "torch.set_grad_enabled",
    "torch.autograd.no_grad", "torch.autograd.inference_mode", "torch.autograd.enable_grad",
    "torch.autograd.set_grad_enabled", "torch.autograd.grad_mode.no_grad",
    "torch.autograd.grad_mode.inference_mode", "torch.autograd.grad_mode.enable_grad",
    "torch.autograd.grad_mode.set_grad_enabled",
})


def sets_grad_mode(node: ast.AST, imports: ImportMap) -> bool:
    """`node` (a `with` item or a decorator) is one of the grad-mode managers."""
    target = node.func if isinstance(node, ast.Call) else node
    return imports.qualify(target) in GRAD_MODES


def in_grad_mode(tree: Tree, imports: ImportMap, node: ast.AST, scope: ast.AST) -> bool:
    """A grad-mode `with` encloses `node` inside `scope`."""
    for _child, parent in tree.edges(node):
        if parent is scope:
            return False
        if isinstance(parent, (ast.With, ast.AsyncWith)) and any(
                sets_grad_mode(item.context_expr, imports) for item in parent.items):
            return True
    return False


def grad_mode_decorated(func: ast.AST, imports: ImportMap) -> bool:
    """`func` is a function that a grad-mode manager decorates."""
    return isinstance(func, FUNCS) and any(sets_grad_mode(d, imports)
                                           for d in func.decorator_list)
