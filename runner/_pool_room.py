"""How many kernels a host runs (a part of KernelPool, apart for reading): each start holds a place
under a lock every process of the host shares, so concurrent starts never pass max_kernels; past it, the
least recently used idle kernel is stopped (saved); and the reaper stops kernels idle longer than idle_s
or that another host asked to stop."""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import secrets
import time
from pathlib import Path
from typing import TYPE_CHECKING

from . import _relay
from ._registry import HOST, STARTING, Entry, Registry
from ._relay import OwnerSilent

if TYPE_CHECKING:
    from ._kernel import Kernel
    from .models import KernelSettings

log = logging.getLogger("code_sessions.runner")

# How often this process looks at its kernels: idle ones stop, and ones another host asked to stop
# (the chat moved there) stop within this.
_REAP_EVERY_S = 2.0
_ROOM_WAIT_S = 30.0  # how long a start waits for a kernel to become idle before going over max_kernels
_ROOM_POLL_S = 0.1


class _Room:
    """Places, eviction and the reaper, for KernelPool."""

    registry_dir: Path
    settings: KernelSettings
    _registry: Registry
    _mine: dict[str, Kernel]
    _in_run: set[str]
    _owner: str
    _reaper: asyncio.Task[None] | None

    if TYPE_CHECKING:

        async def _end(self, key: str, kernel: Kernel, reason: str, *, save: bool = False) -> None: ...
        async def _strand(self, entry: Entry, why: str) -> None: ...

    async def reap(self) -> None:
        """Stop this process's kernels that have been idle too long, or that another host asked to
        stop (runs every couple of seconds)."""
        now = time.monotonic()
        for key, kernel in list(self._mine.items()):
            if not kernel.alive:
                await self._end(key, kernel, kernel.lost or "the kernel stopped")
            elif now - kernel.last_used > self.settings.idle_s and not kernel.busy:
                idle = _minutes(self.settings.idle_s)
                await self._end(key, kernel, f"it was idle for more than {idle}", save=True)
            else:
                if key in self._in_run:
                    continue  # a run here is starting or using it (its entry may not name it yet)
                entry = await asyncio.to_thread(self._registry.get, key)
                if key in self._in_run or self._mine.get(key) is not kernel:
                    continue  # a run began meanwhile
                if entry is not None and entry.cid != kernel.cid:
                    await self._end(key, kernel, "another kernel took over its chat")
                elif entry is not None and entry.stop_requested:
                    await self._end(key, kernel, entry.stop_requested, save=True)

    async def _reserve(self, key: str, workdir: Path) -> None:
        """Make room for the key's kernel and hold its place, under a lock every process of this host
        shares: the count and the place are one step, so concurrent starts never pass max_kernels.
        The place is a registry entry, running, with no kernel yet ("starting-..."), which _register
        replaces (or _unreserve ends)."""
        self.registry_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.registry_dir / ".starts.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX)
            await self._make_room(key)
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

    def _unreserve(self, key: str, why: str) -> None:
        entry = self._registry.get(key)
        if entry is not None and entry.cid.startswith(STARTING) and entry.owner == self._owner:
            entry.running, entry.reason = False, why[:300]
            self._registry.save(entry)

    async def _make_room(self, key: str) -> None:
        """Beyond max_kernels on this host, stop (save) the least recently used idle one. A kernel
        running a cell, or still starting, is never chosen (its owner says when it is busy); with
        none idle, wait up to _ROOM_WAIT_S for one to be, then go over the limit rather than kill a
        run."""
        deadline = time.monotonic() + _ROOM_WAIT_S
        most = self.settings.max_kernels
        reason = f"too many kernels were running (at most {most}); it was the least recently used"
        busy: set[str] = set()  # keys another worker said are running a cell now
        entries = [e for e in await asyncio.to_thread(self._registry.running_here) if e.key != key]
        while len(entries) >= self.settings.max_kernels:
            idle = [
                e
                for e in entries
                if not e.cid.startswith(STARTING)
                and e.key not in busy
                and e.key not in self._in_run
                and not (e.key in self._mine and self._mine[e.key].busy)
            ]
            if not idle:
                if time.monotonic() > deadline:
                    return
                await asyncio.sleep(_ROOM_POLL_S)
                busy.clear()
                entries = [e for e in await asyncio.to_thread(self._registry.running_here) if e.key != key]
                continue
            victim = min(idle, key=lambda e: e.last_used)
            if victim.key in self._mine:
                await self._end(victim.key, self._mine[victim.key], reason, save=True)
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

    def _keep_reaping(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.create_task(self._reap_forever())

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(min(_REAP_EVERY_S, self.settings.idle_s / 4))
            try:
                await self.reap()
            except Exception:
                log.exception("kernel reaper")


def _minutes(seconds: float) -> str:
    minutes = seconds / 60
    return f"{minutes:g} minutes" if minutes != 1 else "1 minute"
