"""A turn's preparation, before the model is asked: the chat's attachments copied into its folder, and
the system prompt that tells the model about the folder and the sandbox."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from runner import Runner, RunnerError
from storage import StorageError

from .host import Host
from .loop import LoopOptions, StatusCall, waiting_status
from .markup import code_span, details_as_read, escape_text
from .previews import strip_previews
from .prompt import PromptFacts, system_prompt
from .service import ChatSession, Engine
from .settings import Settings

__all__ = ["import_uploads", "last_user_text", "messages_with_prompt"]

log = logging.getLogger("code_sessions.engine")


async def import_uploads(
    chat: ChatSession, host: Host, user_id: str, files: Sequence[dict[str, Any]], status: StatusCall
) -> tuple[list[str], list[str]]:
    """Copy the chat's attachments (the host's file items) into /mnt/data, once each. Returns the
    notes for the answer and the sentences about attachments that could not be taken (said once: the
    next message carries the same attachment, and it is not tried again)."""
    notes: list[str] = []
    refused: list[str] = []
    for item in files:
        file_id = item.get("id") or (item.get("file") or {}).get("id")
        if item.get("type", "file") != "file" or not file_id:
            continue
        source = f"open-webui:{file_id}"
        if await chat.session.files.imported(source) is not None:
            continue
        name = str(item.get("name") or (item.get("file") or {}).get("filename") or file_id)
        try:
            data, name = await host.read_upload(file_id, user_id)
        except Exception as error:  # the host's storage providers raise what they like
            log.warning("code-sessions: attachment %s could not be read: %s", file_id, error)
            why = f"it could not be read (Open WebUI could not read it: {error})"
        else:
            if data is None:
                continue  # not this user's file, or gone: nothing to say about someone else's id
            try:
                path = await chat.add_upload(name, data, source=source, waiting=waiting_status(status))
                why = ""
            except StorageError as error:
                why = str(error)
        if why:
            if not await chat.refuse_upload(source, why):
                continue
            refused.append(f"The attachment {name} was not copied into /mnt/data: {why}")
            shown = f"The attachment {escape_text(name)} was not copied into /mnt/data: {escape_text(why)}"
            notes.append(f"_{shown}_\n\n")
            continue
        await status(f"Copied {name} to /mnt/data/{path}", True, hidden=True)  # the answer says so
        notes.append(f"_Attached file available as {code_span('/mnt/data/' + path)}._\n\n")
    return notes, refused


async def messages_with_prompt(
    messages: list[dict[str, Any]],
    chat: ChatSession,
    services: Engine,
    options: LoopOptions,
    notes: Sequence[str],
    *,
    figures_shown: bool = True,
) -> list[dict[str, Any]]:
    """The conversation as the model reads it: the system prompt first (before the host's own system
    message, if any), and earlier answers with our links turned back into /mnt/data paths."""
    settings: Settings = chat.settings
    entries = sorted(await chat.session.files.list(), key=lambda e: e.mtime, reverse=True)
    quotas = settings.policy.quotas
    sandbox = await _sandbox_facts(services.runner)
    kernels = services.kernels is not None
    facts = PromptFacts(
        files=[(entry.path, entry.size) for entry in entries],
        total_files=len(entries),
        total_bytes=sum(entry.size for entry in entries),
        timeout_s=settings.limits.timeout_s,
        memory_mb=settings.limits.memory_mb,
        network=settings.network,
        max_file_bytes=quotas.max_file_bytes,
        quota_bytes=quotas.max_bytes_per_user,
        quota_files=quotas.max_files_per_user,
        tool_mode=options.tool_mode,
        sandbox_notes=(*sandbox.notes, *notes),
        kernel_idle_minutes=settings.kernels.idle_s / 60 if kernels else None,
        packages=sandbox.packages,
        more_packages=sandbox.more_packages,
        tools=sandbox.tools,
        figures_shown=figures_shown,
    )
    prompt = system_prompt(facts)
    history = [dict(message) for message in await chat.sandbox_view(messages)]
    for message in history:  # the previews of earlier answers: the model made those files itself
        if message.get("role") == "assistant" and isinstance(message.get("content"), str):
            message["content"] = strip_previews(details_as_read(message["content"]))
    if history and history[0].get("role") == "system" and isinstance(history[0].get("content"), str):
        history[0]["content"] = prompt + "\n\n" + history[0]["content"]
    else:
        history.insert(0, {"role": "system", "content": prompt})
    return history


def last_user_text(messages: list[dict[str, Any]]) -> str:
    for message in reversed(messages):
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
            return ""
    return ""


@dataclass(frozen=True)
class _SandboxFacts:
    notes: tuple[str, ...] = ()
    packages: tuple[tuple[str, str], ...] = ()
    tools: tuple[str, ...] = ()
    more_packages: int = 0


async def _sandbox_facts(runner: Runner) -> _SandboxFacts:
    """What the prompt says of the sandbox: quirks, packages, tools. None of it without a sandbox at
    all: the run itself will say so, clearly, to model and user."""
    try:
        env = await runner.environment()
        named = await runner.packages(named_only=True)
        more = max(len(await runner.packages()), env.distributions) - len(named)
        return _SandboxFacts(await runner.known_issues(), named, env.tools, more)
    except RunnerError:
        return _SandboxFacts()
