"""runner: run one piece of untrusted Python or bash in a fresh gVisor (runsc) sandbox.

Knows nothing of storage or Open WebUI. See docs/runner.md.
"""

from ._kernel_program.protocol import MAX_FIGURES_PER_RUN
from .capabilities import RunscInfo, detect_runsc
from .doctor import Check, DoctorReport, doctor
from .errors import (
    InterpreterNotFound,
    RunnerError,
    RunscNotFound,
    StateDirError,
    UnsupportedLanguage,
    WorkdirError,
)
from .kernels import KernelPool, reset_sentence
from .models import KernelSettings, Limits, Outcome, RunnerConfig, RunResult
from .runner import HostSetup, Runner

__all__ = [
    "MAX_FIGURES_PER_RUN",
    "Check",
    "DoctorReport",
    "HostSetup",
    "InterpreterNotFound",
    "KernelPool",
    "KernelSettings",
    "Limits",
    "Outcome",
    "RunResult",
    "Runner",
    "RunnerConfig",
    "RunnerError",
    "RunscInfo",
    "RunscNotFound",
    "StateDirError",
    "UnsupportedLanguage",
    "WorkdirError",
    "detect_runsc",
    "doctor",
    "reset_sentence",
]
