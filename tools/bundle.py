"""Bundle each Open WebUI file (the Pipe, the Tool, the Filter, the Action) with the packages it uses into
the single file Open WebUI installs.

Open WebUI stores a function's (or a tool's) source in its database and `exec`s it in a fresh module:
there is no sys.path entry for sibling files, so the packages travel inside the file. Each module is
embedded as a raw string and served by a small import hook under a private parent package whose name
carries a hash of the embedded sources: two versions loaded in one process never share modules, and the
three files of one version do (so they share one store and one set of kernels, see
functions/adapter.py). The entry module itself becomes the body of the file, with its imports of our
packages pointed at that parent package.

The kernel program (runner/_kernel_program/) travels as its modules too: the runner joins them into the
one program the sandbox runs. Building checks that they keep the rules that joining relies on.

    python tools/bundle.py           # write dist/code_sessions.py, ..._tool.py, ..._filter.py, ..._actions.py
    python tools/bundle.py --check   # exit 1 if a committed bundle is not what the sources give
"""

from __future__ import annotations

import argparse
import ast
import functools
import hashlib
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("storage", "runner", "engine", "webui", "functions")
OPEN_WEBUI_VERSION = "0.12.0"


@dataclass(frozen=True)
class Target:
    entry: str  # the module under functions/ that becomes the file's body
    title: str
    description: str

    @property
    def source(self) -> Path:
        return ROOT / "functions" / self.entry

    @property
    def output(self) -> Path:
        return ROOT / "dist" / self.entry


TARGETS = (
    Target(
        "code_sessions.py",
        "Code Sessions",
        "Per-chat /mnt/data folders, code run in gVisor, working download links.",
    ),
    Target(
        "code_sessions_tool.py",
        "Code Sessions Tool",
        "run_code for any model with tool calling: the chat's /mnt/data folder and live kernel, in gVisor.",
    ),
    Target(
        "code_sessions_filter.py",
        "Code Sessions Filter",
        "With the Code Sessions Tool: tells the model about /mnt/data, copies uploads in, links files.",
    ),
    Target(
        "code_sessions_actions.py",
        "Code Sessions Actions",
        "Buttons under an answer: export as notebook, the chat's files, a zip of them, Save to Knowledge.",
    ),
)
ENTRIES = {target.entry for target in TARGETS}
# Kept for callers that name the Pipe's bundle.
FUNCTION = TARGETS[0].source
OUTPUT = TARGETS[0].output

# Open WebUI's loader runs `content.replace(old, new)` for these over the whole file (utils/plugin.py,
# replace_imports), so any occurrence, even in a comment or string, would be corrupted at load time.
FORBIDDEN = ("from utils", "from apps", "from main", "from config")

_BOOTSTRAP = r'''
import importlib.abc as _cs_abc
import importlib.util as _cs_util
import linecache as _cs_linecache
import sys as _cs_sys


class _BundleImporter(_cs_abc.MetaPathFinder, _cs_abc.Loader):
    """Serves the embedded modules as `<package>.<name>` (see tools/bundle.py in the repository)."""

    def __init__(self, package, sources):
        self.package = package
        self.sources = sources

    def _key(self, fullname):
        if fullname == self.package:
            return ""
        if not fullname.startswith(self.package + "."):
            return None
        dotted = fullname[len(self.package) + 1 :].replace(".", "/")
        for key in (dotted + "/__init__.py", dotted + ".py"):
            if key in self.sources:
                return key
        return None

    def find_spec(self, fullname, path=None, target=None):
        key = self._key(fullname)
        if key is None:
            return None
        is_package = key == "" or key.endswith("/__init__.py")
        return _cs_util.spec_from_loader(fullname, self, is_package=is_package)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        key = self._key(module.__name__)
        if key == "":
            return
        filename = "<code_sessions>/" + key
        source = self.sources[key]
        _cs_linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        module.__file__ = filename
        exec(compile(source, filename, "exec"), module.__dict__)


if not any(getattr(f, "package", None) == _CS_PACKAGE for f in _cs_sys.meta_path):
    _cs_sys.meta_path.insert(0, _BundleImporter(_CS_PACKAGE, _CS_SOURCES))
'''


class BundleError(Exception):
    pass


def _project_version() -> str:
    with open(ROOT / "pyproject.toml", "rb") as handle:
        version: str = tomllib.load(handle)["project"]["version"]
        return version


def _package_sources() -> dict[str, str]:
    sources: dict[str, str] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name == "__main__.py" or "__pycache__" in path.parts:
                continue
            if package == "functions" and path.name in ENTRIES:
                continue  # an entry is the body of its own file, not a module the others import
            sources[path.relative_to(ROOT).as_posix()] = path.read_text(encoding="utf-8")
    return sources


def _point_imports_at(source: str, parent: str, filename: str) -> str:
    """Rewrite `from storage ...` / `import storage` (our packages, absolute) to live under `parent`."""
    tree = ast.parse(source, filename)
    lines = source.splitlines(keepends=True)
    edits: list[tuple[int, int, int, str]] = []  # (line index, start col, end col, replacement)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in PACKAGES:
                line = lines[node.lineno - 1]
                start = line.index(node.module, node.col_offset)
                edits.append((node.lineno - 1, start, start + len(node.module), f"{parent}.{node.module}"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PACKAGES:
                    raise BundleError(f"{filename}:{node.lineno}: use `from {alias.name} import ...`")
    for index, start, end, replacement in sorted(edits, reverse=True):
        lines[index] = lines[index][:start] + replacement + lines[index][end:]
    return "".join(lines)


def _embed(key: str, source: str) -> str:
    if "'''" in source or source.endswith("\\"):
        raise BundleError(f"{key}: contains three single quotes or ends with a backslash; cannot embed")
    return f"    {key!r}: r'''{source}''',\n"


def _frontmatter(version: str, target: Target) -> str:
    return (
        '"""\n'
        f"title: {target.title}\n"
        "author: code-sessions\n"
        "author_url: https://github.com/code-sessions/code-sessions\n"
        f"version: {version}\n"
        "license: MIT\n"
        f"description: {target.description}\n"
        "requirements: \n"
        f"required_open_webui_version: {OPEN_WEBUI_VERSION}\n"
        '"""\n'
    )


@functools.cache
def _check_kernel_program() -> None:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from runner._kernel_program import JoinError, check

    try:
        check()
    except JoinError as error:
        raise BundleError(f"runner/_kernel_program: {error}") from None


def build(target: Target = TARGETS[0]) -> str:
    _check_kernel_program()
    version = _project_version()
    sources = _package_sources()
    function_source = target.source.read_text(encoding="utf-8")
    # The hash covers what is embedded, not the entry: the three files of one version share modules.
    digest = hashlib.sha256()
    for key, source in sorted(sources.items()):
        digest.update(key.encode() + b"\0" + source.encode() + b"\0")
    parent = f"_code_sessions_{digest.hexdigest()[:12]}"

    embedded = {key: _point_imports_at(source, parent, key) for key, source in sources.items()}
    name = f"functions/{target.entry}"
    body = _point_imports_at(function_source, parent, name)
    if body.startswith('"""'):
        raise BundleError(f"{name} must not start with a docstring; the bundle adds one")

    parts = [
        _frontmatter(version, target),
        "# Generated by tools/bundle.py from the code-sessions repository; edit the sources, not this.\n",
        "# The packages storage/, runner/, engine/, webui/ and functions/ are embedded below and imported\n",
        f"# through a small import hook; the Open WebUI adapter ({name}) follows them.\n\n",
        f"_CS_PACKAGE = {parent!r}\n",
        "_CS_SOURCES = {\n",
        *(_embed(key, source) for key, source in embedded.items()),
        "}\n",
        _BOOTSTRAP,
        f"\n# ---- {name} ----\n",
        body,
    ]
    bundle = "".join(parts)
    for needle in FORBIDDEN:
        if needle in bundle:
            line = bundle[: bundle.index(needle)].count("\n") + 1
            raise BundleError(
                f"{target.entry}: bundle line {line} contains {needle!r}, which Open WebUI's loader rewrites"
            )
    compile(bundle, str(target.output), "exec")
    return bundle


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="fail if dist/ is stale instead of writing it")
    parser.add_argument("--output", type=Path, help="write (or check) the Pipe's bundle here instead")
    args = parser.parse_args(argv)
    targets = [(TARGETS[0], args.output)] if args.output else [(t, t.output) for t in TARGETS]
    stale = False
    for target, output in targets:
        try:
            bundle = build(target)
        except BundleError as error:
            print(f"bundle: {error}", file=sys.stderr)
            return 2
        if args.check:
            current = output.read_text(encoding="utf-8") if output.exists() else ""
            if current != bundle:
                print(
                    f"bundle: {output} is stale; run `python tools/bundle.py` and commit it", file=sys.stderr
                )
                stale = True
            else:
                print(f"bundle: {output} is current")
            continue
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(bundle, encoding="utf-8")
        print(f"bundle: wrote {output} ({len(bundle):,} bytes)")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
