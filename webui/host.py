"""The Open WebUI host: locations, users, the base models, uploads, valves, which chats exist.

Every method is one question to Open WebUI 0.12 (docs/architecture.md lists the facts each relies
on). `OpenWebUI` implements engine.Host, the one protocol of what the function asks of its host (webui
does not import the engine: mypy checks the fit where functions/adapter.py makes it). A test harness
replaces the whole object with its own stand-in, so nothing else in the function reaches into Open
WebUI.
"""

from __future__ import annotations

import asyncio
import logging
import mimetypes
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from storage import Link, Publisher, is_postgres_url

from .access import read_granted
from .assets import publish, register_asset_route
from .clones import CloneSource, clone_source, walk_up
from .files import FilesPublisher, attach, attachment_item
from .knowledge import knowledge_bases, save_to_knowledge
from .uploads import UploadReceiver, register_upload_route, upload_url

log = logging.getLogger("code_sessions.function")

__all__ = ["CloneSource", "Locations", "Misconfigured", "OpenWebUI"]

# Ids per IN (...) query: well under every database's limit on bound parameters.
_ID_CHUNK = 500
# What the files of one bundle version share in this process (see `OpenWebUI.shared`).
_PROCESS: dict[object, object] = {}


# Open WebUI's chat ids: a temporary chat has none or one of these prefixes, and a channel's messages
# come with `channel:`. Neither is a chat Open WebUI saves.
_TEMPORARY_PREFIXES = ("temporary:", "local:")
_UNSAVED_PREFIXES = (*_TEMPORARY_PREFIXES, "channel:")


def _saved_chat(chat_id: str) -> bool:
    return bool(chat_id) and not chat_id.startswith(_UNSAVED_PREFIXES)


def _content_type(name: str) -> str:
    return mimetypes.guess_type(name, strict=False)[0] or "application/octet-stream"


class Embed(Protocol):
    """An embed that loads plotly.js from Open WebUI (engine.ChartEmbed): the file it needs served, and
    its HTML once that file has a URL."""

    @property
    def script(self) -> Path: ...

    def html(self, script_url: str) -> str: ...


class Misconfigured(ValueError):
    """A valve setting the function refuses to run with."""


@dataclass(frozen=True, slots=True)
class Locations:
    root: Path  # sessions and the index
    publish_dir: Path  # folder copies served by Open WebUI's /cache route
    url_prefix: str  # where Open WebUI serves publish_dir


class OpenWebUI:
    """The real Open WebUI (imports are lazy: this module must load without it)."""

    def locations(self, storage_root: str, function_id: str) -> Locations:
        """The root must stay out of the cache Open WebUI serves to every logged-in user."""
        from open_webui.env import DATA_DIR

        cache = (Path(DATA_DIR) / "cache").resolve()
        root = Path(storage_root).expanduser() if storage_root else Path(DATA_DIR) / "code_sessions"
        root = root.resolve()
        if root == cache or cache in root.parents:
            raise Misconfigured(f"storage_root {root} is inside {cache}, which any logged-in user can read")
        return Locations(root, cache / "functions" / function_id, f"/cache/functions/{function_id}/")

    def shared(self) -> dict[object, object]:
        """A dict every file of this bundle version sees in this process: Open WebUI loads the Pipe,
        the Tool and the Filter as three modules, but their embedded packages are one (see
        tools/bundle.py), so their services can be too."""
        return _PROCESS

    def index_url(self, choice: str) -> str:
        """The database for the session index, from the `index_database` valve: a postgresql:// URL as
        given; "sqlite" (or an sqlite: URL) for the SQLite file under the storage root; empty: Open
        WebUI's own database when that is PostgreSQL (the index's tables go in a schema of their own),
        so every replica that shares Open WebUI's database shares the index too. Anything else is the
        admin's to fix (Misconfigured), said at the first message instead of failing every one."""
        choice = choice.strip()
        if choice:
            if is_postgres_url(choice):
                return choice
            if choice.lower() == "sqlite" or choice.partition(":")[0].lower().split("+")[0] == "sqlite":
                return ""
            scheme = choice.partition(":")[0] or choice
            raise Misconfigured(
                f"index_database {scheme!r}... is not a database the index can use: leave it empty, or "
                "set sqlite or a postgresql:// URL"
            )
        from open_webui.env import DATABASE_URL

        return DATABASE_URL if is_postgres_url(DATABASE_URL) else ""

    def publisher(self, places: object) -> Publisher:
        """Where published copies go: Open WebUI's Files API (owner, admins and shared-chat readers
        only). Copies made earlier under /cache keep their own publisher (see storage.publishing)."""
        return FilesPublisher()

    @staticmethod
    def temporary_chat(chat_id: str) -> bool:
        """Whether the chat is one of Open WebUI's temporary chats (its session expires sooner)."""
        return chat_id == "" or chat_id.startswith(_TEMPORARY_PREFIXES)

    def saves_chat(self, chat_id: str) -> bool:
        """Whether Open WebUI keeps this chat as a chat row (temporary chats and channels it does not)."""
        return _saved_chat(chat_id)

    def can_attach(self, chat_id: str, message_id: str | None) -> bool:
        """Whether a message of this chat can hold attachments (a saved chat's message)."""
        return bool(message_id) and _saved_chat(chat_id)

    async def embed(
        self, embed: Embed | None, emit: Callable[[dict[str, Any]], Awaitable[None]] | None
    ) -> None:
        """Show `embed` in the message as Open WebUI's embed: a sandboxed iframe above the answer's
        text, saved with the message of a saved chat (socket/main.py). Its plotly.js is served by this
        worker's route (webui/assets.py), published first. The message's only embed, sent whole each
        time: the page keeps the list of the latest event, and the database, told to `replace`, keeps
        the same."""
        if embed is None or emit is None:
            return
        try:
            self._serve_assets()
            url = await asyncio.to_thread(publish, self.assets_folder(), embed.script)
            html = await asyncio.to_thread(embed.html, url)
            await emit({"type": "embeds", "data": {"embeds": [html], "replace": True}})
        except Exception as error:  # the static pictures and the files stay
            log.warning("code-sessions: could not show the charts: %s", error)

    def assets_folder(self) -> Path:
        """Where the plotly.js the charts load is published: one place under Open WebUI's data folder,
        the same for every worker (and replica sharing DATA_DIR)."""
        from open_webui.env import DATA_DIR

        return Path(DATA_DIR) / "code_sessions_assets"

    def _serve_assets(self) -> bool:
        """Put the plotly.js route on this process's Open WebUI app (once). False: no app here."""
        import sys

        app = getattr(sys.modules.get("open_webui.main"), "app", None)
        if app is None:
            return False
        register_asset_route(app, self.assets_folder())
        return True

    async def attach(
        self,
        chat_id: str,
        message_id: str | None,
        user_id: str,
        links: Sequence[Link],
        emit: Callable[[dict[str, Any]], Awaitable[None]] | None,
        *,
        inline_urls: Collection[str] = (),
        replacing: Collection[str] = (),
    ) -> None:
        """Show the answer's files as attachments of its message (each once), and link them to the
        chat so the people it is shared with can open them. `inline_urls`: the images the text shows
        inline, linked to the chat but not shown again as attachments; `replacing`: the ids of copies
        these replace (an export made again), taken off the message. Temporary chats have no message to
        attach to: their links still work for their owner."""
        if not links or not message_id or not self.can_attach(chat_id, message_id):
            return
        items = [
            attachment_item(link, _content_type(link.name)) for link in links if link.url.startswith("/api/")
        ]
        try:
            files = await attach(chat_id, message_id, user_id, items, inline_urls, replacing)
        except Exception as error:  # the links in the text work anyway
            log.warning("code-sessions: could not attach the files to message %s: %s", message_id, error)
            return
        if files and emit is not None:
            await emit({"type": "chat:message:files", "data": {"files": files}})

    async def user(self, user_id: str) -> object:
        from open_webui.models.users import Users

        return await Users.get_user_by_id(user_id)

    async def call_model(
        self, request: object, user: object, form: dict[str, Any], *, stream: bool
    ) -> object:
        from open_webui.utils.chat import generate_chat_completion

        # The admin chose these base models for this function: access to the function is what is checked.
        return await generate_chat_completion(request, {**form, "stream": stream}, user, bypass_filter=True)

    async def read_upload(self, file_id: str, user_id: str) -> tuple[bytes | None, str]:
        """The bytes of an uploaded file, only if it belongs to this user (ids in a request are untrusted)."""
        from open_webui.models.files import Files
        from open_webui.storage.provider import Storage

        record = await Files.get_file_by_id_and_user_id(file_id, user_id)
        if record is None or not record.path:
            return None, ""
        local = await asyncio.to_thread(Storage.get_file, record.path)
        data = await asyncio.to_thread(Path(local).read_bytes)
        name = (record.meta or {}).get("name") or record.filename or file_id
        return data, name

    async def stored_valves(self, function_id: str) -> dict[str, Any]:
        """The valves as saved now (the background loop is not called by Open WebUI, so it reads them)."""
        from open_webui.models.functions import Functions

        return await Functions.get_function_valves_by_id(function_id) or {}

    async def store_valves(self, function_id: str, valves: dict[str, Any]) -> None:
        from open_webui.models.functions import Functions

        await Functions.update_function_valves_by_id(function_id, valves)

    async def stored_tool_valves(self, tool_id: str) -> dict[str, Any]:
        """A Tool's valves as saved now (Tools keep theirs apart from functions)."""
        from open_webui.models.tools import Tools

        return await Tools.get_tool_valves_by_id(tool_id) or {}

    async def store_tool_valves(self, tool_id: str, valves: dict[str, Any]) -> None:
        from open_webui.models.tools import Tools

        await Tools.update_tool_valves_by_id(tool_id, valves)

    async def may_use_tool(self, user_id: str, role: str, tool_id: str) -> bool:
        """Whether Open WebUI would run this tool for this user, by the check `utils/tools.py get_tools`
        makes before it offers a tool: an admin (unless admins obey access control), its owner, or a
        read grant to the user or one of their groups."""
        from open_webui.config import BYPASS_ADMIN_ACCESS_CONTROL
        from open_webui.models.tools import Tools

        tool = await Tools.get_tool_by_id(tool_id)
        if tool is None:
            return False
        if (role == "admin" and BYPASS_ADMIN_ACCESS_CONTROL) or tool.user_id == user_id:
            return True
        return await read_granted(user_id, "tool", tool_id)

    async def message_lineage(
        self, chat_id: str, message_id: str, user_message: dict[str, Any] | None = None
    ) -> tuple[list[str], bool]:
        """`message_id` and the messages above it in the chat's tree, nearest first (its user message,
        the answer that one continues, ...), and whether the walk reached the conversation's start.
        A temporary chat lives in the browser only: then the request's user message is all there is."""
        chain = [message_id]
        messages: dict[str, Any] | None = None
        if _saved_chat(chat_id):
            from open_webui.models.chat_messages import ChatMessages
            from open_webui.models.chats import Chats

            messages = await ChatMessages.get_messages_map_by_chat_id(chat_id)
            if not messages or message_id not in messages:
                chat = await Chats.get_chat_by_id(chat_id)
                history = ((chat.chat or {}).get("history") or {}) if chat is not None else {}
                messages = history.get("messages") if isinstance(history, dict) else None
        if isinstance(messages, dict) and isinstance(messages.get(message_id), dict):
            return walk_up(messages, message_id)
        if isinstance(user_message, dict) and isinstance(user_message.get("id"), str):
            chain.append(user_message["id"])
            parent = user_message.get("parentId")
            if parent is None:
                return chain, True
            if isinstance(parent, str) and parent:
                chain.append(parent)
        return chain, False

    # ---- files in: upload links, Save to Knowledge ------------------------------------------------------

    def upload_links_folder(self) -> Path:
        """Where upload link records live: one place under Open WebUI's data folder, the same for every
        worker (and replica sharing DATA_DIR), whatever storage_root a file's valves name, so any worker
        that receives the POST finds the link (the record says where the chat's files are)."""
        from open_webui.env import DATA_DIR

        return Path(DATA_DIR) / "code_sessions_upload_links"

    def serve_uploads(self, receiver: Callable[[], UploadReceiver]) -> bool:
        """Put the upload route, and the route of the charts' plotly.js, on this process's Open WebUI
        app (once; the latest receiver serves). False when there is no app to put them on (not inside
        Open WebUI: `receiver` is not called)."""
        import sys

        main = sys.modules.get("open_webui.main")
        app = getattr(main, "app", None)
        if app is None:
            return False
        register_upload_route(app, receiver())
        self._serve_assets()
        return True

    async def upload_url(self, request: object, token: str) -> str:
        """The link as the user reaches Open WebUI: its configured WEBUI_URL, else the address this
        message's request came to."""
        from open_webui.models.config import Config

        base = str(await Config.get("webui.url") or "")
        if not base and request is not None:
            base = str(getattr(request, "base_url", "") or "")
        return upload_url(base or "/", token)

    async def save_to_knowledge(
        self, request: object, user_id: str, target: str, name: str, data: bytes
    ) -> str:
        """engine.Host.save_to_knowledge: through Open WebUI's Knowledge API and its access checks."""
        return await save_to_knowledge(request, user_id, target, name, data)

    async def clone_origin(self, chat_id: str, user_id: str) -> CloneSource | None:
        """Whether the user's chat is a clone, and of what, proved by Open WebUI's own access rules
        (webui/clones.py); None: not a clone, or not one of a chat the user may read."""
        if not _saved_chat(chat_id):
            return None
        return await clone_source(chat_id, user_id)

    async def chat_messages(self, chat_id: str) -> tuple[str, dict[str, dict[str, Any]]]:
        """The saved chat's title and its messages by id (Open WebUI's tree, never a request's copy)."""
        from open_webui.models.chats import Chats

        chat = await Chats.get_chat_by_id(chat_id)
        if chat is None:
            return "", {}
        messages = await Chats.get_messages_map_by_chat_id(chat_id) or {}
        return str(chat.title or ""), {k: v for k, v in messages.items() if isinstance(v, dict)}

    async def knowledge_bases(self, user_id: str) -> list[tuple[str, str]]:
        """engine.Host.knowledge_bases: the bases Open WebUI lets the user add to."""
        return await knowledge_bases(user_id)

    async def chat_owners(self, chat_ids: Sequence[str]) -> dict[str, str]:
        """{chat id: owner's user id} for those of these chats that exist: one query per 500 ids.
        Raises when the database does (never an empty answer for an error)."""
        from open_webui.models.chats import Chats

        owners: dict[str, str] = {}
        for start in range(0, len(chat_ids), _ID_CHUNK):
            owners.update(await Chats.get_owner_ids_by_chat_ids(list(chat_ids[start : start + _ID_CHUNK])))
        return owners
