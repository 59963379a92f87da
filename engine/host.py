"""What the engine and the function's three files ask of the chat application they serve, in one
protocol (`Host`): webui.OpenWebUI implements it for Open WebUI, the test harnesses stand in their own
(tests/support/pipe_harness.py), and mypy checks every call against it. The engine never imports the
host; the function's files reach Open WebUI only through it.

The host's own objects (its request, its user) pass through as `object`: the engine hands them back
to the host and never looks inside.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Sequence
from pathlib import Path
from typing import Any, Protocol

from storage import Link, Publisher

from .charts import ChartEmbed
from .clones import Origin
from .inbound import Inbound

__all__ = ["Emit", "Host", "Places", "PurgeValve"]

# What the host gives a message to send events to its page with (statuses, files, embeds).
Emit = Callable[[dict[str, Any]], Awaitable[None]]


class Places(Protocol):
    """Where the function keeps its files on the host."""

    @property
    def root(self) -> Path:
        """The sessions and the index."""
        ...

    @property
    def publish_dir(self) -> Path:
        """Folder copies of older answers, served by the host's /cache route."""
        ...

    @property
    def url_prefix(self) -> str:
        """Where the host serves `publish_dir`."""
        ...


class Host(Protocol):
    """Everything the function asks of its host."""

    # ---- where things are, and the process ----------------------------------------------------------

    def locations(self, storage_root: str, function_id: str) -> Places:
        """Where the sessions go (the `storage_root` valve; empty: the host's default). Raises
        webui.Misconfigured for a place the host serves to every user."""
        ...

    def index_url(self, choice: str) -> str:
        """The index's database URL from the `index_database` valve ("": SQLite under the root)."""
        ...

    def publisher(self, places: Places) -> Publisher:
        """Where published copies of the chats' files go (the host's own file store)."""
        ...

    def shared(self) -> dict[object, object]:
        """One dict per process that every file of this version of the function sees (the services
        they share, the upload links' receiver)."""
        ...

    # ---- chats and messages -------------------------------------------------------------------------

    def temporary_chat(self, chat_id: str) -> bool:
        """Whether the chat is one the host keeps only for a while (its session expires sooner)."""
        ...

    def saves_chat(self, chat_id: str) -> bool:
        """Whether the host keeps this chat as a chat it can be asked about (`chat_owners`); the
        others (temporary chats, channels) expire by idle time instead."""
        ...

    async def chat_owners(self, chat_ids: Sequence[str]) -> dict[str, str]:
        """{chat id: owner's user id} for those of these chats that exist. Raises when it cannot
        tell (never an empty answer for an error)."""
        ...

    async def chat_messages(self, chat_id: str) -> tuple[str, dict[str, dict[str, Any]]]:
        """The chat's title and its messages by id, as the host saved them (never a request's copy):
        what a button under an answer reads."""
        ...

    async def clone_origin(self, chat_id: str, user_id: str) -> Origin | None:
        """Where the user's chat was cloned from, when the host's own rules let the user take its
        files (and, for their own chat, its Python state); None: no clone, or a claim they refuse."""
        ...

    async def message_lineage(
        self, chat_id: str, message_id: str, user_message: dict[str, Any] | None = None
    ) -> tuple[list[str], bool]:
        """`message_id` and the messages above it in the chat's tree, nearest first, and whether the
        walk reached the conversation's start."""
        ...

    def can_attach(self, chat_id: str, message_id: str | None) -> bool:
        """Whether a message of this chat can hold attachments."""
        ...

    async def attach(
        self,
        chat_id: str,
        message_id: str | None,
        user_id: str,
        links: Sequence[Link],
        emit: Emit | None,
        *,
        inline_urls: Collection[str] = (),
        replacing: Collection[str] = (),
    ) -> None:
        """Show the answer's files as attachments of its message (but the images its text shows
        inline), and let the people the chat is shared with open them. `replacing`: the refs of
        copies these replace (an export made again), taken off the message."""
        ...

    async def embed(self, embed: ChartEmbed | None, emit: Emit | None) -> None:
        """Show `embed` as the message's one embed (None: nothing to show): serve the plotly.js it
        names (`embed.script`) at a URL of the host's own, then send `embed.html(that URL)`."""
        ...

    async def user(self, user_id: str) -> object:
        """The host's user, to call the base model as."""
        ...

    async def call_model(
        self, request: object, user: object, form: dict[str, Any], *, stream: bool
    ) -> object:
        """The base model's answer to `form` (a chat completion request): a stream, a body, or an
        error response (engine/sse.py `events_from_response` reads each)."""
        ...

    async def read_upload(self, file_id: str, user_id: str) -> tuple[bytes | None, str]:
        """The bytes and name of an upload, only if it is this user's (None: not theirs, or gone)."""
        ...

    # ---- the function's settings, as the host saves them --------------------------------------------

    async def stored_valves(self, function_id: str) -> dict[str, Any]: ...

    async def store_valves(self, function_id: str, valves: dict[str, Any]) -> None: ...

    async def stored_tool_valves(self, tool_id: str) -> dict[str, Any]: ...

    async def store_tool_valves(self, tool_id: str, valves: dict[str, Any]) -> None: ...

    async def may_use_tool(self, user_id: str, role: str, tool_id: str) -> bool:
        """Whether the host would run this tool for this user."""
        ...

    # ---- files in: upload links, Knowledge ----------------------------------------------------------

    def upload_links_folder(self) -> Path:
        """Where upload link records live, the same for every worker."""
        ...

    def serve_uploads(self, receiver: Callable[[], Inbound]) -> bool:
        """Put the upload route on this process's web app (False: there is none here)."""
        ...

    async def upload_url(self, request: object, token: str) -> str:
        """The link a user opens to upload the file of `token`."""
        ...

    async def knowledge_bases(self, user_id: str) -> list[tuple[str, str]]:
        """(id, name) of the Knowledge bases the user may add to, by the host's own rules."""
        ...

    async def save_to_knowledge(
        self, request: object, user_id: str, target: str, name: str, data: bytes
    ) -> str:
        """Put the bytes into the user's Knowledge base `target` (a name or an id) through the host's
        own Knowledge API and its access checks; returns the sentence for the user (a refusal too).
        An empty `target`: the sentence names the bases the user may add to."""
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
