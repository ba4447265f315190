"""The layers of docs/architecture.md, enforced: every import in the package points down (or
stays inside its own package), and no group of modules imports itself round in a cycle.

Every import counts: module level, inside functions (lazy), and under `TYPE_CHECKING`.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "torchscope"

# Lowest first. A module may import modules of its own layer's earlier entries, of lower
# layers, and of its own top-level package. Capabilities are peers: none imports another.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundation", ("errors", "findings", "catalogue", "_util", "_process", "_timing",
                    "_kernels", "models", "hooks", "step")),
    ("distributed", ("distributed",)),
    ("capabilities", ("capture", "grads", "memory", "profiling", "compile", "lint")),
    ("report", ("report",)),
    ("compositions", ("doctor", "lab", "monitoring")),
    ("entry points", ("cli", "integrations", "examples", "__main__")),
)
PEERS = {"capabilities"}  # layers whose packages may not import each other



def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in SRC.rglob("*.py")}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every torchscope module `name` imports (resolving `from pkg import submodule`)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "torchscope")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "torchscope":
                continue
            subs = {f"{target}.{a.name}" for a in node.names} & known
            out.update(subs or {target})
    return {m for m in out if m != name}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {name: _imports(name, path, known) for name, path in mods.items()}


def _rank(module: str) -> tuple[int, int, str] | None:
    """(layer index, position in the layer, top-level package) of a torchscope module."""
    parts = module.split(".")
    if len(parts) == 1:
        return None  # the package root: the public facade, above everything
    top = parts[1]
    for i, (_, packages) in enumerate(LAYERS):
        if top in packages:
            return i, packages.index(top), top
    raise AssertionError(f"{module} belongs to no layer: add {top!r} to LAYERS and to "
                         "docs/architecture.md")


def _violations() -> set[tuple[str, str]]:
    bad: set[tuple[str, str]] = set()
    for src, targets in _graph().items():
        rs = _rank(src)
        if rs is None:
            continue
        for dst in targets:
            rd = _rank(dst)
            if rd is None:
                bad.add((src, dst))  # importing the facade from inside: upward
                continue
            if rd[2] == rs[2]:
                continue  # inside one package: cycles are checked below
            layer = LAYERS[rs[0]][0]
            if rd[0] > rs[0] or (rd[0] == rs[0] and (layer in PEERS or rd[1] > rs[1])):
                bad.add((src, dst))
    return bad


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_import_points_down() -> None:
    bad = _violations()
    assert not bad, "imports that point up or sideways:\n" + "\n".join(
        f"  {a} -> {b}" for a, b in sorted(bad))


def test_no_import_cycles() -> None:
    cycles = _cycles()
    assert not cycles, "import cycles:\n" + "\n".join("  " + " <-> ".join(c) for c in cycles)


def test_every_package_is_in_a_layer_and_documented() -> None:
    doc = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    tops = {m.split(".")[1] for m in _modules() if "." in m}
    for top in tops:
        assert _rank(f"torchscope.{top}") is not None
        assert f"`{top}" in doc, f"docs/architecture.md does not mention {top}"


def test_the_parser_sees_lazy_and_type_only_imports(tmp_path: Path) -> None:
    code = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from torchscope.doctor import runner\n"
            "def f():\n    import torchscope.cli.app\n")
    p = tmp_path / "m.py"
    p.write_text(code)
    found = _imports("torchscope.x.m", p, {"torchscope.doctor.runner"})
    assert found == {"torchscope.doctor.runner", "torchscope.cli.app"}


def test_graph_sees_relations_between_packages() -> None:
    by_top: dict[str, set[str]] = defaultdict(set)
    for src, targets in _graph().items():
        for dst in targets:
            by_top[src.split(".")[1] if "." in src else ""].add(dst)
    assert any(d.startswith("torchscope.hooks") for d in by_top["grads"])
