"""The conversation loop: ask the model, run the code it asks for, feed the result back, repeat.

The model is reached through a `ModelCall` supplied by the caller (the Open WebUI adapter calls the base
model through Open WebUI), so this loop can be tested with a scripted model and no server.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from .blocks import runnable_blocks
from .branches import said_by_branches
from .markup import backtick_fence, details, escape_text
from .outputs import answer_previews
from .scan import SCAN_ON_LOOP_CHARS
from .service import ChatSession, StepResult
from .sse import ModelError, TextDelta, ToolCall
from .step import MAX_RESULT_CHARS

__all__ = [
    "RUN_CODE_TOOL",
    "ExtraTool",
    "LoopOptions",
    "ModelCall",
    "StatusCall",
    "converse",
    "render_step",
    "run_step",
    "waiting_status",
]

RUN_CODE_TOOL = {
    "type": "function",
    "function": {
        "name": "run_code",
        "description": (
            "Run Python or bash in a sandbox. The working directory is /mnt/data, this chat's persistent "
            "folder: files written there stay for the next steps and can be linked in the answer. "
            "Returns the outcome, stdout, stderr and which files changed."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "language": {"type": "string", "enum": ["python", "bash"], "description": "default python"},
                "code": {"type": "string", "description": "the program to run"},
            },
            "required": ["code"],
        },
    },
}

ModelCall = Callable[
    [list[dict[str, Any]], list[dict[str, Any]] | None], AsyncIterator[TextDelta | ToolCall | ModelError]
]


class StatusCall(Protocol):
    """The status line over the message: `done` False while something goes on; `hidden` clears it
    (the step's block is its record, so a status that says nothing more does not stay)."""

    def __call__(self, description: str, done: bool, *, hidden: bool = False) -> Awaitable[None]: ...


@dataclass(frozen=True, slots=True)
class ExtraTool:
    """A tool offered beside run_code (e.g. the upload link): its OpenAI-style spec, and what answers a
    call (the chat and the parsed arguments in, the result the model reads out)."""

    spec: dict[str, Any]
    call: Callable[[ChatSession, dict[str, Any]], Awaitable[str]]

    @property
    def name(self) -> str:
        return str(self.spec["function"]["name"])


@dataclass(frozen=True, slots=True)
class LoopOptions:
    tool_mode: bool = True
    max_steps: int = 8
    show_code: bool = True
    show_output: bool = True
    max_result_chars: int = MAX_RESULT_CHARS
    # The host shows every file the answer links as an attachment of the message (Open WebUI's chips,
    # `attach_files`). Then a file saved but not named in the text is only attached; without it, it is
    # named in one line at the end of the answer.
    attachments: bool = False
    # Tools offered beside run_code; each call counts as a step.
    tools: tuple[ExtraTool, ...] = ()
    # Show a preview of each table file the answer links (a user valve), after the answer's text.
    previews: bool = True


def _fence(text: str) -> str:
    return backtick_fence(text, minimum=3)


def _block(text: str, language: str = "") -> str:
    fence = _fence(text)
    return f"{fence}{language}\n{text.rstrip()}\n{fence}\n"


async def render_step(chat: ChatSession, step: StepResult, options: LoopOptions) -> str:
    """Markdown for the user: one collapsible block, the record of the run (headline; code, output and
    what it deleted inside), its figures inline under it, and the sentences the user must not miss (a
    limit, a lost state, the quota). The files it saved are not listed: the answer names them, and the
    rest reach the user once at the end (`ChatSession.hand_over`)."""
    body: list[str] = []
    if options.show_code:
        body.append(_block(step.code, step.language))
    if options.show_output and step.run is not None:
        output = step.run.stdout + (
            ("\n" if step.run.stdout else "") + step.run.stderr if step.run.stderr else ""
        )
        body.append("Output:\n" + _block(output) if output.strip() else "_(no output)_\n")
    failed = step.why_failed()
    if failed:
        body.append(f"_Why: {escape_text(failed)}_\n")
    deleted = step.deleted_note()
    if deleted:
        body.append(deleted + "\n")
    stills = [picture for _, picture in step.charts if picture]
    if stills:  # the interactive chart is the message's embed; this one is for where embeds are not shown
        shown = await chat.rewrite("".join(f"![{p.rsplit('/', 1)[-1]}](/mnt/data/{p})\n" for p in stills))
        body.append("_Static picture of the interactive chart:_\n\n" + shown)
    block = "\n" + details(step.headline(), "\n".join(body)) + "\n\n"
    pictures = ""
    if step.figures:  # shown like a notebook shows them: inline, under the step
        pictures = await chat.rewrite(
            "".join(f"![{p.rsplit('/', 1)[-1]}](/mnt/data/{p})\n" for p in step.figures)
        )
        pictures += "\n"
    why = step.why_stopped()
    notes = ([f"Why: {escape_text(why)}."] if why else []) + step.attention()
    if not notes:
        return block + pictures
    # Each sentence its own paragraph, in italics: ours, not the model's.
    said = "".join(f"_{note}_\n\n" for note in notes)
    return block + pictures + await chat.rewrite(said, inline_images=False)


def _status_after(step: StepResult, in_text: bool) -> str | None:
    """What the status line says once the run is over: None when the message's text says it all (the
    line is cleared), else the first sentence the run's block does not say: a lost Python state, the
    quota, files a limit removed. (A limit that stopped the run is in the block's headline, and why
    in the line under it.) `in_text`: the run's sentences are in the answer's text (the Pipe's); then
    a branch's sentence, which the status said as the answer started, is not said a third time."""
    notes = [n for n in step.attention() if not (in_text and said_by_branches(n))]
    return notes[0] if notes else None


def _arguments(call: ToolCall, options: LoopOptions) -> tuple[str, str] | dict[str, Any] | str:
    """(language, code) from a run_code call, the arguments of an extra tool's call, or an error
    message for the model."""
    names = ["run_code", *(tool.name for tool in options.tools)]
    if call.name not in names:
        return f"Unknown tool {call.name!r}; the tools are {', '.join(names)}."
    try:
        arguments = json.loads(call.arguments or "{}")
    except json.JSONDecodeError as error:
        return f"The arguments were not valid JSON ({error}); send a JSON object."
    if call.name != "run_code":
        return arguments if isinstance(arguments, dict) else "The arguments must be a JSON object."
    if not isinstance(arguments, dict) or not isinstance(arguments.get("code"), str):
        return "Missing `code` (a string)."
    language = arguments.get("language") or "python"
    return str(language), arguments["code"]


def waiting_status(status: StatusCall) -> Callable[[], Awaitable[None]]:
    """What a step waiting for the chat's lock shows (passed as `waiting=` to ChatSession calls)."""

    async def waiting() -> None:
        await status("Waiting for this chat's previous step to finish...", False)

    return waiting


async def run_step(
    chat: ChatSession, language: str, code: str, status: StatusCall, *, in_text: bool = False
) -> StepResult:
    """Run one piece of code in the chat, saying in statuses that it runs, waits or was reset.
    `in_text`: the caller writes the run's sentences into the answer (`render_step`)."""
    await status(f"Running {language.capitalize()}\u2026", False)
    step = await chat.run(code, language, waiting=waiting_status(status))
    said = _status_after(step, in_text)
    if said is None:
        await status(step.headline(), True, hidden=True)  # the block is the run's one mark
    else:
        await status(said, True)  # a limit or a reset: said where the user looks, and in the text
    return step


async def converse(
    chat: ChatSession,
    messages: list[dict[str, Any]],
    call_model: ModelCall,
    options: LoopOptions,
    status: StatusCall,
    charts: list[str] | None = None,
    saved: list[str] | None = None,
) -> AsyncIterator[str]:
    """Yield the user-visible answer (already link-rewritten) while running the model's code. `charts`
    collects the specs of the charts the runs saved, for the message's embed; `saved`, the files the
    runs saved, in order (for the end of an answer that did not get this far: a failure, a stop)."""
    saved = [] if saved is None else saved
    collected: list[str] = [] if charts is None else charts
    async for piece in _turns(chat, messages, call_model, options, status, saved, collected):
        yield piece
    if options.previews:
        shown = await answer_previews(chat)
        if shown:
            yield shown
    # Every file the runs saved reaches the user once: where the text names it, else as an attachment
    # or in one line here.
    handed = await chat.hand_over(saved, attachments=options.attachments)
    if handed:
        yield handed
    # A file the answer named that exists but could not be linked: say why, rather than stay silent.
    notes = chat.unlinked_notes()
    if notes:
        yield "\n\n" + "\n".join(f"- {note}" for note in notes) + "\n"


async def _turns(
    chat: ChatSession,
    messages: list[dict[str, Any]],
    call_model: ModelCall,
    options: LoopOptions,
    status: StatusCall,
    saved: list[str],
    charts: list[str],
) -> AsyncIterator[str]:
    """The model's turns; `saved` collects the files every run saved, in order."""
    steps = 0
    while True:
        offer_tools = options.tool_mode and steps < options.max_steps
        rewriter = chat.streaming_rewriter()
        text = ""
        calls: list[ToolCall] = []
        offered = [RUN_CODE_TOOL, *(tool.spec for tool in options.tools)]
        async for event in call_model(messages, offered if offer_tools else None):
            if isinstance(event, TextDelta):
                text += event.text
                if len(event.text) > SCAN_ON_LOOP_CHARS:  # a whole answer in one piece (not streamed)
                    visible = await asyncio.to_thread(rewriter.push, event.text)
                else:
                    visible = rewriter.push(event.text)  # sync: no coroutine per streamed piece
                if rewriter.pending:
                    visible += await rewriter.resolve_pending()
                if visible:
                    yield visible
            elif isinstance(event, ToolCall):
                calls.append(event)
            else:
                yield await rewriter.flush()
                yield f"\n\n**The model returned an error:** {event.message}\n"
                return
        tail = await rewriter.flush()
        if tail:
            yield tail

        if options.tool_mode:
            if not calls:
                return
            messages.append(
                {
                    "role": "assistant",
                    "content": text,
                    "tool_calls": [
                        {
                            "id": c.id,
                            "type": "function",
                            "function": {"name": c.name, "arguments": c.arguments},
                        }
                        for c in calls
                    ],
                }
            )
            for call in calls:
                parsed = _arguments(call, options)
                if isinstance(parsed, str):
                    result = parsed
                elif steps >= options.max_steps:
                    result = "Not run: the step limit for this answer is reached. Answer with what you have."
                elif isinstance(parsed, dict):
                    steps += 1
                    tool = next(t for t in options.tools if t.name == call.name)
                    result = await tool.call(chat, parsed)
                else:
                    steps += 1
                    step = await run_step(chat, parsed[0], parsed[1], status, in_text=True)
                    saved.extend(step.saved())
                    charts.extend(spec for spec, _ in step.charts)
                    yield await render_step(chat, step, options)
                    result = step.for_model(options.max_result_chars)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            continue

        blocks = (
            await asyncio.to_thread(runnable_blocks, text)
            if len(text) > SCAN_ON_LOOP_CHARS
            else runnable_blocks(text)
        )
        if not blocks:
            return
        if steps >= options.max_steps:
            yield "\n\n_(The code above was not run: the step limit for this answer is reached.)_\n"
            return
        messages.append({"role": "assistant", "content": text})
        results = []
        for block in blocks:
            steps += 1
            step = await run_step(chat, block.language, block.code, status, in_text=True)
            saved.extend(step.saved())
            charts.extend(spec for spec, _ in step.charts)
            yield await render_step(chat, step, options)
            results.append(step.for_model(options.max_result_chars))
        messages.append(
            {
                "role": "user",
                "content": "Output of the code blocks you wrote, in order:\n\n"
                + "\n\n".join(results)
                + "\n\nContinue. Write more ```python or ```bash blocks only if more code must run.",
            }
        )
