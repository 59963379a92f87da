"""One message's life, owned by the engine (`Turn`), and the entries the host's forms call (`Turns`).

A turn begins (the answer follows its branch of the conversation, then a command is answered, or the
chat's attachments are copied in and the prompt written), converses (the Pipe's loop; the Tool's runs,
one call at a time), and always ends, from a `finally`, however the answer ends: done, an exception,
a stream the host closes, a task it cancels when the user stops the answer, a command answered without
the model. Its end settles the status, attaches the files the answer's runs saved and its text linked,
and saves the answer's state for the conversation's branches (`Turn.end`).

The Pipe makes one call per message (`Turns.answer`). The Tool and the Filter make several, which
`Turns` spans by holding the message's turn, by message id, in this process: the Filter's inlet begins
it (`prepare`), its stream rewrites with it (`rewriter`), each of the Tool's runs continues it
(`run_code`, `call`), and the outlet ends it (`end_saved`); a run the user stops ends it too, since no
outlet follows. The Action's buttons under an answer are one call each, outside any turn (`press`). A
call that finds no turn held here (its message's other calls went to another worker) begins or opens one
from the store: what decides the answer's files (the folder, the branch it follows, its saved state) is
in the store, and only this process's own parts of the message (the rewriter, the charts shown so far,
the files its runs here saved) stay behind with the worker that holds them.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from storage import CLEAR_FILES_COMMAND

from .actions import NOT_OWNER, Ask, Reply, owned, press
from .branches import Place
from .host import Emit, Host
from .inbound import save_command, save_to_knowledge
from .loop import ExtraTool, LoopOptions, ModelCall, converse, run_step, waiting_status
from .outputs import answer_embed, answer_previews
from .prepare import import_uploads, last_user_text, messages_with_prompt
from .service import ChatSession, Engine
from .settings import Settings
from .step import StepResult
from .streaming import StreamingRewriter, rewrite_chunk

__all__ = ["Message", "Status", "Turn", "Turns"]

log = logging.getLogger("code_sessions.engine")

# Turns held at once in a process (messages whose outlet has not come); beyond, the oldest is let go
# (its state is saved when the chat next leaves its branch; its outlet, if it comes, opens it anew).
_HELD = 1000


@dataclass(frozen=True, slots=True)
class Message:
    """One message, as a call of the host hands it over: whose, which chat, which answer and where it
    is in the conversation (`place`), the request's messages and attachments, where this call's
    events go (`emit`), and the host's request (for the model, upload links and Knowledge)."""

    user_id: str
    chat_id: str
    message_id: str | None = None
    place: Place | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    files: Sequence[dict[str, Any]] = ()
    emit: Emit | None = None
    request: object = None

    @property
    def text(self) -> str:
        """The user's message, as typed."""
        return last_user_text(self.messages).strip()


class Status:
    """The message's status line (engine.StatusCall). Open WebUI 0.12 shows a message's last status,
    and nothing when that one is hidden."""

    def __init__(self, emit: Emit | None) -> None:
        self._emit = emit
        self._going: str | None = None  # the description of a status still in progress

    async def __call__(self, description: str, done: bool, *, hidden: bool = False) -> None:
        self._going = None if done else description
        if self._emit is not None:
            data: dict[str, Any] = {"description": description, "done": done}
            if hidden:
                data["hidden"] = True
            await self._emit({"type": "status", "data": data})

    async def settle(self) -> None:
        """The message is over: a status still in progress (a wait for the chat) must not stay."""
        if self._going is not None:
            await self(self._going, True, hidden=True)


class Turn:
    """One message's answer in one chat: its chat as the message uses it, the files its runs saved,
    its charts, and its end. Made by `Turns`."""

    def __init__(self, services: Engine, host: Host, chat: ChatSession, message: Message) -> None:
        self.services = services
        self.host = host
        self.chat = chat
        self.message = message
        self.status = Status(message.emit)
        self.saved: list[str] = []  # the files the runs saved, in order, until the end hands them over
        self.charts: list[str] = []  # the specs of the charts the runs saved: the message's one embed
        self.rewriter: StreamingRewriter | None = None  # the Filter's, for the streamed answer
        self.branch: list[str] = []  # what following the answer's branch said, at its start
        self._ended = False

    def heard(self, message: Message) -> None:
        """Another call of the same message: its events go where that call's go."""
        if message.emit is not None and message.emit is not self.message.emit:
            self.status = Status(message.emit)
        self.message = replace(message, place=message.place or self.message.place)

    @property
    def attachments(self) -> bool:
        """Whether the host shows the answer's files under its message (else one line names them)."""
        return self.chat.settings.attach_files and self.host.can_attach(
            self.message.chat_id, self.message.message_id
        )

    # ---- the start ----------------------------------------------------------------------------------

    async def follow(self, *, runs_here: bool) -> list[str]:
        """Put the folder and kernel at the state of the message the answer continues from (said in the
        status, and returned for the model)."""
        said = await self.chat.follow(
            self.message.place, waiting=waiting_status(self.status), runs_here=runs_here
        )
        for sentence in said:
            await self.status(sentence, True)
        return said

    async def command(self) -> str | None:
        """The answer to a command the user typed instead of a question (`!clear-files`,
        `!save-to-knowledge`), or None when the message is not one."""
        text = self.message.text
        if text == CLEAR_FILES_COMMAND:
            return await self.chat.clear_files(waiting=waiting_status(self.status))
        parsed = save_command(text)
        if parsed is None:
            return None
        host, request, user_id = self.host, self.message.request, self.message.user_id

        async def knowledge(target: str, name: str, data: bytes) -> str:
            return await host.save_to_knowledge(request, user_id, target, name, data)

        return await save_to_knowledge(self.chat, *parsed, knowledge)

    async def uploads(self) -> tuple[list[str], list[str]]:
        """Copy the message's attachments into /mnt/data (each once): the notes for the answer, and the
        sentences about those that could not be taken."""
        message = self.message
        return await import_uploads(self.chat, self.host, message.user_id, message.files, self.status)

    async def prompt(
        self,
        options: LoopOptions,
        sentences: Sequence[str],
        *,
        messages: list[dict[str, Any]] | None = None,
        figures_shown: bool = True,
    ) -> list[dict[str, Any]]:
        """The conversation as the model reads it (the message's, or `messages`), the system prompt
        first, with `sentences` (what the turn's start said) in it."""
        conversation = self.message.messages if messages is None else messages
        return await messages_with_prompt(
            conversation, self.chat, self.services, options, sentences, figures_shown=figures_shown
        )

    # ---- the answer -----------------------------------------------------------------------------------

    async def converse(
        self, model: ModelCall, options: LoopOptions, messages: list[dict[str, Any]], notes: Sequence[str]
    ) -> AsyncIterator[str]:
        """The Pipe's answer, streamed: the upload notes, the model's words and the runs it asks for,
        the charts' embed; ended however the stream ends."""
        handed = False
        try:
            if notes:
                yield "".join(notes)
            async for piece in converse(
                self.chat, messages, model, options, self.status, self.charts, self.saved
            ):
                yield piece
            handed = True  # every saved file reached the text, the attachments or a line
            unshown = await self.show_charts()
            if unshown:
                yield "\n\n" + "".join(f"_{sentence}_\n\n" for sentence in unshown)
        finally:
            await self.end(handed=handed)

    async def run(self, language: str, code: str) -> StepResult:
        """One run of the answer (the Tool's): its files are the answer's to hand over at its end."""
        step = await run_step(self.chat, language, code, self.status)
        self.saved.extend(p for p in step.saved() if p not in self.saved)
        self.charts.extend(spec for spec, _ in step.charts)
        return step

    async def show_charts(self) -> list[str]:
        """Show the answer's charts so far as its embed; returns a sentence for each one that cannot be
        shown interactively."""
        if not self.charts:
            return []
        embed, unshown = await answer_embed(self.services, self.chat, self.charts)
        await self.host.embed(embed, self.message.emit)
        return unshown

    async def close_saved(
        self, content: str | None, parts: Sequence[str], *, previews: bool, tail: str = ""
    ) -> tuple[str | None, list[str]]:
        """The saved answer (the Filter's outlet: its text, and the text parts of its output) rewritten
        whole, with what the streamed text could not carry added once: previews of the tables it links,
        the files its runs saved that it does not name, the files it names that could not be linked.
        `tail`: what the stream still held back."""
        added = ""
        if content is not None:
            content = await self.chat.rewrite(content + tail)
            if previews:
                added += await answer_previews(self.chat)
            added += await self.chat.hand_over(self.saved, attachments=self.attachments)
            self.saved.clear()
            notes = self.chat.unlinked_notes()
            if notes:
                added += "\n\n" + "\n".join(f"- {note}" for note in notes) + "\n"
            content += added
        rewritten = [await self.chat.rewrite(part) for part in parts]
        if added and rewritten:  # the page shows the output, when there is one
            rewritten[-1] += added
        return content, rewritten

    # ---- the end --------------------------------------------------------------------------------------

    async def end(self, *, handed: bool = False) -> None:
        """The end of the answer, the same however it ended: its status settles; the files its runs
        saved (those not handed over yet, unless `handed`) and those its text linked are attached to
        its message (when the host shows attachments); its state is saved in the background. Once per
        turn; raises nothing of its own, and the state is saved even when the rest is cut short."""
        if self._ended:
            return
        self._ended = True
        chat, message = self.chat, self.message
        try:
            await self.status.settle()
            if self.attachments:
                unhanded = [*(() if handed else self.saved), *chat.cut_short]
                if unhanded:
                    await chat.hand_over(unhanded, attachments=True)
                await self.host.attach(
                    message.chat_id,
                    message.message_id,
                    message.user_id,
                    chat.links,
                    message.emit,
                    inline_urls=chat.inline_urls,
                )
        except Exception as error:  # the files are in /mnt/data whatever happens here
            log.warning("code-sessions: the end of answer %r was cut short: %s", message.message_id, error)
        finally:
            chat.save_state_soon()  # its state is saved for later branches


class Turns:
    """The turns in progress of one set of services (`Engine`), by message, and the one entry each call
    of the host's forms makes. Shared by the Pipe, the Tool and the Filter of a process."""

    def __init__(self, services: Engine) -> None:
        self.services = services
        self._held: OrderedDict[str, Turn] = OrderedDict()

    # ---- the Pipe ----------------------------------------------------------------------------------

    async def answer(
        self, host: Host, message: Message, settings: Settings, model: ModelCall, options: LoopOptions
    ) -> str | AsyncIterator[str]:
        """The Pipe's message, start to end: a command's sentence, or the answer's stream. StorageError
        when the chat's files cannot be had at all."""
        turn = await self._begin(host, message, settings, runs_here=True)
        try:
            said = await turn.command()
            if said is None:
                notes, refused = await turn.uploads()
                options = replace(options, attachments=turn.attachments)
                messages = await turn.prompt(options, [*turn.branch, *refused])
        except BaseException:
            await turn.end()
            raise
        if said is not None:  # a command is the whole answer
            await turn.end()
            return said
        return turn.converse(model, options, messages, notes)

    # ---- the Filter and the Tool ---------------------------------------------------------------------

    async def prepare(self, host: Host, message: Message, settings: Settings) -> list[dict[str, Any]]:
        """The Filter's inlet, before the model is asked: the answer's turn begun and held (its branch,
        a command, the attachments), and the conversation the model reads."""
        turn = await self._begin(host, message, settings, runs_here=False)
        try:
            messages = message.messages
            said = await turn.command()
            if said is not None:  # the model answers the user: one sentence, no code
                command = message.text.split(maxsplit=1)[0]
                messages = [
                    *messages[:-1],
                    {
                        **messages[-1],
                        "content": f"(The user typed {command}. {said} Tell the user this in one sentence; "
                        "run no code.)",
                    },
                ]
            notes, refused = await turn.uploads()
            plain = (note.strip().strip("_") for note in notes if note not in refused)
            sentences = [*turn.branch, *refused, *plain]
            prompt = await turn.prompt(LoopOptions(), sentences, messages=messages, figures_shown=False)
            turn.rewriter = turn.chat.streaming_rewriter()
            self._hold(turn)
            await turn.status.settle()  # a wait for the chat is over: the model answers now
            return prompt
        except BaseException:
            await self._end(turn)
            raise

    def holds(self, message: Message) -> bool:
        """Whether this process holds the message's turn (an earlier call of it came here)."""
        turn = self._held.get(message.message_id or "")
        return turn is not None and self._owns(turn, message)

    async def stream(self, message_id: str, event: Any) -> Any:
        """The Filter's stream: a chunk of the answer held for `message_id`, its text rewritten
        (`rewrite_chunk`); any other event, or a chunk of an answer not held here, as it is."""
        turn = self._held.get(message_id)
        if turn is None or turn.rewriter is None or not isinstance(event, dict):
            return event
        return await rewrite_chunk(turn.rewriter, event)

    async def run_code(
        self, host: Host, message: Message, settings: Settings, language: str, code: str
    ) -> str:
        """One of the Tool's runs, in the answer's turn (held, or begun here): the result the model
        reads, with any sentence about the chat's files. A run the user stops ends the answer."""
        turn = await self._continue(host, message, settings)
        try:
            # Without the Filter (or for a file that arrived between two runs) the Tool copies the
            # attachments in, once each.
            notes, _ = await turn.uploads()
            step = await turn.run(language, code)
        except asyncio.CancelledError:
            # The user stopped the answer mid-run: the host cancels it and calls no outlet.
            await self._end(turn)
            raise
        # The user sees the files (and figures) the answer names: the Filter turns their paths into
        # links and images, so the result tells the model which paths to write.
        result = step.for_model(LoopOptions().max_result_chars)
        if step.figures:
            result += "\nTo show a figure, write its /mnt/data path in your answer."
        if step.charts:
            result += "".join(f"\n{sentence}" for sentence in await turn.show_charts())
        return "".join(note.strip().strip("_") + "\n" for note in notes) + result

    async def call(
        self, host: Host, message: Message, settings: Settings, tool: ExtraTool, arguments: dict[str, Any]
    ) -> str:
        """Another of the Tool's tools (the upload link), in the answer's turn."""
        turn = await self._continue(host, message, settings)
        return await tool.call(turn.chat, arguments)

    async def end_saved(
        self,
        host: Host,
        message: Message,
        settings: Settings,
        content: str | None,
        parts: Sequence[str],
        *,
        previews: bool,
    ) -> tuple[str | None, list[str]]:
        """The Filter's outlet: the saved answer rewritten whole (`Turn.close_saved`), and the answer
        ended, whatever the rewriting did."""
        turn = self._held.pop(message.message_id or "", None)
        if turn is not None and not self._owns(turn, message):
            turn = None
        if turn is None:  # the inlet ran in another worker, or long ago: the answer's place is known
            turn = await self._open(host, message, settings)
            turn.chat.place = message.place
        else:
            turn.heard(message)
        handed = False
        try:
            tail = await turn.rewriter.flush() if turn.rewriter is not None else ""
            saved = await turn.close_saved(content, parts, previews=previews, tail=tail)
            handed = content is not None
            return saved
        finally:
            await turn.end(handed=handed)

    # ---- the Action -------------------------------------------------------------------------------------

    async def press(self, host: Host, message: Message, settings: Settings, button: str, ask: Ask) -> Reply:
        """A button under the answer `message.message_id` (engine/actions.py `press`): what it says.
        Only the chat's owner's buttons open the chat (Open WebUI lets its admins call them on any)."""
        if not await owned(host, message.user_id, message.chat_id):
            return NOT_OWNER
        chat = await self.services.chat(message.user_id, message.chat_id, settings)
        return await press(
            self.services, chat, host, button, message.message_id or "", message.request, message.emit, ask
        )

    # ---- the turns --------------------------------------------------------------------------------------

    async def _open(self, host: Host, message: Message, settings: Settings) -> Turn:
        chat = await self.services.chat(message.user_id, message.chat_id, settings)
        return Turn(self.services, host, chat, message)

    async def _begin(self, host: Host, message: Message, settings: Settings, *, runs_here: bool) -> Turn:
        turn = await self._open(host, message, settings)
        try:
            turn.branch = await turn.follow(runs_here=runs_here)
        except BaseException:
            await turn.end()
            raise
        return turn

    async def _continue(self, host: Host, message: Message, settings: Settings) -> Turn:
        """The message's turn held here (another call of it), else one begun and held."""
        turn = self._held.get(message.message_id or "")
        if turn is None or not self._owns(turn, message):
            turn = await self._begin(host, message, settings, runs_here=True)
            self._hold(turn)
            return turn
        turn.heard(message)
        # The folder follows the answer's branch again (another tab's step may have moved it), and what
        # the inlet's following said reaches this first run's result.
        await turn.follow(runs_here=True)
        return turn

    def _hold(self, turn: Turn) -> None:
        message_id = turn.message.message_id
        if not message_id:
            return
        self._held[message_id] = turn
        self._held.move_to_end(message_id)
        while len(self._held) > _HELD:
            self._held.popitem(last=False)

    async def _end(self, turn: Turn) -> None:
        if self._held.get(turn.message.message_id or "") is turn:
            del self._held[turn.message.message_id or ""]
        await turn.end()

    @staticmethod
    def _owns(turn: Turn, message: Message) -> bool:
        """The held turn is this message's: the same user and chat (a message id alone is the caller's)."""
        return (turn.message.user_id, turn.message.chat_id) == (message.user_id, message.chat_id)
