"""The runner's one exception hierarchy.

Only host-side problems raise: a missing runsc, a bad workdir, a missing interpreter. Whatever the
sandboxed code does (crash, loop, exhaust memory) is reported as an ``Outcome``, never raised.
"""

from __future__ import annotations


class RunnerError(Exception):
    """Base class of every error the runner raises."""


class RunscNotFound(RunnerError):
    """The runsc binary is missing or not executable."""

    def __init__(self, runsc_path: str, detail: str = "") -> None:
        self.runsc_path = runsc_path
        msg = (
            f"gVisor's runsc was not found at {runsc_path!r}{': ' + detail if detail else ''}. "
            "Install it with `apt-get install runsc` (Debian/Ubuntu), or download gVisor's release "
            "binary (https://gvisor.dev/docs/user_guide/install/), then point RunnerConfig.runsc_path at it."
        )
        super().__init__(msg)


class WorkdirError(RunnerError):
    """The workdir to mount at /mnt/data is missing, not a directory, or not allowed."""


class InterpreterNotFound(RunnerError):
    """No usable python or bash under /usr on the host."""


class UnsupportedLanguage(RunnerError, ValueError):
    """``language`` is neither "python" nor "bash"."""


class StateDirError(RunnerError):
    """The runner's private state directory cannot be created or is not private."""
