"""The persistent kernel: PID 1 of a chat's long-lived gVisor sandbox, running every cell of the chat.

A package for reading, one module per concern, and one file for the sandbox: ``program()`` joins the
modules (in MODULES order) into the single program the host writes into the sandbox as
/run/code/main.py (compiled once, see runner/_bytecode.py) and starts as ``python3 /run/code/main.py``
with cwd /mnt/data. Importing a module does nothing: everything happens in kernel.main(). Standard
library only, and no imports of the runner package: the joined program stands alone. The wire is
described, and its constants are kept, in protocol.py, which the host's decoder (runner/_wire.py)
imports too.

The rules that let the modules be joined, checked by ``check()``: a module imports its siblings only
as ``from .name import ...`` at its top level, and only from modules earlier in MODULES (the joiner
removes those lines); the names a module defines at its top level are its own (in the joined program
they share one namespace); and no module rebinds another's global (basics.set_diag_fd).

Startup and the first cell are on the critical path of a new chat, and imports are slow in the sandbox
(measured in gVisor: re 34 ms, json 24 ms on top, linecache 11-21 ms, traceback 11 ms, threading 5-21
ms, signal with enum 7-11 ms, struct 3-7 ms). So: annotations are strings; requests are decoded by
json's C scanner without the json package (which needs re), and replies are encoded by the kernel's
own encoder; signals go through the builtin _signal, threads and locks through _thread, frame lengths
through int.to_bytes; linecache and traceback wait until they are needed. (site has already imported
contextlib, functools and types.)
"""

from __future__ import annotations

import ast
import importlib
import inspect

MODULES = (
    "protocol",
    "basics",
    "condition",
    "codec",
    "pumps",
    "interrupts",
    "stdio",
    "packages",
    "hooks",
    "figures",
    "charts",
    "tracebacks",
    "python_cells",
    "bash_cells",
    "leftovers",
    "kernel",
)
_SHARED = frozenset({"TYPE_CHECKING"})  # defined alike by several modules (False)
_HEADER = (
    '"""The code-sessions kernel, joined from the modules of runner/_kernel_program/ by its program().\n'
    'Its wire: see the part from protocol.py below."""\n\n'
    "from __future__ import annotations\n"
)


class JoinError(Exception):
    """A module breaks a rule the joined program depends on (see the package's docstring)."""


def program() -> str:
    """The kernel program as the sandbox runs it: one self-contained file. Only joins (it runs when the
    runner is imported, and parsing the modules would cost tens of ms): ``check`` holds the rules."""
    parts = [_HEADER]
    for name in MODULES:
        lines = _source(name).splitlines(keepends=True)
        dropped = _import_lines(lines)
        kept = "".join(line for number, line in enumerate(lines, 1) if number not in dropped)
        parts.append(f"\n\n# ---- runner/_kernel_program/{name}.py ----\n\n{kept.strip(chr(10))}\n")
    return "".join(parts)


def check() -> None:
    """Raise JoinError where a module breaks a rule of the package's docstring, or the joined program
    is not the one self-contained file it must be (tools/bundle.py and the tests run this)."""
    owners: dict[str, str] = {}  # top-level name -> the module defining it, or the import binding it
    for name in MODULES:
        _check_module(name, _source(name), owners)
    source = program()
    tree = ast.parse(source, "kernel program")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            raise JoinError(f"the joined program keeps a relative import at line {node.lineno}")
    compile(source, "kernel program", "exec", dont_inherit=True)


def _source(name: str) -> str:
    # inspect reads what the import system loaded: the file, or, inside the bundle of dist/, the
    # embedded text (tools/bundle.py puts it in linecache).
    return inspect.getsource(importlib.import_module(f"{__name__}.{name}"))


def _import_lines(lines: list[str]) -> set[int]:
    """Numbers (from 1) of the lines holding an import of a sibling or of __future__ (the header has
    that one), as ruff formats them: at the start of a line, parenthesised when long."""
    dropped: set[int] = set()
    inside = False
    for number, line in enumerate(lines, 1):
        if inside or line.startswith(("from .", "from __future__ import")):
            dropped.add(number)
            inside = line.rstrip().endswith("(") or (inside and line.rstrip() != ")")
    return dropped


def _check_module(name: str, source: str, owners: dict[str, str]) -> None:
    tree = ast.parse(source, f"{name}.py")
    expected: set[int] = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.level or node.module == "__future__"):
            if node.level:
                _check_sibling_import(name, node, owners)
            expected.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    if _import_lines(source.splitlines(keepends=True)) != expected:
        raise JoinError(f"{name}.py: its sibling imports are not the lines program() removes")
    for inner in ast.walk(tree):
        if isinstance(inner, ast.ImportFrom) and inner.level and inner not in tree.body:
            raise JoinError(f"{name}.py:{inner.lineno}: a sibling import must be at the top level")
        modules: list[str] = []
        if isinstance(inner, ast.Import):
            modules = [a.name for a in inner.names]
        elif isinstance(inner, ast.ImportFrom) and not inner.level:
            modules = [inner.module or ""]
        if any(m.split(".")[0] == "runner" for m in modules):
            raise JoinError(f"{name}.py:{getattr(inner, 'lineno', '?')}: imports the runner package")
        if isinstance(inner, ast.Global) and name != "basics":
            raise JoinError(f"{name}.py:{inner.lineno}: rebinds a global (only basics.set_diag_fd may)")
    for defined, binder in _top_level_names(tree, name):
        if owners.setdefault(defined, binder) != binder and defined not in _SHARED:
            raise JoinError(f"{name}.py binds {defined}, which {owners[defined]} binds too")


def _check_sibling_import(name: str, node: ast.ImportFrom, owners: dict[str, str]) -> None:
    if node.level != 1 or node.module is None:
        raise JoinError(f"{name}.py:{node.lineno}: import siblings as `from .module import name`")
    earlier = MODULES[: MODULES.index(name)]
    if node.module not in earlier:
        raise JoinError(f"{name}.py:{node.lineno}: imports {node.module}, which is not before it in MODULES")
    for alias in node.names:
        if alias.asname is not None or owners.get(alias.name) != node.module:
            raise JoinError(f"{name}.py:{node.lineno}: {alias.name} is not a name {node.module}.py defines")


def _top_level_names(tree: ast.Module, name: str) -> list[tuple[str, str]]:
    """(name, what binds it) for the module's top level: the module itself for its own definitions,
    the import for a name it imports (the same import in two modules binds the same thing)."""
    names: list[tuple[str, str]] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.append((node.name, name))
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.extend((n.id, name) for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, ast.Import):
            names.extend(((a.asname or a.name).split(".")[0], f"import {a.name}") for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module != "__future__":
            names.extend((a.asname or a.name, f"from {node.module} import {a.name}") for a in node.names)
    return names
