"""A chat's kernel held elsewhere: on another host, which is asked to give it up, or by a worker of this
host that does not answer, whose kernel is stopped. (Serving this process's kernels to the other
workers is the pool's own: `KernelPool._serve`, over runner/_relay.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from . import _relay
from ._registry import Entry, Registry
from .capabilities import run_quick
from .runner import Runner

log = logging.getLogger("code_sessions.runner")

_HANDOVER_WAIT_S = 10.0  # how long a host waits for another one to stop a chat's kernel


class Peers:
    """Handing over and stranding kernels held by other processes, through the shared registry."""

    def __init__(self, runner: Runner, registry: Registry) -> None:
        self._runner = runner
        self._registry = registry

    async def take_over(self, entry: Entry) -> None:
        """The chat's kernel runs on another host (its runs reach that host's replica no longer): ask
        that host to stop it, and wait until it has, so the chat never has two kernels at once. A host
        that does not answer within _HANDOVER_WAIT_S is taken to be gone (its kernels died with it)."""
        reason = "this chat's previous runs were on another server"
        entry.stop_requested = reason
        await asyncio.to_thread(self._registry.save_if_same, entry)
        deadline = time.monotonic() + _HANDOVER_WAIT_S
        while time.monotonic() < deadline:
            now = await asyncio.to_thread(self._registry.get, entry.key)
            if now is None or now.cid != entry.cid or not now.running:
                return
            await asyncio.sleep(0.2)
        log.warning(
            "kernel %s of %s on %s did not stop when asked: taken to be gone",
            entry.cid,
            entry.key,
            entry.host,
        )

    async def strand(self, entry: Entry, why: str) -> None:
        """The worker holding the chat's kernel does not answer: kill that kernel (same host, same
        user, same runsc state), so the chat never has two, and record why its state went."""
        with contextlib.suppress(Exception):
            setup = await self._runner.setup()
            base = [setup.runsc.path, "--root", str(self._runner.state_dir)]
            with contextlib.suppress(Exception):
                await run_quick([*base, "kill", "--all", entry.cid, "KILL"], _relay.CONNECT_TIMEOUT_S * 5)
            with contextlib.suppress(Exception):
                await run_quick([*base, "delete", "--force", entry.cid], _relay.CONNECT_TIMEOUT_S * 5)
        entry.running, entry.reason, entry.unsaved, entry.image = False, why, False, ""
        await asyncio.to_thread(self._registry.save_if_same, entry)
        log.warning("kernel %s of %s: %s; stopped it", entry.cid, entry.key, why)
