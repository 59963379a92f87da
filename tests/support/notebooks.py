"""An exported notebook checked the way Jupyter reads it (nbformat's validator) and run top to bottom in the
sandbox environment, in real gVisor: every code cell in one live kernel of the runner, as the chat ran
its runs (a Python cell in the kernel; a `%%bash` cell, its magic line taken off, as the bash run it
was), with a fresh folder at /mnt/data."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import nbformat

from runner import KernelPool, Limits, Runner
from runner.models import RunResult

SANDBOX_UID = 65534


def validated(data: bytes) -> dict:
    """The notebook, read and validated by nbformat (raises nbformat.ValidationError)."""
    notebook = nbformat.reads(data.decode("utf-8"), as_version=4)
    nbformat.validate(notebook)
    parsed: dict = json.loads(data)
    return parsed


def source(cell: dict) -> str:
    text = cell["source"]
    return "".join(text) if isinstance(text, list) else text


async def run_notebook(notebook: dict, workdir: Path, registry: Path) -> list[RunResult]:
    """Run every code cell of `notebook`, in order, with `workdir` as /mnt/data; each must succeed."""
    workdir.mkdir(parents=True, exist_ok=True)
    os.chown(workdir, SANDBOX_UID, SANDBOX_UID)
    pool = KernelPool(Runner(), registry)
    results = []
    try:
        for cell in notebook["cells"]:
            if cell["cell_type"] != "code":
                continue
            code, language = source(cell), "python"
            if code.startswith("%%bash\n"):
                code, language = code[len("%%bash\n") :], "bash"
            result = await pool.run("notebook/run", workdir, code, language, Limits(timeout_s=120))
            assert result.ok, (code, result.outcome, result.stderr[-2000:])
            results.append(result)
    finally:
        await pool.close()
    return results


def digests(folder: Path, *, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """Every regular file under `folder` (relative path -> sha256), links never followed."""
    found = {}
    for directory, _, names in os.walk(folder):
        for name in names:
            path = Path(directory) / name
            rel = path.relative_to(folder).as_posix()
            if path.is_symlink() or not path.is_file() or rel.startswith(skip):
                continue
            found[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found
