"""Python cells: compiled IPython style (a last expression is shown), run in the chat's namespace."""

from __future__ import annotations

import _ast
import os
import sys

from .basics import _os_getpid
from .charts import _Charts, _is_plotly_figure
from .figures import _Figures
from .interrupts import _Interrupts
from .tracebacks import format_cell_exception

TYPE_CHECKING = False
if TYPE_CHECKING:
    import types
    from collections.abc import Callable
    from typing import Any, NoReturn


def _ends_with_semicolon(code: str, node: Any) -> bool:
    """``x;`` as the last statement hides its value, as in IPython (a ``;`` in a comment does not)."""
    lines = code.splitlines()
    if node.end_lineno is None or node.end_lineno > len(lines):
        return False
    rest = lines[node.end_lineno - 1].encode("utf-8", "surrogateescape")[node.end_col_offset :]
    return bool(rest.lstrip().startswith(b";"))  # ast counts columns in UTF-8 bytes


def _exit_code_of(code: object) -> tuple[int, str | None]:
    """What ``python3 cell.py`` would exit with, and the message it would print, for SystemExit(code)."""
    if code is None:
        return 0, None
    if isinstance(code, int):
        return code & 0xFF, None
    try:
        return 1, str(code)
    except Exception:
        return 1, None


def _into_linecache(linecache: types.ModuleType, filename: str, code: str) -> None:
    """A cell's source where tracebacks look (no mtime: linecache.checkcache leaves it alone)."""
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)


class _PythonCells:
    """The kernel's Python cells: each compiled (its source kept for tracebacks) and run in the chat's
    namespace, with ``interrupts`` armed while its code runs; a last expression's value is shown, as a
    chart or a figure when it is one (``charts``, ``figures``), else printed on ``live_stdout()``."""

    def __init__(
        self,
        workdir: str,
        kernel_pid: int,
        namespace: dict[str, Any],
        interrupts: _Interrupts,
        charts: _Charts,
        figures: _Figures,
        live_stdout: Callable[[], Any],
    ) -> None:
        self._workdir = workdir
        self._kernel_pid = kernel_pid
        self._namespace = namespace
        self._interrupts = interrupts
        self._charts = charts
        self._figures = figures
        self._live_stdout = live_stdout
        self._cell_names: set[str] = set()
        # Cell sources for tracebacks: linecache (with tokenize and re, ~50 ms to import in the
        # sandbox) is filled only once something imports it (a traceback, the code itself).
        self._cell_sources: dict[str, str] = {}

    def on_linecache_import(self, module: types.ModuleType) -> None:
        for filename, code in self._cell_sources.items():
            _into_linecache(module, filename, code)
        self._cell_sources.clear()  # from now on _compile puts them straight into linecache

    def _cell_filename(self, run_id: int) -> str:
        name = f"<cell-{run_id}>"
        n = 1
        while name in self._cell_names:  # the host reused an id: keep the old cell's source lines
            n += 1
            name = f"<cell-{run_id}.{n}>"
        self._cell_names.add(name)
        return name

    def _compile(self, run_id: int, code: str) -> tuple[Any, Any]:
        """(statements, last expression or None), IPython style: a last expression statement is
        evaluated apart so its value can be shown."""
        filename = self._cell_filename(run_id)
        linecache = sys.modules.get("linecache")
        if linecache is not None:
            _into_linecache(linecache, filename, code)
        else:
            self._cell_sources[filename] = code
        # The builtin _ast, not the ast module (a few ms more to import in the sandbox): the same nodes.
        tree = compile(code, filename, "exec", _ast.PyCF_ONLY_AST, dont_inherit=True)
        assert isinstance(tree, _ast.Module)  # what "exec" parses to
        last = None
        final = tree.body[-1] if tree.body else None
        if isinstance(final, _ast.Expr) and not _ends_with_semicolon(code, final):
            tree.body.pop()
            last = compile(_ast.Expression(final.value), filename, "eval", dont_inherit=True)
        return compile(tree, filename, "exec", dont_inherit=True), last

    def run(self, run_id: int, code: str) -> tuple[str, int | None, str]:
        """(status, exit code, what to print on stderr once the cell's stdio damage is undone)."""
        # A module the previous cell wrote into the workdir must be importable now, even within the
        # granularity of the directory's mtime, by which the import system notices new files.
        finder = sys.path_importer_cache.get(self._workdir)
        if finder is not None and hasattr(finder, "invalidate_caches"):
            finder.invalidate_caches()
        try:
            body, last = self._compile(run_id, code)
        except Exception as exc:  # SyntaxError, ValueError (NUL bytes), RecursionError (deep nesting)
            import traceback

            return "error", 1, "".join(traceback.format_exception_only(type(exc), exc))
        ns = self._namespace
        failure: BaseException | None = None
        message: str | None = None
        try:
            self._interrupts.armed = self._interrupts.cell_running = True
            exec(body, ns)
            if last is not None:
                value = eval(last, ns)
                if value is not None:
                    ns["_"] = value
                    chart = _is_plotly_figure(value) and self._charts.capture(value)
                    if not (chart or self._figures.capture(value)):
                        self._live_stdout().write(repr(value) + "\n")
            self._interrupts.armed = self._interrupts.cell_running = False
            status, exit_code = "ok", 0
        except KeyboardInterrupt as exc:
            self._interrupts.armed = self._interrupts.cell_running = False
            failure, status, exit_code = exc, "interrupted", None
        except SystemExit as exc:
            self._interrupts.armed = self._interrupts.cell_running = False
            exit_code, message = _exit_code_of(exc.code)
            status = "ok" if exit_code == 0 else "error"
        except BaseException as exc:
            self._interrupts.armed = self._interrupts.cell_running = False
            failure, status, exit_code = exc, "error", 1
        # A child the cell forked must not become a second kernel on the wire. os.fork and
        # multiprocessing run Python's at-fork hook, which sets the flag; a fork behind Python's back
        # (libc's fork through ctypes, a C extension) runs no hook, and one getpid per cell (a few
        # microseconds in gVisor) catches it.
        if self._interrupts.forked or _os_getpid() != self._kernel_pid:
            self._exit_forked_child(failure, exit_code)
        if failure is not None:
            sys.last_type, sys.last_value, sys.last_traceback = type(failure), failure, failure.__traceback__
            return status, exit_code, format_cell_exception(failure)
        return status, exit_code, "" if message is None else message + "\n"

    def _exit_forked_child(self, failure: BaseException | None, exit_code: int | None) -> NoReturn:
        """A cell forked and the child ran off the end of the cell: it must not become a second kernel
        (it shares the channel). End it the way a forked script would end."""
        try:
            if failure is not None and not isinstance(failure, KeyboardInterrupt):
                sys.stderr.write(format_cell_exception(failure))
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(exit_code or 0)
