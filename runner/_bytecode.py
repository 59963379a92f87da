"""Bytecode for a program the sandbox starts again and again (the kernel), compiled once per Runner.

Python compiles a script it is given on every start, and inside gVisor that costs 30-50 ms for the
kernel program (its parser allocates, and every mmap is a trip through the sentry): a tenth of a chat's
first step. The sandbox's interpreter is a file on the host (under the sandbox environment's root,
run chrooted into it; or the host's own /usr), so that very binary, run once on the host, makes
bytecode the sandbox can start from: `python3 main.pyc` skips the
compile. Anything wrong on the way (no such binary on the host, a timeout, odd output) means the
source is used, as before: slower, never broken.
"""

from __future__ import annotations

import logging
import subprocess
import threading

log = logging.getLogger(__name__)

# Run by the sandbox's interpreter on the host: source on stdin, a .pyc on stdout. A .pyc run as a
# script needs only the interpreter's magic number in front; the 12 bytes after it are not read there.
_COMPILE = (
    "import importlib.util, marshal, sys\n"
    "code = compile(sys.stdin.buffer.read(), sys.argv[1], 'exec', dont_inherit=True)\n"
    "sys.stdout.buffer.write(importlib.util.MAGIC_NUMBER + bytes(12) + marshal.dumps(code))\n"
)
_TIMEOUT_S = 30.0


class BytecodeCache:
    """Compiled programs by (interpreter, in-sandbox file name, source); None where compiling failed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # callers are worker threads; one compile per program
        self._compiled: dict[tuple[str, str, str], bytes | None] = {}

    def get(self, interpreter: list[str], filename: str, source: str) -> bytes | None:
        """``interpreter``: the command that runs the sandbox's interpreter on the host."""
        key = (" ".join(interpreter), filename, source)  # the kernel's source is one str: its hash is cached
        with self._lock:
            if key not in self._compiled:
                self._compiled[key] = _compile(interpreter, filename, source)
            return self._compiled[key]


def _compile(interpreter: list[str], filename: str, source: str) -> bytes | None:
    try:
        done = subprocess.run(
            [*interpreter, "-I", "-S", "-c", _COMPILE, filename],
            input=source.encode("utf-8", "surrogateescape"),
            capture_output=True,
            timeout=_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning(
            "code-sessions: could not precompile %s with %s (%s); the sandbox compiles it",
            filename,
            interpreter,
            exc,
        )
        return None
    if done.returncode != 0 or len(done.stdout) < 17:
        detail = done.stderr.decode("utf-8", "replace").strip()[-300:]
        log.warning(
            "code-sessions: could not precompile %s with %s (exit %s: %s); the sandbox compiles it",
            filename,
            interpreter,
            done.returncode,
            detail,
        )
        return None
    return done.stdout
