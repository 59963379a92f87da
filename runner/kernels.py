"""Persistent kernels, one per chat, reachable from every worker process of this host.

A `KernelPool` (one per process) runs code in the kernel of a key (the caller's name for a chat). The
caller holds the chat's lock around `run`, so a chat never starts two kernels; the pool finds its
kernel wherever it lives:

* started by this process: run it here;
* started by another worker of this host: that worker serves it on a unix socket
  (`<socket_dir>/<digest>.sock`), and the run goes there and back;
* none (first run, or the previous one ended): start one here, and say why the state was reset.

The registry (`<registry_dir>/<digest>.json`, one small file per key, kept across restarts) says
where each key's kernel lives (host, process and its start time, socket), when it was last used, and,
once it ended, why: "idle for 5 minutes", "Open WebUI restarted", "it ran out of memory". The next
run reads that reason and passes it on as one plain sentence (`RunResult.notes`): losing the state is
always said, never silent.

Lifecycle: a kernel idle longer than `idle_s` is stopped; starting one beyond `max_kernels` on this
host stops the least recently used idle one; `stop(key)` ends one (its chat was purged, deleted,
expired); a kernel dies with the process that started it (an Open WebUI restart), and the registry
entry it leaves is how the next run knows.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import hashlib
import logging
import os
import secrets
import time
import weakref
from pathlib import Path

from pydantic import ValidationError

from . import _delta, _hibernate, _relay, _saving
from ._hibernate import ImageRefused
from ._kernel import KERNEL_SOURCE, Kernel, KernelLost, NotSaved, lifetime_limits
from ._orphans import owner_stamp
from ._peers import Peers
from ._procs import pss_bytes
from ._registry import HOST, Entry, Registry, digest, owned_here
from ._relay import OwnerSilent
from ._room import Chat, Room
from ._supervise import human_bytes
from ._warm import WarmStart, wants_template
from .models import KernelSettings, Limits, Outcome, RunResult
from .runner import Runner

__all__ = ["KernelPool", "reset_sentence", "unsaved_sentence"]

log = logging.getLogger("code_sessions.runner")

_TOUCH_EVERY_S = 30.0
_SAVING_WAIT_S = 90.0  # how long a run waits for another worker to finish saving its chat's kernel
_SHUTDOWN_SAVE_S = 8.0  # at exit, how long saving every idle kernel may take (a stop timeout is ~10 s)
_KERNEL_DIGEST = hashlib.sha256(KERNEL_SOURCE.encode()).hexdigest()[:16]
_SNAPSHOT_REPLY_S = 90.0  # another worker's copy of a big kernel (the checkpoint's own bound, and more)
_STOPPED_WAIT_S = 10.0  # how long a rewind waits for another worker to record its kernel's end
# What a kernel's host processes hold beyond what its image keeps (runsc, the gofer, the sentry's own).
_SANDBOX_OVERHEAD = 128 * 2**20
_BEST_RATIO = 8  # zstd on a kernel's memory: 4.6x with pandas loaded, 3.9x plain (docs/benchmarks.md)


def reset_sentence(reason: str) -> str:
    return f"The Python state was reset ({reason}); files in /mnt/data are kept."


def unsaved_sentence(reason: str) -> str:
    return f"The Python state could not be kept ({reason}); files in /mnt/data are kept."


class KernelPool:
    """The kernels of this process, and the way to every other kernel of a chat. One record per chat
    (`Chat`); it is composed of a `Room` (places under `max_kernels`, eviction, the idle reaper), a
    `Peers` (kernels held by other hosts or silent workers) and a `WarmStart` (the template); the
    registry (_registry), the relay (_relay) and the saves (_saving) are what it uses.

    Settings travel with each call that needs them (`settings=`: the message's `KernelSettings`), and
    each chat keeps its latest run's, so two forms of the function sharing this pool with different
    valves each keep their own: idle time, saved-state bounds and compression follow the chat's
    settings, `max_kernels` bounds the host's kernels at each start with the starting run's value. A
    call without settings uses `defaults`, fixed when the pool is made. What is truly per process is
    the runner's configuration (platform, runsc, network) and `warm_start`."""

    def __init__(
        self,
        runner: Runner,
        registry_dir: Path,
        *,
        settings: KernelSettings | None = None,
        socket_dir: Path | None = None,
        warm_start: bool = False,
    ) -> None:
        self.runner = runner
        self.registry_dir = Path(registry_dir)
        self._registry = Registry(self.registry_dir)
        self.socket_dir = Path(socket_dir) if socket_dir is not None else runner.bundle_dir / "kernels"
        # For calls that bring none (tests, benchmarks). The saved images together are checked once the
        # new image is in place, so two saves at once can only both refuse, never both pass.
        self.defaults = settings or KernelSettings()
        self._chats: dict[str, Chat] = {}
        # The kernels being ended, each once; done once the registry says why (weak: gone with them).
        self._ended: weakref.WeakKeyDictionary[Kernel, asyncio.Future[None]] = weakref.WeakKeyDictionary()
        self._identity: dict[str, object] | None = None
        # A new kernel resumes a template with the data stack imported (see _warm), when one is built.
        self.warm_start = warm_start
        self._warm = WarmStart(runner, runner.bundle_dir / "templates")
        self._bases_dir = self.registry_dir / "bases"  # template pages that images are stored against
        # An Open WebUI restart ends its event loop before the process: the idle kernels are saved
        # then, from the exit handler (see _save_at_exit).
        atexit.register(self._save_at_exit)
        # "<pid> <start time> <pool>": two pools of one process (files of two versions of the function
        # loaded side by side) reach each other's kernels over the socket, as two workers do.
        self._owner = f"{owner_stamp()} {secrets.token_hex(4)}"
        self._peers = Peers(runner, self._registry)
        self._room = Room(
            self._registry, self._owner, self._chats, self.defaults, self._end, self._peers.strand
        )

    # ------------------------------------------------------------------ public

    async def run(
        self,
        key: str,
        workdir: Path,
        code: str,
        language: str,
        limits: Limits,
        *,
        state_dir: Path | None = None,
        settings: KernelSettings | None = None,
    ) -> RunResult:
        """Run a cell in the key's kernel, starting one when there is none. Call it holding the
        chat's lock. Never raises for what the code does; RunnerError for host-side problems.

        `state_dir`: the chat's own folder for its saved kernel (outside `workdir`, which the sandbox
        can write): a kernel that would be stopped (idle, least recently used, this process exiting,
        another host taking the chat) is saved there instead, and the next run resumes it, here or in
        any process that reaches the folder. Without it, such a kernel is stopped and its state lost.
        `settings`: the message's (None: `defaults`); the chat keeps them until its next run."""
        self._room.keep_reaping()
        workdir = Path(os.path.realpath(workdir))
        chat = self._chat(key, settings)
        if state_dir is not None:
            chat.state_dir = Path(state_dir)
        chat.in_run = True
        try:
            return await self._run(key, workdir, code, language, limits, state_dir, chat.settings)
        finally:
            chat.in_run = False

    def retune(self, was: KernelSettings, now: KernelSettings) -> None:
        """The chats whose latest run had the settings `was` take `now` (an admin saved new valves and
        no message has come since: their idle time and saves follow at once). Chats of another form
        of the function whose settings were the same follow too, until their own next run."""
        for chat in self._chats.values():
            if chat.settings == was:
                chat.settings = now

    def _chat(self, key: str, settings: KernelSettings | None = None) -> Chat:
        """The key's record, made when first needed; `settings`, when given, become its own."""
        chat = self._chats.get(key)
        if chat is None:
            chat = self._chats[key] = Chat(settings or self.defaults)
        elif settings is not None:
            chat.settings = settings
        return chat

    def _kernel(self, key: str) -> Kernel | None:
        chat = self._chats.get(key)
        return chat.kernel if chat is not None else None

    async def _run(
        self,
        key: str,
        workdir: Path,
        code: str,
        language: str,
        limits: Limits,
        state_dir: Path | None,
        settings: KernelSettings,
    ) -> RunResult:
        await self._settled(key)
        notes: list[str] = []
        kernel = self._kernel(key)
        if kernel is not None:
            misfit = self._misfit(kernel, workdir, limits)
            if misfit is not None:
                await self._end(key, kernel, misfit)
                kernel = None
        if kernel is None:
            entry = await self._entry_once_saved(key)
            if entry is not None and entry.running and entry.owner != self._owner and owned_here(entry):
                try:
                    result = await _relay.run_remote(entry, workdir, code, language, limits, settings)
                except OwnerSilent as silent:
                    await self._peers.strand(entry, str(silent))
                    result = None
                if result is not None:
                    log.info(
                        "kernel %s of %s: run by the worker that holds it (%s)", entry.cid, key, entry.owner
                    )
                    return result
                entry = await asyncio.to_thread(self._registry.get, key)  # it ended meanwhile: why?
            if entry is not None and entry.running and entry.host != HOST:
                await self._peers.take_over(entry)
                entry = await self._entry_once_saved(key)
            said = len(notes)
            kernel = await self._resume(key, workdir, limits, state_dir, entry, notes, settings)
            if kernel is None and len(notes) == said:
                sentence = self._lost_sentence(entry)
                if sentence:
                    notes.append(sentence)
            if kernel is None:
                try:
                    kernel = await self._start(key, workdir, limits, state_dir, code, language, settings)
                except KernelLost as lost:
                    return _refused(str(lost), notes)
        try:
            result = await kernel.run(code, language, limits)
        except KernelLost as lost:  # it had died since the last run: once more in a new one
            await self._end(key, kernel, str(lost))
            notes.append(reset_sentence(str(lost)))
            try:
                kernel = await self._start(key, workdir, limits, state_dir, code, language, settings)
            except KernelLost as again:
                return _refused(str(again), notes)
            result = await kernel.run(code, language, limits)
        if not kernel.alive:
            await self._end(key, kernel, kernel.lost or "the kernel stopped")
        else:
            await self._note_use(key, kernel)
        return result.model_copy(update={"notes": (*notes, *result.notes)}) if notes else result

    async def stop(
        self, key: str, reason: str, *, forget: bool = False, state_dir: Path | None = None
    ) -> None:
        """End the key's kernel (wherever on this host it runs), without saving it, and remove its
        saved state (in `state_dir`, or where its runs here said); `forget`: its chat is gone, so no
        reason is kept for a next run."""
        await self._settled(key)
        kernel = self._kernel(key)
        if kernel is not None:
            await self._end(key, kernel, reason)
        else:
            entry = await asyncio.to_thread(self._registry.get, key)
            if entry is not None and entry.running and owned_here(entry):
                try:
                    await _relay.ask(entry, {"op": "stop", "reason": reason})
                except OwnerSilent as silent:
                    await self._peers.strand(entry, str(silent))
            elif entry is not None and not forget:
                entry.running, entry.reason = False, reason  # the next run says this, not an older why
                await asyncio.to_thread(self._registry.save, entry)
        entry = await asyncio.to_thread(self._registry.get, key)
        if entry is not None and entry.image and not forget:
            entry.image = ""
            await asyncio.to_thread(self._registry.save, entry)
        chat = self._chats.get(key)
        kept = chat.state_dir if chat is not None else None
        if chat is not None:
            chat.state_dir = None
            if chat.kernel is None and not chat.in_run and chat.saving is None:
                del self._chats[key]
        for folder in {state_dir, kept} - {None}:
            assert folder is not None
            await asyncio.to_thread(_hibernate.discard, folder)
        if forget:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._registry.path(key))

    async def hibernate(self, key: str) -> str | None:
        """Save the key's kernel to its state folder now and stop it, as idling would. None when it
        was saved; else why not (no kernel of it here, no state folder, or what the save said)."""
        await self._settled(key)
        kernel = self._kernel(key)
        if kernel is None:
            return "no kernel of this chat runs in this process"
        await self._end(key, kernel, "it was saved", save=True)
        entry = await asyncio.to_thread(self._registry.get, key)
        if entry is None:
            return "its registry entry is gone"
        return None if entry.image else entry.reason or "it was not saved"

    async def reap(self) -> None:
        """Stop this process's kernels idle longer than their chat's idle time, or that another host
        asked to stop (the reaper does this every couple of seconds)."""
        await self._room.reap()

    async def close(self) -> None:
        """Stop every kernel of this process (its owner is going away), saving the idle ones that
        have a state folder, all within _SHUTDOWN_SAVE_S; the rest are stopped with their state. A
        kernel whose state is being copied for a branch is idle: its save follows the copy."""
        self._room.stop_reaping()
        ends = [
            asyncio.ensure_future(self._end(key, kernel, "Open WebUI restarted", save=not kernel.busy))
            for key, kernel in self.kernels().items()
        ]
        if ends:
            _, late = await asyncio.wait(ends, timeout=_SHUTDOWN_SAVE_S)
            for task in late:
                task.cancel()
            await asyncio.gather(*ends, return_exceptions=True)

    def _save_at_exit(self) -> None:
        """Save this process's idle kernels that have a state folder, at interpreter exit, within
        _SHUTDOWN_SAVE_S (see _saving.save_at_exit), each within its chat's bounds."""
        setup = self.runner.host_setup
        targets = [
            (key, chat.kernel, chat.state_dir, chat.settings)
            for key, chat in list(self._chats.items())
            if chat.kernel is not None
            and chat.state_dir is not None
            and chat.settings.max_image_bytes != 0
            # in_use: no event loop is left to wait for a copy being taken; runsc would refuse a second
            and chat.kernel.alive
            and not chat.kernel.in_use
            and chat.kernel.ready is not None
        ]
        if not targets or setup is None:
            return
        identity = {**self.runner.sandbox_identity_now(setup), "kernel_program": _KERNEL_DIGEST}
        flags = self.runner.checkpoint_flags()
        _saving.save_at_exit(targets, self._registry, identity, flags, _SHUTDOWN_SAVE_S)

    def kernels(self) -> dict[str, Kernel]:
        """The kernels this process runs, by key."""
        return {key: chat.kernel for key, chat in list(self._chats.items()) if chat.kernel is not None}

    # ------------------------------------------------------------------ copies of a state

    async def snapshot(
        self,
        key: str,
        into: Path,
        *,
        state_dir: Path | None = None,
        max_bytes: int | None = None,
        settings: KernelSettings | None = None,
    ) -> tuple[str, str]:
        """Copy the key's Python state into the folder `into` (its image at `into`/kernel), the
        kernel running on, for the conversation's branches: (image id, "") or ("", why there is
        none). The kernel may run in this process, in another worker of this host, or sleep in
        `state_dir` (its saved image is the state: it is shared, not written again). `max_bytes`: a
        copy larger than this is not kept; `settings`: the message's (None: the chat's latest run's)."""
        await self._settled(key)
        kernel = self._kernel(key)
        if kernel is not None and kernel.alive:
            return await self._snapshot_here(key, kernel, into, max_bytes, settings)
        entry = await asyncio.to_thread(self._registry.get, key)
        if entry is None:
            return "", "this chat has no Python state"
        if entry.running and owned_here(entry) and entry.owner != self._owner:
            request: dict[str, object] = {"op": "snapshot", "into": str(into), "max_bytes": max_bytes}
            if settings is not None:
                request["settings"] = settings.model_dump()
            try:
                reply = await _relay.ask(entry, request, _SNAPSHOT_REPLY_S)
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
        self, key: str, kernel: Kernel, into: Path, max_bytes: int | None, settings: KernelSettings | None
    ) -> tuple[str, str]:
        settings = settings or self._chat(key).settings
        limit = settings.max_image_bytes
        if limit == 0:
            return "", "saving Python states is turned off"
        if max_bytes is not None:
            limit = max_bytes if limit is None else min(limit, max_bytes)
        if limit is not None:  # a copy clearly too big is not written only to be thrown away
            memory = await asyncio.to_thread(_memory_of, kernel) - _SANDBOX_OVERHEAD
            # Compressed, a kernel's memory takes a fourth to a half of itself on disk (random numbers
            # all of it): only memory that could not fit even at an eighth is clearly too big.
            if memory > (_BEST_RATIO if settings.compress else 1) * limit:
                held = f"{memory / 2**20:.0f} MiB"
                return "", f"its memory of {held} is more than {human_bytes(limit)} can hold"
        t0 = time.monotonic()
        staging: Path | None = None
        try:
            staging = await asyncio.to_thread(_hibernate.new_staging, into)
            await kernel.checkpoint(staging, self.runner.checkpoint_flags(), leave_running=True)
            identity = await self._image_identity(kernel.limits)
            ready, packed = kernel.ready_fields(), settings.compress
            base = await asyncio.to_thread(self._shared_base, kernel.base) if packed else None
            image = await asyncio.to_thread(
                functools.partial(_hibernate.seal, staging, into, identity, ready, packed=packed, base=base)
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
        _saving.log_written(kernel, key, "state copied", t0, image)
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

    # ------------------------------------------------------------------ starting and ending

    def _misfit(self, kernel: Kernel, workdir: Path, limits: Limits) -> str | None:
        """Why this kernel cannot take the next run, or None."""
        if not kernel.alive:
            return kernel.lost or "the kernel stopped"
        if kernel.sandbox.workdir != workdir:
            return "the chat's folder was replaced"
        if lifetime_limits(kernel.limits) != lifetime_limits(limits):
            return "the admin changed the sandbox's limits"
        return None

    async def _start(
        self,
        key: str,
        workdir: Path,
        limits: Limits,
        state_dir: Path | None,
        code: str,
        language: str,
        settings: KernelSettings,
    ) -> Kernel:
        """A new kernel for the key, whose first cell is `code`: resumed from the warm-start template
        when that cell needs more than the standard library (see _warm.wants_template), else cold."""
        if state_dir is not None:  # an older image is stale from now on: never resumed over a newer state
            await asyncio.to_thread(_hibernate.discard, state_dir)
        await self._room.reserve(key, workdir, settings.max_kernels)
        if self.warm_start:
            identity = await self._image_identity(limits)
            if wants_template(code, language):
                warm = await self._warm.resume(workdir, limits, identity)
            else:
                warm = None
                await self._warm.build_if_missing(limits, identity)  # for the next data chat
            if warm is not None:
                await self._register(key, warm, workdir)
                log.info(
                    "kernel %s started warm for %s in %.2f s", warm.cid, key, time.time() - warm.started_at
                )
                return warm
        sandbox, watch = await self.runner.prepare(
            KERNEL_SOURCE, "python", workdir, limits, prefix="cs-k-", compile_once=True, kernel=True
        )
        kernel = Kernel(sandbox, limits)
        try:
            await kernel.start(watch)
        except BaseException as error:
            await kernel.close()
            await asyncio.to_thread(self._room.unreserve, key, str(error) or "the kernel could not start")
            raise
        await self._register(key, kernel, workdir)
        log.info("kernel %s started for %s in %.2f s", kernel.cid, key, time.time() - kernel.started_at)
        return kernel

    async def _resume(
        self,
        key: str,
        workdir: Path,
        limits: Limits,
        state_dir: Path | None,
        entry: Entry | None,
        notes: list[str],
        settings: KernelSettings,
    ) -> Kernel | None:
        """The chat's saved kernel, resumed; None (and the sentence in `notes` when a saved state
        was lost) when there is none to resume."""
        if state_dir is None or entry is None or entry.running or not entry.image:
            return None
        t0 = time.monotonic()
        reserved = False
        try:
            identity = await self._image_identity(limits)
            image = await asyncio.to_thread(_hibernate.load, state_dir, entry.image, identity)
            await self._room.reserve(key, workdir, settings.max_kernels)
            reserved = True
            sandbox, watch = await self.runner.prepare(
                KERNEL_SOURCE,
                "python",
                workdir,
                limits,
                prefix="cs-k-",
                compile_once=True,
                kernel=True,
                restore_from=None if image.packed else image.folder,
                restore_unpacked=image.packed,
            )
            kernel = Kernel(sandbox, limits)
            base = await asyncio.to_thread(self._base_for, image, identity) if image.base else None
            unpack = (
                functools.partial(_hibernate.unpack, image, sandbox.image_dir, base) if image.packed else None
            )
            kernel.base = base
            try:
                await kernel.resume_checked(
                    watch, image.ready, "", functools.partial(_hibernate.verify, image), unpack
                )
            except BaseException:
                await kernel.close()
                raise
        except (ImageRefused, KernelLost) as lost:
            log.warning("kernel of %s: saved state not resumed: %s", key, lost)
            notes.append(reset_sentence(str(lost)))
            await asyncio.to_thread(_hibernate.discard, state_dir)
            entry.image, entry.reason = "", str(lost)
            await asyncio.to_thread(self._registry.save_if_same, entry)
            return None
        except BaseException as error:
            # Any other failure gives back the place reserved for it, as a failed start does.
            if reserved:
                reason = str(error) or "the saved kernel could not resume"
                await asyncio.to_thread(self._room.unreserve, key, reason)
            raise
        await self._register(key, kernel, workdir)
        # Resumed: the image is behind the live state from now on, so it goes (a crash must not bring
        # back an older state without a word).
        await asyncio.to_thread(_hibernate.discard, state_dir)
        log.info("kernel %s of %s resumed from disk in %.2f s", kernel.cid, key, time.monotonic() - t0)
        return kernel

    def _base_for(self, image: _hibernate.SavedImage, identity: dict[str, object]) -> _delta.Base | None:
        """The template pages an image was stored against: this host's template when it is that one
        (hot in the page cache), else the copy beside the registry; None when neither holds them."""
        places = [self._warm.pages(identity), self._bases_dir / f"{image.base}.img"]
        size = image.unpacked_base_size
        return _delta.find(image.base, size, places)

    def _shared_base(self, base: _delta.Base | None) -> _delta.Base | None:
        """`base`, once a copy of it is beside the registry (so that any process or host sharing the
        registry can unpack what is stored against it); None when it cannot be kept there."""
        if base is None or _hibernate.zstd_command() is None:
            return None
        try:
            _delta.keep_copy(base.path, base.digest, self._bases_dir)
        except OSError as error:
            log.warning("the template's pages could not be kept beside the registry: %s", error)
            return None
        return base

    async def _image_identity(self, limits: Limits) -> dict[str, object]:
        if self._identity is None:
            self._identity = {**await self.runner.sandbox_identity(), "kernel_program": _KERNEL_DIGEST}
        return {**self._identity, "lifetime_limits": list(lifetime_limits(limits))}

    async def _register(self, key: str, kernel: Kernel, workdir: Path) -> None:
        kernel.last_used = time.monotonic()  # idle from now, not from before its (slow) start
        chat = self._chat(key)
        chat.kernel = kernel
        sock = self._socket_path(key, kernel.cid)
        try:
            chat.server = await _relay.listen(sock, functools.partial(self._serve, key))
        except OSError as error:  # other workers then start their own after this one stops
            log.warning("kernel %s: cannot serve it to other workers: %s", kernel.cid, error)
        entry = Entry(
            key, kernel.cid, HOST, self._owner, str(sock), str(workdir), time.time(), time.time(), True
        )
        await asyncio.to_thread(self._registry.save, entry)

    async def _end(self, key: str, kernel: Kernel, reason: str, *, save: bool = False) -> None:
        """Stop the key's kernel; `save`: write its state to the chat's state folder first, so the
        next run resumes it (`reason` is then said only if that fails). Once per kernel: a run that
        finds its kernel gone after a save must not overwrite what the save recorded."""
        ended = self._ended.get(kernel)
        if ended is not None:  # another call is ending it: return once the registry says why
            await asyncio.shield(ended)
            return
        ended = self._ended[kernel] = asyncio.get_running_loop().create_future()
        try:
            await self._end_once(key, kernel, reason, save)
        finally:
            ended.set_result(None)

    async def _end_once(self, key: str, kernel: Kernel, reason: str, save: bool) -> None:
        chat = self._chat(key)
        if save and chat.kernel is kernel:
            chat.kernel = None  # being saved: no run may use it meanwhile (they wait in _settled)
        if chat.server is not None and chat.kernel in (kernel, None):
            chat.server.close()
            chat.server = None
        state_dir = chat.state_dir
        image, unsaved = "", ""
        if save and state_dir is not None and kernel.alive and chat.settings.max_image_bytes != 0:
            done = asyncio.get_running_loop().create_future()
            chat.saving = done
            try:
                image, unsaved = await self._save_state(key, kernel, state_dir, chat.settings)
            finally:
                chat.saving = None
                done.set_result(None)
        await kernel.close(reason)
        entry = await asyncio.to_thread(self._registry.get, key)
        if entry is not None and entry.cid == kernel.cid:
            entry.running, entry.saving, entry.stop_requested = False, False, ""
            entry.image, entry.unsaved = image, bool(unsaved)
            entry.reason = unsaved or ("" if image else kernel.lost or reason)
            await asyncio.to_thread(self._registry.save, entry)
        # A kernel that died is held until the registry says why it ended: a run meanwhile finds it
        # lost and waits for this (`_end` again), then reads the real cause, not a running entry.
        if chat.kernel is kernel:
            chat.kernel = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._socket_path(key, kernel.cid))  # its own: a newer kernel's has another name

    async def _save_state(
        self, key: str, kernel: Kernel, state_dir: Path, settings: KernelSettings
    ) -> tuple[str, str]:
        """Checkpoint the kernel into `state_dir`: (image id, "") or ("", why it could not be kept)."""
        entry = await asyncio.to_thread(self._registry.get, key)
        if entry is not None and entry.cid == kernel.cid:
            entry.saving = True  # other workers of this chat wait for the image rather than start anew
            await asyncio.to_thread(self._registry.save, entry)
        identity = functools.partial(self._image_identity, kernel.limits)
        flags = self.runner.checkpoint_flags()
        packed = settings.compress
        base = await asyncio.to_thread(self._shared_base, kernel.base) if packed else None
        refusal = functools.partial(
            _saving.refusal,
            max_image_bytes=settings.max_image_bytes,
            max_together=settings.max_saved_bytes_together,
        )
        return await _saving.save(key, kernel, state_dir, flags, identity, refusal, packed=packed, base=base)

    async def _settled(self, key: str) -> None:
        """Wait while this process saves the key's kernel (its next run resumes the image)."""
        chat = self._chats.get(key)
        ending = chat.saving if chat is not None else None
        if ending is not None:
            await asyncio.shield(ending)

    async def _entry_once_saved(self, key: str) -> Entry | None:
        """The key's registry entry, once no other worker of this host is saving its kernel."""
        deadline = time.monotonic() + _SAVING_WAIT_S
        while True:
            entry = await asyncio.to_thread(self._registry.get, key)
            if entry is None or not (entry.running and entry.saving and owned_here(entry)):
                return entry
            if time.monotonic() > deadline:
                return entry
            await asyncio.sleep(0.05)

    # ------------------------------------------------------------------ what the next run says

    def _lost_sentence(self, entry: Entry | None) -> str:
        """What the next run says of a state it could not resume ("" when nothing was lost)."""
        if entry is None:
            return ""  # this chat never had a kernel (or its chat was deleted): nothing was lost
        if entry.running:
            if entry.host != HOST:
                return reset_sentence("this chat's previous runs were on another server")
            return reset_sentence("Open WebUI restarted" if not owned_here(entry) else "the kernel stopped")
        if entry.unsaved:
            return unsaved_sentence(entry.reason or "it could not be saved")
        return reset_sentence(entry.reason or "the kernel stopped")

    # ------------------------------------------------------------------ where it is found

    def _socket_path(self, key: str, cid: str) -> Path:
        # Named by the kernel, not only the chat: an old kernel's teardown never removes a newer
        # kernel's socket (a chat whose worker lost its socket is taken over by another worker).
        return self.socket_dir / f"{digest(key)[:20]}-{cid[-16:]}.sock"

    async def _note_use(self, key: str, kernel: Kernel) -> None:
        """Keep the registry's last use roughly current (other workers' LRU reads it): at most every
        _TOUCH_EVERY_S, so a warm step does not pay a file write."""
        chat = self._chat(key)
        if time.monotonic() - chat.touched >= _TOUCH_EVERY_S:
            chat.touched = time.monotonic()
            await asyncio.to_thread(self._registry.touch, key, kernel.cid, time.time())

    # ------------------------------------------------------------------ serving the other workers

    async def _serve(self, key: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Another worker of this host asks this process's kernel. Only our own user's processes can
        reach the socket (mode 0600 in a 0700 folder owned by us) and the peer's credentials are
        checked too; a request must name this chat and this kernel, or it is refused (a registry
        entry pointing at another chat's socket never runs a cell in that chat). A run or a copy
        brings its message's settings, which the chat keeps as a local run's would."""
        try:
            uid = _relay.peer_uid(writer)
            if uid != os.geteuid():
                log.warning("kernel of %s: refused a request from uid %s", key, uid)
                await _relay.send(writer, {"refused": "not our user"})
                return
            request = await _relay.receive(reader)
            chat = self._chats.get(key)
            kernel = chat.kernel if chat is not None else None
            if chat is None or kernel is None or not kernel.alive:
                await _relay.send(writer, {"gone": True})
                return
            if request.get("key") != key or request.get("cid") != kernel.cid:
                log.warning("kernel %s of %s: refused a request for another chat or kernel", kernel.cid, key)
                await _relay.send(writer, {"refused": "not this chat's kernel"})
                return
            try:  # the asker's message's; one another version of the function cannot read is not used
                settings = (
                    KernelSettings.model_validate(request["settings"]) if "settings" in request else None
                )
            except ValidationError:
                settings = None
            if request.get("op") == "stop":
                if request.get("if_idle") is True and (kernel.busy or chat.in_run):
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
                into = Path(str(request.get("into")))
                image, why = await self._snapshot_here(key, kernel, into, limit, settings)
                await _relay.send(writer, {"image": image, "why": why})
                return
            if settings is not None:
                chat.settings = settings
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


def _refused(why: str, notes: list[str]) -> RunResult:
    return RunResult(
        outcome=Outcome.SANDBOX_FAILURE,
        exit_code=None,
        stdout="",
        stderr="",
        duration_s=0.0,
        reason=f"the Python kernel could not start: {why}",
        notes=tuple(notes),
    )


def _memory_of(kernel: Kernel) -> int:
    """A kernel's memory: what its cgroup is charged; without cgroups, the proportional memory of its
    host processes (which misses the part of gVisor's memory file no process maps at the moment)."""
    cgroup = kernel.sandbox.cgroup
    charged = cgroup.memory_bytes() if cgroup is not None else None
    return charged if charged is not None else pss_bytes(kernel.host_pids())


def _ended_entry(key: str, reason: str, entry: Entry | None = None) -> Entry:
    """The key's registry entry for a kernel that is not running, saying `reason` at its next run."""
    now = time.time()
    if entry is None:
        entry = Entry(key, "", HOST, "", "", "", now, now, False)
    entry.running, entry.reason, entry.image, entry.unsaved, entry.saving = False, reason, "", False, False
    entry.stop_requested = ""
    return entry
