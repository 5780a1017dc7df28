"""No import cycle between the modules of ``python/mlxfast``.

Walks every module's imports from its source (module level and inside
functions alike: a lazy import is still a dependency; imports under
``if TYPE_CHECKING:`` are not), resolves them to modules of the package, and
looks for strongly connected components. A package's ``__init__`` counts as a
module of its own; importing a submodule is not counted as importing its
parent packages (Python does that, but it is not a design dependency).
"""

from __future__ import annotations

import ast
from pathlib import Path

import mlxfast

ROOT = Path(mlxfast.__file__).resolve().parent


def _modules() -> dict[str, tuple[Path | None, bool]]:
    mods: dict[str, tuple[Path | None, bool]] = {"mlxfast._ext": (None, False)}  # the native module
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts.pop()
        mods[".".join(parts)] = (path, is_pkg)
    return mods


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and (
        (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
        or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING"))


def _imports(tree: ast.AST):
    stack = [tree]
    while stack:
        node = stack.pop()
        if _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _targets(module: str, is_pkg: bool, node, mods) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        base = module.split(".") if is_pkg else module.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    # ``from pkg import name``: the submodule pkg.name when there is one.
    return [f"{target}.{a.name}" if f"{target}.{a.name}" in mods else target for a in node.names]


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for module, (path, is_pkg) in mods.items():
        if path is None:
            continue
        for node in _imports(ast.parse(path.read_text(), str(path))):
            graph[module] |= {t for t in _targets(module, is_pkg, node, mods) if t in mods and t != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_the_walker_sees_a_cycle():
    """The detector itself: a two-module cycle, a three-module one, and a DAG."""
    assert cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_the_graph_resolves_relative_imports():
    graph = import_graph()
    assert "mlxfast.ops.dispatch" in graph["mlxfast.ops.matmul"]
    assert "mlxfast._ext" in graph["mlxfast.ops.dispatch"]
    assert "mlxfast.kv.allocator" in graph["mlxfast.engine.scheduler"]
    # TYPE_CHECKING imports are not dependencies.
    assert "mlxfast.text.tokenizer" not in graph["mlxfast.text.detokenizer"]


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_lower_layers_import_no_upper_ones():
    """kv and ops know nothing of the engine or the server; the engine knows nothing of the server."""
    graph = import_graph()
    upper = {"kv": ("mlxfast.engine", "mlxfast.server"), "ops": ("mlxfast.engine", "mlxfast.server", "mlxfast.kv"),
             "engine": ("mlxfast.server",)}
    bad = []
    for layer, banned in upper.items():
        for module, deps in graph.items():
            if module.startswith(f"mlxfast.{layer}"):
                bad += [(module, d) for d in deps if d.startswith(banned)]
    assert bad == []
