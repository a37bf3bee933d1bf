"""The folder tree is the architecture: the core never reaches into tools,
integrations or plugins, and no two modules import each other in a circle.

Imports are read from the source (module level, ``TYPE_CHECKING`` blocks and
imports inside functions alike), so a lazy import cannot hide an edge.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvcore"
PLUGINS = ROOT / "plugins"
#: Subpackages of kvcore that are not the core.
OUTSIDE_CORE = ("kvcore.tools", "kvcore.integrations")
#: What the core may import besides the standard library and itself: the
#: core's own hard dependencies.
CORE_DEPENDENCIES = {"torch", "pluggy", "attrs", "cattrs", "numpy", "xxhash"}
#: The testing kit is a pytest plugin, loaded only by pytest.
TESTING_KIT = "kvcore.testing"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found = {_module_name(p, ROOT): p for p in PACKAGE.rglob("*.py")}
    for p in PLUGINS.rglob("*.py"):
        found[_module_name(p, PLUGINS)] = p
    return found


MODULES = _modules()
PLUGIN_PACKAGES = {p.name for p in PLUGINS.iterdir() if (p / "__init__.py").exists()}


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _imports(name: str) -> Iterator[str]:
    """Every module ``name`` imports, resolved to the most specific module."""
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    package = name if _is_package(name) else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield sub if sub in MODULES else base


def _core(name: str) -> bool:
    return (name == "kvcore" or name.startswith("kvcore.")) and not name.startswith(
        OUTSIDE_CORE
    )


def _top(name: str) -> str:
    return name.partition(".")[0]


@pytest.mark.parametrize("name", sorted(n for n in MODULES if _core(n)))
def test_core_imports_only_the_core_and_its_dependencies(name: str) -> None:
    bad = [
        imported
        for imported in _imports(name)
        if imported.startswith(OUTSIDE_CORE)
        or not (
            _core(imported)
            or _top(imported) in CORE_DEPENDENCIES
            or (name.startswith(TESTING_KIT) and _top(imported) == "pytest")
            or _top(imported) in sys.stdlib_module_names
            or imported == "__future__"
        )
    ]
    assert not bad, f"core module {name} imports {bad}"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if _top(n) == "kvcore"))
def test_kvcore_never_imports_a_plugin_package(name: str) -> None:
    bad = [
        imported
        for imported in _imports(name)
        if _top(imported) in PLUGIN_PACKAGES or _top(imported).startswith("kvcore_")
    ]
    assert not bad, f"{name} imports plugin packages {bad}"


def test_plugins_never_import_tools_integrations_or_examples() -> None:
    bad = {
        name: imported
        for name in MODULES
        if _top(name) in PLUGIN_PACKAGES
        for imported in _imports(name)
        if imported.startswith(OUTSIDE_CORE)
        or (
            _top(imported).startswith("kvcore_")
            and _top(imported) not in PLUGIN_PACKAGES
        )
    }
    assert not bad, f"plugins import outside the core and the built-in plugins: {bad}"


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name in MODULES:
        for imported in _imports(name):
            if imported in MODULES and imported != name:
                graph[name].add(imported)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _without_package_reexports(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """A submodule reading a name its own package re-exports is the one edge
    Python resolves without a cycle (the package imports its submodules);
    every other edge counts."""
    return {
        name: {
            imported
            for imported in edges
            if not (_is_package(imported) and name.startswith(imported + "."))
        }
        for name, edges in graph.items()
    }


def test_no_import_cycle() -> None:
    cycles = _cycles(_without_package_reexports(_graph()))
    assert not cycles, f"import cycles: {cycles}"


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_core_imports_without_tool_or_integration_dependencies() -> None:
    """Every core module imports with the CLI's, the pictures', the hub's
    and the events' libraries made unimportable."""
    core = sorted(n for n in MODULES if _core(n))
    code = (
        "import sys\n"
        "for name in ('rich', 'matplotlib', 'huggingface_hub', 'msgspec', 'zmq'):\n"
        "    sys.modules[name] = None\n"
        "import importlib\n"
        f"for name in {core!r}:\n"
        "    importlib.import_module(name)\n"
        "loaded = sorted(n for n in sys.modules if n.startswith(('kvcore.tools', "
        "'kvcore.integrations', 'kvcore_')))\n"
        "print(loaded)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert (out.returncode, out.stderr) == (0, "")
    assert out.stdout.strip() == "[]"
