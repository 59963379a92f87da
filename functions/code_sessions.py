# Open WebUI adapter for code-sessions: a manifold Pipe that gives each chat a persistent /mnt/data folder,
# runs the model's code there in gVisor and turns /mnt/data paths in the answer into download links.
#
# This file is the adapter: the Pipe's valves and its entry point (the valves, the settings built from
# them and the services it shares with the Tool and the Filter are in functions/adapter.py). Sessions,
# the index, quotas and links live in `storage`; the sandbox in `runner`; the chat step, the turn's
# preparation, the conversation loop and the maintenance in `engine`; every question to Open WebUI
# itself in `webui`. `tools/bundle.py` embeds those packages so that Open WebUI gets one file
# (dist/code_sessions.py).
#
# No `from __future__` import here: in the bundle this module's body does not start the file.

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, Field

from engine import (
    LoopOptions,
    ModelError,
    TextDelta,
    ToolCall,
    answer_embed,
    converse,
    escape_text,
    events_from_message,
    events_from_sse,
    import_uploads,
    last_user_text,
    messages_with_prompt,
    waiting_status,
)
from functions.adapter import Adapter, SharedValves, Status, turn_of
from functions.inbound import answer_command, upload_link_tool
from storage import CLEAR_FILES_COMMAND, StorageError
from webui import Misconfigured

log = logging.getLogger("code_sessions.function")


class _PipeValves(BaseModel):
    """The Pipe's own valves, shown first (before the session valves it shares with the Tool)."""

    base_models: str = Field(
        default="",
        description="Comma-separated ids of models already in Open WebUI (e.g. gpt-4o,llama3.1:8b). "
        "Each appears as its own model with code sessions.",
    )
    model_name_prefix: str = Field(default="Code · ", description="Shown before each base model's name.")
    execution_mode: str = Field(
        default="native",
        description="native: the model calls a run_code tool (needs tool calling). fenced: every "
        "```python / ```bash block in the reply is run (for models without tool calling).",
        json_schema_extra={"input": {"type": "select", "options": ["native", "fenced"]}},
    )
    max_steps: int = Field(default=8, ge=1, le=50, description="Code runs allowed per answer.")


class Pipe(Adapter):
    class Valves(SharedValves, _PipeValves):
        pass

    class UserValves(BaseModel):
        show_code: bool = Field(default=True, description="Show the code that ran.")
        show_output: bool = Field(default=True, description="Show the output of each run.")
        table_previews: bool = Field(
            default=True,
            description="Under the answer, a preview (first rows, columns and types, row count) of each "
            "CSV, TSV, XLSX or Parquet file it links.",
        )

    valves: Valves

    def __init__(self) -> None:
        super().__init__()
        self.valves = self.Valves()

    # ---- models -------------------------------------------------------------------------------------

    def pipes(self) -> list[dict[str, Any]]:
        models = [m.strip() for m in self.valves.base_models.split(",") if m.strip()]
        if not models:
            return [
                {"id": "setup", "name": f"{self.valves.model_name_prefix}(set base_models in the valves)"}
            ]
        return [{"id": model, "name": f"{self.valves.model_name_prefix}{model}"} for model in models]

    def pipes_ids(self) -> set[str]:
        return {model["id"] for model in self.pipes()}

    # ---- the chat -----------------------------------------------------------------------------------

    async def pipe(
        self,
        body: dict[str, Any],
        __user__: dict[str, Any],
        __request__: Any = None,
        __event_emitter__: Any = None,
        __chat_id__: str | None = None,
        __task__: str | None = None,
        __files__: list[Any] | None = None,
        __message_id__: str | None = None,
        __metadata__: dict[str, Any] | None = None,
    ) -> Any:
        self._function_id, _, base_model = str(body.get("model", "")).partition(".")
        host = self._host
        user = await host.user(__user__["id"])
        if __task__:
            # Titles, tags, follow-ups: answer with the base model, never run code.
            return await host.call_model(__request__, user, {**body, "model": base_model}, stream=False)
        if base_model == "setup" or base_model not in self.pipes_ids():
            return "No base model is set for Code Sessions: an admin sets `base_models` in the valves."

        try:
            services, settings = await self._begin()
        except Misconfigured as error:  # the admin's to fix; the user gets the sentence, not a crash
            return f"Code Sessions is not set up correctly: {error}"
        try:
            chat = await services.chat(__user__["id"], __chat_id__ or "", settings)
        except StorageError as error:  # a new chat on a full disk, an id the index refuses
            log.warning("code-sessions: no session for chat %r: %s", (__chat_id__ or "")[:80], error)
            return f"This chat's files are not available right now: {escape_text(str(error))}"
        status = Status(__event_emitter__)
        # A regenerated or edited message, or another branch: the folder and kernel go back to the state
        # of the message it continues from (said in the status and to the model).
        turn = turn_of(host, __chat_id__ or "", __message_id__, __metadata__)
        branch = await chat.begin_turn(turn, waiting=waiting_status(status))
        for sentence in branch:
            await status(sentence, True)
        text = last_user_text(body.get("messages", [])).strip()
        if text == CLEAR_FILES_COMMAND:
            said = await chat.clear_files(waiting=waiting_status(status))
            await status.settle()
            chat.end_turn()
            return said
        command = await answer_command(host, chat, __request__, text)  # !save-to-knowledge
        if command is not None:
            return command

        notes, refused = await import_uploads(chat, host, __user__["id"], __files__ or [], status)
        user_valves = __user__.get("valves") or self.UserValves()
        options = LoopOptions(
            tool_mode=self.valves.execution_mode != "fenced",
            max_steps=self.valves.max_steps,
            show_code=bool(getattr(user_valves, "show_code", True)),
            show_output=bool(getattr(user_valves, "show_output", True)),
            previews=bool(getattr(user_valves, "table_previews", True)),
            # Files saved but not named are then only attachments; else one line names them.
            attachments=settings.attach_files and host.can_attach(__chat_id__ or "", __message_id__),
            tools=(upload_link_tool(host, services, self.valves, chat, __request__),),
        )
        messages = await messages_with_prompt(
            body.get("messages", []), chat, services, options, [*branch, *refused]
        )

        async def call_model(
            history: list[dict[str, Any]], tools: list[dict[str, Any]] | None
        ) -> AsyncIterator[TextDelta | ToolCall | ModelError]:
            form = {**body, "model": base_model, "messages": history, "stream": True}
            form.pop("tools", None)
            if tools:
                form["tools"] = tools
            try:
                response = await host.call_model(__request__, user, form, stream=True)
            except Exception as error:  # the answer says what went wrong; the chat keeps working
                log.warning("code-sessions: base model %s failed: %s", base_model, error)
                yield ModelError(f"{base_model}: {error}")
                return
            async for event in _model_events(response):
                yield event

        async def answer() -> AsyncIterator[str]:
            if notes:
                yield "".join(notes)
            charts: list[str] = []
            async for piece in converse(chat, messages, call_model, options, status, charts):
                yield piece
            embed, unshown = await answer_embed(services, chat, charts)
            await host.embed(embed, __event_emitter__)
            if unshown:
                yield "\n\n" + "".join(f"_{sentence}_\n\n" for sentence in unshown)
            await status.settle()
            if settings.attach_files:
                await host.attach(
                    __chat_id__ or "",
                    __message_id__,
                    __user__["id"],
                    chat.links,
                    __event_emitter__,
                    inline_urls=chat.inline_urls,
                )
            chat.end_turn()  # its state is saved for later branches

        return answer()


# ---- small helpers --------------------------------------------------------------------------------------


async def _model_events(response: Any) -> AsyncIterator[TextDelta | ToolCall | ModelError]:
    """Events from whatever generate_chat_completion returned: a stream, a body, or an error response."""
    if isinstance(response, dict):
        for event in events_from_message(response):
            yield event
    elif hasattr(response, "body_iterator"):
        async for event in events_from_sse(response.body_iterator):
            yield event
    else:
        body = getattr(response, "body", b"")
        try:
            payload = json.loads(body) if body else {}
        except ValueError:
            payload = {}
        status = getattr(response, "status_code", "?")
        events = events_from_message(payload) if isinstance(payload, dict) else []
        for event in events or [ModelError(f"the base model answered with HTTP {status}")]:
            yield event
