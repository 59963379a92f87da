"""What the three Open WebUI files (the Pipe, the Tool and the Filter) share: the valves that set up the
sessions, the one way they become the message's `engine.Settings` (`settings_from`), and the services
built from them (one store and one set of kernels per process), with the background loop that wakes
the engine's maintenance.

The valves' defaults are not written here: each comes from its one home, the layers' own models
(`engine.DEFAULTS`, which holds runner.Limits, runner.KernelSettings, storage.Quotas and
storage.Expiry), shown in the valves' units. A valve's "0: no limit" is None below (`_limit`).

Open WebUI loads each file as a module of its own, so nothing at module level of one file is seen by
another. Files bundled from the same sources share this module, though (the bundle's package name is
a hash of what it embeds), and the host's `shared` dict is process-wide: a Pipe and a Tool with the same
storage valves run on one `CodeSessions`. Across processes and versions they meet where every worker
already does: the store's locks, its `claim`s and the kernel registry.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from engine import (
    DEFAULTS,
    CodeSessions,
    LoopOptions,
    PromptFacts,
    Settings,
    code_span,
    escape_text,
    parse_purge,
    system_prompt,
    waiting_status,
)
from runner import KernelPool, KernelSettings, Limits, Runner, RunnerConfig, RunnerError
from storage import Expiry, Policy, Quotas, StorageError, Store
from webui import OpenWebUI

__all__ = ["SessionValves", "SessionsAdapter", "Status", "last_user_text", "settings_from"]

log = logging.getLogger("code_sessions.function")

MINUTE_S = 60.0
KiB = 1024
MiB = 1024 * KiB
DAY = 86400.0
# The folder name under Open WebUI's cache that older, /cache-served copies used: the same for every
# file, so that a Pipe, a Tool and a Filter build the same services.
LOCATION_ID = "code_sessions"
_PURGE_RETRYMINUTE_SS = 10  # a purge that keeps meeting chats mid-step gives up (and says so) after this
# A chat missing from Open WebUI this long (two looks a background tick apart) is deleted with its files.
_DELETED_AFTER_S = 50.0
_LOGGED_VALUE_CHARS = 200  # an admin's purge text is logged at most this long
_NOT_SAVED_PREFIXES = ("channel:",)  # chat ids Open WebUI never saves as chats (besides temporary ones)

_LIMITS, _QUOTAS, _EXPIRY = DEFAULTS.limits, DEFAULTS.policy.quotas, DEFAULTS.policy.expiry
_RUNNER = RunnerConfig()


def _whole(value: float) -> float:
    # A default shown in a valve's unit: 30, not 30.0, when it is a whole number of them.
    return int(value) if float(value).is_integer() else value


def _in(value: float | None, unit: float = 1) -> Any:
    """A layer's default in a valve's unit; a layer's None (no limit) is the valve's 0."""
    return 0 if value is None else _whole(value / unit)


def _limit(value: float, unit: float = 1) -> Any:
    """A valve's value in a layer's unit; the valve's 0 (no limit) is the layers' None."""
    return value * unit or None


class SessionValves(BaseModel):
    """The valves of a session: storage, the sandbox, limits, quotas, expiry, maintenance. The Pipe's
    valves extend these; the Tool's are these; the Filter reads the Tool's."""

    kernel: str = Field(
        default="persistent",
        description="persistent: each chat keeps a live Python kernel, so variables survive from run to "
        "run. fresh: every run starts a new sandbox (only files carry over).",
        json_schema_extra={"input": {"type": "select", "options": ["persistent", "fresh"]}},
    )
    kernel_idle_minutes: float = Field(
        default=_whole(DEFAULTS.kernels.idle_s / MINUTE_S),
        gt=0,
        le=24 * 60,
        description="A chat's kernel unused this long is saved to disk and stopped; its next run "
        "resumes it with its variables.",
    )
    max_kernels: int = Field(
        default=DEFAULTS.kernels.max_kernels,
        ge=1,
        le=1000,
        description="Kernels alive at once on this server; beyond, the least "
        "recently used idle one is saved to disk and stopped.",
    )
    max_saved_state_mb: int = Field(
        default=_in(DEFAULTS.kernels.max_image_bytes, MiB),
        ge=0,
        le=1024 * 1024,
        description="Largest saved kernel (its memory written to disk, next to the chat's files, "
        "not counted in the user's file quota). A larger one is lost, and its chat is told. "
        "0: kernels are never saved; an idle one is stopped and its variables are lost.",
    )
    max_saved_state_mb_per_user: int = Field(
        default=_in(DEFAULTS.kernels.max_saved_bytes_together, MiB),
        ge=0,
        description="All of a user's saved kernels together (several chats of one user cannot pass "
        "it). A save that would go over is lost, and its chat is told. 0: no limit.",
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
    timeout_seconds: float = Field(default=_LIMITS.timeout_s, gt=0, le=3600, description="Wall time per run.")
    memory_mb: int = Field(default=_LIMITS.memory_mb, ge=64, description="Memory per run.")
    max_processes: int = Field(
        default=_LIMITS.max_processes, ge=4, description="Processes/threads per run (fork bombs)."
    )
    max_output_kb: int = Field(
        default=_in(_LIMITS.max_output_bytes, KiB), ge=1, description="stdout and stderr kept per run, each."
    )
    network: bool = Field(
        default=DEFAULTS.network,
        description="Let sandboxed code use the network. Needs network_namespace (see docs/runner.md).",
    )
    network_namespace: str = Field(
        default="",
        description="A network namespace prepared for the sandbox, e.g. /var/run/netns/code-sessions.",
    )
    max_files_per_user: int = Field(
        default=_in(_QUOTAS.max_files_per_user), ge=0, description="All of a user's chats. 0: no limit."
    )
    max_mb_per_user: int = Field(
        default=_in(_QUOTAS.max_bytes_per_user, MiB), ge=0, description="All of a user's chats. 0: no limit."
    )
    max_file_mb: int = Field(
        default=_in(_QUOTAS.max_file_bytes, MiB), ge=0, description="Largest single file. 0: no limit."
    )
    max_new_files_per_run: int = Field(
        default=_in(_QUOTAS.max_new_files_per_run), ge=0, description="0: no limit."
    )
    file_max_age_days: float = Field(
        default=_in(_EXPIRY.file_max_age_s, DAY),
        ge=0,
        description="Files older than this are deleted. 0: never.",
    )
    session_idle_days: float = Field(
        default=_in(_EXPIRY.session_idle_s, DAY),
        ge=0,
        description="A chat's folder unused this long is deleted. 0: never.",
    )
    temporary_idle_minutes: float = Field(
        default=_in(_EXPIRY.temporary_idle_s, MINUTE_S),
        ge=1,
        description="Folders of temporary chats are deleted after this much idle time.",
    )
    cleanup_interval_minutes: float = Field(
        default=_whole(DEFAULTS.cleanup_every_s / MINUTE_S),
        ge=1,
        description="Expiry runs at least this often while Open WebUI is up.",
    )
    purge: str = Field(
        default=DEFAULTS.purge,
        description="One-shot admin purge, run at the next message or within a minute (a chat mid-step "
        "is retried a minute later), then cleared: "
        "'all', 'user:<user id>', 'chat:<chat id>' or 'idle:<duration>' such as idle:7d, idle:12h.",
    )
    attach_files: bool = Field(
        default=DEFAULTS.attach_files,
        description="Show an answer's files as attachments of its message (and let the people a chat "
        "is shared with open them). Off: a file a run saved that the answer does not name is named in "
        "one line at the end of the answer instead.",
    )
    runsc_path: str = Field(default=_RUNNER.runsc_path, description="The gVisor runsc binary.")
    runsc_platform: str = Field(default="", description="Empty: detect (systrap if supported, else ptrace).")


def settings_from(valves: SessionValves) -> Settings:
    """The message's settings, built once from the valves in force: the one way the Pipe, the Tool
    and the Filter do it."""
    return Settings(
        limits=Limits(
            timeout_s=valves.timeout_seconds,
            memory_mb=valves.memory_mb,
            max_processes=valves.max_processes,
            max_output_bytes=valves.max_output_kb * KiB,
            max_file_bytes=_limit(valves.max_file_mb, MiB),
        ),
        policy=Policy(
            Quotas(
                max_files_per_user=_limit(valves.max_files_per_user),
                max_bytes_per_user=_limit(valves.max_mb_per_user, MiB),
                max_file_bytes=_limit(valves.max_file_mb, MiB),
                max_new_files_per_run=_limit(valves.max_new_files_per_run),
            ),
            Expiry(
                file_max_age_s=_limit(valves.file_max_age_days, DAY),
                session_idle_s=_limit(valves.session_idle_days, DAY),
                temporary_idle_s=valves.temporary_idle_minutes * MINUTE_S,
            ),
        ),
        kernels=KernelSettings(
            idle_s=valves.kernel_idle_minutes * MINUTE_S,
            max_kernels=valves.max_kernels,
            max_image_bytes=valves.max_saved_state_mb * MiB,  # 0 is its own: kernels are never saved
            max_saved_bytes_together=_limit(valves.max_saved_state_mb_per_user, MiB),
        ),
        network=valves.network,
        attach_files=valves.attach_files,
        cleanup_every_s=valves.cleanup_interval_minutes * MINUTE_S,
        purge=valves.purge,
    )


class SessionsAdapter:
    """The part of each Open WebUI file that is the same for all three: its services, the message's
    settings and the background loop. A subclass says where its valves are saved (`_read_settings`,
    `_write_settings`) and sets `settings` (the valves) before each use."""

    # How long the background loop's "minute" lasts, and how long a chat must be missing from Open
    # WebUI before its files go (tests shorten both on an instance).
    minute_s: float = MINUTE_S
    deleted_after_s: float = _DELETED_AFTER_S

    def __init__(self) -> None:
        # Everything asked of Open WebUI goes through this one object (a test harness replaces it).
        self._host = OpenWebUI()
        self._services: CodeSessions | None = None
        self._services_key: tuple | None = None
        self._function_id: str | None = None
        self._purge_pending: tuple[str, float, float] | None = None  # request, first and last try
        self._background: asyncio.Task | None = None

    @property
    def settings(self) -> SessionValves:
        """The session valves in force now (the Pipe's and the Tool's own valves; the Tool's for the
        Filter)."""
        return self.valves  # type: ignore[attr-defined]

    @settings.setter
    def settings(self, value: SessionValves) -> None:
        self.valves = value

    async def _read_settings(self) -> dict:
        """The settings as saved now (the background loop is not called by Open WebUI, so it reads
        them); empty when this file does not know its id yet."""
        if not self._function_id:
            return {}
        return await self._host.stored_valves(self._function_id)

    async def _write_settings(self, stored: dict) -> None:
        if self._function_id:
            await self._host.store_valves(self._function_id, stored)

    async def _begin(self) -> tuple[CodeSessions, Settings]:
        """A message's start, the same in the three files: its settings (built once, here), the
        services for them, the background loop kept running, and a purge the valves ask for run now
        rather than a minute later. Raises webui.Misconfigured for valves it cannot run with."""
        settings = settings_from(self.settings)
        services = await self._services_for_valves()
        self._keep_background_running()
        if settings.purge.strip():
            await self._purge_now(services)
        return services, settings

    # ---- composition --------------------------------------------------------------------------------

    async def _services_for_valves(self) -> CodeSessions:
        """The store and runner for the current valves (rebuilt only when a valve they are built from
        changes). The message's settings reach them through `CodeSessions.chat`."""
        valves = self.settings
        places = self._host.locations(valves.storage_root, LOCATION_ID)
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
        if self._services is None or key != self._services_key:
            services = await self._shared_services(key, valves, places, index_url)
            old, self._services, self._services_key = self._services_key, services, key
            if old is not None and old != key:
                await self._release_services(old)
        return self._services

    async def _shared_services(self, key: tuple, valves: SessionValves, places: Any, index_url: str) -> Any:
        """The services for `key`, made once per process whichever file asks first (a Pipe and a Tool
        with the same storage valves share one store and one set of kernels)."""
        shared = self._host.shared()
        async with _shared_lock(shared):
            entry = shared.get(_in_loop(key))
            if entry is None:
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
                entry = shared[_in_loop(key)] = [CodeSessions(store, runner, kernels=kernels), 0]
                if kernels is not None:
                    _save_kernels_before_stop(shared)
            entry[1] += 1
            return entry[0]

    async def _release_services(self, key: tuple) -> None:
        """This file no longer uses the services for `key` (a valve changed): the last user closes them."""
        shared = self._host.shared()
        async with _shared_lock(shared):
            entry = shared.get(_in_loop(key))
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del shared[_in_loop(key)]
        await entry[0].close()

    async def release(self) -> None:
        """Stop using the services (what the end of the process does; the last user closes them)."""
        self._cancel_background()
        if self._services_key is not None:
            key, self._services, self._services_key = self._services_key, None, None
            await self._release_services(key)

    def _cancel_background(self) -> None:
        if self._background is not None:
            self._background.cancel()
            self._background = None

    def _keep_background_running(self) -> None:
        if self._background is None or self._background.done():
            self._background = asyncio.create_task(self._background_loop())

    async def _background_loop(self) -> None:
        # Wakes every minute and reads the saved valves: a purge typed into the valves runs within a
        # minute even if no message comes, and a shorter cleanup interval applies at once.
        while True:
            await asyncio.sleep(self.minute_s)
            try:
                await self._tick()
            except Exception:  # the loop must outlive a bad tick; the next one retries
                log.exception("code-sessions background cleanup failed")

    async def _tick(self) -> None:
        """One background tick, with the valves as saved now."""
        stored = await self._read_settings()
        if stored:
            self.settings = type(self.settings)(**{k: v for k, v in stored.items() if v is not None})
        services = await self._services_for_valves()
        await self._maintain(services, settings_from(self.settings))

    async def _maintain(self, services: CodeSessions, settings: Settings) -> None:
        """One background tick: in every worker, what a dead worker's sandboxes left; then an admin's
        purge, chats deleted in Open WebUI, and expiry when it is due, by one worker (of every
        replica) at a time, under a lock every process of the store shares (the expiry interval is
        kept in the index, so several workers expire once)."""
        # Every worker, every tick: what the runs of a dead worker of this host left (its sandboxes
        # died with it; their container state, bundles and cgroups did not). Only dead owners' runs.
        try:
            await services.runner.sweep_leftovers()
        except RunnerError as error:  # no usable runsc: a run says so in words; nothing to sweep
            log.debug("code-sessions: no sweep of sandbox leftovers: %s", error)
        lock = services.store.lock("maintenance")
        if not await lock.try_acquire():
            return  # another worker (or replica) is on it
        try:
            await self._run_requested_purge(services, fresh=True)
            # Every file of every worker ticks: the look at Open WebUI's chats is shared out like expiry.
            if await services.store.claim("deleted-chats", self.minute_s * 0.9):
                await self._forget_deleted_chats(services)
            every = settings.cleanup_every_s / MINUTE_S * self.minute_s
            if await services.store.claim("expiry", every):
                report = await services.expire(settings)
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
        gone = await services.store.mark_missing(missing, after_s=self.deleted_after_s)
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
        if fresh:
            stored = await self._read_settings()
            if stored or self._function_id:
                self.settings = self.settings.model_copy(update={"purge": str(stored.get("purge") or "")})
        request = self.settings.purge.strip()
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
            if pending and now - pending[2] < self.minute_s:
                return  # a request that met a chat mid-step is retried once a minute, not per message
            report = await services.purge(purge)
            first_try = pending[1] if pending else now
            if report.sessions_in_use and now - first_try < _PURGE_RETRYMINUTE_SS * self.minute_s:
                # A chat mid-step was skipped; its step ends within the time limit, so keep the
                # request and let the next minute finish the job.
                self._purge_pending = (request, first_try, now)
                log.warning("code-sessions purge %r: %s; retrying within a minute", shown, report.summary())
                return
            log.warning("code-sessions purge %r: %s", shown, report.summary())
        self._purge_pending = None
        # Clear the one-shot valve so the purge does not run again at the next message.
        self.settings = self.settings.model_copy(update={"purge": ""})
        stored = await self._read_settings()
        if str(stored.get("purge") or "").strip() == request:
            await self._write_settings({**stored, "purge": ""})

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
            await status(f"Copied {name} to /mnt/data/{path}", True, hidden=True)  # the answer says so
            notes.append(f"_Attached file available as {code_span('/mnt/data/' + path)}._\n\n")
        return notes, refused

    async def _messages_with_prompt(
        self,
        messages: list[dict],
        chat: Any,
        services: CodeSessions,
        options: LoopOptions,
        notes: list[str],
        *,
        figures_shown: bool = True,
    ) -> list[dict]:
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
            tools=sandbox.tools,
            figures_shown=figures_shown,
        )
        prompt = system_prompt(facts)
        history = [dict(message) for message in await chat.sandbox_view(messages)]
        if history and history[0].get("role") == "system" and isinstance(history[0].get("content"), str):
            history[0]["content"] = prompt + "\n\n" + history[0]["content"]
        else:
            history.insert(0, {"role": "system", "content": prompt})
        return history


def _in_loop(key: tuple) -> tuple:
    # Services belong to the event loop they were made in (their tasks, their connections' futures).
    return (id(asyncio.get_running_loop()), *key)


def _shared_lock(shared: dict) -> asyncio.Lock:
    """One lock per process and loop: two first messages at once (to any of the files) must not open
    two stores."""
    key = ("lock", id(asyncio.get_running_loop()))
    lock = shared.get(key)
    if lock is None:
        lock = shared[key] = asyncio.Lock()
    return lock


# ---- small helpers --------------------------------------------------------------------------------------


def last_user_text(messages: list[dict]) -> str:
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


@dataclass(frozen=True)
class _SandboxFacts:
    notes: tuple[str, ...] = ()
    packages: tuple[tuple[str, str], ...] = ()
    tools: tuple[str, ...] = ()


async def _sandbox_facts(runner: Runner) -> _SandboxFacts:
    """What the prompt says of the sandbox: quirks, packages, tools. None of it without a sandbox at
    all: the run itself will say so, clearly, to model and user."""
    try:
        env = await runner.environment()
        return _SandboxFacts(await runner.known_issues(), await runner.packages(), env.tools)
    except RunnerError:
        return _SandboxFacts()


def _save_kernels_before_stop(shared: dict) -> None:
    """Open WebUI's server (uvicorn) handles SIGTERM and SIGINT by ending its event loop, which closes
    the kernels' pipes, and then raises the signal again, so no exit handler runs: every kernel would
    die with its state. So the stop signal first saves this process's idle kernels (KernelPool.close:
    within 8 s, as a container's stop timeout is usually 10 s), every file's, then goes on to the
    server's own handler. A second signal stops at once. Hooked once per process (`shared` is the
    process's), and only from the main thread, where uvicorn installed its handlers; elsewhere (a test
    harness) nothing is changed."""
    if shared.get("code-sessions:stop-hooked"):
        return
    shared["code-sessions:stop-hooked"] = True
    loop = asyncio.get_running_loop()
    stopping = [False]

    def chained(previous: Any) -> Any:
        def handler(signum: int, frame: Any) -> None:
            if stopping[0]:
                previous(signum, frame)
                return
            stopping[0] = True

            async def save_then_stop() -> None:
                try:
                    for entry in list(shared.values()):
                        services = entry[0] if isinstance(entry, list) and entry else None
                        kernels = getattr(services, "kernels", None)
                        if kernels is not None:
                            await kernels.close()
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


class Status:
    """The message's status line (engine.StatusCall). Open WebUI 0.12 shows a message's last status,
    and nothing when that one is hidden."""

    def __init__(self, emitter: Any) -> None:
        self._emit = emitter
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
