"""The pool and the other workers and hosts of a chat (a part of KernelPool, apart for reading): it
serves its kernels to the other workers of its host over their sockets (runner/_relay.py), asks another
host to give a chat's kernel up, and stops a kernel whose worker does not answer."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from . import _relay
from ._kernel import KernelLost
from ._registry import Entry, Registry
from .capabilities import run_quick
from .models import Limits

if TYPE_CHECKING:
    from ._kernel import Kernel
    from .runner import Runner

log = logging.getLogger("code_sessions.runner")

_HANDOVER_WAIT_S = 10.0  # how long a host waits for another one to stop a chat's kernel


class _Peers:
    """Serving, handing over and stranding kernels, for KernelPool."""

    runner: Runner
    _registry: Registry
    _mine: dict[str, Kernel]
    _in_run: set[str]

    if TYPE_CHECKING:

        async def _end(self, key: str, kernel: Kernel, reason: str, *, save: bool = False) -> None: ...
        def _misfit(self, kernel: Kernel, workdir: Path, limits: Limits) -> str | None: ...
        async def _note_use(self, key: str, kernel: Kernel) -> None: ...
        async def _snapshot_here(
            self, key: str, kernel: Kernel, into: Path, max_bytes: int | None
        ) -> tuple[str, str]: ...

    async def _take_over(self, entry: Entry) -> None:
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

    async def _strand(self, entry: Entry, why: str) -> None:
        """The worker holding the chat's kernel does not answer: kill that kernel (same host, same
        user, same runsc state), so the chat never has two, and record why its state went."""
        with contextlib.suppress(Exception):
            setup = await self.runner.setup()
            base = [setup.runsc.path, "--root", str(self.runner.state_dir)]
            with contextlib.suppress(Exception):
                await run_quick([*base, "kill", "--all", entry.cid, "KILL"], _relay.CONNECT_TIMEOUT_S * 5)
            with contextlib.suppress(Exception):
                await run_quick([*base, "delete", "--force", entry.cid], _relay.CONNECT_TIMEOUT_S * 5)
        entry.running, entry.reason, entry.unsaved, entry.image = False, why, False, ""
        await asyncio.to_thread(self._registry.save_if_same, entry)
        log.warning("kernel %s of %s: %s; stopped it", entry.cid, entry.key, why)

    async def _serve(self, key: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Another worker of this host asks this process's kernel. Only our own user's processes can
        reach the socket (mode 0600 in a 0700 folder owned by us) and the peer's credentials are
        checked too; a request must name this chat and this kernel, or it is refused (a registry
        entry pointing at another chat's socket never runs a cell in that chat)."""
        try:
            uid = _relay.peer_uid(writer)
            if uid != os.geteuid():
                log.warning("kernel of %s: refused a request from uid %s", key, uid)
                await _relay.send(writer, {"refused": "not our user"})
                return
            request = await _relay.receive(reader)
            kernel = self._mine.get(key)
            if kernel is None or not kernel.alive:
                await _relay.send(writer, {"gone": True})
                return
            if request.get("key") != key or request.get("cid") != kernel.cid:
                log.warning("kernel %s of %s: refused a request for another chat or kernel", kernel.cid, key)
                await _relay.send(writer, {"refused": "not this chat's kernel"})
                return
            if request.get("op") == "stop":
                if request.get("if_idle") is True and (kernel.busy or key in self._in_run):
                    await _relay.send(writer, {"busy": True})
                    return
                await _relay.send(writer, {"ok": True})
                await self._end(
                    key, kernel, str(request.get("reason", "stopped")), save=request.get("save") is True
                )
                return
            if request.get("op") == "snapshot":  # a copy of the state for the chat's branches
                bound = request.get("max_bytes")
                limit = bound if isinstance(bound, int) else None
                image, why = await self._snapshot_here(key, kernel, Path(str(request.get("into"))), limit)
                await _relay.send(writer, {"image": image, "why": why})
                return
            limits = Limits.model_validate(request["limits"])
            misfit = self._misfit(kernel, Path(str(request.get("workdir", ""))), limits)
            if misfit is not None:  # as a local run would: this kernel cannot take it
                await self._end(key, kernel, misfit)
                await _relay.send(writer, {"gone": True})
                return
            run = asyncio.ensure_future(kernel.run(str(request["code"]), str(request["language"]), limits))
            hangup = asyncio.ensure_future(reader.read(1))  # the asker gave up: EOF
            await asyncio.wait({run, hangup}, return_when=asyncio.FIRST_COMPLETED)
            if not run.done():
                # Its answer was stopped: stop the cell here as a local run would be (interrupted,
                # settled), then say so, so the asker reconciles after the cell's last write.
                run.cancel()
                with contextlib.suppress(asyncio.CancelledError, KernelLost):
                    await run
                if not kernel.alive:
                    await self._end(key, kernel, kernel.lost or "the kernel stopped")
                await _relay.send(writer, {"cancelled": True})
                return
            hangup.cancel()
            try:
                result = run.result()
            except KernelLost:
                await _relay.send(writer, {"gone": True})
                return
            if not kernel.alive:
                await self._end(key, kernel, kernel.lost or "the kernel stopped")
            else:
                await self._note_use(key, kernel)
            await _relay.send(writer, {"result": result.model_dump(mode="json")})
        except (OSError, ValueError, KeyError, asyncio.IncompleteReadError) as error:
            log.warning("kernel of %s: a request from another worker failed: %s", key, error)
        finally:
            writer.close()
