"""The packages' imports point one way, with no cycle and no import hidden inside a function.

storage knows nothing of the sandbox or the web UI, runner nothing of storage or the web UI, engine
nothing of the web UI; inside each package (bench too), the module graph has no cycle (a deferred import that
hides one counts: every import is read, wherever it is).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("storage", "runner", "engine", "webui", "bench")
FORBIDDEN = {
    "storage": {"runner", "engine", "webui", "functions", "open_webui"},
    "runner": {"storage", "engine", "webui", "functions", "open_webui"},
    "engine": {"webui", "functions", "open_webui"},
    "webui": {"runner", "engine", "functions"},
    "bench": set(),  # it measures every layer; its own modules still form no cycle
}


def _modules(package: str) -> dict[str, Path]:
    base = ROOT / package
    if not base.is_dir():
        return {}
    return {
        path.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".").removesuffix(".__init__"): path
        for path in sorted(base.rglob("*.py"))
    }


def _imports(module: str, path: Path) -> list[tuple[str, bool]]:
    """(imported module, imported inside a function) for every import statement of the module."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, nested: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = nested or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            if isinstance(child, ast.Import):
                found.extend((alias.name, inner) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - child.level + 1])
                    target = f"{base}.{child.module}" if child.module else base
                    # `from . import _index` imports the module _index itself.
                    names = [f"{target}.{a.name}" for a in child.names] if not child.module else [target]
                    found.extend((name, inner) for name in names)
                elif child.module:
                    found.append((child.module, inner))
            visit(child, inner)

    visit(tree, False)
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_no_forbidden_imports(package: str) -> None:
    bad = [
        f"{module} imports {name}"
        for module, path in _modules(package).items()
        for name, _ in _imports(module, path)
        if name.split(".")[0] in FORBIDDEN[package]
    ]
    assert bad == []


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_inside_functions(package: str) -> None:
    modules = _modules(package)
    bad = [
        f"{module} imports {name} inside a function"
        for module, path in modules.items()
        for name, nested in _imports(module, path)
        if nested and name.split(".")[0] == package
    ]
    assert bad == []


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle(package: str) -> None:
    modules = _modules(package)
    graph = {
        module: sorted({name for name, _ in _imports(module, path) if name in modules and name != module})
        for module, path in modules.items()
    }
    # The package's __init__ re-exports its modules; modules importing the package itself would
    # loop through it, and do not count as a dependency on every module.
    graph.pop(package, None)
    for deps in graph.values():
        if package in deps:
            deps.remove(package)
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in graph.get(node, ()):
            if state.get(dep) == 1:
                return [*stack[stack.index(dep) :], dep]
            if dep not in state and (cycle := walk(dep)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in graph:
        if node not in state and (cycle := walk(node)):
            pytest.fail("import cycle: " + " -> ".join(cycle))
