"""A prepared sandbox, as the runner hands it to whatever starts and supervises it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ._cgroups import RunCgroup


@dataclass(frozen=True)
class Sandbox:
    """A prepared sandbox: its id, OCI bundle, cgroup, and the command that runs it."""

    cid: str
    bundle: Path
    cgroup: RunCgroup | None
    argv: list[str]  # runsc ... run --bundle <bundle> <cid>
    runsc_base: list[str]  # runsc --root <state>, for kill / delete
    workdir: Path

    @property
    def image_dir(self) -> Path:
        """Where a compressed saved image is unpacked for `runsc restore` (Runner.prepare's
        `restore_unpacked`): private to this sandbox, and removed with its bundle."""
        return self.bundle / "image"

    @property
    def memory_by_rlimit(self) -> bool:
        return self.cgroup is None
