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
storage valves run on one `Engine`. Across processes and versions they meet where every worker
already does: the store's locks, its `claim`s and the kernel registry.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, Field

from engine import (
    DEFAULTS,
    MINUTE_S,
    BranchSettings,
    Emit,
    Engine,
    Host,
    Maintenance,
    Message,
    Origin,
    Place,
    Places,
    Settings,
    Turns,
)
from functions.inbound import serve_uploads
from runner import KernelPool, KernelSettings, Limits, Runner, RunnerConfig
from storage import DAY, Expiry, KiB, MiB, Policy, Quotas, Store
from webui import OpenWebUI

__all__ = [
    "Adapter",
    "HeldValves",
    "SharedServices",
    "SharedValves",
    "message_of",
    "place_of",
    "settings_from",
]

log = logging.getLogger("code_sessions.function")

# The folder name under Open WebUI's cache that older, /cache-served copies used: the same for every
# file, so that a Pipe, a Tool and a Filter build the same services.
LOCATION_ID = "code_sessions"

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


class SharedValves(BaseModel):
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
        description="A chat's kernel unused this long is saved to disk and stopped, freeing its memory; "
        "its next run resumes it with its variables (in about half a second).",
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
        description="A new chat whose first cell imports a package (or is bash) starts from a "
        "template with numpy, pandas and matplotlib already imported (made once per server): its "
        "first data step is several times faster, and its kernel holds about 240 MiB less memory "
        "than one that imported them itself. A first cell of plain Python starts a lighter kernel.",
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
    branch_states: int = Field(
        default=DEFAULTS.branches.states,
        ge=0,
        le=1000,
        description="Answers per chat whose files and Python state are kept, so that "
        "regenerating or editing a message, or going back to another branch, continues from that "
        "message's state. They count toward the user's storage after the files, and the oldest go "
        "first when it is full. 0: the folder is the chat's whole, whatever the branch, and no run is "
        "recorded for a notebook export.",
    )
    branch_python_states: int = Field(
        default=DEFAULTS.branches.python_states,
        ge=0,
        le=100,
        description="Of those, how many of the newest also keep the Python state (a copy of the "
        "kernel's memory each, counted in the user's storage: when it is full, the oldest Python states "
        "go first). 0: a branch gets its files back, and a new Python state.",
    )
    attach_files: bool = Field(
        default=DEFAULTS.attach_files,
        description="Show an answer's files as attachments of its message (and let the people a chat "
        "is shared with open them). Off: a file a run saved that the answer does not name is named in "
        "one line at the end of the answer instead.",
    )
    upload_link_minutes: float = Field(
        default=_whole(DEFAULTS.upload_link_s / MINUTE_S),
        gt=0,
        le=24 * 60,
        description="An upload link the model offers (one file, one use, into one path of the chat) "
        "works this long.",
    )
    runsc_path: str = Field(default=_RUNNER.runsc_path, description="The gVisor runsc binary.")
    runsc_platform: str = Field(default="", description="Empty: detect (systrap if supported, else ptrace).")
    kernel_platform: str = Field(
        default=_RUNNER.kernel_platform or "",
        description="gVisor platform of the live kernels: ptrace, whose idle kernel uses no CPU (an idle "
        "systrap kernel uses about 1.5% of a core). Empty: the same as runsc_platform.",
    )


def settings_from(valves: SharedValves) -> Settings:
    """The message's settings, built once from the valves in force: the one way the Pipe, the Tool
    and the Filter do it."""
    return Settings(
        limits=Limits(
            timeout_s=valves.timeout_seconds,
            memory_mb=valves.memory_mb,
            max_processes=valves.max_processes,
            max_output_bytes=valves.max_output_kb * KiB,
        ),  # the per-file size is the quota's, lowered into each run's limits (ChatSession.run)
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
        branches=BranchSettings(states=valves.branch_states, python_states=valves.branch_python_states),
        cleanup_every_s=valves.cleanup_interval_minutes * MINUTE_S,
        purge=valves.purge,
        upload_link_s=valves.upload_link_minutes * MINUTE_S,
    )


@dataclass(eq=False)
class SharedServices:
    """The services of one set of storage valves in a process (`OpenWebUI.shared`), and how many of
    the function's files use them: the engine and the turns in progress on it."""

    turns: Turns
    users: int = 0

    @property
    def services(self) -> Engine:
        return self.turns.services


class ValvesHolder(Protocol):
    """Whose `valves` an adapter's settings are: the Pipe itself, the Tool, or `HeldValves`."""

    valves: SharedValves


@dataclass(eq=False)
class HeldValves:
    """The settings of a file whose own valves are not session valves (the Filter's are the Tool's
    saved ones, the Action's the Pipe's or the Tool's): held here, read as saved at each use."""

    valves: SharedValves = field(default_factory=SharedValves)


class Adapter:
    """The part of each Open WebUI file that is the same for all of them: its services, the message's
    settings and the background loop. A subclass says where its valves are saved (`_read_settings`,
    `_write_settings`); `holder` is whose `valves` are its settings (None: its own)."""

    valves: SharedValves

    def __init__(self, holder: ValvesHolder | None = None) -> None:
        self._holder: ValvesHolder = self if holder is None else holder
        # Everything asked of Open WebUI goes through one object (`_host`; a test harness replaces it),
        # which the engine's maintenance asks too.
        host: Host = OpenWebUI()
        self.maintenance = Maintenance(host, _PurgeValve(self))
        self._turns: Turns | None = None
        self._services_key: tuple[object, ...] | None = None
        self._function_id: str | None = None
        self._background: asyncio.Task[None] | None = None
        # Open WebUI makes the file's instance when it loads the file: from then on this worker serves
        # upload links (functions/inbound.py).
        serve_uploads(self._host)

    @property
    def _host(self) -> Host:
        return self.maintenance.host

    @_host.setter
    def _host(self, host: Host) -> None:
        self.maintenance.host = host

    @property
    def _services(self) -> Engine | None:
        """The engine this file uses now (None: no message or tick yet)."""
        return self._turns.services if self._turns is not None else None

    @property
    def settings(self) -> SharedValves:
        """The session valves in force now (the Pipe's and the Tool's own valves; for the Filter and
        the Action, the Tool's or the Pipe's as last read)."""
        return self._holder.valves

    @settings.setter
    def settings(self, value: SharedValves) -> None:
        self._holder.valves = value

    async def _read_settings(self) -> dict[str, Any]:
        """The settings as saved now (the background loop is not called by Open WebUI, so it reads
        them); empty when this file does not know its id yet."""
        if not self._function_id:
            return {}
        return await self._host.stored_valves(self._function_id)

    async def _write_settings(self, stored: dict[str, Any]) -> None:
        if self._function_id:
            await self._host.store_valves(self._function_id, stored)

    async def _begin(self) -> tuple[Turns, Settings]:
        """A message's start, the same in the three files: its settings (built once, here), the
        services for them, the background loop kept running, and a purge the valves ask for run now
        rather than a minute later. Raises webui.Misconfigured for valves it cannot run with."""
        settings = settings_from(self.settings)
        turns = await self._turns_for_valves()
        self._keep_background_running()
        if settings.purge.strip():
            await self.maintenance.purge_now(turns.services, settings)
        return turns, settings

    # ---- composition --------------------------------------------------------------------------------

    async def _turns_for_valves(self) -> Turns:
        """The services for the current valves (rebuilt only when a valve they are built from
        changes). The message's settings travel with each call (`Settings`), not in the services: a
        Pipe and a Tool with different quotas share them and each enforce their own."""
        valves = self.settings
        places = self._host.locations(valves.storage_root, LOCATION_ID)
        index_url = self._host.index_url(valves.index_database)
        key = (
            str(places.root),
            index_url,
            str(places.publish_dir),
            valves.runsc_path,
            valves.runsc_platform,
            valves.kernel_platform,
            valves.network,
            valves.network_namespace,
            valves.kernel,
            valves.warm_start,
        )
        if self._turns is None or key != self._services_key:
            turns = await self._shared_services(key, valves, places, index_url)
            old, self._turns, self._services_key = self._services_key, turns, key
            if old is not None and old != key:
                await self._release_services(old)
        return self._turns

    async def _shared_services(
        self, key: tuple[object, ...], valves: SharedValves, places: Places, index_url: str
    ) -> Turns:
        """The services for `key`, made once per process whichever file asks first (a Pipe and a Tool
        with the same storage valves share one store and one set of kernels)."""
        shared = self._host.shared()
        async with _shared_lock(shared):
            entry = shared.get(_in_loop(key))
            if not isinstance(entry, SharedServices):
                runner = Runner(
                    RunnerConfig(
                        runsc_path=valves.runsc_path,
                        platform=valves.runsc_platform or None,
                        kernel_platform=valves.kernel_platform or None,
                        network=valves.network,
                        netns_path=Path(valves.network_namespace) if valves.network_namespace else None,
                    )
                )
                owner = (runner.sandbox_uid, runner.sandbox_gid) if os.geteuid() == 0 else None
                store = Store(
                    places.root,
                    publisher=self._host.publisher(places),
                    owner=owner,
                    database_url=index_url,
                    temporary_chat=self._host.temporary_chat,
                )
                await store.open()
                kernels = None
                if valves.kernel != "fresh":
                    kernels = KernelPool(runner, places.root / "kernels", warm_start=valves.warm_start)
                entry = shared[_in_loop(key)] = SharedServices(Turns(Engine(store, runner, kernels=kernels)))
                if kernels is not None:
                    _save_kernels_before_stop(shared)
            entry.users += 1
            return entry.turns

    async def _release_services(self, key: tuple[object, ...]) -> None:
        """This file no longer uses the services for `key` (a valve changed): the last user closes them."""
        shared = self._host.shared()
        async with _shared_lock(shared):
            entry = shared.get(_in_loop(key))
            if not isinstance(entry, SharedServices):
                return
            entry.users -= 1
            if entry.users > 0:
                return
            del shared[_in_loop(key)]
        await entry.services.close()

    async def release(self) -> None:
        """Stop using the services (what the end of the process does; the last user closes them)."""
        self._cancel_background()
        if self._services_key is not None:
            key, self._turns, self._services_key = self._services_key, None, None
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
            await asyncio.sleep(self.maintenance.minute_s)
            try:
                await self._tick()
            except Exception:  # the loop must outlive a bad tick; the next one retries
                log.exception("code-sessions background cleanup failed")

    async def _tick(self) -> None:
        """One tick of the engine's maintenance, with the valves as saved now."""
        stored = await self._read_settings()
        if stored:
            self.settings = type(self.settings)(**{k: v for k, v in stored.items() if v is not None})
        turns = await self._turns_for_valves()
        await self.maintenance.tick(turns.services, settings_from(self.settings))


class _PurgeValve:
    """The `purge` valve of one file (engine.PurgeValve): in its valves in force, and where Open WebUI
    saves them."""

    def __init__(self, adapter: Adapter) -> None:
        self._adapter = adapter

    async def saved_purge(self) -> str | None:
        adapter = self._adapter
        stored = await adapter._read_settings()
        return str(stored.get("purge") or "") if stored or adapter._function_id else None

    async def clear_purge(self, request: str) -> None:
        adapter = self._adapter
        adapter.settings = adapter.settings.model_copy(update={"purge": ""})
        stored = await adapter._read_settings()
        if str(stored.get("purge") or "").strip() == request:
            await adapter._write_settings({**stored, "purge": ""})


def _in_loop(key: tuple[object, ...]) -> tuple[object, ...]:
    # Services belong to the event loop they were made in (their tasks, their connections' futures).
    return (id(asyncio.get_running_loop()), *key)


def _shared_lock(shared: dict[object, object]) -> asyncio.Lock:
    """One lock per process and loop: two first messages at once (to any of the files) must not open
    two stores."""
    key = ("lock", id(asyncio.get_running_loop()))
    lock = shared.get(key)
    if not isinstance(lock, asyncio.Lock):
        lock = shared[key] = asyncio.Lock()
    return lock


def _save_kernels_before_stop(shared: dict[object, object]) -> None:
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
                        if isinstance(entry, SharedServices) and entry.services.kernels is not None:
                            await entry.services.kernels.close()
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


def place_of(
    host: Host,
    chat_id: str,
    message_id: str | None,
    metadata: dict[str, Any] | None,
    messages: object = None,
    *,
    user_id: str = "",
) -> Place | None:
    """Where the answer Open WebUI is writing is in the chat's conversation (None: the request named
    no message, as an API call may not: the folder is then the chat's whole). `messages`: the request's
    messages, when this call has them (None: unknown).

    The web UI names the user message (`user_message`, with its `parentId`), and Open WebUI files the
    answer under it. An API caller that sends only `chat_id` and the answer's `id` (or `parent_id`
    alone, which Open WebUI 0.12 drops) gets an answer filed with no parent: the tree then says
    nothing of where it is. So the place opens the conversation (`Place.opens`) only when the request
    says so itself: a user message whose `parentId` is null, and no earlier turn in its messages.

    `user_id`: whose chat it is; the place then asks the host, once the answer finds no state in the
    chat's folder, whether the chat is a clone it may start from (`Place.origin`, engine/clones.py)."""
    if not message_id:
        return None
    found = (metadata or {}).get("user_message")
    user_message: dict[str, Any] | None = found if isinstance(found, dict) else None
    parent = user_message.get("parentId") if user_message is not None else None
    opens = (
        user_message is not None
        and "parentId" in user_message
        and parent is None
        and messages is not None
        and not earlier_turns(messages)
    )

    async def lineage() -> tuple[list[str], bool]:
        return await host.message_lineage(chat_id, message_id, user_message)

    async def origin() -> Origin | None:  # the host proves a clone's claim, or drops it (webui/clones.py)
        return await host.clone_origin(chat_id, user_id)

    continues = parent if isinstance(parent, str) and parent else None
    return Place(message_id, lineage, continues=continues, opens=opens, origin=origin if user_id else None)


def earlier_turns(messages: object) -> bool:
    """Whether a request's messages carry turns before its last user message (what an API caller
    sends as the history: the chat's earlier questions and answers). A tool's own calls and results
    come after the last user message; a system message is not a turn."""
    if not isinstance(messages, list):
        return False
    users = [i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"]
    before = messages[: users[-1]] if users else []
    return any(isinstance(m, dict) and m.get("role") in ("user", "assistant") for m in before)


def message_of(
    host: Host,
    user_id: str,
    chat_id: str,
    message_id: str | None,
    metadata: dict[str, Any] | None,
    messages: object,
    files: Sequence[dict[str, Any]] = (),
    emit: Emit | None = None,
    request: object = None,
) -> Message:
    """One call's message as the engine takes it, from what Open WebUI hands the call: `messages` as
    the request carries them (None: the call has none; what is not a message is left out)."""
    listed = [m for m in messages if isinstance(m, dict)] if isinstance(messages, list) else []
    place = place_of(host, chat_id, message_id, metadata, messages, user_id=user_id)
    return Message(user_id, chat_id, message_id, place, listed, files, emit, request)
