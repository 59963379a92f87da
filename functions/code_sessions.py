# Open WebUI adapter for code-sessions: a manifold Pipe that gives each chat a persistent /mnt/data folder,
# runs the model's code there in gVisor and turns /mnt/data paths in the answer into download links.
#
# This file is the adapter: valves, the Pipe's entry point, and the background loop. Sessions, the index,
# quotas and links live in `storage`; the sandbox in `runner`; the chat step and the conversation loop in
# `engine`; every question to Open WebUI itself in `webui`. `tools/bundle.py` embeds those packages so
# that Open WebUI gets one file (dist/code_sessions.py).
#
# No `from __future__` import here: in the bundle this module's body does not start the file.

import asyncio
import json
import logging
import os
import signal
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
    escape_text,
    events_from_message,
    events_from_sse,
    parse_purge,
    system_prompt,
    waiting_status,
)
from runner import KernelPool, Limits, Runner, RunnerConfig, RunnerError
from storage import (
    CLEAR_FILES_COMMAND,
    Expiry,
    Policy,
    Quotas,
    StorageError,
    Store,
)
from webui import Misconfigured, OpenWebUI

log = logging.getLogger("code_sessions.function")

_MB = 1024 * 1024
_MINUTE = 60.0
_DAY = 86400.0
_NO_LIMIT = 1 << 40  # what "0: no limit" becomes where the sandbox needs a number
_PURGE_RETRY_MINUTES = 10  # a purge that keeps meeting chats mid-step gives up (and says so) after this
# A chat missing from Open WebUI this long (two looks a background tick apart) is deleted with its files.
_DELETED_AFTER_S = 50.0
_LOGGED_VALUE_CHARS = 200  # an admin's purge text is logged at most this long
_NOT_SAVED_PREFIXES = ("channel:",)  # chat ids Open WebUI never saves as chats (besides temporary ones)


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
        kernel: str = Field(
            default="persistent",
            description="persistent: each chat keeps a live Python kernel, so variables survive from run to "
            "run. fresh: every run starts a new sandbox (only files carry over).",
            json_schema_extra={"input": {"type": "select", "options": ["persistent", "fresh"]}},
        )
        kernel_idle_minutes: float = Field(
            default=20,
            gt=0,
            le=24 * 60,
            description="A chat's kernel unused this long is saved to disk and stopped; its next run "
            "resumes it with its variables.",
        )
        max_kernels: int = Field(
            default=20,
            ge=1,
            le=1000,
            description="Kernels alive at once on this server; beyond, the least "
            "recently used idle one is saved to disk and stopped.",
        )
        max_saved_state_mb: int = Field(
            default=2048,
            ge=0,
            le=1024 * 1024,
            description="Largest saved kernel (its memory written to disk, next to the chat's files, "
            "not counted in the user's file quota). A larger one is lost, and its chat is told. "
            "0: kernels are never saved; an idle one is stopped and its variables are lost.",
        )
        warm_start: bool = Field(
            default=True,
            description="A new chat's kernel starts from a template with numpy, pandas and matplotlib "
            "already imported (made once per server; a live kernel then holds about 100 MB more memory, "
            "a data chat's first step is several times faster).",
        )
        storage_root: str = Field(
            default="",
            description="Folder for the chats' files (and the SQLite index). Empty: "
            "<DATA_DIR>/code_sessions. Never inside <DATA_DIR>/cache, which Open WebUI serves to every "
            "logged-in user. With several replicas: one shared folder every replica mounts at this path.",
        )
        index_database: str = Field(
            default="",
            description="Where the file index lives. Empty: Open WebUI's own database when it is "
            "PostgreSQL (tables in a schema code_sessions; needed with several replicas), else an SQLite "
            "file in storage_root. sqlite: always that file. Or a postgresql:// URL.",
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
            default=True,
            description="Also show the files an answer links as attachments of its message (and let the "
            "people a chat is shared with open them).",
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
        # Everything asked of Open WebUI goes through this one object (a test harness replaces it).
        self._host = OpenWebUI()
        self._services: CodeSessions | None = None
        self._services_key: tuple | None = None
        self._services_lock = asyncio.Lock()  # two first messages at once must not open two stores
        self._function_id: str | None = None
        self._purge_pending: tuple[str, float, float] | None = None  # request, first and last try
        self._background: asyncio.Task | None = None
        self._stop_hooked = False
        self._stopping = False

    # ---- models -------------------------------------------------------------------------------------

    def pipes(self) -> list[dict]:
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
        body: dict,
        __user__: dict,
        __request__: Any = None,
        __event_emitter__: Any = None,
        __chat_id__: str | None = None,
        __task__: str | None = None,
        __files__: list | None = None,
        __message_id__: str | None = None,
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
            services = await self._services_for_valves()
        except Misconfigured as error:  # the admin's to fix; the user gets the sentence, not a crash
            return f"Code Sessions is not set up correctly: {error}"
        self._keep_background_running()
        if self.valves.purge.strip():  # at the next message, not a minute later
            await self._purge_now(services)
        try:
            chat = await services.chat(__user__["id"], __chat_id__ or "")
        except StorageError as error:  # a new chat on a full disk, an id the index refuses
            log.warning("code-sessions: no session for chat %r: %s", (__chat_id__ or "")[:80], error)
            return f"This chat's files are not available right now: {escape_text(str(error))}"
        status = _status_emitter(__event_emitter__)
        if _last_user_text(body.get("messages", [])).strip() == CLEAR_FILES_COMMAND:
            return await chat.clear_files(waiting=waiting_status(status))

        notes, refused = await self._import_uploads(chat, __user__["id"], __files__ or [], status)
        user_valves = __user__.get("valves") or self.UserValves()
        options = LoopOptions(
            tool_mode=self.valves.execution_mode != "fenced",
            max_steps=self.valves.max_steps,
            show_code=bool(getattr(user_valves, "show_code", True)),
            show_output=bool(getattr(user_valves, "show_output", True)),
        )
        messages = await self._messages_with_prompt(
            body.get("messages", []), chat, services, options, refused
        )

        async def call_model(history: list[dict], tools: list[dict] | None) -> AsyncIterator:
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
            async for piece in converse(chat, messages, call_model, options, status):
                yield piece
            if self.valves.attach_files:
                await host.attach(
                    __chat_id__ or "", __message_id__, __user__["id"], chat.links, __event_emitter__
                )

        return answer()

    # ---- composition --------------------------------------------------------------------------------

    async def _services_for_valves(self) -> CodeSessions:
        """The store and runner for the current valves (rebuilt only when a valve they are built from
        changes), with the current limits and policy applied."""
        valves = self.valves
        places = self._host.locations(valves.storage_root, self._function_id or "code_sessions")
        index_url = self._host.index_url(valves.index_database)
        key = (
            str(places.root),
            index_url,
            str(places.publish_dir),
            valves.runsc_path,
            valves.runsc_platform,
            valves.network,
            valves.network_namespace,
            valves.kernel,
            valves.warm_start,
        )
        async with self._services_lock:
            if self._services is None or key != self._services_key:
                if self._services is not None:
                    await self._services.close()
                runner = Runner(
                    RunnerConfig(
                        runsc_path=valves.runsc_path,
                        platform=valves.runsc_platform or None,
                        network=valves.network,
                        netns_path=Path(valves.network_namespace) if valves.network_namespace else None,
                    )
                )
                owner = (runner.sandbox_uid, runner.sandbox_gid) if os.geteuid() == 0 else None
                store = Store(
                    places.root, publisher=self._host.publisher(places), owner=owner, database_url=index_url
                )
                await store.open()
                kernels = None
                if valves.kernel != "fresh":
                    kernels = KernelPool(runner, places.root / "kernels", warm_start=valves.warm_start)
                self._services = CodeSessions(store, runner, Limits(), kernels=kernels)
                self._services_key = key
                if kernels is not None:
                    self._save_kernels_before_stop()
        services = self._services
        services.store.policy = _policy(valves)
        services.limits = _limits(valves)
        if services.kernels is not None:
            services.kernels.idle_s = valves.kernel_idle_minutes * _MINUTE
            services.kernels.max_kernels = valves.max_kernels
            services.kernels.max_image_bytes = valves.max_saved_state_mb * 1024 * 1024
        return services

    def _save_kernels_before_stop(self) -> None:
        """Open WebUI's server (uvicorn) handles SIGTERM and SIGINT by ending its event loop, which
        closes the kernels' pipes, and then raises the signal again, so no exit handler runs: every
        kernel would die with its state. So the stop signal first saves this process's idle kernels
        (KernelPool.close: within 8 s, as a container's stop timeout is usually 10 s), then goes on to
        the server's own handler. A second signal stops at once. Only from the main thread, where
        uvicorn installed its handlers; elsewhere (a test harness) nothing is changed."""
        if self._stop_hooked:
            return
        self._stop_hooked = True
        loop = asyncio.get_running_loop()

        def chained(previous: Any) -> Any:
            def handler(signum: int, frame: Any) -> None:
                if self._stopping:
                    previous(signum, frame)
                    return
                self._stopping = True

                async def save_then_stop() -> None:
                    try:
                        services = self._services
                        if services is not None and services.kernels is not None:
                            await services.kernels.close()
                    except Exception:
                        log.exception("code-sessions: saving the kernels before the stop failed")
                    finally:
                        previous(signum, frame)

                loop.call_soon_threadsafe(lambda: loop.create_task(save_then_stop()))

            return handler

        for sig in (signal.SIGTERM, signal.SIGINT):
            previous = signal.getsignal(sig)
            if not callable(previous):
                continue  # no graceful handler to chain to: the default stop stays as it is
            try:
                signal.signal(sig, chained(previous))
            except ValueError:  # not the main thread
                return

    def _keep_background_running(self) -> None:
        if self._background is None or self._background.done():
            self._background = asyncio.create_task(self._background_loop())

    async def _background_loop(self) -> None:
        # Wakes every minute and reads the saved valves: a purge typed into the valves runs within a
        # minute even if no message comes, and a shorter cleanup interval applies at once.
        while True:
            await asyncio.sleep(_MINUTE)
            try:
                if self._function_id:
                    stored = await self._host.stored_valves(self._function_id)
                    if stored:
                        self.valves = self.Valves(**{k: v for k, v in stored.items() if v is not None})
                services = await self._services_for_valves()
                await self._tick(services)
            except Exception:  # the loop must outlive a bad tick; the next one retries
                log.exception("code-sessions background cleanup failed")

    async def _tick(self, services: CodeSessions) -> None:
        """One background tick: an admin's purge, chats deleted in Open WebUI, and expiry when it is
        due. One worker (of every replica) at a time does it, under a lock every process of the store
        shares, and the expiry interval is kept in the index, so several workers expire once."""
        lock = services.store.lock("maintenance")
        if not await lock.try_acquire():
            return  # another worker (or replica) is on it
        try:
            await self._run_requested_purge(services, fresh=True)
            await self._forget_deleted_chats(services)
            every = self.valves.cleanup_interval_minutes * _MINUTE
            if await services.store.claim("expiry", every):
                report = await services.expire()
                log.info("code-sessions cleanup: %s", report.summary())
        finally:
            await lock.release()

    async def _forget_deleted_chats(self, services: CodeSessions) -> None:
        """Delete the folders, links (and kernels) of chats deleted in Open WebUI: a Pipe hears of no
        deletion, so every tick asks, in one batched query, which of our chats still exist.

        A chat counts as deleted only when two looks at least _DELETED_AFTER_S apart both miss it:
        a chat being created in the meantime (or a database answer that was briefly wrong) never
        loses its folder."""
        # Temporary chats and channels have no chat row in Open WebUI: they expire by idle time instead.
        saved = [
            (user, chat)
            for user, chat, _, temporary in await services.store.chats()
            if not temporary and not chat.startswith(_NOT_SAVED_PREFIXES)
        ]
        if not saved:
            return
        owners = await self._host.chat_owners(sorted({chat for _, chat in saved}))
        missing = [(user, chat) for user, chat in saved if owners.get(chat) != user]
        gone = await services.store.mark_missing(missing, after_s=_DELETED_AFTER_S)
        if gone:
            report = await services.forget_chats(gone, "the chat was deleted in Open WebUI")
            log.info("code-sessions: %d chats deleted in Open WebUI: %s", len(gone), report.summary())

    async def _purge_now(self, services: CodeSessions) -> None:
        lock = services.store.lock("maintenance")
        if not await lock.try_acquire():
            return  # another worker is doing maintenance: it runs the purge
        try:
            await self._run_requested_purge(services, fresh=True)
        finally:
            await lock.release()

    async def _run_requested_purge(self, services: CodeSessions, *, fresh: bool) -> None:
        """Run the purge the valve asks for (call it holding the maintenance lock). `fresh`: read the
        valve as saved now: another worker may have run and cleared it a moment ago."""
        if fresh and self._function_id:
            stored = await self._host.stored_valves(self._function_id)
            self.valves = self.valves.model_copy(update={"purge": str(stored.get("purge") or "")})
        request = self.valves.purge.strip()
        if not request:
            return
        shown = _shorten(request)
        try:
            purge = parse_purge(request)
        except ValueError as error:
            log.error("code-sessions: ignoring purge valve %r: %s", shown, _shorten(str(error)))
        else:
            now = time.monotonic()
            pending = self._purge_pending
            if pending and pending[0] != request:
                pending = None  # the admin typed a new request: it starts afresh
            if pending and now - pending[2] < _MINUTE:
                return  # a request that met a chat mid-step is retried once a minute, not per message
            report = await services.purge(purge)
            first_try = pending[1] if pending else now
            if report.sessions_in_use and now - first_try < _PURGE_RETRY_MINUTES * _MINUTE:
                # A chat mid-step was skipped; its step ends within the time limit, so keep the
                # request and let the next minute finish the job.
                self._purge_pending = (request, first_try, now)
                log.warning("code-sessions purge %r: %s; retrying within a minute", shown, report.summary())
                return
            log.warning("code-sessions purge %r: %s", shown, report.summary())
        self._purge_pending = None
        # Clear the one-shot valve so the purge does not run again at the next message.
        self.valves = self.valves.model_copy(update={"purge": ""})
        if self._function_id:
            stored = await self._host.stored_valves(self._function_id)
            if stored.get("purge", "").strip() == request:
                await self._host.store_valves(self._function_id, {**stored, "purge": ""})

    # ---- the parts of a message ---------------------------------------------------------------------

    async def _import_uploads(
        self, chat: Any, user_id: str, files: list, status: Any
    ) -> tuple[list[str], list[str]]:
        """Copy the chat's attachments into /mnt/data, once each. Returns the notes for the answer and
        the sentences about attachments that could not be taken (said once: the next message carries
        the same attachment, and it is not tried again)."""
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
                try:
                    data, name = await self._host.read_upload(file_id, user_id)
                except Exception as error:  # Open WebUI's storage providers raise what they like
                    log.warning("code-sessions: attachment %s could not be read: %s", file_id, error)
                    raise OSError(f"Open WebUI could not read it: {error}") from error
                if data is None:
                    continue  # not this user's file, or gone: nothing to say about someone else's id
                path = await chat.add_upload(name, data, source=source, waiting=waiting_status(status))
            except (StorageError, OSError) as error:
                why = str(error) if isinstance(error, StorageError) else f"it could not be read ({error})"
                if not await chat.refuse_upload(source, why):
                    continue
                refused.append(f"The attachment {name} was not copied into /mnt/data: {why}")
                shown = (
                    f"The attachment {escape_text(name)} was not copied into /mnt/data: {escape_text(why)}"
                )
                notes.append(f"_{shown}_\n\n")
                continue
            await status(f"Copied {name} to /mnt/data/{path}", True)
            notes.append(f"_Attached file available as {code_span('/mnt/data/' + path)}._\n\n")
        return notes, refused

    async def _messages_with_prompt(
        self, messages: list[dict], chat: Any, services: CodeSessions, options: LoopOptions, notes: list[str]
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
            sandbox_notes=(*await _sandbox_notes(services.runner), *notes),
            kernel_idle_minutes=self.valves.kernel_idle_minutes if services.kernels is not None else None,
            packages=await _packages(services.runner),
        )
        prompt = system_prompt(facts)
        history = [dict(message) for message in await chat.sandbox_view(messages)]
        if history and history[0].get("role") == "system" and isinstance(history[0].get("content"), str):
            history[0]["content"] = prompt + "\n\n" + history[0]["content"]
        else:
            history.insert(0, {"role": "system", "content": prompt})
        return history


# ---- settings from valves --------------------------------------------------------------------------------


def _policy(valves: Any) -> Policy:
    return Policy(
        Quotas(
            max_files_per_user=valves.max_files_per_user,
            max_bytes_per_user=valves.max_mb_per_user * _MB,
            max_file_bytes=valves.max_file_mb * _MB,
            max_new_files_per_run=valves.max_new_files_per_run,
        ),
        Expiry(
            file_max_age_s=valves.file_max_age_days * _DAY or None,
            session_idle_s=valves.session_idle_days * _DAY or None,
            temporary_idle_s=valves.temporary_idle_minutes * _MINUTE,
        ),
    )


def _limits(valves: Any) -> Limits:
    return Limits(
        timeout_s=valves.timeout_seconds,
        memory_mb=valves.memory_mb,
        max_processes=valves.max_processes,
        max_output_bytes=valves.max_output_kb * 1024,
        max_file_bytes=valves.max_file_mb * _MB or _NO_LIMIT,
    )


# ---- small helpers --------------------------------------------------------------------------------------


def _last_user_text(messages: list[dict]) -> str:
    for message in reversed(messages):
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
            return ""
    return ""


def _shorten(text: str, limit: int = _LOGGED_VALUE_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


async def _sandbox_notes(runner: Runner) -> tuple[str, ...]:
    try:
        return await runner.known_issues()
    except RunnerError:  # no sandbox at all: the run itself will say so, clearly, to model and user
        return ()


async def _packages(runner: Runner) -> tuple[tuple[str, str], ...]:
    try:
        return await runner.packages()
    except RunnerError:
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
