"""What one message runs with, in one frozen value.

The host builds a `Settings` from its own settings once per message (the function's valves:
functions/adapter.py `settings_from`) and hands it down with the operations: `Engine.chat` opens the
chat's session with its quotas and binds its per-run limits and kernel settings to the chat; expiry
takes its policy. The store and the kernel pool keep no message's copy. A change is a new value, never
an edit of a live object.

The defaults live in the layers' own models, each in one place: `runner.Limits`,
`runner.KernelSettings`, `storage.Quotas`, `storage.Expiry`, and the fields below for what is the
engine's. The valves take theirs from these (`DEFAULTS`). "No limit" is None in every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runner import KernelSettings, Limits, RunnerConfig
from storage import Policy

__all__ = ["DEFAULTS", "LOCK_WAIT_S", "BranchSettings", "Settings"]

# How long a message waits for its chat's lock (another step of the chat, another worker) before it
# says the chat is busy.
LOCK_WAIT_S = 300.0


@dataclass(frozen=True, slots=True)
class BranchSettings:
    """How much of a chat's past the branches of its conversation can go back to (engine/branches.py)."""

    states: int = 20  # answers' states kept per chat; 0: the folder does not follow the branches
    # Of those (the newest), how many keep the Python state too: all of them, as far as the user's
    # storage allows (the oldest Python states, of any of the user's chats, go first when it is full).
    python_states: int = 20


@dataclass(frozen=True, slots=True)
class Settings:
    limits: Limits = field(default_factory=Limits)  # per run (a chat's quota may lower them)
    # The quotas and expiry: each session applies its message's, each expiry its tick's.
    policy: Policy = field(default_factory=Policy)
    kernels: KernelSettings = field(default_factory=KernelSettings)
    # What the prompt tells the model; the runner's own configuration is what opens the network.
    network: bool = RunnerConfig.model_fields["network"].default
    # Show an answer's files as attachments of its message (else one line names them).
    attach_files: bool = True
    branches: BranchSettings = field(default_factory=BranchSettings)
    cleanup_every_s: float = 30 * 60.0  # expiry runs at least this often
    purge: str = ""  # the admin's one-shot purge request (engine/purge.py), as typed
    upload_link_s: float = 15 * 60.0  # how long an upload link the model offers stays usable


DEFAULTS = Settings()
