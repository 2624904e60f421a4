"""The library's imports point one way: no cycle, no private name used across modules.

Walks the source of every module of ``torchtune_ext`` with ``ast`` (nothing is
imported), so a new cycle or a reach into another module's private names fails
here, whichever function hides it.
"""

import ast
from pathlib import Path
from typing import Dict, List, Set, Tuple

PACKAGE = "torchtune_ext"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE

# The layers of docs/architecture.md, by the top-level package (or leaf module) under torchtune_ext: a module
# imports from its own layer or those below, never from above. One package per layer from config/ up.
LAYERS = {
    1: ("errors", "ranks", "text", "moved"),
    2: ("config",),
    3: ("checkpoint",),
    4: ("parallel",),
    5: ("train",),
    6: ("data",),
    7: ("model",),
    8: ("run",),
    9: ("tools", "_local_recipes"),
}
# The bottom of the stack: these import nothing of ours.
LEAVES = ("errors", "ranks", "text", "moved")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> Dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(importer: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(name: str, path: Path, known: Set[str]) -> List[Tuple[str, int, str, bool]]:
    """(imported module, line, imported name or '', inside a function) for each import of ours."""
    tree = ast.parse(path.read_text(), str(path))
    found = []

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            local = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((a.name, child.lineno, "", in_function) for a in child.names
                             if a.name.split(".")[0] == PACKAGE)
            elif isinstance(child, ast.ImportFrom):
                module = _resolve(name, child, path.name == "__init__.py")
                if module.split(".")[0] != PACKAGE:
                    continue
                for alias in child.names:
                    target = f"{module}.{alias.name}"
                    if target in known:  # `from package import module`
                        found.append((target, child.lineno, "", in_function))
                    else:
                        found.append((module, child.lineno, alias.name, in_function))
            visit(child, local)

    visit(tree, False)
    return found


def _edges(importer: str, module: str, known: Set[str]) -> Set[str]:
    """The modules an import of ``module`` by ``importer`` runs: ``module`` and each package on the way.

    Importing a.b.c runs a and a.b first, except a package the importer itself
    lies in: that one has started before the importer could run, so a module
    importing its sibling (a.b.x importing a.b.c) does not depend on a.b's
    ``__init__``. Importing a package itself (``from a.b import name``) does.
    """
    parts = module.split(".")
    on_the_way = {".".join(parts[:i]) for i in range(2, len(parts))}
    edges = {p for p in on_the_way if p in known and not importer.startswith(p + ".")}
    if module in known:
        edges.add(module)
    edges.discard(importer)
    return edges


def _graph() -> Dict[str, Set[str]]:
    modules = _modules()
    known = set(modules)
    graph = {}
    for name, path in modules.items():
        edges = set()
        for module, _, _, _ in _imports(name, path, known):
            edges |= _edges(name, module, known)
        graph[name] = edges
    return graph


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    counter = [0]

    def strongconnect(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_an_import_runs_the_packages_on_the_way_except_the_importers_own():
    known = {"p", "p.a", "p.sub", "p.sub.x", "p.sub.y"}
    assert _edges("p.a", "p.sub.x", known) == {"p.sub", "p.sub.x"}
    assert _edges("p.sub.y", "p.sub.x", known) == {"p.sub.x"}  # p.sub has started before p.sub.y runs
    assert _edges("p.sub.y", "p.sub", known) == {"p.sub"}  # a name from the package's __init__: a real edge


def test_no_import_cycle_among_the_library_modules():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def _layer(module: str) -> int:
    top = module.split(".")[1] if module.count(".") else ""
    if not top:
        return 1  # the package's own __init__: it installs the old paths (moved), a leaf
    found = [layer for layer, names in LAYERS.items() if top in names]
    assert found, f"{module} is in no layer of LAYERS (tests/unit/test_imports.py, docs/architecture.md)"
    return found[0]


def test_imports_point_down_the_layers():
    upward = [f"{name} (layer {_layer(name)}) imports {target} (layer {_layer(target)})"
              for name, targets in _graph().items() for target in sorted(targets) if _layer(target) > _layer(name)]
    assert not upward, "\n".join(upward)


def test_the_leaves_import_nothing_of_ours():
    graph = _graph()
    for leaf in LEAVES:
        assert graph[f"{PACKAGE}.{leaf}"] == set(), leaf


def test_no_private_name_is_imported_from_another_module():
    modules = _modules()
    known = set(modules)
    offenders = [f"{_module_name(path)}:{line} imports {module}.{imported}"
                 for name, path in modules.items()
                 for module, line, imported, _ in _imports(name, path, known)
                 if imported.startswith("_") and not imported.startswith("__")]
    assert not offenders, "\n".join(offenders)


def _has_comment(path: Path, line: int) -> bool:
    lines = path.read_text().splitlines()
    return "#" in lines[line - 1] or lines[line - 2].strip().startswith("#")


def test_a_function_imports_a_library_module_only_for_import_weight_and_says_so():
    """A function-local import of our own modules must not dodge a cycle; one that defers a heavy import
    (e.g. at interpreter start-up, from a .pth file) says so in a comment on or above its line."""
    modules = _modules()
    known = set(modules)
    offenders = [f"{_module_name(path)}:{line} imports {module} inside a function without saying why"
                 for name, path in modules.items()
                 for module, line, _, in_function in _imports(name, path, known)
                 if in_function and not _has_comment(path, line)]
    assert not offenders, "\n".join(offenders)


def _top_level_graph() -> Dict[str, Set[str]]:
    """The import graph with each top-level package or module of the library as one node."""
    top = {}
    for name, targets in _graph().items():
        if name == PACKAGE:
            continue
        node = name.split(".")[1]
        top.setdefault(node, set()).update(t.split(".")[1] for t in targets if t != PACKAGE and t.split(".")[1] != node)
    return top


def _levels(graph: Dict[str, Set[str]]) -> Dict[str, int]:
    """1 for a node that imports nothing of ours, else one more than the highest node it imports."""
    levels: Dict[str, int] = {}

    def level(node: str) -> int:
        if node not in levels:
            levels[node] = 1 + max((level(t) for t in graph.get(node, ())), default=0)
        return levels[node]

    for node in graph:
        level(node)
    return levels


def test_the_levels_helper_counts_the_longest_chain():
    assert _levels({"a": set(), "b": {"a"}, "c": {"a", "b"}}) == {"a": 1, "b": 2, "c": 3}


def test_the_library_is_a_few_packages_on_a_few_levels():
    """docs/architecture.md: at most 16 top-level nodes on at most 9 levels, and no file over ~600 lines."""
    graph = _top_level_graph()
    assert not _cycles(graph)
    levels = _levels(graph)
    by_level = {}
    for node, n in sorted(levels.items()):
        by_level.setdefault(n, []).append(node)
    shown = "; ".join(f"{n}: {', '.join(nodes)}" for n, nodes in sorted(by_level.items()))
    assert len(graph) <= 16 and max(levels.values()) <= 9, shown
    long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py") if (n := len(p.read_text().splitlines())) > 620}
    assert not long, long
