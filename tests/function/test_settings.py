"""The valves and the settings built from them: one home for each default, one way of saying "no
limit" (None) in every layer below the valves."""

from __future__ import annotations

import pytest

from engine import DEFAULTS
from functions.adapter import SharedValves, settings_from
from functions.code_sessions import Pipe
from functions.code_sessions_tool import Tools
from runner import KernelSettings, RunnerConfig
from storage import Expiry, Quotas

# The valves whose 0 means "no limit" (or "never"), as their descriptions say.
NO_LIMIT = {
    name
    for name, field in SharedValves.model_fields.items()
    if "0: no limit" in (field.description or "") or "0: never" in (field.description or "")
}


def test_the_valves_defaults_are_the_layers_defaults() -> None:
    """Untouched valves build exactly the default settings: no default is written twice."""
    assert settings_from(SharedValves()) == DEFAULTS
    assert settings_from(Pipe.Valves()) == settings_from(Tools.Valves()) == DEFAULTS
    assert SharedValves().kernel_platform == RunnerConfig().kernel_platform == "ptrace"
    assert SharedValves().kernel_idle_minutes == KernelSettings().idle_s / 60 == 5


def test_a_valves_0_is_none_in_every_layer() -> None:
    assert {
        "max_files_per_user",
        "max_mb_per_user",
        "max_file_mb",
        "max_new_files_per_run",
        "max_saved_state_mb_per_user",
        "file_max_age_days",
        "session_idle_days",
    } == NO_LIMIT
    settings = settings_from(SharedValves(**dict.fromkeys(NO_LIMIT, 0)))
    assert settings.limits.max_file_bytes is None  # the runner's per-file size is the quota's
    assert settings.policy.quotas == Quotas(None, None, None, None)
    expiry = settings.policy.expiry
    assert (expiry.file_max_age_s, expiry.session_idle_s) == (None, None)
    assert expiry.temporary_idle_s == Expiry().temporary_idle_s
    assert settings.kernels.max_saved_bytes_together is None
    # max_saved_state_mb's 0 is not "no limit": kernels are never saved.
    assert settings_from(SharedValves(max_saved_state_mb=0)).kernels.max_image_bytes == 0


def test_the_settings_are_frozen() -> None:
    settings = settings_from(SharedValves())
    for part, name, value in ((settings, "purge", "all"), (settings.limits, "timeout_s", 1)):
        with pytest.raises((AttributeError, TypeError, ValueError)):
            setattr(part, name, value)
