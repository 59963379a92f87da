"""Drive the installed Tool and Filter (dist/code_sessions_tool.py, dist/code_sessions_filter.py, each
loaded the way Open WebUI loads a file) in-process, with Open WebUI's native tool loop stood in for.

What Open WebUI 0.12.4 does for a model with the Tool and the Filter enabled, in the order it does it
(utils/middleware.py): the Filter's `inlet` gets the request body; the model is called with the tools'
specs and streams chat.completion.chunk events, each passed through the Filter's `stream`; a tool call
runs `Tools.run_code` with the reserved arguments it names (`__user__`, `__chat_id__`, `__files__`,
`__event_emitter__`, `__id__`), its result goes back to the model, and so on; the saved answer goes
through the Filter's `outlet`. The claims about Open WebUI itself are made in tests/e2e with
a real server.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from demo import scripted_model
from tests.support.files_api import FilesApi
from tests.support.pipe_harness import (
    PipeHarness,
    UploadStore,
    _HarnessHost,
    load_like_open_webui,
    record_turn,
    settle,
    stop_adapter,
)

REPO = Path(__file__).resolve().parents[2]
TOOL_BUNDLE = REPO / "dist" / "code_sessions_tool.py"
FILTER_BUNDLE = REPO / "dist" / "code_sessions_filter.py"
TOOL_ID = "code_sessions_tool"
FILTER_ID = "code_sessions_filter"
MAX_TOOL_ROUNDS = 8


@dataclass
class Turn:
    streamed: str  # what the browser saw while the answer streamed (after the Filter's stream)
    saved: str  # the saved message (after the Filter's outlet)
    tool_results: list[str]
    events: list[dict]
    shown: str = ""  # what the page shows: the saved message's output text (Open WebUI renders it)


@dataclass
class ToolHarness(UploadStore):
    data_dir: Path
    valves: dict[str, Any] = field(default_factory=dict)
    process: dict = field(default_factory=dict)  # share a PipeHarness's to be the same worker
    uploads: dict[str, tuple[str, str, bytes]] = field(default_factory=dict)
    # Users Open WebUI would not run the Tool for (no read grant on it).
    no_tool_access: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.tool_module = load_like_open_webui(TOOL_BUNDLE.read_text())
        self.filter_module = load_like_open_webui(FILTER_BUNDLE.read_text())
        self.tools = self.tool_module.Tools()
        self.filter = self.filter_module.Filter()
        self.cache_dir = self.data_dir / "cache"
        # Open WebUI's Files API, as the Pipe harness stands in for it (a `beside` harness shares it).
        self.files = FilesApi(self.tool_module, self.data_dir / "uploads", self.data_dir / "files-api.json")
        self.requests: list[dict] = []
        self.chats: dict[str, str] = {}
        self.deleted_chats: set[tuple[str, str]] = set()
        self.unsaved_chats: set[str] = set()
        self.stored_valves: dict[str, Any] = {}  # the Pipe's (a harness host answers for it too)
        self.stored_tool_valves: dict[str, Any] = dict(self.valves)
        self.trees: dict[str, dict[str, str | None]] = {}  # each chat's tree of messages (see PipeHarness)
        self.clones: dict[tuple[str, str], Any] = {}  # what Open WebUI proves of clones (see PipeHarness)
        self.tools._adapter._host = _ToolHost(self, self.tool_module)
        self.filter._adapter._host = _ToolHost(self, self.filter_module)

    @classmethod
    def beside(cls, pipe: PipeHarness, **valves: Any) -> ToolHarness:
        """The Tool and Filter installed in the same Open WebUI (and worker) as the Pipe harness."""
        harness = cls(pipe.data_dir, valves={**pipe.stored_valves, **valves}, process=pipe.process)
        harness.chats = pipe.chats
        harness.uploads = pipe.uploads
        harness.files = pipe.files
        harness.trees = pipe.trees
        harness.clones = pipe.clones
        return harness

    def set_valves(self, **changes: Any) -> None:
        self.stored_tool_valves = {**self.stored_tool_valves, **changes}

    async def say(
        self,
        user_id: str,
        chat_id: str,
        text: str,
        *,
        history: list[dict] | None = None,
        files: list[dict] | None = None,
        tool_enabled: bool = True,
        message_id: str | None = None,
        user_message: dict | None = None,
    ) -> Turn:
        """One user message with the Tool and the Filter enabled, as Open WebUI's native tool loop runs it.
        `tool_enabled=False`: the Filter is on (say, global) but this chat does not offer the Tool.
        `user_message` ({id, parentId}): where it is in the chat's tree (see PipeHarness.say)."""
        self.chats.setdefault(chat_id, user_id)
        message_id = message_id or str(uuid.uuid4())
        record_turn(self.trees, chat_id, message_id, user_message)
        events: list[dict] = []
        self.events = events  # as they come: a test may stop the answer midway, as the user does

        async def emit(event: dict) -> None:
            events.append(event)

        user = {"id": user_id, "name": user_id, "role": "user"}
        tool_ids = [TOOL_ID] if tool_enabled else []
        metadata = {"chat_id": chat_id, "message_id": message_id, "files": files or [], "tool_ids": tool_ids}
        if user_message:
            metadata["user_message"] = user_message
        # Open WebUI assigns the saved valves before every call.
        self.tools.valves = self.tools.Valves(**self.stored_tool_valves)
        body = {
            "model": scripted_model.MODEL_ID,
            "messages": [*(history or []), {"role": "user", "content": text}],
            "stream": True,
            "files": files or [],
            "tool_ids": tool_ids,
        }
        body = await self.filter.inlet(
            body, __user__=dict(user), __metadata__=metadata, __event_emitter__=emit
        )
        messages = list(body["messages"])
        spec = {"type": "function", "function": _run_code_spec()}
        # Open WebUI offers the model only the tools this user may use (utils/tools.py get_tools).
        offered = tool_enabled and user_id not in self.no_tool_access
        streamed = ""
        results: list[str] = []
        for _ in range(MAX_TOOL_ROUNDS):
            form = {**body, "messages": messages, "tools": [spec] if offered else []}
            self.requests.append(json.loads(json.dumps(form)))
            reply = scripted_model.answer(form)
            text_parts: list[str] = []
            calls: dict[int, dict] = {}
            for chunk in scripted_model._chunks(form, reply):
                chunk = await self.filter.stream(json.loads(json.dumps(chunk)), __metadata__=metadata)
                for choice in chunk.get("choices") or ():
                    delta = choice.get("delta") or {}
                    if delta.get("content"):
                        text_parts.append(delta["content"])
                    for call in delta.get("tool_calls") or ():
                        slot = calls.setdefault(call.get("index", 0), {"id": "", "name": "", "arguments": ""})
                        slot["id"] = call.get("id") or slot["id"]
                        function = call.get("function") or {}
                        slot["name"] += function.get("name") or ""
                        slot["arguments"] += function.get("arguments") or ""
            said = "".join(text_parts)
            streamed += said
            if not calls:
                break
            messages.append(
                {
                    "role": "assistant",
                    "content": said,
                    "tool_calls": [
                        {
                            "id": c["id"],
                            "type": "function",
                            "function": {"name": c["name"], "arguments": c["arguments"]},
                        }
                        for c in calls.values()
                    ],
                }
            )
            for call in calls.values():
                arguments = json.loads(call["arguments"] or "{}")
                try:
                    result = await self.tools.run_code(
                        **arguments,
                        __user__={**user, "valves": None},
                        __chat_id__=chat_id,
                        __files__=files or [],
                        __event_emitter__=emit,
                        __id__=TOOL_ID,
                        __message_id__=message_id,
                        __metadata__=metadata,
                        __messages__=messages,
                    )
                except Exception as error:  # Open WebUI's middleware: a tool's error is its result
                    result = json.dumps({"error": str(error)})
                results.append(result)
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        outlet = {
            "model": scripted_model.MODEL_ID,
            "messages": [
                *[{"role": m["role"], "content": m.get("content")} for m in history or []],
                {"role": "user", "content": text},
                {
                    "id": message_id,
                    "role": "assistant",
                    "content": streamed,
                    # Open WebUI 0.12.4 keeps a tool-calling answer's text as output items too, and its
                    # page renders those (the last message item carries the answer's last text).
                    "output": [{"type": "message", "content": [{"type": "output_text", "text": streamed}]}],
                },
            ],
            "chat_id": chat_id,
            "id": message_id,
        }
        outlet = await self.filter.outlet(
            outlet, __user__=dict(user), __metadata__=metadata, __event_emitter__=emit
        )
        await settle(self.filter._adapter)
        saved = outlet["messages"][-1]
        shown = "".join(
            part.get("text", "")
            for item in saved.get("output") or ()
            if item.get("type") == "message"
            for part in item.get("content") or ()
        )
        return Turn(streamed, saved["content"], results, events, shown)

    async def aclose(self) -> None:
        await stop_adapter(self.tools._adapter)
        await stop_adapter(self.filter._adapter)

    @property
    def sessions_root(self) -> Path:
        return self.data_dir / "code_sessions"


def _run_code_spec() -> dict:
    """The spec Open WebUI builds from Tools.run_code (utils/tools.py get_tool_specs), as models see it."""
    return {
        "name": "run_code",
        "description": "Run Python or bash in a sandbox.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string"}, "language": {"type": "string", "default": "python"}},
            "required": ["code"],
        },
    }


class _ToolHost(_HarnessHost):
    """The harness's Open WebUI, with the Tool's saved valves kept where Open WebUI keeps them."""

    def __init__(self, harness: ToolHarness, module: Any) -> None:
        self._harness = harness
        self._module = module

    async def may_use_tool(self, user_id: str, role: str, tool_id: str) -> bool:
        return tool_id == TOOL_ID and user_id not in self._harness.no_tool_access

    async def stored_tool_valves(self, tool_id: str) -> dict:
        return dict(self._harness.stored_tool_valves) if tool_id == TOOL_ID else {}

    async def store_tool_valves(self, tool_id: str, valves: dict) -> None:
        if tool_id == TOOL_ID:
            self._harness.stored_tool_valves = dict(valves)
