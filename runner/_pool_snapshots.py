"""Copies of a chat's Python state for its conversation's branches (a part of KernelPool, apart for
reading): `snapshot` writes a copy of the live kernel's state into a folder the caller names, while
the kernel goes on (`runsc checkpoint --leave-running`); `rewind` ends the chat's kernel and leaves
one such copy as its saved state, so the next run resumes it, as it would resume a sleeping kernel."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from . import _hibernate, _relay
from ._hibernate import ImageRefused
from ._kernel import NotSaved
from ._procs import rss_bytes
from ._registry import HOST, Entry, Registry, owned_here
from ._relay import OwnerSilent
from ._supervise import human_bytes
from .models import KernelSettings, Limits

if TYPE_CHECKING:
    from ._kernel import Kernel
    from .runner import Runner

log = logging.getLogger("code_sessions.runner")

_SNAPSHOT_REPLY_S = 90.0  # another worker's copy of a big kernel (the checkpoint's own bound, and more)
_STOPPED_WAIT_S = 10.0
# What a kernel's host processes hold beyond what its image keeps (runsc, the gofer, the sentry's own).
_SANDBOX_OVERHEAD = 128 * 2**20  # how long a rewind waits for another worker to record its kernel's end


class _Snapshots:
    """snapshot() and rewind(), for KernelPool."""

    runner: Runner
    settings: KernelSettings
    _registry: Registry
    _mine: dict[str, Kernel]
    _owner: str

    if TYPE_CHECKING:

        async def _settled(self, key: str) -> None: ...
        async def _image_identity(self, limits: Limits) -> dict[str, object]: ...
        async def stop(
            self, key: str, reason: str, *, forget: bool = False, state_dir: Path | None = None
        ) -> None: ...

    async def snapshot(
        self, key: str, into: Path, *, state_dir: Path | None = None, max_bytes: int | None = None
    ) -> tuple[str, str]:
        """Copy the key's Python state into the folder `into` (its image at `into`/kernel), the
        kernel running on: (image id, "") or ("", why there is none). The kernel may run in this
        process, in another worker of this host, or sleep in `state_dir` (its saved image is the
        state: it is shared, not written again). `max_bytes`: a copy larger than this is not kept."""
        await self._settled(key)
        kernel = self._mine.get(key)
        if kernel is not None and kernel.alive:
            return await self._snapshot_here(key, kernel, into, max_bytes)
        entry = await asyncio.to_thread(self._registry.get, key)
        if entry is None:
            return "", "this chat has no Python state"
        if entry.running and owned_here(entry) and entry.owner != self._owner:
            try:
                reply = await _relay.ask(
                    entry, {"op": "snapshot", "into": str(into), "max_bytes": max_bytes}, _SNAPSHOT_REPLY_S
                )
            except OwnerSilent as silent:
                return "", str(silent)
            if reply is None:
                return "", "its kernel ended meanwhile"
            return str(reply.get("image", "")), str(reply.get("why", ""))
        if not entry.running and entry.image and state_dir is not None:
            try:
                return await asyncio.to_thread(_hibernate.copy_image, state_dir, into), ""
            except (ImageRefused, OSError) as error:
                return "", f"its saved image could not be shared: {error}"
        return "", "its kernel is not running on this server"

    async def _snapshot_here(
        self, key: str, kernel: Kernel, into: Path, max_bytes: int | None
    ) -> tuple[str, str]:
        limit = self.settings.max_image_bytes
        if limit == 0:
            return "", "saving Python states is turned off"
        if max_bytes is not None:
            limit = max_bytes if limit is None else min(limit, max_bytes)
        if limit is not None:  # a copy clearly too big is not written only to be thrown away
            rss = await asyncio.to_thread(rss_bytes, kernel.host_pids())
            if rss - _SANDBOX_OVERHEAD > limit:
                return "", f"its memory of {rss / 2**20:.0f} MiB is over the {human_bytes(limit)} it may take"
        t0 = time.monotonic()
        staging: Path | None = None
        try:
            staging = await asyncio.to_thread(_hibernate.new_staging, into)
            await kernel.checkpoint(staging, self.runner.checkpoint_flags(), leave_running=True)
            identity = await self._image_identity(kernel.limits)
            image = await asyncio.to_thread(
                _hibernate.seal, staging, into, identity, kernel.ready_fields()
            )
            staging = None
        except (NotSaved, ImageRefused, OSError) as error:
            log.warning("kernel %s of %s: no copy of its state: %s", kernel.cid, key, error)
            return "", str(error)[:300]
        finally:
            if staging is not None:
                await asyncio.to_thread(_hibernate.discard, into)
        if limit is not None and image.size > limit:
            await asyncio.to_thread(_hibernate.discard, into)
            size = f"{image.size / 2**20:.0f} MiB"
            return "", f"its image of {size} is over the {human_bytes(limit)} it may take"
        log.info(
            "kernel %s of %s: state copied in %.2f s (%.1f MiB)",
            kernel.cid,
            key,
            time.monotonic() - t0,
            image.size / 2**20,
        )
        return image.id, ""

    async def rewind(self, key: str, state_dir: Path, image: Path | None, reason: str) -> None:
        """The chat goes on from another point of its conversation: its kernel (wherever on this
        host) ends without being saved. With `image` (a folder `snapshot` wrote), that state becomes
        the chat's saved one, and the next run resumes it with nothing said; without, the next run
        starts anew and says `reason`."""
        await self.stop(key, reason, state_dir=state_dir)
        deadline = time.monotonic() + _STOPPED_WAIT_S
        entry = await asyncio.to_thread(self._registry.get, key)
        while entry is not None and entry.running and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # another worker is ending it: it records the end itself
            entry = await asyncio.to_thread(self._registry.get, key)
        if image is None:
            if entry is None:
                await asyncio.to_thread(self._registry.save, _ended_entry(key, reason))
            return
        try:
            image_id = await asyncio.to_thread(_hibernate.copy_image, image, state_dir)
        except (ImageRefused, OSError) as error:
            log.warning("kernel of %s: the branch's state could not be set: %s", key, error)
            why = f"the Python state of that message could not be restored: {error}"[:300]
            await asyncio.to_thread(self._registry.save, _ended_entry(key, why, entry))
            return
        fresh = _ended_entry(key, "", entry)
        fresh.image = image_id
        await asyncio.to_thread(self._registry.save, fresh)


def _ended_entry(key: str, reason: str, entry: Entry | None = None) -> Entry:
    """The key's registry entry for a kernel that is not running, saying `reason` at its next run."""
    now = time.time()
    if entry is None:
        entry = Entry(key, "", HOST, "", "", "", now, now, False)
    entry.running, entry.reason, entry.image, entry.unsaved, entry.saving = False, reason, "", False, False
    entry.stop_requested = ""
    return entry
