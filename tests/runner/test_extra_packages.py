"""The admin's extra packages (sandbox/build --extra, CODE_SESSIONS_SANDBOX_EXTRA): installed on top of the
lock, never moving a pinned package, and named in the manifest the doctor and the system prompt read.

A whole environment takes minutes and the lock's wheels from PyPI, so this runs the build's own extra
step on its own (`sandbox/build --extra FILE --extra-into SITE`: the same function a full build calls
after the pinned wheels), offline: pip gets no index, only a folder of small wheels made here. One of
them stands in for a pinned package (tabulate, at the lock's version and at a newer one), so the
constraint is seen choosing. The manifest step is sandbox/manifest.py, run on the result.

The manual proof of a whole build with an extra file, as docs/environment.md records it:
`CODE_SESSIONS_SANDBOX_EXTRA=FILE ./scripts/setup`, then `python -m runner doctor` lists the package.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "sandbox" / "build"
LOCK = REPO / "sandbox" / f"requirements.{os.uname().machine}.lock"


def pinned(name: str) -> str:
    found = re.search(rf"^{re.escape(name)}==([^\s\\]+)", LOCK.read_text(), re.MULTILINE)
    assert found, f"{name} is not in {LOCK.name}"
    return found.group(1)


def wheel(into: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> None:
    """A pure-Python wheel with one module, made by hand (no build backend, no network)."""
    module = name.replace("-", "_")
    info = f"{module}-{version}.dist-info"
    files = {
        f"{module}/__init__.py": f"VERSION = {version!r}\n",
        f"{info}/METADATA": "Metadata-Version: 2.1\n"
        f"Name: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires),
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    with zipfile.ZipFile(into / f"{module}-{version}-py3-none-any.whl", "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)


@pytest.fixture
def wheels(tmp_path: Path) -> Path:
    folder = tmp_path / "wheels"
    folder.mkdir()
    tabulate = pinned("tabulate")
    wheel(folder, "cs-probe", "1.0")
    wheel(folder, "tabulate", tabulate)
    wheel(folder, "tabulate", "99.0")  # newer than the pin: pip would take it without the lock
    wheel(folder, "cs-tables", "2.0", ("tabulate>=0.8",))
    wheel(folder, "cs-old-numpy", "1.0", ("numpy<2",))
    return folder


def extra_step(
    tmp_path: Path, wheels: Path, lines: list[str]
) -> tuple[subprocess.CompletedProcess[str], Path]:
    extra = tmp_path / "extra-requirements.txt"
    extra.write_text("\n".join(lines) + "\n")
    site = tmp_path / "site"
    env = {
        **os.environ,
        "PIP_NO_INDEX": "1",  # offline: nothing but the wheels made here
        "PIP_FIND_LINKS": str(wheels),
        "PIP_NO_CACHE_DIR": "1",
        "BUILD_PYTHON": os.environ.get("BUILD_PYTHON", "python3"),
    }
    done = subprocess.run(
        [str(BUILD), "--extra", str(extra), "--extra-into", str(site)],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    return done, site


def installed(site: Path) -> dict[str, str]:
    found = {}
    for info in site.glob("*.dist-info"):
        name, version = info.name.removesuffix(".dist-info").rsplit("-", 1)
        found[name] = version
    return found


def test_an_extra_package_is_installed_and_named_in_the_manifest(tmp_path: Path, wheels: Path) -> None:
    done, site = extra_step(tmp_path, wheels, ["# the admin's own", "cs-probe>=1.0", "cs-tables  # tables"])
    assert done.returncode == 0, done.stdout + done.stderr
    # The names the build gives the manifest, from the admin's lines (versions and comments dropped).
    first = done.stdout.splitlines()[0]
    assert "installing the admin's packages from" in first and first.endswith(": cs-probe cs-tables"), first
    # The dependency at the lock's version, although a newer one was offered.
    assert installed(site) == {"cs_probe": "1.0", "cs_tables": "2.0", "tabulate": pinned("tabulate")}
    assert (site / "cs_probe" / "__init__.py").read_text() == "VERSION = '1.0'\n"
    assert not list(site.rglob("*.pyc"))  # a build compiles once, inside the sandbox's own tree
    manifest = subprocess.run(
        [sys.executable, str(REPO / "sandbox" / "manifest.py")],
        capture_output=True,
        text=True,
        env={
            **os.environ,
            "PYTHONPATH": str(site),
            "REQUESTED": "cs-probe cs-tables",
            "PROMPT": "cs-probe cs-tables",  # the build names the admin's packages in the prompt
            "TOOLS": "",
            "KEY": "k",
        },
        timeout=60,
        check=True,
    )
    packages = json.loads(manifest.stdout)["packages"]
    assert packages == [
        {"name": "cs-probe", "version": "1.0", "imports": ["cs_probe"], "prompt": True},
        {"name": "cs-tables", "version": "2.0", "imports": ["cs_tables"], "prompt": True},
    ]


def test_an_extra_package_cannot_move_a_pinned_one(tmp_path: Path, wheels: Path) -> None:
    done, site = extra_step(tmp_path, wheels, ["cs-old-numpy"])
    assert done.returncode != 0, done.stdout + done.stderr
    said = done.stdout + done.stderr
    # pip's own words name both sides: the package's wish and the lock's pin.
    assert "numpy<2" in said and f"numpy=={pinned('numpy')}" in said, said
    assert installed(site) == {}


def test_an_extra_package_asking_for_a_pinned_package_at_another_version_fails(
    tmp_path: Path, wheels: Path
) -> None:
    done, site = extra_step(tmp_path, wheels, ["tabulate==99.0"])
    assert done.returncode != 0, done.stdout + done.stderr
    assert f"tabulate=={pinned('tabulate')}" in done.stdout + done.stderr
    assert installed(site) == {}
