# Open WebUI Tool for code-sessions: `run_code` for any model with tool calling, in the chat's persistent
# /mnt/data folder and live Python kernel, in gVisor. Install it beside the Filter
# (functions/code_sessions_filter.py), which tells the model about the folder, copies the chat's
# uploads in and turns /mnt/data paths in the answer into links.
#
# This file only translates: its valves are the session valves every file shares (the settings and
# services built from them are functions/adapter.py's), and each call is one engine entry
# (`Turns.run_code`, `Turns.call`: engine/turn.py holds the message's turn across its calls).
# Open WebUI offers every public method of `Tools` to the model: `run_code` and `upload_link`.
#
# No `from __future__` import here: Open WebUI reads run_code's annotations to build its schema, and in
# the bundle this module's body does not start the file.

import logging
from typing import Any

from engine import escape_text
from functions.adapter import Adapter, SharedValves, message_of
from functions.inbound import upload_link_tool
from storage import StorageError
from webui import Misconfigured

log = logging.getLogger("code_sessions.function")


class Tools:
    class Valves(SharedValves):
        pass

    def __init__(self) -> None:
        self.valves: SharedValves = self.Valves()
        self._adapter = ToolAdapter(self)

    async def run_code(
        self,
        code: str,
        language: str = "python",
        __user__: dict[str, Any] | None = None,
        __chat_id__: str | None = None,
        __files__: list[Any] | None = None,
        __event_emitter__: Any = None,
        __id__: str | None = None,
        __message_id__: str | None = None,
        __metadata__: dict[str, Any] | None = None,
        __messages__: list[Any] | None = None,
    ) -> str:
        """
        Run Python or bash in a sandbox. The working directory is /mnt/data, this chat's persistent
        folder: files written there stay for the next steps and can be linked in the answer by writing
        their /mnt/data path. Python runs in a live kernel: variables carry over between runs.
        Returns the outcome, stdout, stderr and which files changed.
        :param code: the program to run
        :param language: python (the default) or bash
        """
        return await self._adapter.run_code(
            code,
            language or "python",
            user=__user__ or {},
            chat_id=__chat_id__ or "",
            files=__files__ or [],
            emitter=__event_emitter__,
            tool_id=__id__,
            message_id=__message_id__,
            metadata=__metadata__,
            messages=__messages__,
        )

    async def upload_link(
        self,
        path: str,
        __user__: dict[str, Any] | None = None,
        __chat_id__: str | None = None,
        __request__: Any = None,
        __id__: str | None = None,
        __message_id__: str | None = None,
        __metadata__: dict[str, Any] | None = None,
        __messages__: list[Any] | None = None,
    ) -> str:
        """
        Make a link the user can upload one file with, straight into /mnt/data at the path you choose
        (for files too big to attach, or that come from another system). The link takes one file,
        once, for a few minutes. Give the link to the user as it is.
        :param path: where the file goes, e.g. /mnt/data/export.csv
        """
        return await self._adapter.upload_link(
            path,
            user=__user__ or {},
            chat_id=__chat_id__ or "",
            request=__request__,
            tool_id=__id__,
            message_id=__message_id__,
            metadata=__metadata__,
            messages=__messages__,
        )


class ToolAdapter(Adapter):
    """The Tool's side of the shared adapter: its settings are the Tool's valves, saved with the tool."""

    def __init__(self, tool: Tools) -> None:
        super().__init__(tool)
        self._tool = tool

    async def _read_settings(self) -> dict[str, Any]:
        return await self._host.stored_tool_valves(self._function_id) if self._function_id else {}

    async def _write_settings(self, stored: dict[str, Any]) -> None:
        if self._function_id:
            await self._host.store_tool_valves(self._function_id, stored)

    async def run_code(
        self,
        code: str,
        language: str,
        *,
        user: dict[str, Any],
        chat_id: str,
        files: list[Any],
        emitter: Any,
        tool_id: str | None,
        message_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        messages: list[Any] | None = None,
    ) -> str:
        """One run for the model: the result it reads, with any sentence about the chat's files."""
        self._function_id = tool_id or self._function_id
        user_id = str(user.get("id") or "")
        if not user_id:
            return "Not run: Open WebUI did not say which user this is."
        try:
            turns, settings = await self._begin()
        except Misconfigured as error:
            return f"Not run: Code Sessions is not set up correctly: {error}"
        message = message_of(self._host, user_id, chat_id, message_id, metadata, messages, files, emitter)
        try:
            return await turns.run_code(self._host, message, settings, language, code)
        except StorageError as error:
            log.warning("code-sessions: no session for chat %r: %s", chat_id[:80], error)
            return f"Not run: this chat's files are not available right now: {escape_text(str(error))}"

    async def upload_link(
        self,
        path: str,
        *,
        user: dict[str, Any],
        chat_id: str,
        request: object,
        tool_id: str | None,
        message_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        messages: list[Any] | None = None,
    ) -> str:
        """A link the user can upload one file with, into this chat's /mnt/data (functions/inbound.py);
        the file joins the state of the answer that offers it."""
        self._function_id = tool_id or self._function_id
        user_id = str(user.get("id") or "")
        if not user_id:
            return "No upload link: Open WebUI did not say which user this is."
        message = message_of(self._host, user_id, chat_id, message_id, metadata, messages, request=request)
        valves = self.settings
        tool = upload_link_tool(self._host, valves.storage_root, valves.index_database, request)
        try:
            turns, settings = await self._begin()
            return await turns.call(self._host, message, settings, tool, {"path": path})
        except (Misconfigured, StorageError) as error:
            return f"No upload link: {escape_text(str(error))}"
