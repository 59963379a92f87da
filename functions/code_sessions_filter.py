# Open WebUI Filter for code-sessions, the Tool's other half: before the model is asked (inlet) it copies
# the chat's uploads into /mnt/data and tells the model about the folder; while the answer streams
# (stream) and once it is saved (outlet) it turns /mnt/data paths into owner-only links and attaches the
# linked files to the message. Its settings are the Tool's valves (read from the Tool named in
# `tool_id`). This file only translates: each hook is one engine entry (engine/turn.py `Turns`, which
# holds the message's turn from the inlet to the outlet; the Tool's runs continue it).
#
# No `from __future__` import here: in the bundle this module's body does not start the file.

import logging
from typing import Any

from pydantic import BaseModel, Field

from engine import Settings, Turns
from functions.adapter import Adapter, HeldValves, SharedValves, message_of, settings_from
from storage import StorageError
from webui import Misconfigured

log = logging.getLogger("code_sessions.function")


class Filter:
    class Valves(BaseModel):
        tool_id: str = Field(
            default="code_sessions_tool",
            description="The id the Code Sessions Tool was installed with: its valves (storage, limits, "
            "quotas) are this filter's too.",
        )
        priority: int = Field(default=0, description="Order among filters (lower runs first).")

    class UserValves(BaseModel):
        table_previews: bool = Field(
            default=True,
            description="Under the answer, a preview (first rows, columns and types, row count) of each "
            "CSV, TSV, XLSX or Parquet file it links.",
        )

    def __init__(self) -> None:
        self.valves = self.Valves()
        self._adapter = FilterAdapter(self)

    async def inlet(
        self,
        body: dict[str, Any],
        __user__: dict[str, Any] | None = None,
        __metadata__: dict[str, Any] | None = None,
        __event_emitter__: Any = None,
        __request__: Any = None,
    ) -> dict[str, Any]:
        return await self._adapter.inlet(
            body, __user__ or {}, __metadata__ or {}, __event_emitter__, __request__
        )

    async def stream(
        self, event: dict[str, Any], __metadata__: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Rewrite the chunk's text as it streams (engine's `rewrite_chunk`). Called for every chunk of
        every answer of the models this filter is on: a lookup, and for an answer of ours a few reads."""
        turns = self._adapter._turns
        if turns is None:
            return event
        rewritten: dict[str, Any] = await turns.stream(
            str((__metadata__ or {}).get("message_id") or ""), event
        )
        return rewritten

    async def outlet(
        self,
        body: dict[str, Any],
        __user__: dict[str, Any] | None = None,
        __metadata__: dict[str, Any] | None = None,
        __event_emitter__: Any = None,
    ) -> dict[str, Any]:
        return await self._adapter.outlet(body, __user__ or {}, __metadata__ or {}, __event_emitter__)


class FilterAdapter(Adapter):
    """The Filter's side of the shared adapter: the settings are the Tool's saved valves."""

    def __init__(self, owner: Filter) -> None:
        super().__init__(HeldValves())
        self._filter = owner

    async def _read_settings(self) -> dict[str, Any]:
        return await self._host.stored_tool_valves(self._filter.valves.tool_id)

    async def _write_settings(self, stored: dict[str, Any]) -> None:
        await self._host.store_tool_valves(self._filter.valves.tool_id, stored)

    async def _begin(self) -> tuple[Turns, Settings]:
        """The message's start with the Tool's settings as saved now."""
        stored = await self._read_settings()
        if stored:
            self.settings = SharedValves(**{k: v for k, v in stored.items() if v is not None})
        return await super()._begin()

    async def _ours(self, user: dict[str, Any], body: dict[str, Any], metadata: dict[str, Any]) -> bool:
        """Whether this request offers the Tool to a user it runs for: the web UI sends the tools of
        the model and those the user picked in the chat as `tool_ids` (read by Open WebUI after the
        inlets). Without the Tool the model cannot run code, so the filter stays out of the way (a
        Filter made global thus serves exactly the chats that use the Tool). The ids are the caller's
        to choose: the user must also be one Open WebUI runs the Tool for (`may_use_tool`)."""
        tool_id = self._filter.valves.tool_id
        tool_ids = body.get("tool_ids") or metadata.get("tool_ids") or ()
        if not isinstance(tool_ids, list | tuple) or tool_id not in tool_ids:
            return False
        user_id, role = str(user.get("id") or ""), str(user.get("role") or "")
        return bool(user_id) and await self._host.may_use_tool(user_id, role, tool_id)

    # ---- before the model ----------------------------------------------------------------------------

    async def inlet(
        self,
        body: dict[str, Any],
        user: dict[str, Any],
        metadata: dict[str, Any],
        emitter: Any,
        request: object = None,
    ) -> dict[str, Any]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not await self._ours(user, body, metadata):
            return body
        chat_id = str(metadata.get("chat_id") or "")
        files = body.get("files") or metadata.get("files") or []
        message_id = metadata.get("message_id")
        message = message_of(
            self._host, str(user.get("id")), chat_id, message_id, metadata, messages, files, emitter, request
        )
        try:
            turns, settings = await self._begin()
            body["messages"] = await turns.prepare(self._host, message, settings)
        except (Misconfigured, StorageError) as error:  # the model is asked as the request stands
            log.warning("code-sessions filter: chat %r not prepared: %s", chat_id[:80], error)
        return body

    # ---- once it is saved ----------------------------------------------------------------------------

    async def outlet(
        self, body: dict[str, Any], user: dict[str, Any], metadata: dict[str, Any], emitter: Any
    ) -> dict[str, Any]:
        """The saved answer, rewritten whole (what streaming could not: a path in a stream that ended
        without a finish, an answer that was not streamed), with its linked files attached."""
        message_id = str(body.get("id") or metadata.get("message_id") or "")
        chat_id = str(body.get("chat_id") or metadata.get("chat_id") or "")
        message = message_of(
            self._host, str(user.get("id") or ""), chat_id, message_id, metadata, None, emit=emitter
        )
        held = self._turns if self._turns is not None and self._turns.holds(message) else None
        if held is None and not await self._ours(user, {}, metadata):
            return body  # no inlet of ours began this answer here, and the request does not offer the Tool
        found = (m for m in body.get("messages") or () if _is_answer(m, message_id))
        answer: dict[str, Any] = next(found, {})
        content = answer.get("content")
        # Open WebUI 0.12.4 keeps a tool-calling answer's text as output items too, and its page shows those.
        parts = [
            part
            for item in answer.get("output") or ()
            if isinstance(item, dict) and item.get("type") == "message"
            for part in item.get("content") or ()
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        ]
        previews = bool(getattr(user.get("valves"), "table_previews", True))
        try:
            turns, settings = (
                (self._turns, settings_from(self.settings)) if self._turns else await self._begin()
            )
            text, texts = await turns.end_saved(
                self._host,
                message,
                settings,
                content if isinstance(content, str) else None,
                [part["text"] for part in parts],
                previews=previews,
            )
        except (Misconfigured, StorageError) as error:
            log.warning("code-sessions filter: chat %r not rewritten: %s", chat_id[:80], error)
            return body
        if text is not None:
            answer["content"] = text
        for part, rewritten in zip(parts, texts, strict=True):
            part["text"] = rewritten
        return body


def _is_answer(message: object, message_id: str) -> bool:
    return (
        isinstance(message, dict) and message.get("role") == "assistant" and message.get("id") == message_id
    )
