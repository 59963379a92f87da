"""How many kernels a host runs, and how long one lives unused.

`Room` holds a place for each start under a lock every process of the host shares, so concurrent starts
never pass the starting message's `max_kernels`; past it, the least recently used idle kernel is stopped
(saved). Its reaper stops this process's kernels idle longer than their chat's `idle_s`, or that another
host asked to stop. It reads the pool's chats (`Chat`, one record each) and ends a kernel through the
pool, which it is handed as two calls: it owns its lock file and its reaper task, nothing of the pool's.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from . import _relay
from ._kernel import Kernel
from ._registry import HOST, STARTING, Entry, Registry
from ._relay import OwnerSilent
from .models import KernelSettings

log = logging.getLogger("code_sessions.runner")

# How often this process looks at its kernels: idle ones stop, and ones another host asked to stop
# (the chat moved there) stop within this.
_REAP_EVERY_S = 2.0
_ROOM_WAIT_S = 30.0  # how long a start waits for a kernel to become idle before going over max_kernels
_ROOM_POLL_S = 0.1


class End(Protocol):
    """The pool's way to end a kernel (`save`: saved to its chat's state folder first)."""

    async def __call__(self, key: str, kernel: Kernel, reason: str, *, save: bool = False) -> None: ...


Strand = Callable[[Entry, str], Awaitable[None]]  # a silent worker's kernel: killed, and why recorded


@dataclass(eq=False)
class Chat:
    """What this process keeps of one chat (a `KernelPool` holds one per key it has served)."""

    # Its latest run's settings: its idle time, and the bounds its saves and copies are kept within.
    settings: KernelSettings
    kernel: Kernel | None = None  # its kernel, when it runs in this process
    state_dir: Path | None = None  # where its kernel is saved when it stops
    server: asyncio.AbstractServer | None = None  # its kernel's socket, for the other workers
    saving: asyncio.Future[None] | None = None  # done once the save in progress here is over
    in_run: bool = False  # a run is in progress here (never an LRU victim)
    touched: float = 0.0  # monotonic time the registry's last use was last written


class Room:
    """Places, eviction and the reaper of one `KernelPool`."""

    def __init__(
        self,
        registry: Registry,
        owner: str,
        chats: dict[str, Chat],
        defaults: KernelSettings,
        end: End,
        strand: Strand,
    ) -> None:
        self._registry = registry
        self._owner = owner
        self._chats = chats  # the pool's, read here
        self._defaults = defaults
        self._end = end
        self._strand = strand
        self._reaper: asyncio.Task[None] | None = None

    async def reap(self) -> None:
        """Stop this process's kernels that have been idle longer than their chat's `idle_s`, or
        that another host asked to stop (runs every couple of seconds)."""
        now = time.monotonic()
        looked: list[tuple[str, Kernel]] = []
        for key, chat in list(self._chats.items()):
            kernel = chat.kernel
            if kernel is None:
                continue
            idle_s = chat.settings.idle_s
            if not kernel.alive:
                await self._end(key, kernel, kernel.lost or "the kernel stopped", save=False)
            elif now - kernel.last_used > idle_s and not kernel.busy:
                await self._end(key, kernel, f"it was idle for more than {_minutes(idle_s)}", save=True)
            elif not chat.in_run:  # (a run here is starting or using it: its entry may not name it)
                looked.append((key, kernel))
        if not looked:
            return
        # Their entries in one trip to a thread, not one each: fifty idle kernels' reaping must not
        # cost more than the kernels do.
        entries = await asyncio.to_thread(lambda: [self._registry.get(key) for key, _ in looked])
        for (key, kernel), entry in zip(looked, entries, strict=True):
            now_held = self._chats.get(key)
            if now_held is None or now_held.in_run or now_held.kernel is not kernel:
                continue  # a run began meanwhile
            if entry is not None and entry.cid != kernel.cid:
                await self._end(key, kernel, "another kernel took over its chat", save=False)
            elif entry is not None and entry.stop_requested:
                await self._end(key, kernel, entry.stop_requested, save=True)

    async def reserve(self, key: str, workdir: Path, max_kernels: int) -> None:
        """Make room for the key's kernel and hold its place, under a lock every process of this host
        shares: the count and the place are one step, so concurrent starts never pass `max_kernels`
        (the starting message's). The place is a registry entry, running, with no kernel yet
        ("starting-..."), which the pool's registration replaces (or `unreserve` ends)."""
        folder = self._registry.folder
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(folder / ".starts.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX)
            await self._make_room(key, max_kernels)
            now = time.time()
            place = Entry(
                key,
                f"{STARTING}{secrets.token_hex(6)}",
                HOST,
                self._owner,
                "",
                str(workdir),
                now,
                now,
                True,
            )
            await asyncio.to_thread(self._registry.save, place)
        finally:
            os.close(fd)  # releases the lock

    def unreserve(self, key: str, why: str) -> None:
        """The key's held place was not taken (its kernel did not start): its entry says why."""
        entry = self._registry.get(key)
        if entry is not None and entry.cid.startswith(STARTING) and entry.owner == self._owner:
            entry.running, entry.reason = False, why[:300]
            self._registry.save(entry)

    async def _make_room(self, key: str, most: int) -> None:
        """Beyond `most` kernels on this host, stop (save) the least recently used idle one. A kernel
        running a cell, or still starting, is never chosen (its owner says when it is busy); with
        none idle, wait up to _ROOM_WAIT_S for one to be, then go over the limit rather than kill a
        run."""
        deadline = time.monotonic() + _ROOM_WAIT_S
        reason = f"too many kernels were running (at most {most}); it was the least recently used"
        busy: set[str] = set()  # keys another worker said are running a cell now
        entries = [e for e in await asyncio.to_thread(self._registry.running_here) if e.key != key]
        while len(entries) >= most:
            idle = [
                e
                for e in entries
                if not e.cid.startswith(STARTING) and e.key not in busy and self._idle(e.key)
            ]
            if not idle:
                if time.monotonic() > deadline:
                    return
                await asyncio.sleep(_ROOM_POLL_S)
                busy.clear()
                entries = [e for e in await asyncio.to_thread(self._registry.running_here) if e.key != key]
                continue
            victim = min(idle, key=lambda e: e.last_used)
            chat = self._chats.get(victim.key)
            if chat is not None and chat.kernel is not None:
                await self._end(victim.key, chat.kernel, reason, save=True)
            else:
                # Its owner saves it and records that itself; a busy one it keeps, and says so.
                request = {"op": "stop", "reason": reason, "save": True, "if_idle": True}
                try:
                    reply = await _relay.ask(victim, request)
                except OwnerSilent as silent:
                    await self._strand(victim, str(silent))
                    reply = None
                if reply is not None and reply.get("busy"):
                    busy.add(victim.key)
                    continue
            entries = [e for e in entries if e.key != victim.key]

    def _idle(self, key: str) -> bool:
        """Whether this process leaves the key's kernel free to be stopped (another's says itself)."""
        chat = self._chats.get(key)
        return chat is None or not (chat.in_run or (chat.kernel is not None and chat.kernel.busy))

    def keep_reaping(self) -> None:
        """Start the reaper, unless it runs."""
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.create_task(self._reap_forever())

    def stop_reaping(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()

    async def _reap_forever(self) -> None:
        while True:
            # Within a fourth of the shortest idle time of the chats held here.
            shortest = min([self._defaults.idle_s, *(c.settings.idle_s for c in list(self._chats.values()))])
            await asyncio.sleep(min(_REAP_EVERY_S, shortest / 4))
            try:
                await self.reap()
            except Exception:
                log.exception("kernel reaper")


def _minutes(seconds: float) -> str:
    minutes = seconds / 60
    return f"{minutes:g} minutes" if minutes != 1 else "1 minute"
