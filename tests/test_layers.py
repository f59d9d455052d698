"""The layers of ``../shared/ARCHITECTURE.md``, read from the code: a layer imports the ones below it, never above.

    tools      train, cli, emulate/, bench/, advise/
    config     conf/, configs.py
    adapters   strategies/, callbacks/, plugins/   (Lightning)
    algorithms algorithms/                         (torch only)

Within the adapters, callbacks work through what strategies publish (their ``sync_stats`` record and the mode API of
``algorithms.switch_policy.SwitchesModes``) and never import a strategy; a strategy that adds a callback for the user
(``auto_sync`` its ``SyncSwitcher``, the watched strategies their ``PeerWatchdog``) imports it where it adds it, inside
the function, so no module of one imports the other at import time. Every import counts, in functions too.

Nor do modules import in a circle, directly or through others, whatever their layer (``bench/runner.py`` hands
``bench/elastic.py`` what a node-fault run needs instead of being imported back), and no module outgrows 600 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_syncasync"
TOOLS = ("train", "cli", "emulate", "bench", "advise", "configs")
ADAPTERS = ("strategies", "callbacks", "plugins")
LIGHTNING = ("lightning", "pytorch_lightning", "lightning_utilities")


def _modules(layer: str) -> list[Path]:
    return sorted((PACKAGE / layer).rglob("*.py"))


def _imports(path: Path, module_level_only: bool = False) -> list[tuple[int, str]]:
    """(line, imported module) of every absolute import in ``path`` (``from a.b import c`` gives ``a.b.c`` too, so a
    submodule imported by name is seen)."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: a relative import; the package imports absolutely"
            found.append((node.lineno, node.module or ""))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def _within(name: str, roots: tuple[str, ...], package: bool = True) -> bool:
    prefix = "lightning_syncasync." if package else ""
    return any(name == prefix + r or name.startswith(prefix + r + ".") for r in roots)


def _violations(paths: list[Path], roots: tuple[str, ...], package: bool = True, module_level_only: bool = False):
    return [
        f"{p.relative_to(PACKAGE.parent)}:{line} imports {name}"
        for p in paths
        for line, name in _imports(p, module_level_only)
        if _within(name, roots, package)
    ]


def test_the_layers_see_the_code():
    assert len(_modules("algorithms")) >= 20 and len(_modules("strategies")) >= 10 and _modules("callbacks")
    # The walk finds an import that exists, in a function (auto_sync adds its switcher where it needs it).
    found = _imports(PACKAGE / "strategies" / "auto_sync.py")
    assert any(name == "lightning_syncasync.callbacks.switcher.SyncSwitcher" for _, name in found)


def test_the_algorithms_import_neither_lightning_nor_anything_above_them():
    paths = _modules("algorithms")
    assert not _violations(paths, LIGHTNING, package=False)
    assert not _violations(paths, (*ADAPTERS, *TOOLS, "demo"))


@pytest.mark.parametrize("layer", ADAPTERS)
def test_the_adapters_import_no_tool_or_config(layer):
    assert not _violations(_modules(layer), TOOLS)


def test_callbacks_never_import_a_strategy():
    assert not _violations(_modules("callbacks"), ("strategies",))


def test_no_strategy_imports_a_callback_at_import_time():
    assert not _violations(_modules("strategies"), ("callbacks",), module_level_only=True)


# The public names of the modules that became packages when algorithms/ was grouped by concern: user code that
# imported them from the module keeps working.
_FORMER_MODULES = {
    "compression": ("Compressor", "METHODS", "CHUNKED", "COLLECTIVES", "check_method", "add_server_residual_"),
    "averaging": ("DelayedAverager", "PeerLostError", "check_settings"),
    "ssp": ("SSPExchange", "SSPStats", "ApplyFn"),
    "batching": ("BatchBalancer",),
}


@pytest.mark.parametrize("package", sorted(_FORMER_MODULES))
def test_a_grouped_package_keeps_its_former_modules_names_and_exports_what_it_lists(package):
    import importlib

    module = importlib.import_module(f"lightning_syncasync.algorithms.{package}")
    assert module.__file__.endswith("__init__.py"), f"algorithms/{package} is a package now"
    missing = [name for name in _FORMER_MODULES[package] if not hasattr(module, name)]
    assert not missing, f"lightning_syncasync.algorithms.{package} lost {missing}"
    unresolved = [name for name in module.__all__ if not hasattr(module, name)]
    assert not unresolved, f"{package}.__all__ lists names it does not define: {unresolved}"


# -- the module graph -------------------------------------------------------------------------------------------------

MAX_MODULE_LINES = 600


def _module_names() -> dict[str, Path]:
    """``{dotted module name: file}`` of every module of the package (a package is its ``__init__``)."""
    names = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _module_graph() -> dict[str, dict[str, int]]:
    """``{module: {module it imports: line}}`` over every import of the package, in functions too.

    ``import a.b.c`` is an edge to ``a.b.c``; ``from a.b import name`` to ``a.b.name`` where that is a module, else to
    ``a.b``. An edge from a module to one of its own ancestor packages (which Python runs first anyway) is left out.
    """
    modules = _module_names()
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names if alias.name in modules]
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{path}:{node.lineno}: a relative import; the package imports absolutely"
                base = node.module or ""
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                    if f"{base}.{alias.name}" in modules or base in modules
                ]
            else:
                continue
            for target in targets:
                if target != module and not module.startswith(target + "."):
                    edges.setdefault(target, node.lineno)
        graph[module] = edges
    return graph


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) in each strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for component in components:
        # A shortest way back to the component's first module, by breadth-first search inside it.
        start = min(component)
        came_from: dict[str, str] = {}
        frontier = [start]
        while start not in came_from:
            reached = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w in component and w not in came_from:
                        came_from[w] = v
                        reached.append(w)
            frontier = reached
        path = [start]
        while len(path) == 1 or path[-1] != start:
            path.append(came_from[path[-1]])
        cycles.append(path[::-1])
    return cycles


def test_the_module_graph_sees_the_imports():
    graph = _module_graph()
    assert len(graph) >= 100
    # A module imported by name, one imported in a function, and a name imported from a module.
    assert "lightning_syncasync.callbacks.switcher" in graph["lightning_syncasync.strategies.auto_sync"]
    assert "lightning_syncasync.bench.elastic" in graph["lightning_syncasync.bench.runner"]
    assert "lightning_syncasync.bench.scenarios" in graph["lightning_syncasync.bench.runner"]
    # An import of a package's own ancestors is not an edge.
    assert not any(dst in src for src, edges in graph.items() for dst in edges if src.startswith(dst + "."))
    assert _cycles({"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}) == [["a", "b", "c", "a"]]


def test_no_import_circle_between_modules():
    graph = _module_graph()
    cycles = _cycles(graph)
    described = [
        " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:], strict=False)) + f" -> {cycle[-1]}"
        for cycle in cycles
    ]
    assert not cycles, "import circles (every import counts, in functions too):\n" + "\n".join(described)


def test_no_module_is_over_the_size_limit():
    """Issue 67: no module over 600 lines (Lightning's ddp.py is under 500); the long ones were split along seams."""
    sizes = {path: len(path.read_text().splitlines()) for path in _module_names().values()}
    over = sorted(f"{p.relative_to(PACKAGE.parent)}: {n} lines" for p, n in sizes.items() if n > MAX_MODULE_LINES)
    assert not over, f"modules over {MAX_MODULE_LINES} lines; split them along a seam:\n" + "\n".join(over)
