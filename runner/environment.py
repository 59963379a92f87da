"""The sandbox environment: the root filesystem every sandbox runs on, read-only.

Built by ``sandbox/build`` (setup and the Dockerfile run it): a Debian 13 minbase with its python3, the
shell tools and pinned PyPI wheels, in ``<home>/env-<key>/rootfs`` beside a ``manifest.json`` that says
what is in it. ``<home>/current`` names the newest build; it is resolved once, when a Runner starts, so a
rebuild never changes the root under a sandbox that is running.

Without a built environment the runner falls back to the host's own ``/usr`` (the sandbox then sees the
host's interpreter and whatever is installed there); the doctor warns about it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import RunnerError

DEFAULT_HOME = Path("/opt/code-sessions/sandbox-env")
HOME_VARIABLE = "CODE_SESSIONS_SANDBOX_ENV"
_MANIFEST = "manifest.json"
_MAX_MANIFEST_BYTES = 1 << 20
_MAX_NAME = 100


class EnvironmentNotFound(RunnerError):
    """The configured sandbox environment is missing or damaged."""


@dataclass(frozen=True)
class Package:
    name: str  # the distribution's name (python-docx)
    version: str
    imports: tuple[str, ...]  # its top-level modules (docx)
    named: bool = True  # the system prompt names it (requirements.txt's "prompt" mark, the admin's extras)

    @property
    def label(self) -> str:
        """How the prompt and the doctor name it: what to import, and the distribution where that
        differs (``docx (python-docx)``)."""
        if not self.imports:
            return self.name
        own = self.name.lower().replace("-", "_")
        if own in (i.lower() for i in self.imports):  # numpy; duckdb beside its adbc_driver_duckdb
            return next(i for i in self.imports if i.lower() == own)
        return f"{', '.join(self.imports)} ({self.name})"


@dataclass(frozen=True)
class SandboxEnvironment:
    """Where the sandbox's / comes from, and what it holds."""

    root: Path  # host path of the tree the sandbox sees at / (the host's own / without a build)
    key: str  # identifies the contents: a build's key, or "host"
    built: bool  # False: the host's own /usr (the fallback)
    os_name: str = ""
    python: str = ""
    packages: tuple[Package, ...] = ()  # the packages asked for by name
    tools: tuple[str, ...] = ()
    distributions: int = 0  # every Python distribution installed, the packages' dependencies with them

    def host_path(self, sandbox_path: str) -> Path:
        """Where a path the sandbox sees lies on the host."""
        return self.root / sandbox_path.lstrip("/")

    def host_command(self, interpreter: str) -> list[str]:
        """How the host runs the sandbox's interpreter itself (to precompile the kernel program): a
        built environment has its own libc, so its binaries run chrooted into it."""
        return ["chroot", str(self.root), interpreter] if self.built else [interpreter]

    def describe(self) -> str:
        if not self.built:
            return "the host's own /usr (no sandbox environment built)"
        return (
            f"{self.os_name}, Python {self.python}, {len(self.packages)} packages "
            f"({self.distributions} distributions in all) ({self.root.parent})"
        )


HOST = SandboxEnvironment(root=Path("/"), key="host", built=False)


def locate(configured: Path | None = None) -> SandboxEnvironment:
    """The environment to run on: ``configured`` (an environments folder, or one build), else
    $CODE_SESSIONS_SANDBOX_ENV, else /opt/code-sessions/sandbox-env; the host's /usr if none of these
    holds a build. A folder named explicitly that holds no usable build is an error, not a fallback."""
    explicit = configured is not None or bool(os.environ.get(HOME_VARIABLE))
    home = configured or Path(os.environ.get(HOME_VARIABLE) or DEFAULT_HOME)
    build = home / "current" if (home / "current").exists() else home
    if not (build / _MANIFEST).is_file():
        if explicit:
            raise EnvironmentNotFound(
                f"no sandbox environment in {home} (build one with sandbox/build --dest {home})"
            )
        return HOST
    return load(build.resolve())


def load(build: Path) -> SandboxEnvironment:
    """One build: ``build/rootfs`` and ``build/manifest.json``."""
    rootfs = build / "rootfs"
    try:
        raw = (build / _MANIFEST).read_bytes()[:_MAX_MANIFEST_BYTES]
        manifest = json.loads(raw)
        packages = tuple(
            Package(
                name=_word(p["name"]),
                version=_word(p["version"]),
                imports=tuple(_word(i) for i in p.get("imports", ())),
                named=p.get("prompt", True) is not False,
            )
            for p in manifest.get("packages", ())
        )
        env = SandboxEnvironment(
            root=rootfs,
            key=_word(manifest["key"]),
            built=True,
            os_name=str(manifest.get("os", ""))[:_MAX_NAME],
            python=_word(manifest.get("python", "")),
            packages=packages,
            tools=tuple(_word(t) for t in manifest.get("tools", ())),
            distributions=len(manifest.get("all_packages", ())),
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise EnvironmentNotFound(
            f"the sandbox environment in {build} is damaged ({exc}); run sandbox/build"
        ) from exc
    if not (rootfs / "usr" / "bin").is_dir():
        raise EnvironmentNotFound(
            f"the sandbox environment in {build} has no root filesystem; run sandbox/build"
        )
    return env


def _word(value: object) -> str:
    text = str(value)
    if not text or len(text) > _MAX_NAME or any(c.isspace() or not c.isprintable() for c in text):
        raise ValueError(f"unexpected value {text[:_MAX_NAME]!r}")
    return text
