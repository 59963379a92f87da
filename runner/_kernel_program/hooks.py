"""Import hooks: run the kernel's code once a watched module (matplotlib.pyplot, linecache) is imported."""

from __future__ import annotations

import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    import importlib.machinery
    import types
    from collections.abc import Callable, Mapping
    from typing import Any


class _PatchingLoader:
    """Wraps the loader of a watched module so the kernel can patch it as it is imported."""

    def __init__(self, inner: Any, on_import: Callable[[types.ModuleType], None]) -> None:
        self._inner = inner
        self._on_import = on_import

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        create = getattr(self._inner, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: types.ModuleType) -> None:
        self._inner.exec_module(module)
        self._on_import(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... for inspect and linecache
        return getattr(self._inner, name)


class _ImportHooks:
    """A meta path hook that sees only the modules it is given, each with what to do once it is
    imported: matplotlib.pyplot (plt.show() must save figures from the very cell that first imports
    it) and linecache (filled with the cells' sources when something first needs it). Costs one dict
    lookup per import of anything else."""

    def __init__(self, hooks: Mapping[str, Callable[[types.ModuleType], None]]) -> None:
        self._hooks = hooks

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        on_import = self._hooks.get(fullname)
        if on_import is None:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader, on_import)
                return spec
        return None
