"""Decide a run's Outcome from what supervision observed. First matching rule wins:
the runner's own stops (timeout, output, disk, oom), then a kernel OOM kill, then gVisor's own
errors, then the exit status."""

from __future__ import annotations

import re
import signal

from ._diagnose import sandbox_failure_reason
from ._supervise import Facts
from .models import Limits, Outcome

_STOPPED = {"timeout": Outcome.TIMEOUT, "output": Outcome.OUTPUT_LIMIT, "disk": Outcome.DISK_LIMIT}
_RUNSC_FAILED = 128  # runsc's exit status when it fails itself
_RUNSC_ERROR_LINE = re.compile(r"^(running|creating|starting) container: |^reading spec: |^runsc: ")
# Without cgroups (RLIMIT_AS), running out of memory is a failed allocation the program reports.
_ALLOC_FAILURE = re.compile(r"MemoryError|Cannot allocate memory|std::bad_alloc|out of memory")


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def classify(
    facts: Facts, limits: Limits, runsc_errors: list[str], stderr_tail: str, memory_by_rlimit: bool
) -> tuple[Outcome, int | None, str | None]:
    """(outcome, exit_code, reason)."""
    memory = f"{limits.memory_mb} MB"
    if facts.stopped_for in _STOPPED:
        return _STOPPED[facts.stopped_for], None, facts.stop_detail
    if facts.stopped_for == "oom" or facts.oom_kills:
        return Outcome.OOM, None, f"ran out of memory (limit {memory} for the whole sandbox); it was killed"
    code = facts.returncode
    last_line = stderr_tail.rstrip("\n").rpartition("\n")[2]
    if not runsc_errors and code == _RUNSC_FAILED and _RUNSC_ERROR_LINE.match(last_line):
        # runsc died before it opened its log (or an unusual build logs elsewhere): its error is
        # then the last line of stderr.
        runsc_errors = [last_line]
    if runsc_errors:
        return Outcome.SANDBOX_FAILURE, None, sandbox_failure_reason(runsc_errors)
    if code is None or code < 0:
        # runsc itself died of a signal without saying why.
        return Outcome.SANDBOX_FAILURE, None, f"runsc ended abnormally (status {code})"
    if code == 0:
        return Outcome.OK, 0, None
    if memory_by_rlimit and _ALLOC_FAILURE.search(stderr_tail):
        return Outcome.OOM, code, f"ran out of memory (RLIMIT_AS {memory} per process; no cgroups here)"
    if code > 128 and code - 128 < 65:
        return Outcome.ERROR, code, f"exit code {code} (killed by {_signal_name(code - 128)})"
    return Outcome.ERROR, code, f"exit code {code}"
