"""What the engine asks of the chat application it serves, as protocols the host implements
(webui.OpenWebUI for Open WebUI; a test harness stands in its own). The engine never imports the host."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["Host", "PurgeValve"]


class Host(Protocol):
    async def read_upload(self, file_id: str, user_id: str) -> tuple[bytes | None, str]:
        """The bytes and name of an upload, only if it is this user's (None: not theirs, or gone)."""
        ...

    def saves_chat(self, chat_id: str) -> bool:
        """Whether the host keeps this chat as a chat it can be asked about (`chat_owners`); the
        others (temporary chats, channels) expire by idle time instead."""
        ...

    async def chat_owners(self, chat_ids: Sequence[str]) -> dict[str, str]:
        """{chat id: owner's user id} for those of these chats that exist. Raises when it cannot
        tell (never an empty answer for an error)."""
        ...


class PurgeValve(Protocol):
    """Where an admin types the one-shot purge request: a setting the host saves."""

    async def saved_purge(self) -> str | None:
        """The request as saved now (another worker may have run and cleared it a moment ago);
        None: not saved anywhere yet, so the message's settings say it."""
        ...

    async def clear_purge(self, request: str) -> None:
        """The request ran (or was refused): clear it, in the saved settings only if it is still
        `request` there (an admin may have typed a new one meanwhile)."""
        ...
