"""The layers of ``../shared/ARCHITECTURE.md``, read from the code: a layer imports the ones below it, never above.

    tools      train, cli, emulate/, bench/, advise/
    config     conf/, configs.py
    adapters   strategies/, callbacks/, plugins/   (Lightning)
    algorithms algorithms/                         (torch only)

Within the adapters, callbacks work through what strategies publish (their ``sync_stats`` record and the mode API of
``algorithms.switch_policy.SwitchesModes``) and never import a strategy; a strategy that adds a callback for the user
(``auto_sync`` its ``SyncSwitcher``, the watched strategies their ``PeerWatchdog``) imports it where it adds it, inside
the function, so no module of one imports the other at import time. Every import counts, in functions too.
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
