# Open WebUI Filter for code-sessions, the Tool's other half: before the model is asked (inlet) it copies
# the chat's uploads into /mnt/data and tells the model about the folder; while the answer streams
# (stream) and once it is saved (outlet) it turns /mnt/data paths into owner-only links and attaches the
# linked files to the message.
#
# Its settings are the Tool's valves (read from the Tool named in `tool_id`), so the two never disagree
# on where the files are or what the limits are. The work is functions/adapter.py's and engine's.
#
# No `from __future__` import here: in the bundle this module's body does not start the file.

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, Field

from engine import (
    ChatSession,
    LoopOptions,
    StreamingRewriter,
    answer_previews,
    import_uploads,
    last_user_text,
    messages_with_prompt,
    waiting_status,
)
from engine.scan import SCAN_ON_LOOP_CHARS
from functions.adapter import Adapter, SharedValves, Status, turn_of
from functions.inbound import answer_command
from storage import CLEAR_FILES_COMMAND, StorageError
from webui import Misconfigured

log = logging.getLogger("code_sessions.function")

# Answers being streamed at once in this worker that the filter keeps a rewriter for; beyond, the
# oldest is dropped (its outlet still rewrites the saved message whole).
_MAX_ANSWERS = 1000


@dataclass
class _Answer:
    """One answer in flight: its chat, and the rewriter that holds back a path split across chunks."""

    chat: ChatSession
    rewriter: StreamingRewriter
    user_id: str


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
        """Rewrite the chunk's text: paths become links as they complete; a path split across chunks is
        held back until it is whole, and the end of each model call (its finish_reason) releases the
        rest. Chunks are the upstream's chat.completion.chunk events.

        Called for every chunk of every answer of the models this filter is on, so the common cases
        (not an answer of ours, a chunk of plain text) are a lookup, a few reads and a sync push."""
        answer = self._adapter.answers.get(str((__metadata__ or {}).get("message_id") or ""))
        if answer is None or not isinstance(event, dict):
            return event
        rewriter = answer.rewriter
        for choice in event.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                delta = {}
            text = delta.get("content")
            if text and isinstance(text, str):
                if len(text) > SCAN_ON_LOOP_CHARS:  # a whole answer in one piece: scanned in a thread
                    visible = await asyncio.to_thread(rewriter.push, text)
                else:
                    visible = rewriter.push(text)
                if rewriter.pending:
                    visible += await rewriter.resolve_pending()
                delta["content"] = visible
            if choice.get("finish_reason"):
                tail = await rewriter.flush()
                if tail:
                    delta["content"] = (delta.get("content") or "") + tail
                    choice["delta"] = delta
        return event

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
        super().__init__()
        self._filter = owner
        self._settings = SharedValves()
        # Answers in flight, by message id: the inlet adds one, the outlet takes it.
        self.answers: OrderedDict[str, _Answer] = OrderedDict()

    @property
    def settings(self) -> SharedValves:
        return self._settings

    @settings.setter
    def settings(self, value: SharedValves) -> None:
        self._settings = value

    async def _read_settings(self) -> dict[str, Any]:
        stored: dict[str, Any] = await self._host.stored_tool_valves(self._filter.valves.tool_id)
        return stored

    async def _write_settings(self, stored: dict[str, Any]) -> None:
        await self._host.store_tool_valves(self._filter.valves.tool_id, stored)

    async def _chat(self, user_id: str, chat_id: str) -> tuple[Any, ChatSession] | None:
        """The services and the chat's session with the Tool's settings as saved now, or None (said in
        the log) when they cannot be had: the message then goes to the model untouched."""
        try:
            stored = await self._read_settings()
            if stored:
                self.settings = SharedValves(**{k: v for k, v in stored.items() if v is not None})
            services, settings = await self._begin()
        except Misconfigured as error:
            log.warning("code-sessions filter: not set up correctly: %s", error)
            return None
        try:
            return services, await services.chat(user_id, chat_id, settings)
        except StorageError as error:
            log.warning("code-sessions: no session for chat %r: %s", chat_id[:80], error)
            return None

    # ---- before the model ----------------------------------------------------------------------------

    async def inlet(
        self,
        body: dict[str, Any],
        user: dict[str, Any],
        metadata: dict[str, Any],
        emitter: Any,
        request: Any = None,
    ) -> dict[str, Any]:
        user_id = str(user.get("id") or "")
        messages = body.get("messages")
        if not user_id or not isinstance(messages, list) or not self._tool_enabled(body, metadata):
            return body
        role = str(user.get("role") or "")
        if not await self._host.may_use_tool(user_id, role, self._filter.valves.tool_id):
            return body  # Open WebUI will not run the Tool for this user: nothing to prepare for it
        chat_id = str(metadata.get("chat_id") or "")
        found = await self._chat(user_id, chat_id)
        if found is None:
            return body
        services, chat = found
        status = Status(emitter)
        turn = turn_of(self._host, chat_id, metadata.get("message_id"), metadata)
        branch = await chat.begin_turn(turn, waiting=waiting_status(status), runs_here=False)
        for sentence in branch:
            await status(sentence, True)
        text = last_user_text(messages).strip()
        said = None
        if text == CLEAR_FILES_COMMAND:
            said = await chat.clear_files(waiting=waiting_status(status))
        else:
            said = await answer_command(self._host, chat, request, text)  # !save-to-knowledge
        if said is not None:
            command = text.split(maxsplit=1)[0]
            messages[-1] = {
                **messages[-1],
                "content": f"(The user typed {command}. {said} Tell the user this in one sentence; "
                "run no code.)",
            }
        files = body.get("files") or metadata.get("files") or []
        notes, refused = await import_uploads(chat, self._host, user_id, files, status)
        sentences = [*branch, *refused, *(note.strip().strip("_") for note in notes if note not in refused)]
        options = LoopOptions(tool_mode=True)
        body["messages"] = await messages_with_prompt(
            messages, chat, services, options, sentences, figures_shown=False
        )
        message_id = metadata.get("message_id")
        if message_id:
            self.answers[str(message_id)] = _Answer(chat, chat.streaming_rewriter(), user_id)
            while len(self.answers) > _MAX_ANSWERS:
                self.answers.popitem(last=False)
        return body

    def _tool_enabled(self, body: dict[str, Any], metadata: dict[str, Any]) -> bool:
        """Whether this request offers the Tool: the web UI sends the tools of the model and those the
        user picked in the chat as `tool_ids` (read by Open WebUI after the inlets). Without the Tool
        the model cannot run code, so the filter stays out of the way (a Filter made global thus
        serves exactly the chats that use the Tool). The ids are the caller's to choose: the inlet
        also checks that the user may use the Tool (`OpenWebUI.may_use_tool`)."""
        tool_ids = body.get("tool_ids") or metadata.get("tool_ids") or ()
        return isinstance(tool_ids, list | tuple) and self._filter.valves.tool_id in tool_ids

    # ---- while it streams -------------------------------------------------------------------------------

    # ---- once it is saved ----------------------------------------------------------------------------

    async def outlet(
        self, body: dict[str, Any], user: dict[str, Any], metadata: dict[str, Any], emitter: Any
    ) -> dict[str, Any]:
        """The saved answer, rewritten whole (what streaming could not: a path in a stream that ended
        without a finish, an answer that was not streamed), with its linked files attached."""
        message_id = str(body.get("id") or metadata.get("message_id") or "")
        chat_id = str(body.get("chat_id") or metadata.get("chat_id") or "")
        user_id = str(user.get("id") or "")
        answer = self.answers.pop(message_id, None)
        if answer is not None:
            chat, tail = answer.chat, await answer.rewriter.flush()
            services = self._services
        else:
            if not user_id or not self._tool_enabled({}, metadata):
                return body
            role = str(user.get("role") or "")
            if not await self._host.may_use_tool(user_id, role, self._filter.valves.tool_id):
                return body
            found = await self._chat(user_id, chat_id)
            if found is None:
                return body
            services, chat, tail = found[0], found[1], ""
        attachments = chat.settings.attach_files and self._host.can_attach(chat_id, message_id)
        for message in body.get("messages") or ():
            if not isinstance(message, dict) or message.get("role") != "assistant":
                continue
            if message.get("id") != message_id:
                continue
            content, added = message.get("content"), ""
            if isinstance(content, str):
                rewritten = await chat.rewrite(content + tail)
                if bool(getattr(user.get("valves"), "table_previews", True)):
                    added += await answer_previews(chat)
                # The Tool's runs' files the answer did not name: attachments, or one line here.
                saved = services.take_saved(user_id, chat_id) if services is not None else []
                added += await chat.hand_over(saved, attachments=attachments)
                notes = chat.unlinked_notes()
                if notes:
                    added += "\n\n" + "\n".join(f"- {note}" for note in notes) + "\n"
                message["content"] = rewritten + added
            last: dict[str, Any] | None = None
            for item in message.get("output") or ():
                if isinstance(item, dict) and item.get("type") == "message":
                    for part in item.get("content") or ():
                        if isinstance(part, dict) and isinstance(part.get("text"), str):
                            part["text"] = await chat.rewrite(part["text"])
                            last = part
            if added and last is not None:  # the page shows the output, when there is one
                last["text"] += added
        if chat.settings.attach_files:
            await self._host.attach(
                chat_id, message_id, user_id, chat.links, emitter, inline_urls=chat.inline_urls
            )
        if chat.turn is None:  # the inlet ran in another worker
            chat.turn = turn_of(self._host, chat_id, message_id, metadata)
        chat.end_turn()  # its state is saved for later branches
        return body
