# Open WebUI adapter for code-sessions: a manifold Pipe that gives each chat a persistent /mnt/data folder,
# runs the model's code there in gVisor and turns /mnt/data paths in the answer into download links.
#
# This file is the only place that talks to Open WebUI. Sessions, the index, quotas and links live in
# `storage`; the sandbox in `runner`; the chat step and the conversation loop in `engine`.
# `tools/bundle.py` embeds those packages so that Open WebUI gets one file (dist/code_sessions.py).
#
# No `from __future__` import here: in the bundle this module's body does not start the file.

import asyncio
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from engine import (
    CodeSessions,
    LoopOptions,
    ModelError,
    PromptFacts,
    code_span,
    converse,
    events_from_message,
    events_from_sse,
    parse_purge,
    system_prompt,
)
from runner import Limits, Runner, RunnerConfig, RunnerError
from storage import Expiry, Publisher, Purge, Quotas, Store

log = logging.getLogger("code_sessions.function")

_MB = 1024 * 1024
_MINUTE = 60.0
_HOUR = 3600.0
_DAY = 86400.0
_NO_LIMIT = 1 << 40  # what "0: no limit" becomes where the sandbox needs a number
_PURGE_RETRY_MINUTES = 10  # a purge that keeps meeting chats mid-step gives up (and says so) after this


class Misconfigured(ValueError):
    """A valve setting the function refuses to run with."""


class Pipe:
    class Valves(BaseModel):
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
        storage_root: str = Field(
            default="",
            description="Folder for sessions and the index. Empty: <DATA_DIR>/code_sessions. Never inside "
            "<DATA_DIR>/cache, which Open WebUI serves to every logged-in user.",
        )
        timeout_seconds: float = Field(default=30.0, gt=0, le=3600, description="Wall time per run.")
        memory_mb: int = Field(default=512, ge=64, description="Memory per run.")
        max_processes: int = Field(default=64, ge=4, description="Processes/threads per run (fork bombs).")
        max_output_kb: int = Field(default=64, ge=1, description="stdout and stderr kept per run, each.")
        network: bool = Field(
            default=False,
            description="Let sandboxed code use the network. Needs network_namespace (see docs/runner.md).",
        )
        network_namespace: str = Field(
            default="",
            description="A network namespace prepared for the sandbox, e.g. /var/run/netns/code-sessions.",
        )
        max_files_per_user: int = Field(default=5000, ge=0, description="All of a user's chats. 0: no limit.")
        max_mb_per_user: int = Field(default=1024, ge=0, description="All of a user's chats. 0: no limit.")
        max_file_mb: int = Field(default=100, ge=0, description="Largest single file. 0: no limit.")
        max_new_files_per_run: int = Field(default=500, ge=0, description="0: no limit.")
        file_max_age_days: float = Field(
            default=30, ge=0, description="Files older than this are deleted. 0: never."
        )
        session_idle_days: float = Field(
            default=30, ge=0, description="A chat's folder unused this long is deleted. 0: never."
        )
        temporary_idle_minutes: float = Field(
            default=60, ge=1, description="Folders of temporary chats are deleted after this much idle time."
        )
        cleanup_interval_minutes: float = Field(
            default=30, ge=1, description="Expiry runs at least this often while Open WebUI is up."
        )
        purge: str = Field(
            default="",
            description="One-shot admin purge, run at the next message or within a minute (a chat mid-step "
            "is retried a minute later), then cleared: "
            "'all', 'user:<user id>', 'chat:<chat id>' or 'idle:<duration>' such as idle:7d, idle:12h.",
        )
        attach_files: bool = Field(
            default=False, description="Also list the linked files under the answer as Open WebUI file items."
        )
        runsc_path: str = Field(default="runsc", description="The gVisor runsc binary.")
        runsc_platform: str = Field(
            default="", description="Empty: detect (systrap if supported, else ptrace)."
        )

    class UserValves(BaseModel):
        show_code: bool = Field(default=True, description="Show the code that ran.")
        show_output: bool = Field(default=True, description="Show the output of each run.")

    def __init__(self) -> None:
        self.valves = self.Valves()
        self._services: CodeSessions | None = None
        self._services_key: tuple | None = None
        self._function_id: str | None = None
        self._last_cleanup = 0.0
        self._ready_lock = asyncio.Lock()
        self._purge_pending: tuple[str, float, float] | None = None  # request, first and last try
        self._background: asyncio.Task | None = None

    # ---- models -------------------------------------------------------------------------------------

    def pipes(self) -> list[dict]:
        models = [m.strip() for m in self.valves.base_models.split(",") if m.strip()]
        if not models:
            return [
                {"id": "setup", "name": f"{self.valves.model_name_prefix}(set base_models in the valves)"}
            ]
        return [{"id": model, "name": f"{self.valves.model_name_prefix}{model}"} for model in models]

    # ---- the chat -----------------------------------------------------------------------------------

    async def pipe(
        self,
        body: dict,
        __user__: dict,
        __request__: Any = None,
        __event_emitter__: Any = None,
        __chat_id__: str | None = None,
        __task__: str | None = None,
        __files__: list | None = None,
    ) -> Any:
        self._function_id, _, base_model = str(body.get("model", "")).partition(".")
        user = await _open_webui_user(__user__["id"])
        if __task__:
            # Titles, tags, follow-ups: answer with the base model, never run code.
            return await _call_model(__request__, user, {**body, "model": base_model}, stream=False)
        if base_model == "setup" or base_model not in self.pipes_ids():
            return "No base model is set for Code Sessions: an admin sets `base_models` in the valves."

        try:
            services = await self._ready()
        except Misconfigured as error:  # the admin's to fix; the user gets the sentence, not a crash
            return f"Code Sessions is not set up correctly: {error}"
        chat = await services.chat(__user__["id"], __chat_id__ or "")
        user_valves = __user__.get("valves") or self.UserValves()
        status = _status_emitter(__event_emitter__)
        uploads = await self._import_uploads(chat, __user__["id"], __files__ or [], status)
        options = LoopOptions(
            tool_mode=self.valves.execution_mode != "fenced",
            max_steps=self.valves.max_steps,
            show_code=bool(getattr(user_valves, "show_code", True)),
            show_output=bool(getattr(user_valves, "show_output", True)),
        )
        messages = await self._messages_with_prompt(body.get("messages", []), chat, services, options)

        async def call_model(history: list[dict], tools: list[dict] | None) -> AsyncIterator:
            form = {**body, "model": base_model, "messages": history, "stream": True}
            form.pop("tools", None)
            if tools:
                form["tools"] = tools
            try:
                response = await _call_model(__request__, user, form, stream=True)
            except Exception as error:  # the answer says what went wrong; the chat keeps working
                log.warning("code-sessions: base model %s failed: %s", base_model, error)
                yield ModelError(f"{base_model}: {error}")
                return
            async for event in _model_events(response):
                yield event

        async def answer() -> AsyncIterator[str]:
            if uploads:
                yield "".join(uploads)
            async for piece in converse(chat, messages, call_model, options, status):
                yield piece
            if self.valves.attach_files and __event_emitter__ is not None:
                await _emit_files(__event_emitter__, chat.published)

        return answer()

    def pipes_ids(self) -> set[str]:
        return {model["id"] for model in self.pipes()}

    # ---- composition --------------------------------------------------------------------------------

    async def _ready(self) -> CodeSessions:
        """The store and runner for the current valves; rebuilt only when a valve they depend on changes."""
        valves = self.valves
        root, publish_dir, url_prefix = _locations(valves.storage_root, self._function_id or "code_sessions")
        key = (
            str(root),
            str(publish_dir),
            valves.runsc_path,
            valves.runsc_platform,
            valves.network,
            valves.network_namespace,
        )
        async with self._ready_lock:  # two first messages at once must not open two stores
            if self._services is None or key != self._services_key:
                if self._services is not None:
                    await self._services.store.close()
                runner = Runner(
                    RunnerConfig(
                        runsc_path=valves.runsc_path,
                        platform=valves.runsc_platform or None,
                        network=valves.network,
                        netns_path=Path(valves.network_namespace) if valves.network_namespace else None,
                    )
                )
                owner = (runner.sandbox_uid, runner.sandbox_gid) if os.geteuid() == 0 else None
                store = Store(root, publisher=Publisher(publish_dir, url_prefix), owner=owner)
                await store.open()
                self._services = CodeSessions(store, runner, Limits())
                self._services_key = key
        services = self._services
        services.store.quotas = Quotas(
            max_files_per_user=valves.max_files_per_user,
            max_bytes_per_user=valves.max_mb_per_user * _MB,
            max_file_bytes=valves.max_file_mb * _MB,
            max_new_files_per_run=valves.max_new_files_per_run,
        )
        services.store.expiry = Expiry(
            file_max_age_s=valves.file_max_age_days * _DAY or None,
            session_idle_s=valves.session_idle_days * _DAY or None,
            temporary_idle_s=valves.temporary_idle_minutes * _MINUTE,
        )
        services.limits = Limits(
            timeout_s=valves.timeout_seconds,
            memory_mb=valves.memory_mb,
            max_processes=valves.max_processes,
            max_output_bytes=valves.max_output_kb * 1024,
            max_file_bytes=valves.max_file_mb * _MB or _NO_LIMIT,
        )
        await self._maintain(services)
        return services

    async def _maintain(self, services: CodeSessions) -> None:
        """Keep the background loop alive and run an admin's purge request, if one is waiting."""
        if self._background is None or self._background.done():
            self._background = asyncio.create_task(self._background_cleanup())
        request = self.valves.purge.strip()
        if request:
            await self._purge(services, request)

    async def _expire_if_due(self, services: CodeSessions) -> None:
        # Only from the background loop: a large expiry must not delay anyone's answer.
        if time.monotonic() - self._last_cleanup >= self.valves.cleanup_interval_minutes * _MINUTE:
            self._last_cleanup = time.monotonic()
            report = await services.store.cleanup()
            log.info("code-sessions cleanup: %s", report.summary())
            await self._forget_deleted_chats(services)

    async def _forget_deleted_chats(self, services: CodeSessions) -> None:
        """Delete the folders of chats the user deleted in Open WebUI (a Pipe hears of no deletion)."""
        settled = time.time() - _HOUR  # a chat being created right now is left alone
        candidates = [
            (info.user_id, info.chat_id)
            for info in await services.store.sessions()
            if not info.temporary and info.last_used_at < settled
        ]
        for user_id, chat_id in await _deleted_chats(candidates):
            report = await services.store.cleanup(Purge(user_id=user_id, chat_id=chat_id))
            log.info("code-sessions: chat %s was deleted; %s", chat_id, report.summary())

    async def _purge(self, services: CodeSessions, request: str) -> None:
        try:
            purge = parse_purge(request)
        except ValueError as error:
            log.error("code-sessions: ignoring purge valve %r: %s", request, error)
        else:
            now = time.monotonic()
            pending = self._purge_pending
            if pending and pending[0] != request:
                pending = None  # the admin typed a new request: it starts afresh
            if pending and now - pending[2] < _MINUTE:
                return  # a request that met a chat mid-step is retried once a minute, not per message
            report = await services.store.cleanup(purge)
            first_try = pending[1] if pending else now
            if report.sessions_in_use and now - first_try < _PURGE_RETRY_MINUTES * _MINUTE:
                # A chat mid-step was skipped; its step ends within the time limit, so keep the
                # request and let the next minute finish the job.
                self._purge_pending = (request, first_try, now)
                log.warning("code-sessions purge %r: %s; retrying within a minute", request, report.summary())
                return
            log.warning("code-sessions purge %r: %s", request, report.summary())
        self._purge_pending = None
        # Clear the one-shot valve so the purge does not run again at the next message.
        self.valves = self.valves.model_copy(update={"purge": ""})
        if self._function_id:
            stored = await _stored_valves(self._function_id)
            if stored.get("purge", "").strip() == request:
                await _store_valves(self._function_id, {**stored, "purge": ""})

    async def _background_cleanup(self) -> None:
        # Wakes every minute and reads the saved valves: a purge typed into the valves runs within a
        # minute even if no message comes, and a shorter cleanup interval applies at once.
        while True:
            await asyncio.sleep(_MINUTE)
            try:
                if self._function_id:
                    stored = await _stored_valves(self._function_id)
                    if stored:
                        self.valves = self.Valves(**{k: v for k, v in stored.items() if v is not None})
                await self._expire_if_due(await self._ready())
            except Exception:  # the loop must outlive a bad tick; the next one retries
                log.exception("code-sessions background cleanup failed")

    async def _import_uploads(self, chat: Any, user_id: str, files: list, status: Any) -> list[str]:
        """Copy the chat's attachments into /mnt/data, once each; returns notes for the answer."""
        notes: list[str] = []
        for item in files:
            file_id = item.get("id") or (item.get("file") or {}).get("id")
            if item.get("type", "file") != "file" or not file_id:
                continue
            if await chat.session.files.imported(f"open-webui:{file_id}"):
                continue
            data, name = await _read_open_webui_file(file_id, user_id)
            if data is None:
                continue
            path = await chat.add_upload(name, data, source=f"open-webui:{file_id}")
            await status(f"Copied {name} to /mnt/data/{path}", True)
            notes.append(f"_Attached file available as {code_span('/mnt/data/' + path)}._\n\n")
        return notes

    async def _messages_with_prompt(
        self, messages: list[dict], chat: Any, services: CodeSessions, options: LoopOptions
    ) -> list[dict]:
        entries = sorted(await chat.session.files.list(), key=lambda e: e.mtime, reverse=True)
        quotas = services.store.quotas
        facts = PromptFacts(
            files=[(entry.path, entry.size) for entry in entries],
            total_files=len(entries),
            total_bytes=sum(entry.size for entry in entries),
            timeout_s=services.limits.timeout_s,
            memory_mb=services.limits.memory_mb,
            network=self.valves.network,
            max_file_bytes=quotas.max_file_bytes,
            quota_bytes=quotas.max_bytes_per_user,
            quota_files=quotas.max_files_per_user,
            tool_mode=options.tool_mode,
            sandbox_notes=await _sandbox_notes(services.runner),
        )
        prompt = system_prompt(facts)
        history = [dict(message) for message in await chat.sandbox_view(messages)]
        if history and history[0].get("role") == "system" and isinstance(history[0].get("content"), str):
            history[0]["content"] = prompt + "\n\n" + history[0]["content"]
        else:
            history.insert(0, {"role": "system", "content": prompt})
        return history


# ---- Open WebUI glue (imported lazily: the bundle must load without a running Open WebUI) --------------


def _locations(storage_root: str, function_id: str) -> tuple[Path, Path, str]:
    """(session root, publish dir, url prefix). The root must stay out of the cache Open WebUI serves."""
    from open_webui.env import DATA_DIR

    cache = (Path(DATA_DIR) / "cache").resolve()
    root = Path(storage_root).expanduser() if storage_root else Path(DATA_DIR) / "code_sessions"
    root = root.resolve()
    if root == cache or cache in root.parents:
        raise Misconfigured(f"storage_root {root} is inside {cache}, which any logged-in user can read")
    return root, cache / "functions" / function_id, f"/cache/functions/{function_id}/"


async def _stored_valves(function_id: str) -> dict:
    """The valves as saved now (the background loop is not called by Open WebUI, so it reads them)."""
    from open_webui.models.functions import Functions

    return await Functions.get_function_valves_by_id(function_id) or {}


async def _store_valves(function_id: str, valves: dict) -> None:
    from open_webui.models.functions import Functions

    await Functions.update_function_valves_by_id(function_id, valves)


async def _deleted_chats(sessions: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The (user, chat) pairs whose chat no longer exists in Open WebUI.

    Open WebUI's lookups answer None on a database error too, so a chat counts as deleted only when
    its user was found a moment before (the database works) and the chat was not."""
    from open_webui.models.chats import Chats
    from open_webui.models.users import Users

    deleted = []
    users: dict[str, bool] = {}
    for user_id, chat_id in sessions:
        if user_id not in users:
            users[user_id] = await Users.get_user_by_id(user_id) is not None
        if users[user_id] and await Chats.get_chat_by_id_and_user_id(chat_id, user_id) is None:
            deleted.append((user_id, chat_id))
    return deleted


async def _open_webui_user(user_id: str) -> Any:
    from open_webui.models.users import Users

    return await Users.get_user_by_id(user_id)


async def _call_model(request: Any, user: Any, form: dict, *, stream: bool) -> Any:
    from open_webui.utils.chat import generate_chat_completion

    # The admin chose these base models for this function: access to the function is what is checked.
    return await generate_chat_completion(request, {**form, "stream": stream}, user, bypass_filter=True)


async def _read_open_webui_file(file_id: str, user_id: str) -> tuple[bytes | None, str]:
    """The bytes of an uploaded file, only if it belongs to this user (ids in a request are untrusted)."""
    from open_webui.models.files import Files
    from open_webui.storage.provider import Storage

    record = await Files.get_file_by_id_and_user_id(file_id, user_id)
    if record is None or not record.path:
        return None, ""
    local = await asyncio.to_thread(Storage.get_file, record.path)
    data = await asyncio.to_thread(Path(local).read_bytes)
    name = (record.meta or {}).get("name") or record.filename or file_id
    return data, name


async def _sandbox_notes(runner: Runner) -> tuple[str, ...]:
    try:
        return await runner.known_issues()
    except RunnerError:  # no sandbox at all: the run itself will say so, clearly, to model and user
        return ()


async def _model_events(response: Any) -> AsyncIterator:
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


def _status_emitter(emitter: Any) -> Any:
    async def status(description: str, done: bool) -> None:
        if emitter is not None:
            await emitter({"type": "status", "data": {"description": description, "done": done}})

    return status


async def _emit_files(emitter: Any, targets: list) -> None:
    items = [
        {"type": "image" if target.is_image else "file", "name": target.name, "url": target.url}
        for target in targets
    ]
    if items:
        await emitter({"type": "files", "data": {"files": items}})
