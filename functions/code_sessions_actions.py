# Open WebUI Action for code-sessions: buttons under an answer of a Code Sessions chat. "Export as notebook"
# attaches the conversation up to that answer as a Jupyter notebook; "Files of this chat" shows /mnt/data
# with download links and sizes; "Download all files" makes one zip of /mnt/data; "Save to Knowledge" puts
# the answer's files into one of your Knowledge bases.
#
# Its settings are the Pipe's valves (for the Pipe's "Code · " models) or the Tool's (for any other model),
# read as saved, so storage and limits agree with the chat's own. This file only translates: the request
# into one engine entry (`Turns.press`; who may press and what each button does are engine/actions.py's),
# the reply out as a dialog or a notification.
#
# No `from __future__` import here: in the bundle this module's body does not start the file.

import base64
import logging
from typing import Any

from pydantic import BaseModel, Field

from engine import BUTTONS, Message, Reply
from functions.adapter import Adapter, HeldValves, SharedValves
from storage import StorageError
from webui import Misconfigured

log = logging.getLogger("code_sessions.function")

_PATHS = {  # 24x24 outlines, drawn for these buttons: a notebook, a folder, a download, a book
    "notebook": '<rect x="5" y="3" width="14" height="18" rx="2"/><path d="M9 8l4 3-4 3M13 16h2"/>',
    "files": '<path d="M3 6a2 2 0 0 1 2-2h4l2 2h8a2 2 0 0 1 2 2v10a2 2 0 0 1-2 2H5a2 2 0 0 1-2-2z"/>'
    '<path d="M7 11h10M7 15h6"/>',
    "zip": '<path d="M12 3v12M7 10l5 5 5-5M4 17v2a2 2 0 0 0 2 2h12a2 2 0 0 0 2-2v-2"/>',
    "knowledge": '<path d="M4 5a2 2 0 0 1 2-2h13v16H6a2 2 0 0 0-2 2z"/><path d="M4 19V5M9 7h6"/>',
}


def _icon(paths: str) -> str:
    svg = (
        '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24" fill="none" stroke="black" '
        f'stroke-width="1.5" stroke-linecap="round" stroke-linejoin="round">{paths}</svg>'
    )
    return "data:image/svg+xml;base64," + base64.b64encode(svg.encode()).decode("ascii")


class Action:
    class Valves(BaseModel):
        pipe_id: str = Field(
            default="code_sessions",
            description="The id the Code Sessions Pipe was installed with: its valves (storage, limits, "
            "quotas) are the buttons' for its models.",
        )
        tool_id: str = Field(
            default="code_sessions_tool",
            description="The id the Code Sessions Tool was installed with: its valves are the buttons' for "
            "every other model.",
        )
        priority: int = Field(default=0, description="Order among actions (lower comes first).")

    def __init__(self) -> None:
        # Open WebUI reads `actions` when it lists the models: one button each, `<function id>.<id>`.
        self.actions = [{"id": k, "name": name, "icon_url": _icon(_PATHS[k])} for k, name in BUTTONS.items()]
        self.valves = self.Valves()
        self._adapter = ActionAdapter(self)

    async def action(
        self,
        body: dict[str, Any],
        __user__: dict[str, Any] | None = None,
        __event_emitter__: Any = None,
        __event_call__: Any = None,
        __id__: str | None = None,
        __request__: Any = None,
    ) -> dict[str, Any] | None:
        return await self._adapter.act(
            __id__ or "", body, __user__ or {}, __event_emitter__, __event_call__, __request__
        )


class ActionAdapter(Adapter):
    """The Action's side of the shared adapter: its settings are the Pipe's or the Tool's saved valves,
    by the model of the chat."""

    def __init__(self, owner: Action) -> None:
        super().__init__(HeldValves())
        self._action = owner
        self._tool = False  # whose valves these are: the Pipe's (False) or the Tool's

    async def _read_settings(self) -> dict[str, Any]:
        valves = self._action.valves
        if self._tool:
            stored: dict[str, Any] = await self._host.stored_tool_valves(valves.tool_id)
        else:
            stored = await self._host.stored_valves(valves.pipe_id)
        return stored

    async def _write_settings(self, stored: dict[str, Any]) -> None:
        valves = self._action.valves
        if self._tool:
            await self._host.store_tool_valves(valves.tool_id, stored)
        else:
            await self._host.store_valves(valves.pipe_id, stored)

    async def act(
        self, button: str, body: dict[str, Any], user: dict[str, Any], emit: Any, call: Any, request: Any
    ) -> dict[str, Any] | None:
        if body.get("event"):  # Open WebUI calls every action on a regenerate: nothing to do then
            return None
        user_id = str(user.get("id") or "")
        chat_id, message_id = str(body.get("chat_id") or ""), str(body.get("id") or "")
        if button not in BUTTONS:
            return None
        self._tool = not str(body.get("model") or "").startswith(self._action.valves.pipe_id + ".")
        message = Message(user_id, chat_id, message_id, emit=emit, request=request)

        async def ask(title: str, text: str, options: Any) -> str | None:
            return await _choose(call, title, text, options)

        try:
            stored = await self._read_settings()
            self.settings = SharedValves(**{k: v for k, v in stored.items() if v is not None})
            turns, settings = await self._begin()
            reply = await turns.press(self._host, message, settings, button, ask)
        except (Misconfigured, StorageError) as error:
            reply = Reply(f"Code Sessions is not available: {error}", level="error")
        return await self._show(reply, emit, call)

    async def _show(self, reply: Reply, emit: Any, call: Any) -> dict[str, Any]:
        """A dialog (the reply has a title) or a notification; returned too, for an API caller."""
        shown = False
        if reply.title and call is not None:
            dialog = {"title": reply.title, "message": reply.text}
            answer = await call({"type": "confirmation", "data": dialog})
            shown = not (isinstance(answer, dict) and answer.get("error"))
        if not shown and emit is not None:
            await emit({"type": "notification", "data": {"type": reply.level, "content": reply.text}})
        return {"code_sessions": {"level": reply.level, "title": reply.title, "text": reply.text}}


async def _choose(call: Any, title: str, message: str, options: Any) -> str | None:
    """One of `options` ((value, label)), picked in Open WebUI's input dialog; None when not."""
    if call is None:
        return None
    choices = [{"label": label, "value": value} for value, label in options]
    answer = await call(
        {
            "type": "input",
            "data": {
                "title": title,
                "message": message,
                "placeholder": "Knowledge base",
                "value": choices[0]["value"] if choices else "",
                "input": {"type": "select", "options": choices},
            },
        }
    )
    return answer if isinstance(answer, str) and answer else None
