"""The AST checker: one pass over a parsed module finds every TS rule violation.

The rules reason about loops the way a reader does: a call in a loop body runs once per
iteration; a receiver that does not depend on anything the loop changes is the *same* object
every iteration (the training-loop case), while `for m in model.modules(): m.register_...`
touches a different module each time and is fine.
"""

from __future__ import annotations

import ast
import re
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from torchscope.findings import Severity
from torchscope.lint._astutil import (
    FUNCS,
    SCOPES,
    ImportMap,
    Loop,
    Tree,
    bindings,
    dotted,
    refs,
    target_names,
    walk_local,
)
from torchscope.lint.eval_grad import check_ts010
from torchscope.lint.eval_mode import check_ts013
from torchscope.lint.fsdp_hooks import check_ts008
from torchscope.lint.loss_history import check_ts011
from torchscope.lint.loss_inputs import check_ts014, check_ts015
from torchscope.lint.rank_norms import check_ts009
from torchscope.lint.records import LintViolation
from torchscope.lint.rules import RULES
from torchscope.lint.zero_grad import check_ts012, check_ts016, check_ts017

__all__ = ["check_tree"]

_HOOK_NAME = re.compile(r"^register_\w*hook$")
# torch registrations named like hooks that return no handle: nothing to keep or remove.
_NO_HANDLE = frozenset({"register_comm_hook", "register_python_privateuseone_hook"})
# Module hooks: the hook's first argument is the module, the rest are tensors.
_MODULE_HOOKS = frozenset({
    "register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook",
    "register_full_backward_pre_hook", "register_backward_hook",
    "register_module_forward_hook", "register_module_forward_pre_hook",
    "register_module_full_backward_hook", "register_module_full_backward_pre_hook",
    "register_module_backward_hook",
})
# Tensor hooks: every argument is a tensor (a gradient, or the parameter itself).
_TENSOR_HOOKS = frozenset({"register_hook", "register_post_accumulate_grad_hook"})
# torchscope.hooks.HookSession methods: (target, fn) like the torch methods they wrap.
_SESSION_MODULE_HOOKS = frozenset({
    "forward_hook", "forward_pre_hook", "full_backward_hook", "backward_pre_hook"})
_SESSION_TENSOR_HOOKS = frozenset({"tensor_hook", "post_accumulate_grad_hook"})
_DEPRECATED = {
    "register_backward_hook": "register_full_backward_hook",
    "register_module_backward_hook": "register_module_full_backward_hook",
}
# Handle stored into a container: removal is then looked for through the container.
_CONTAINER_METHODS = frozenset({"append", "add", "extend", "insert", "appendleft", "setdefault"})
# Handle handed to something that removes it later.
_OWNER_METHODS = frozenset({"track", "enter_context", "push", "callback"})
_SYNC_METHODS = ("item", "cpu", "tolist")
# Tensor methods whose result is metadata, not a tensor: printing them does not sync.
_META_METHODS = frozenset({
    "size", "dim", "numel", "nelement", "element_size", "stride", "is_contiguous",
    "data_ptr", "storage_offset", "is_floating_point", "is_complex", "get_device", "type",
})
_TENSOR_ATTRS = frozenset({"data", "grad", "T", "mT", "H", "mH", "real", "imag"})
_STRINGIFY = frozenset({"str", "repr", "format", "float", "int", "bool"})
_COMPILE = "torch.compile"
_EMPTY_CACHE = frozenset({"torch.cuda.empty_cache", "torch.cuda.memory.empty_cache"})
_OOM_TYPES = frozenset({
    "torch.cuda.OutOfMemoryError", "torch.OutOfMemoryError", "torch.cuda.memory.OutOfMemoryError",
    "torch._C.OutOfMemoryError", "RuntimeError", "MemoryError"})
_BROAD_TYPES = frozenset({"Exception", "BaseException"})
_GC_COLLECT = "gc.collect"
# Words of an `if` test that make it a device check or a reaction to memory, not an option.
_NOT_AN_OPTION = ("cuda", "device", "gpu", "available", "xpu", "mps", "npu", "accelerator",
                  "oom", "out_of_memory", "memory_allocated", "memory_reserved", "max_memory",
                  "mem_get_info", "memory_stats")
# Calls that load a checkpoint or a model: `load_state_dict`, `torch.load`, `from_pretrained`.
_LOAD = re.compile(r"(?:^|_)(?:re)?load(?:_|$)|^from_pretrained$")
_MEMORY_READINGS = frozenset({
    "memory_reserved", "memory_allocated", "max_memory_allocated", "max_memory_reserved",
    "mem_get_info", "memory_stats", "memory_summary", "reset_peak_memory_stats"})
# Module and tensor methods that return the object they are called on (or an equivalent
# one): `m = model.to(device)` is still the caller's model, not one built per call.
_SAME_OBJECT = frozenset({
    "to", "cuda", "cpu", "train", "eval", "float", "half", "bfloat16", "double", "type",
    "requires_grad_", "to_empty", "get_submodule", "get_parameter", "module"})
# Process-wide registrations (torch.nn.modules.module, torch.optim.optimizer).
_GLOBAL_HOOK_PREFIXES = ("register_module_", "register_optimizer_")
_CHECKPOINT = frozenset({
    "torch.utils.checkpoint.checkpoint", "torch.utils.checkpoint.checkpoint_sequential"})
_CACHE_DECORATORS = frozenset({"cache", "lru_cache", "cached_property"})
# Keyword arguments of keras' Model.compile: not a torch model.
_NOT_TORCH_COMPILE_KW = frozenset({"optimizer", "loss", "metrics"})


@dataclass(frozen=True)
class _Repeat:
    """A loop that runs a call again, on the same objects, on every iteration.

    Attributes:
        line: the loop's header line.
        through: the functions of this file between the loop and the call, outermost first
            (empty: the call is in the loop's own body).
    """

    line: int
    through: tuple[str, ...]


@dataclass(frozen=True)
class _HookFn:
    """A function (or lambda) registered as a hot-path hook."""

    node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
    module_hook: bool
    registered_line: int


def check_tree(module: ast.Module, lines: list[str], path: str,
               codes: Iterable[str] | None = None) -> list[LintViolation]:
    """Every violation of the enabled rules in one parsed module.

    Args:
        module: the parsed source.
        lines: the source split into lines (for character columns).
        path: file path to put in the violations.
        codes: enabled rule codes (default: all).

    Returns:
        Violations sorted by position and code, without noqa filtering.
    """
    checker = _Checker(module, lines, path, frozenset(RULES if codes is None else codes))
    checker.run()
    return sorted(checker.found.values(), key=lambda v: (v.line, v.col, v.code))


class _Checker:
    def __init__(self, module: ast.Module, lines: list[str], path: str,
                 codes: frozenset[str]) -> None:
        self.tree = Tree(module)
        self.imports = ImportMap(self.tree.imports)
        self.lines = lines
        self.path = path
        self.codes = codes
        self.found: dict[tuple[str, int, int], LintViolation] = {}
        # Traversal order is not source order; sort so results never depend on it.
        self.calls = sorted(self.tree.calls, key=lambda c: (c.lineno, c.col_offset))
        self._defs: dict[ast.AST, dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]]] = {}
        self._sites: dict[ast.AST, list[ast.Call]] | None = None
        self._flows: dict[ast.AST, _Flow] = {}
        for node in sorted(self.tree.funcs, key=lambda f: f.lineno):
            scope = self.tree.scope(node)
            self._defs.setdefault(scope, {}).setdefault(node.name, []).append(node)

    # ------------------------------------------------------------------ reporting
    def _char_col(self, line: int, byte_col: int) -> int:
        text = self.lines[line - 1] if 0 < line <= len(self.lines) else ""
        return len(text.encode("utf-8")[:byte_col].decode("utf-8", errors="replace")) + 1

    def report(self, code: str, node: ast.expr | ast.stmt, message: str,
               fix: str | None = None, severity: Severity | None = None) -> None:
        if code not in self.codes:
            return
        func = node.func if isinstance(node, ast.Call) else None
        if isinstance(func, ast.Attribute) and func.end_lineno is not None \
                and func.end_col_offset is not None:
            line = func.end_lineno
            byte_col = func.end_col_offset - len(func.attr.encode("utf-8"))
        else:
            line, byte_col = node.lineno, node.col_offset
        end_line = node.end_lineno or line
        end_col = self._char_col(end_line, node.end_col_offset or 0)
        key = (code, line, byte_col)
        if key not in self.found:
            self.found[key] = LintViolation(
                self.path, line, self._char_col(line, byte_col), end_line, end_col, code,
                message, RULES[code].fix if fix is None else fix,
                RULES[code].severity if severity is None else severity)

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _method(call: ast.Call) -> str | None:
        func = call.func
        if isinstance(func, ast.Attribute):
            return func.attr
        if isinstance(func, ast.Name):
            return func.id
        return None

    def _hook_name(self, call: ast.Call) -> str | None:
        name = self._method(call)
        if name is None or name in _NO_HANDLE or not _HOOK_NAME.match(name):
            return None
        return name

    @staticmethod
    def _receiver(call: ast.Call) -> ast.AST | None:
        return call.func.value if isinstance(call.func, ast.Attribute) else None

    def _resolve_defs(self, callee: ast.AST, at: ast.AST
                      ) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
        """The functions of this file that a call to `callee` at `at` may run."""
        if isinstance(callee, ast.Name):
            for scope in self.tree.scopes(at):
                if isinstance(scope, ast.ClassDef):
                    continue  # class bodies are not visible from their methods
                defs = self._defs.get(scope, {}).get(callee.id)
                if defs:
                    return defs
            return []
        if isinstance(callee, ast.Attribute):
            base = dotted(callee.value)
            if base in ("self", "cls"):
                cls = self.tree.enclosing_class(at)
                return [] if cls is None else self._defs.get(cls, {}).get(callee.attr, [])
            return [d for scope, by_name in self._defs.items() if isinstance(scope, ast.ClassDef)
                    for d in by_name.get(callee.attr, [])]
        return []

    # ------------------------------------------------------------------ driver
    def run(self) -> None:
        hook_calls = [(c, n) for c in self.calls if (n := self._hook_name(c)) is not None]
        for call, name in hook_calls:
            self._ts001(call, name)
            self._ts002(call, name)
            self._ts003(call, name)
        if "TS004" in self.codes:
            self._ts004()
        if "TS006" in self.codes:
            self._ts006()
        for call in self.calls:
            qual = self.imports.qualify(call.func)
            if qual in _EMPTY_CACHE:
                self._ts005(call, qual)
            elif qual in _CHECKPOINT:
                self._ts007(call, qual)
        # The distributed rules and TS010's flow live in their own modules.
        for code, rule in (("TS008", check_ts008), ("TS009", check_ts009),
                           ("TS010", check_ts010), ("TS011", check_ts011),
                           ("TS012", check_ts012), ("TS013", check_ts013),
                           ("TS014", check_ts014), ("TS015", check_ts015),
                           ("TS016", check_ts016), ("TS017", check_ts017)):
            if code in self.codes:
                for node, message in rule(self.tree, self.imports, self.calls):
                    self.report(code, node, message)

    # ------------------------------------------------------------------ TS001
    def _handle_use(self, call: ast.Call) -> tuple[str, set[str]]:
        """How the handle is kept: ("owned"|"discarded"|"names"|"container", dotted names)."""
        parent = self.tree.parent(call)
        # `(h := m.register_forward_hook(f))` keeps a name and passes the value on.
        if isinstance(parent, ast.NamedExpr):
            return "names", {parent.target.id}
        if isinstance(parent, (ast.withitem, ast.Return, ast.Yield, ast.YieldFrom, ast.Await)):
            return "owned", set()  # a `with` scopes it; a caller gets it
        if isinstance(parent, ast.Expr):
            return "discarded", set()
        if isinstance(parent, (ast.Assign, ast.AnnAssign)):
            targets = parent.targets if isinstance(parent, ast.Assign) else [parent.target]
            names: set[str] = set()
            containers: set[str] = set()
            for t in targets:
                if isinstance(t, ast.Subscript):
                    d = dotted(t.value)
                    if d:
                        containers.add(d)
                elif (d := dotted(t)) is not None:
                    names.add(d)
            if containers:
                return "container", containers | names
            return "names", names
        if isinstance(parent, (ast.List, ast.Tuple, ast.Set)):
            parent = self.tree.parent(parent)
        if isinstance(parent, ast.Call) and isinstance(parent.func, ast.Attribute):
            if parent.func.attr in _OWNER_METHODS:
                return "owned", set()
            if parent.func.attr in _CONTAINER_METHODS:
                d = dotted(parent.func.value)
                return ("container", {d}) if d else ("owned", set())
        # Anything else (passed to a function, stored in a literal): assume it is kept.
        return "owned", set()

    def _removed_in(self, body: tuple[ast.AST, ...], kind: str, names: set[str]) -> bool:
        """Whether `body` removes the handle (or every handle of a container)."""
        iter_names: set[str] = set()
        if kind == "container":
            for node in walk_local(list(body)):
                if isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)) \
                        and _iter_base(node.iter) in names:
                    iter_names |= {n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)}
        return any(_removes(node, names, iter_names) for node in walk_local(list(body)))

    def _ts001(self, call: ast.Call, name: str) -> None:
        if "TS001" not in self.codes:
            return
        loops = self.tree.loops(call)
        if not loops:
            return
        kind, names = self._handle_use(call)
        if kind == "owned":
            return
        receiver = refs(self._receiver(call))
        hook_fn = refs(_arg(call, 0, "hook"))
        for loop in loops:
            if receiver & loop.varying:
                continue  # a different object every iteration: one hook each, not a pile
            if hook_fn & loop.targets and not loop.counted:
                continue  # `for fn in hooks: m.register_forward_hook(fn)`: each hook once
            if kind != "discarded" and self._removed_in(loop.body, kind, names):
                continue
            what = "its handle is discarded" if kind == "discarded" else \
                f"`{', '.join(sorted(names)) or 'the handle'}` is never removed in the loop body"
            self.report("TS001", call, (
                f"`{name}` runs on every iteration of the loop at line {loop.line} and {what}: "
                "each step adds one more hook to the same module or tensor, so after N steps "
                "it fires N times per call and keeps N copies of what it captures (time and "
                "memory grow until out of memory)."))
            return

    # ------------------------------------------------------------------ TS002
    def _ts002(self, call: ast.Call, name: str) -> None:
        if "TS002" not in self.codes or not isinstance(self.tree.parent(call), ast.Expr):
            return
        if name in ("register_hook", "register_prehook") and self._transient_tensor(call):
            return
        if name.startswith(_GLOBAL_HOOK_PREFIXES):
            self.report("TS002", call, (
                f"`{name}` registers a process-wide hook and discards its handle: it can never "
                "be removed, runs for every module or optimizer of the process (models built "
                "later, evaluation and other libraries' measurements included) and keeps "
                "everything its closure references alive."))
            return
        # What the registration acts on: the module or tensor; a loop over hooks
        # (`for fn in hooks: m.register_forward_hook(fn)`) adds each hook once.
        repeat = self._repeated(call, refs(self._receiver(call)),
                                per_item=refs(_arg(call, 0, "hook")))
        if repeat is not None:
            self.report("TS002", call, (
                f"`{name}` runs on every iteration of the loop at line {repeat.line}"
                f"{_through(repeat)} and its handle is discarded: one more hook that can never "
                "be removed piles up on the same module or tensor every iteration, so it "
                "fires once more per call each step and time and memory grow with the steps."))
            return
        receiver = self._receiver(call)
        owner = "its object" if receiver is None else f"`{_shorten(ast.unparse(receiver))}`"
        self.report("TS002", call, (
            f"the handle returned by `{name}` is discarded: registered once (at setup), the "
            f"hook stays on {owner} for the rest of its life, which is fine when that is the "
            "intent; keep the handle if it must ever come off (evaluation, export, a second "
            "run in the same process)."), severity=Severity.INFO)

    def _transient_tensor(self, call: ast.Call) -> bool:
        """`t.register_hook` on a tensor computed in this function, or on an autograd node
        (`out.grad_fn`): it dies with the graph."""
        receiver = self._receiver(call)
        if isinstance(receiver, ast.Attribute) and receiver.attr == "grad_fn":
            return True
        scope = self.tree.scope(call)
        if isinstance(scope, FUNCS) and scope.name == "forward":
            return receiver is not None and not (dotted(receiver) or "").startswith("self.")
        if not isinstance(receiver, ast.Name):
            return False
        for node in walk_local(list(getattr(scope, "body", []))):
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == receiver.id for t in node.targets):
                value = node.value
                return isinstance(value, (ast.Call, ast.BinOp, ast.UnaryOp, ast.Subscript)) or (
                    isinstance(value, ast.Attribute) and value.attr == "grad_fn")
        return False

    # ------------------------------------------------------------------ TS003
    def _ts003(self, call: ast.Call, name: str) -> None:
        new = _DEPRECATED.get(name)
        if new is None:
            return
        self.report("TS003", call, (
            f"`{name}` is deprecated: on a module whose forward runs more than one autograd "
            "operation it sees the gradients of the last operation only, so the grad_input it "
            "reports or rewrites is silently wrong."),
            fix=f"Use `{new}` (same `(module, grad_input, grad_output)` signature).")

    # ------------------------------------------------------------------ TS004
    def _compile_target(self, call: ast.Call) -> tuple[bool, ast.AST | None]:
        """(is a torch compile call, what it compiles)."""
        if self.imports.qualify(call.func) == _COMPILE:
            target = call.args[0] if call.args else next(
                (k.value for k in call.keywords if k.arg == "model"), None)
            return True, target
        func = call.func
        if not (isinstance(func, ast.Attribute) and func.attr == "compile"):
            return False, None
        root = (dotted(func.value) or "").split(".")[0]
        if not root or self.imports.is_import(root):
            return False, None  # re.compile, regex.compile, some_module.compile
        if any(isinstance(a, (ast.Constant, ast.JoinedStr)) for a in call.args):
            return False, None  # pattern.compile("...")
        if any(k.arg in _NOT_TORCH_COMPILE_KW for k in call.keywords):
            return False, None
        return True, func.value

    def _cache_guarded(self, call: ast.Call, stop: ast.AST, loop: Loop | None = None) -> bool:
        """Whether an `if` between `call` and `stop` (the loop, or the function, that would
        repeat it) lets it run once, not per step: it tests what the call's result is
        assigned to (`if compiled is None: compiled = torch.compile(m)`), or a flag that the
        branch holding the call sets (`if not compiled: ...; compiled = True`), or it asks
        for one value of `loop`'s counter (`if step == warmup:`)."""
        parent = self.tree.parent(call)
        assigned: set[str] = set()
        if isinstance(parent, (ast.Assign, ast.AnnAssign, ast.NamedExpr)):
            targets = parent.targets if isinstance(parent, ast.Assign) else [parent.target]
            for t in targets:
                assigned |= refs(t.value if isinstance(t, ast.Subscript) else t)
        for child, node in self.tree.edges(call):
            if node is stop:
                break
            if not isinstance(node, ast.If):
                continue
            tested = refs(node.test)
            if tested & assigned:
                return True
            branch = node.body if child in node.body else node.orelse \
                if child in node.orelse else None
            if branch is None:
                continue  # the call is in the test itself: it runs whenever the test does
            if _flags(tested, branch, stop, loop):
                return True
            if loop is not None and branch is node.body and _one_count(node.test, loop):
                return True
        return False

    def _ts004(self) -> None:
        for call in self.calls:
            is_compile, target = self._compile_target(call)
            if not is_compile:
                continue
            what = "`torch.compile`" if self.imports.qualify(call.func) == _COMPILE \
                else f"`{dotted(call.func) or 'compile'}()`"
            # Any argument the loop changes (the model, `mode=`, `backend=`, `options=`) means
            # each iteration compiles something different: a sweep, not the trap.
            used = refs(target)
            for arg in (*call.args, *(k.value for k in call.keywords)):
                used |= refs(arg)
            repeat = self._repeated(call, used)
            if repeat is None:
                continue
            where = f" in `{repeat.through[-1]}`" if repeat.through else ""
            self.report("TS004", call, _compile_message(
                f"{what}{where} runs on every iteration of the loop at line {repeat.line}"
                f"{_through(repeat)} and compiles the same model or function each time"))

    # ------------------------------------------------------------------ repetition
    def _call_sites(self) -> dict[ast.AST, list[ast.Call]]:
        """This file's calls of each of its functions, in source order."""
        if self._sites is None:
            self._sites = {}
            for call in self.calls:
                for d in self._resolve_defs(call.func, call):
                    self._sites.setdefault(d, []).append(call)
        return self._sites

    def _repeated(self, call: ast.Call, used: set[str], per_item: set[str] | None = None
                  ) -> _Repeat | None:
        """The loop that runs `call` again, on the same objects, on every iteration.

        `used` names what the call acts on (the compiled model, the hooked module) in the
        call's scope. A loop that changes one of them (`for block in model.children()`) acts
        on a different object each iteration: not a repeat. Outside such loops the search goes
        on at this file's calls of the enclosing function, with `used` replaced by the
        arguments bound to the parameters it depends on, breadth first (the nearest loop is
        reported). A function that builds the object itself (`net = nn.Linear(...)`) or is
        cached (`functools.cache`) acts on a new object, or only once, per call.
        `per_item` names (the hook of a registration) make the call differ between the
        iterations of a loop in its own scope that changes them, but are not followed.
        """
        extra = frozenset(per_item or ())
        queue: deque[tuple[ast.Call, frozenset[str], tuple[str, ...]]] = deque(
            [(call, frozenset(used), ())])
        seen: set[tuple[ast.AST, frozenset[str]]] = set()
        while queue:
            at, names, through = queue.popleft()
            differ = names | extra if at is call else names
            for loop in self.tree.loops(at):
                if differ & loop.varying or self._cache_guarded(at, loop.node, loop):
                    continue
                return _Repeat(loop.line, through)
            func = self.tree.scope(at)
            if not isinstance(func, FUNCS) or _is_cached(func) or self._cache_guarded(at, func):
                continue
            flow = self._flows.get(func)
            if flow is None:
                flow = self._flows[func] = _Flow.of(func)
            params = flow.params_behind(names)
            if params is None or (func, params) in seen:
                continue
            seen.add((func, params))
            for site in self._call_sites().get(func, []):
                bound = _bound_args(site, func, params)
                queue.append((site, frozenset(set().union(*(refs(b) for b in bound))),
                              (func.name, *through)))
        return None

    # ------------------------------------------------------------------ TS005
    def _oom_handler(self, call: ast.Call) -> str | None:
        """The caught type when `call` sits in an out-of-memory handler."""
        for child, parent in self.tree.edges(call):
            if isinstance(parent, (*FUNCS, ast.Lambda, ast.ClassDef)):
                return None
            if isinstance(parent, ast.ExceptHandler) and child in parent.body:
                types = [] if parent.type is None else (
                    list(parent.type.elts) if isinstance(parent.type, ast.Tuple)
                    else [parent.type])
                quals = [self.imports.qualify(t) or "" for t in types]
                for q in quals:
                    if q in _OOM_TYPES:
                        return q
                broad = not quals or any(q in _BROAD_TYPES for q in quals)
                if broad and _mentions_oom(parent.body):
                    return quals[0] if quals else "(bare except)"
        return None

    def _releases(self, node: ast.AST) -> bool:
        """`del x`, `delattr(m, name)`, `gc.collect()`, `x = None` or `x = {}`,
        `cache.clear()`, or moving a module off the device in place (`model.cpu()`,
        `self.fc = self.fc.to("cpu")`)."""
        if isinstance(node, ast.Delete):
            return True
        if isinstance(node, ast.Call) and self.imports.qualify(node.func) == _GC_COLLECT:
            return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "clear" and not node.args:
            return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id == "delattr":
            return True
        if isinstance(node, (ast.Assign, ast.Expr)):
            value = node.value
            if isinstance(node, ast.Assign) and _empty_value(value):
                return True
            return isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) \
                and value.func.attr in ("cpu", "to")
        return False

    def _released_before(self, call: ast.Call) -> bool:
        """Whether something is released before `call`: earlier in its block, then in each
        enclosing block of the same function (`del out` followed by `if cuda:
        empty_cache()`); in a loop, anywhere in the loop body (the previous iteration's
        `del` runs before it too), and nothing before the loop counts."""
        stmt: ast.AST | None = self.tree.statement(call)
        while isinstance(stmt, ast.stmt) and not isinstance(stmt, (*FUNCS, ast.ClassDef)):
            if any(self._releases(node) for node in walk_local(list(self.tree.block_before(stmt)))):
                return True
            parent = self.tree.parent(stmt)
            if isinstance(parent, (ast.For, ast.AsyncFor, ast.While)) and stmt in parent.body:
                return any(self._releases(node) for node in walk_local(list(parent.body)))
            stmt = self.tree.statement(parent) if parent is not None else None
        return False

    def _with_a_purpose(self, call: ast.Call) -> bool:
        """A checkpoint or model load in the same loop body or function (`load_state_dict`,
        `torch.load`, `load_checkpoint`, `from_pretrained`): emptying the cache makes room for
        it, or returns the blocks of the weights it replaced; or a memory reading that
        follows it in the same block (`total = torch.cuda.mem_get_info()`): emptying first
        makes the reading count live tensors only (a reading in a condition, `if
        memory_allocated() > x`, is a reaction, not a purpose)."""
        loops = self.tree.loops(call)
        scope = self.tree.scope(call)
        body = list(loops[0].body) if loops else list(getattr(scope, "body", []))
        if any(isinstance(node, ast.Call) and _LOAD.search(self._method(node) or "")
               for node in walk_local(body)):
            return True
        stmt = self.tree.statement(call)
        block = self.tree.block(stmt) if stmt is not None else []
        following = block[block.index(stmt) + 1:] if stmt in block else []
        return any(isinstance(node, ast.Call) and self._method(node) in _MEMORY_READINGS
                   for s in following if not isinstance(s, (ast.If, ast.While))
                   for node in walk_local([s]))

    def _behind_an_option(self, call: ast.Call) -> bool:
        """Inside an `if` on an option or a schedule (`if args.empty_cache_level >= 1`, `if
        step % 100 == 0`): emptying the cache is the user's explicit choice there, not a
        reflex. A device check (`if torch.cuda.is_available()`) or a memory reaction (`if
        oom`, `if torch.cuda.memory_allocated() > x`) is no such option."""
        for child, parent in self.tree.edges(call):
            if isinstance(parent, SCOPES):
                return False
            if not isinstance(parent, (ast.If, ast.IfExp)) or child is parent.test:
                continue
            test = parent.test
            text = ast.unparse(test).lower()
            if any(word in text for word in _NOT_AN_OPTION):
                continue
            optionish = any(
                isinstance(n, ast.Attribute) and not (self.imports.qualify(n) or "")
                .startswith("torch.") for n in ast.walk(test)) or any(
                isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod) for n in ast.walk(test))
            if optionish:
                return True
        return False

    def _ts005(self, call: ast.Call, qual: str) -> None:
        shown = dotted(call.func) or qual
        caught = self._oom_handler(call)
        if caught is not None:
            self.report("TS005", call, (
                f"`{shown}()` in an `except {caught}` handler as the out-of-memory fix: while "
                "the handler runs, the exception's traceback still references the frames "
                "that hold the tensors, so nothing is freed and the retry runs out of memory "
                "again."),
                fix="Leave the except block first (set a flag), `del` the references, then "
                    "retry with a smaller batch; or need less memory (smaller batch, "
                    "activation checkpointing, mixed precision).")
            return
        if self._released_before(call) or self._with_a_purpose(call) \
                or self._behind_an_option(call):
            return
        fix = ("Drop the references first (`del out, loss`; `gc.collect()` for cycles) and "
               "then call it, or remove it: the caching allocator reuses freed blocks itself.")
        repeat = self._repeated(call, set())
        if repeat is not None:
            self.report("TS005", call, (
                f"`{shown}()` runs on every iteration of the loop at line {repeat.line}"
                f"{_through(repeat)} with nothing released before it (no `del`, "
                "`gc.collect()` or `x = None`): it frees no memory a tensor still references, "
                "so it prevents no out-of-memory error, and every step pays for cudaMalloc "
                "again for the blocks it returned."), fix=fix)
            return
        self.report("TS005", call, (
            f"`{shown}()` with nothing released before it (no `del`, `gc.collect()` or "
            "`x = None`): it only returns cached blocks that no tensor uses, so memory still "
            "referenced is not freed (it is no out-of-memory fix), and the next allocations "
            "pay for cudaMalloc again."), fix=fix, severity=Severity.INFO)

    # ------------------------------------------------------------------ TS006
    def _hook_functions(self) -> list[_HookFn]:
        found: dict[ast.AST, _HookFn] = {}
        for call in self.calls:
            name = self._method(call)
            if name is None:
                continue
            fn_arg: ast.AST | None
            if name in _MODULE_HOOKS or name in _TENSOR_HOOKS:
                fn_arg = _arg(call, 0, "hook")
                module_hook = name in _MODULE_HOOKS
            elif name == "register_multi_grad_hook":
                fn_arg, module_hook = _arg(call, 1, "fn"), False
            elif isinstance(call.func, ast.Attribute) and (
                    name in _SESSION_MODULE_HOOKS or name in _SESSION_TENSOR_HOOKS):
                fn_arg, module_hook = _arg(call, 1, "fn"), name in _SESSION_MODULE_HOOKS
            else:
                continue
            if isinstance(fn_arg, ast.Call) and (dotted(fn_arg.func) or "").endswith("partial") \
                    and fn_arg.args:
                fn_arg = fn_arg.args[0]
            targets: list[ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda]
            if isinstance(fn_arg, ast.Lambda):
                targets = [fn_arg]
            elif isinstance(fn_arg, ast.Call):
                # A hook factory: `register_forward_hook(self._make_hook(name))`.
                targets = [h for f in self._resolve_defs(fn_arg.func, call)
                           for h in self._returned_functions(f)]
            elif fn_arg is not None:
                targets = list(self._resolve_defs(fn_arg, call))
            else:
                targets = []
            for t in targets:
                found.setdefault(t, _HookFn(t, module_hook, call.lineno))
        return list(found.values())

    def _returned_functions(self, factory: ast.FunctionDef | ast.AsyncFunctionDef
                            ) -> list[ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda]:
        """The nested functions or lambdas a factory returns."""
        out: list[ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda] = []
        for node in walk_local(list(factory.body)):
            if not isinstance(node, ast.Return) or node.value is None:
                continue
            if isinstance(node.value, ast.Lambda):
                out.append(node.value)
            elif isinstance(node.value, ast.Name):
                out.extend(self._defs.get(factory, {}).get(node.value.id, []))
        return out

    def _ts006(self) -> None:
        for hook in self._hook_functions():
            fn = hook.node
            label = "a lambda hook" if isinstance(fn, ast.Lambda) else f"hook `{fn.name}`"
            tensors = _hook_tensor_params(fn, hook.module_hook,
                                          is_method=isinstance(self.tree.parent(fn),
                                                               ast.ClassDef))
            body: list[ast.AST] = [fn.body] if isinstance(fn, ast.Lambda) else list(fn.body)
            _propagate_tensors(body, tensors)
            where = (f"inside {label} (registered at line {hook.registered_line}) "
                     "copies to the host and waits for the device on every call: the hot "
                     "path stalls, and under torch.compile it is a graph break.")
            for node in walk_local(body):
                if not isinstance(node, ast.Call):
                    continue
                func = node.func
                if isinstance(func, ast.Attribute) and func.attr in _SYNC_METHODS:
                    self.report("TS006", node, f"`.{func.attr}()` {where}")
                elif isinstance(func, ast.Name) and func.id == "print" \
                        and not self.imports.is_import("print") \
                        and any(_tensorish(a, tensors) for a in
                                [*node.args, *(k.value for k in node.keywords)]):
                    self.report("TS006", node, f"`print` of a tensor {where}")

    # ------------------------------------------------------------------ TS007
    def _ts007(self, call: ast.Call, qual: str) -> None:
        if any(k.arg in ("use_reentrant", None) for k in call.keywords):
            return  # explicit, or possibly inside **kwargs
        short = qual.rsplit(".", 1)[1]
        self.report("TS007", call, (
            f"`{short}` without `use_reentrant=`: PyTorch warns on every call and falls back "
            "to the reentrant implementation, which gives the checkpointed parameters no "
            "gradient when no input requires grad, rejects keyword arguments and does not "
            "work with torch.autograd.grad; the argument is announced to become required."))


# ---------------------------------------------------------------------- module helpers
def _flags(tested: set[str], branch: list[ast.stmt], stop: ast.AST, loop: Loop | None
           ) -> set[str]:
    """The names of `tested` that `branch` alone, of `stop`'s body, sets, to a value that
    `loop` does not change (`compiled = True`): once set, a test of them that kept the
    branch from running keeps it from running again (a name reset elsewhere in the body,
    or counted up, is no flag)."""
    varying = loop.varying if loop is not None else frozenset()
    inside = bindings([*branch])
    out = {name for names, value, always in inside
           if not always and not refs(value) & varying for name in names & tested - varying}
    if out:  # the whole body is read only for a candidate
        everywhere = bindings(list(getattr(stop, "body", [])))
        out = {name for name in out if sum(name in n for n, _v, _a in everywhere)
               == sum(name in n for n, _v, _a in inside)}
    return out


def _one_count(test: ast.AST, loop: Loop) -> bool:
    """`test` holds for one iteration of `loop` at most: it compares one of the loop's
    counters for equality with what the loop does not change (`step == warmup`), alone or
    as a term of an `and`."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return any(_one_count(v, loop) for v in test.values)
    if not isinstance(test, ast.Compare) or len(test.ops) != 1 or \
            not isinstance(test.ops[0], ast.Eq):
        return False
    sides = (test.left, test.comparators[0])
    for side, other in (sides, sides[::-1]):
        if dotted(side) in loop.counters and not refs(other) & loop.varying:
            return True
    return False


def _compile_message(head: str) -> str:
    return (f"{head}: each call builds a new compiled "
            "wrapper (`model = torch.compile(model)` nests one more per step) that goes "
            "through dynamo's cache and guard checks again, and any guard change recompiles "
            "until the recompile limit, after which the model silently runs eager.")


def _iter_base(node: ast.AST) -> str | None:
    """The container a `for` iterates: `hs`, `hs.values()`, `reversed(hs)`, `list(hs)`."""
    while isinstance(node, ast.Call):
        if isinstance(node.func, ast.Attribute) and node.func.attr in ("values", "items"):
            node = node.func.value
        elif isinstance(node.func, ast.Name) and node.args and node.func.id in (
                "reversed", "list", "tuple", "sorted", "enumerate", "iter"):
            node = node.args[0]
        else:
            return None
    return dotted(node)


def _through(repeat: _Repeat) -> str:
    """`, which calls `step`, which calls `build`,` for a repeat through functions."""
    chain = "".join(f", which calls `{name}`" for name in repeat.through)
    return f"{chain}," if chain else ""


@dataclass(frozen=True, eq=False)
class _Flow:
    """Where the names of one function come from: which parameters decide each, and which
    are objects the function builds itself."""

    params: frozenset[str]
    origin: dict[str, frozenset[str]]
    built: frozenset[str]

    @classmethod
    def of(cls, func: ast.FunctionDef | ast.AsyncFunctionDef) -> _Flow:
        a = func.args
        params = {p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)}
        params |= {v.arg for v in (a.vararg, a.kwarg) if v is not None}
        origin: dict[str, set[str]] = {p: {p} for p in params}
        binds = [(name, refs(value)) for targets, value, _always in bindings(list(func.body))
                 for name in targets]
        changed = True
        while changed:
            changed = False
            for name, read in binds:
                source = set().union(*(origin[r] for r in read if r in origin))
                if not source <= origin.setdefault(name, set()):
                    origin[name] |= source
                    changed = True
        # A call's result is a new object (a factory, a constructor), unless it is the same
        # object moved or switched (`model.to(device)`, `model.eval()`); a `for` target is
        # an item of what it iterates, no new object either.
        built = {name for node in walk_local(list(func.body))
                 if isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr))
                 and isinstance(node.value, ast.Call) and not (
                     isinstance(node.value.func, ast.Attribute)
                     and node.value.func.attr in _SAME_OBJECT)
                 for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
                 for name in target_names(target)}
        return cls(frozenset(params), {k: frozenset(v) for k, v in origin.items()},
                   frozenset(built - params))

    def params_behind(self, names: frozenset[str]) -> frozenset[str] | None:
        """The parameters whose values decide `names`, directly or through locals.

        None when a name is an object the function builds itself (`net = nn.Linear(...)`,
        `fn = self.make_fn()`): a new one on every call. Names that are neither parameters
        nor bound here are globals: the same on every call.
        """
        if names & self.built:
            return None
        return frozenset().union(*(self.origin.get(n, frozenset()) for n in names))


def _bound_args(site: ast.Call, func: ast.FunctionDef | ast.AsyncFunctionDef,
                params: frozenset[str]) -> list[ast.AST]:
    """The expressions a call of `func` passes to `params` (a method call's receiver binds
    `self`; `*args` and `**kwargs` may bind anything)."""
    a = func.args
    positional = [p.arg for p in (*a.posonlyargs, *a.args)]
    bound: list[ast.AST] = []
    if positional[:1] in (["self"], ["cls"]) and isinstance(site.func, ast.Attribute):
        if positional[0] in params:
            bound.append(site.func.value)
        positional = positional[1:]
    for i, arg in enumerate(site.args):
        if isinstance(arg, ast.Starred) or (i < len(positional) and positional[i] in params) \
                or (i >= len(positional) and a.vararg is not None and a.vararg.arg in params):
            bound.append(arg)
    named = {*positional, *(k.arg for k in a.kwonlyargs)}
    extra = a.kwarg is not None and a.kwarg.arg in params
    bound.extend(k.value for k in site.keywords
                 if k.arg is None or k.arg in params or (extra and k.arg not in named))
    return bound


def _shorten(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else f"{text[:limit - 1]}…"


def _empty_value(node: ast.AST) -> bool:
    """`None`, `{}`, `[]`, `()`, `dict()`, `list()`: what a released reference is set to."""
    if isinstance(node, ast.Constant):
        return node.value is None
    if isinstance(node, (ast.Dict, ast.List, ast.Tuple, ast.Set)):
        return not (node.keys if isinstance(node, ast.Dict) else node.elts)
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
        and node.func.id in ("dict", "list", "tuple", "set") and not node.args \
        and not node.keywords


def _removes(node: ast.AST, names: set[str], iter_names: set[str]) -> bool:
    """Whether `node` removes (or hands off) one of the tracked handles."""
    if isinstance(node, ast.Attribute) and node.attr == "remove":
        value = node.value
        if dotted(value) in names or dotted(value) in iter_names:
            return True
        if isinstance(value, ast.Subscript):
            return dotted(value.value) in names
        return isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) \
            and dotted(value.func.value) in names
    if isinstance(node, ast.withitem):
        return dotted(node.context_expr) in names
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
        and node.func.attr in _OWNER_METHODS and any(dotted(a) in names for a in node.args)


def _is_cached(func: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    for dec in func.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        if (dotted(target) or "").rsplit(".", 1)[-1] in _CACHE_DECORATORS:
            return True
    return False


def _mentions_oom(body: list[ast.stmt]) -> bool:
    return any(isinstance(n, ast.Constant) and isinstance(n.value, str)
               and "out of memory" in n.value.lower() for n in walk_local(list(body)))


def _arg(call: ast.Call, index: int, keyword: str) -> ast.AST | None:
    if len(call.args) > index and not isinstance(call.args[index], ast.Starred):
        return call.args[index]
    return next((k.value for k in call.keywords if k.arg == keyword), None)


def _hook_tensor_params(fn: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda,
                        module_hook: bool, *, is_method: bool) -> set[str]:
    """Parameters torch fills with tensors (or tuples of them) when it calls the hook."""
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    # Parameters with defaults are the `_n=name` closure idiom: torch never passes them.
    n_required = len(positional) - len(a.defaults)
    names = [p.arg for p in positional[:n_required]]
    decorators = [] if isinstance(fn, ast.Lambda) else fn.decorator_list
    if is_method and names and not any(dotted(d) == "staticmethod" for d in decorators):
        names = names[1:]
    if module_hook and names:
        names = names[1:]
    if a.vararg is not None:
        names.append(a.vararg.arg)
    return set(names)


def _propagate_tensors(body: list[ast.AST], tensors: set[str]) -> None:
    """Add locals computed from tensors (`y = out[0].float()`, `for t in outputs:`)."""
    bindings: list[tuple[ast.AST, ast.AST]] = []
    for node in walk_local(body):
        if isinstance(node, ast.Assign):
            bindings.extend((t, node.value) for t in node.targets)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and node.value is not None:
            bindings.append((node.target, node.value))
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            bindings.append((node.target, node.iter))
        elif isinstance(node, ast.NamedExpr):
            bindings.append((node.target, node.value))
    changed = True
    while changed:
        changed = False
        for target, value in bindings:
            if _tensorish(value, tensors):
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Name) and sub.id not in tensors:
                        tensors.add(sub.id)
                        changed = True


def _tensorish(node: ast.AST, tensors: set[str]) -> bool:
    """Whether an expression (probably) evaluates to a tensor, or formats one."""
    if isinstance(node, ast.Name):
        return node.id in tensors
    if isinstance(node, (ast.Subscript, ast.Starred)):
        return _tensorish(node.value, tensors)
    if isinstance(node, ast.Attribute):
        return node.attr in _TENSOR_ATTRS and _tensorish(node.value, tensors)
    if isinstance(node, ast.BinOp):
        return _tensorish(node.left, tensors) or _tensorish(node.right, tensors)
    if isinstance(node, ast.UnaryOp):
        return _tensorish(node.operand, tensors)
    if isinstance(node, (ast.Tuple, ast.List)):
        return any(_tensorish(e, tensors) for e in node.elts)
    if isinstance(node, ast.JoinedStr):
        return any(isinstance(v, ast.FormattedValue) and _tensorish(v.value, tensors)
                   for v in node.values)
    if isinstance(node, ast.Call):
        func = node.func
        args = [*node.args, *(k.value for k in node.keywords)]
        if isinstance(func, ast.Attribute):
            if _tensorish(func.value, tensors):
                return func.attr not in _META_METHODS
            if func.attr == "format" or (dotted(func.value) or "").split(".")[0] == "torch":
                return any(_tensorish(a, tensors) for a in args)
            return False
        if isinstance(func, ast.Name) and func.id in _STRINGIFY:
            return any(_tensorish(a, tensors) for a in args)
    return False
