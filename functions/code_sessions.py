# Open WebUI adapter for code-sessions: a manifold Pipe that gives each chat a persistent /mnt/data folder,
# runs the model's code there in gVisor and turns /mnt/data paths in the answer into download links.
#
# This file only translates: the Pipe's valves, and Open WebUI's call into one engine entry per message
# (`Turns.answer`, engine/turn.py, which runs the message from its start to its end). The valves, the
# settings built from them and the services it shares with the Tool and the Filter are in
# functions/adapter.py; sessions, the index, quotas and links in `storage`; the sandbox in `runner`;
# every question to Open WebUI itself in `webui`. `tools/bundle.py` embeds those packages so that Open
# WebUI gets one file (dist/code_sessions.py).
#
# No `from __future__` import here: in the bundle this module's body does not start the file.

import logging
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, Field

from engine import (
    Host,
    LoopOptions,
    ModelCall,
    ModelError,
    TextDelta,
    ToolCall,
    escape_text,
    events_from_response,
)
from functions.adapter import Adapter, SharedValves, message_of
from functions.inbound import upload_link_tool
from storage import StorageError
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
    max_steps: int = Field(
        default=LoopOptions().max_steps, ge=1, le=50, description="Code runs allowed per answer."
    )


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
            turns, settings = await self._begin()
        except Misconfigured as error:  # the admin's to fix; the user gets the sentence, not a crash
            return f"Code Sessions is not set up correctly: {error}"
        chat_id = __chat_id__ or ""
        message = message_of(
            host,
            __user__["id"],
            chat_id,
            __message_id__,
            __metadata__,
            body.get("messages"),
            __files__ or [],
            __event_emitter__,
            __request__,
        )
        user_valves = __user__.get("valves") or self.UserValves()
        options = LoopOptions(
            tool_mode=self.valves.execution_mode != "fenced",
            max_steps=self.valves.max_steps,
            show_code=bool(getattr(user_valves, "show_code", True)),
            show_output=bool(getattr(user_valves, "show_output", True)),
            previews=bool(getattr(user_valves, "table_previews", True)),
            tools=(
                upload_link_tool(host, self.valves.storage_root, self.valves.index_database, __request__),
            ),
        )
        try:
            return await turns.answer(
                host, message, settings, _base_model(host, body, base_model, __request__, user), options
            )
        except StorageError as error:  # a new chat on a full disk, an id the index refuses
            log.warning("code-sessions: no session for chat %r: %s", chat_id[:80], error)
            return f"This chat's files are not available right now: {escape_text(str(error))}"


def _base_model(
    host: Host, body: dict[str, Any], base_model: str, request: object, user: object
) -> ModelCall:
    """The base model, called through Open WebUI with the request's own fields."""

    async def call(
        history: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> AsyncIterator[TextDelta | ToolCall | ModelError]:
        form = {**body, "model": base_model, "messages": history, "stream": True}
        form.pop("tools", None)
        if tools:
            form["tools"] = tools
        try:
            response = await host.call_model(request, user, form, stream=True)
        except Exception as error:  # the answer says what went wrong; the chat keeps working
            log.warning("code-sessions: base model %s failed: %s", base_model, error)
            yield ModelError(f"{base_model}: {error}")
            return
        async for event in events_from_response(response):
            yield event

    return call
