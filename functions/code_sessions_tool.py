# Open WebUI Tool for code-sessions: `run_code` for any model with tool calling, in the chat's persistent
# /mnt/data folder and live Python kernel, in gVisor. Install it beside the Filter
# (functions/code_sessions_filter.py), which tells the model about the folder, copies the chat's
# uploads in and turns /mnt/data paths in the answer into links.
#
# This file is a thin adapter: its valves are the session valves every file shares, and the settings
# and services built from them are functions/adapter.py's; the step and the maintenance are engine's.
# Open WebUI offers every public method of `Tools` to the model: `run_code` and `upload_link`.
#
# No `from __future__` import here: Open WebUI reads run_code's annotations to build its schema, and in
# the bundle this module's body does not start the file.

import logging
from collections import OrderedDict
from typing import Any

from engine import LoopOptions, answer_embed, escape_text, import_uploads, run_step
from functions.adapter import Adapter, SharedValves, Status, turn_of
from functions.inbound import upload_link
from storage import StorageError
from webui import Misconfigured

log = logging.getLogger("code_sessions.function")

_MESSAGES = 1000  # answers at once whose charts this worker keeps


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
        )

    async def upload_link(
        self,
        path: str,
        __user__: dict[str, Any] | None = None,
        __chat_id__: str | None = None,
        __request__: Any = None,
        __id__: str | None = None,
    ) -> str:
        """
        Make a link the user can upload one file with, straight into /mnt/data at the path you choose
        (for files too big to attach, or that come from another system). The link takes one file,
        once, for a few minutes. Give the link to the user as it is.
        :param path: where the file goes, e.g. /mnt/data/export.csv
        """
        return await self._adapter.upload_link(
            path, user=__user__ or {}, chat_id=__chat_id__ or "", request=__request__, tool_id=__id__
        )


class ToolAdapter(Adapter):
    """The Tool's side of the shared adapter: its settings are the Tool's valves, saved with the tool."""

    def __init__(self, tool: Tools) -> None:
        super().__init__()
        self._tool = tool
        # The charts of the answers being written, by message: each run shows its message's every
        # chart in one embed (Open WebUI keeps an event's list whole). The oldest go first.
        self._charts: OrderedDict[tuple[str, str, str], list[str]] = OrderedDict()

    @property
    def settings(self) -> SharedValves:
        return self._tool.valves

    @settings.setter
    def settings(self, value: SharedValves) -> None:
        self._tool.valves = value

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
    ) -> str:
        """One run for the model: the result it reads, with any sentence about the chat's files."""
        self._function_id = tool_id or self._function_id
        user_id = str(user.get("id") or "")
        if not user_id:
            return "Not run: Open WebUI did not say which user this is."
        try:
            services, settings = await self._begin()
        except Misconfigured as error:
            return f"Not run: Code Sessions is not set up correctly: {error}"
        try:
            chat = await services.chat(user_id, chat_id, settings)
        except StorageError as error:
            log.warning("code-sessions: no session for chat %r: %s", chat_id[:80], error)
            return f"Not run: this chat's files are not available right now: {escape_text(str(error))}"
        status = Status(emitter)
        # The folder follows the conversation's branches (the Filter's inlet did it before the model was
        # asked; without the Filter, the answer's first run does): what it says reaches the result.
        await chat.begin_turn(turn_of(self._host, chat_id, message_id, metadata))
        # The Filter copies uploads in before the model is asked; without it (or when a file arrives
        # between two runs of one answer) the Tool does, once each: nothing is copied twice.
        notes, _ = await import_uploads(chat, self._host, user_id, files, status)
        step = await run_step(chat, language, code, status)
        # What the run saved reaches the user at the answer's end (the Filter's outlet): the files the
        # answer does not name are attached, or named in one line.
        services.note_saved(user_id, chat_id, step.saved())
        # The user sees the files (and figures) the answer names: the Filter turns their paths into
        # links and images, so the result tells the model which paths to write.
        result = step.for_model(LoopOptions().max_result_chars)
        if step.figures:
            result += "\nTo show a figure, write its /mnt/data path in your answer."
        if step.charts:
            message = (user_id, chat_id, message_id or "")
            result += await self._show_charts(services, chat, message, step, emitter)
        return "".join(_plain(note) for note in notes) + result

    async def upload_link(
        self, path: str, *, user: dict[str, Any], chat_id: str, request: Any, tool_id: str | None
    ) -> str:
        """A link the user can upload one file with, into this chat's /mnt/data (functions/inbound.py)."""
        self._function_id = tool_id or self._function_id
        user_id = str(user.get("id") or "")
        if not user_id:
            return "No upload link: Open WebUI did not say which user this is."
        try:
            services, settings = await self._begin()
            chat = await services.chat(user_id, chat_id, settings)
        except (Misconfigured, StorageError) as error:
            return f"No upload link: {escape_text(str(error))}"
        return await upload_link(self._host, services, self.settings, chat, request, path)


    async def _show_charts(
        self, services: Any, chat: Any, message: tuple[str, str, str], step: Any, emitter: Any
    ) -> str:
        """Show the message's charts so far as its embed; returns what the model should know of them."""
        charts = self._charts.setdefault(message, [])
        self._charts.move_to_end(message)
        while len(self._charts) > _MESSAGES:
            self._charts.popitem(last=False)
        charts.extend(spec for spec, _ in step.charts)
        embed, unshown = await answer_embed(services, chat, charts)
        await self._host.embed(embed, emitter)
        return "".join(f"\n{sentence}" for sentence in unshown)


def _plain(note: str) -> str:
    # The attachment notes are Markdown for an answer (`_..._`); the model reads them as sentences.
    return note.strip().strip("_") + "\n"
