"""What the test servers started from Debian's packages (PostgreSQL, Redis) share."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from demo.launcher import free_port

__all__ = ["free_port", "log_tail", "missing"]


def log_tail(log: Path, lines: int = 20) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    return "(no server log)"


def missing(why: str) -> None:
    # On CI the server must be there (scripts/setup installs it): a skip there would hide a gap.
    if os.environ.get("CI"):
        pytest.fail(why)
    pytest.skip(why)
