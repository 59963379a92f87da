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
once it ended, why: "idle for 20 minutes", "Open WebUI restarted", "it ran out of memory". The next
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
from pathlib import Path

from . import _hibernate, _relay, _saving
from ._hibernate import ImageRefused
from ._kernel import KERNEL_SOURCE, Kernel, KernelLost, lifetime_limits
from ._orphans import owner_stamp
from ._pool_peers import _Peers
from ._pool_room import _Room
from ._pool_snapshots import _Snapshots
from ._registry import HOST, Entry, Registry, digest, owned_here
from ._relay import OwnerSilent
from ._warm import WarmStart, wants_template
from .models import KernelSettings, Limits, Outcome, RunResult
from .runner import Runner

__all__ = ["KernelPool", "reset_sentence", "unsaved_sentence"]

log = logging.getLogger("code_sessions.runner")

_TOUCH_EVERY_S = 30.0
_SAVING_WAIT_S = 90.0  # how long a run waits for another worker to finish saving its chat's kernel
_SHUTDOWN_SAVE_S = 8.0  # at exit, how long saving every idle kernel may take (a stop timeout is ~10 s)
_KERNEL_DIGEST = hashlib.sha256(KERNEL_SOURCE.encode()).hexdigest()[:16]


def reset_sentence(reason: str) -> str:
    return f"The Python state was reset ({reason}); files in /mnt/data are kept."


def unsaved_sentence(reason: str) -> str:
    return f"The Python state could not be kept ({reason}); files in /mnt/data are kept."


class KernelPool(_Room, _Peers, _Snapshots):
    """The kernels of this process, and the way to every other kernel of a chat. Its parts beside this
    file: _pool_room (places, eviction, the reaper), _pool_peers (other workers and hosts) and
    _pool_snapshots (copies of a state for the conversation's branches) are parts of this class;
    _registry, _relay and _saving are what it uses."""

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
        # Replaced whole when an admin changes them (frozen); each use reads the current value. The
        # saved images together are checked once the new image is in place, so two saves at once can
        # only both refuse, never both pass.
        self.settings = settings or KernelSettings()
        self._mine: dict[str, Kernel] = {}
        self._state_dirs: dict[str, Path] = {}  # where each kernel of ours is saved when it stops
        self._ending: dict[str, asyncio.Future[None]] = {}  # kernels being saved now, by key
        # The kernels _end has taken, by id (each is ended once); done once the registry says why.
        self._ended: dict[str, asyncio.Future[None]] = {}
        self._in_run: set[str] = set()  # keys with a run in progress here (never an LRU victim)
        self._identity: dict[str, object] | None = None
        # A new kernel resumes a template with the data stack imported (see _warm), when one is built.
        self.warm_start = warm_start
        self._warm = WarmStart(runner, runner.bundle_dir / "templates")
        # An Open WebUI restart ends its event loop before the process: the idle kernels are saved
        # then, from the exit handler (see _save_at_exit).
        atexit.register(self._save_at_exit)
        self._servers: dict[str, asyncio.AbstractServer] = {}
        self._reaper: asyncio.Task[None] | None = None
        # "<pid> <start time> <pool>": two pools of one process (files of two versions of the function
        # loaded side by side) reach each other's kernels over the socket, as two workers do.
        self._owner = f"{owner_stamp()} {secrets.token_hex(4)}"
        self._touched: dict[str, float] = {}

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
    ) -> RunResult:
        """Run a cell in the key's kernel, starting one when there is none. Call it holding the
        chat's lock. Never raises for what the code does; RunnerError for host-side problems.

        `state_dir`: the chat's own folder for its saved kernel (outside `workdir`, which the sandbox
        can write): a kernel that would be stopped (idle, least recently used, this process exiting,
        another host taking the chat) is saved there instead, and the next run resumes it, here or in
        any process that reaches the folder. Without it, such a kernel is stopped and its state lost."""
        self._keep_reaping()
        workdir = Path(os.path.realpath(workdir))
        if state_dir is not None:
            self._state_dirs[key] = Path(state_dir)
        self._in_run.add(key)
        try:
            return await self._run(key, workdir, code, language, limits, state_dir)
        finally:
            self._in_run.discard(key)

    async def _run(
        self, key: str, workdir: Path, code: str, language: str, limits: Limits, state_dir: Path | None
    ) -> RunResult:
        await self._settled(key)
        notes: list[str] = []
        kernel = self._mine.get(key)
        if kernel is not None:
            misfit = self._misfit(kernel, workdir, limits)
            if misfit is not None:
                await self._end(key, kernel, misfit)
                kernel = None
        if kernel is None:
            entry = await self._entry_once_saved(key)
            if entry is not None and entry.running and entry.owner != self._owner and owned_here(entry):
                try:
                    result = await _relay.run_remote(entry, workdir, code, language, limits)
                except OwnerSilent as silent:
                    await self._strand(entry, str(silent))
                    result = None
                if result is not None:
                    log.info(
                        "kernel %s of %s: run by the worker that holds it (%s)", entry.cid, key, entry.owner
                    )
                    return result
                entry = await asyncio.to_thread(self._registry.get, key)  # it ended meanwhile: why?
            if entry is not None and entry.running and entry.host != HOST:
                await self._take_over(entry)
                entry = await self._entry_once_saved(key)
            said = len(notes)
            kernel = await self._resume(key, workdir, limits, state_dir, entry, notes)
            if kernel is None and len(notes) == said:
                sentence = self._lost_sentence(entry)
                if sentence:
                    notes.append(sentence)
            if kernel is None:
                try:
                    kernel = await self._start(key, workdir, limits, state_dir, code, language)
                except KernelLost as lost:
                    return _refused(str(lost), notes)
        try:
            result = await kernel.run(code, language, limits)
        except KernelLost as lost:  # it had died since the last run: once more in a new one
            await self._end(key, kernel, str(lost))
            notes.append(reset_sentence(str(lost)))
            try:
                kernel = await self._start(key, workdir, limits, state_dir, code, language)
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
        kernel = self._mine.get(key)
        if kernel is not None:
            await self._end(key, kernel, reason)
        else:
            entry = await asyncio.to_thread(self._registry.get, key)
            if entry is not None and entry.running and owned_here(entry):
                try:
                    await _relay.ask(entry, {"op": "stop", "reason": reason})
                except OwnerSilent as silent:
                    await self._strand(entry, str(silent))
            elif entry is not None and not forget:
                entry.running, entry.reason = False, reason  # the next run says this, not an older why
                await asyncio.to_thread(self._registry.save, entry)
        entry = await asyncio.to_thread(self._registry.get, key)
        if entry is not None and entry.image and not forget:
            entry.image = ""
            await asyncio.to_thread(self._registry.save, entry)
        for folder in {state_dir, self._state_dirs.pop(key, None)} - {None}:
            assert folder is not None
            await asyncio.to_thread(_hibernate.discard, folder)
        if forget:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._registry.path(key))

    async def hibernate(self, key: str) -> str | None:
        """Save the key's kernel to its state folder now and stop it, as idling would. None when it
        was saved; else why not (no kernel of it here, no state folder, or what the save said)."""
        await self._settled(key)
        kernel = self._mine.get(key)
        if kernel is None:
            return "no kernel of this chat runs in this process"
        await self._end(key, kernel, "it was saved", save=True)
        entry = await asyncio.to_thread(self._registry.get, key)
        if entry is None:
            return "its registry entry is gone"
        return None if entry.image else entry.reason or "it was not saved"

    async def close(self) -> None:
        """Stop every kernel of this process (its owner is going away), saving the idle ones that
        have a state folder, all within _SHUTDOWN_SAVE_S; the rest are stopped with their state. A
        kernel whose state is being copied for a branch is idle: its save follows the copy."""
        if self._reaper is not None:
            self._reaper.cancel()
        ends = [
            asyncio.ensure_future(self._end(key, kernel, "Open WebUI restarted", save=not kernel.busy))
            for key, kernel in list(self._mine.items())
        ]
        if ends:
            _, late = await asyncio.wait(ends, timeout=_SHUTDOWN_SAVE_S)
            for task in late:
                task.cancel()
            await asyncio.gather(*ends, return_exceptions=True)

    def _save_at_exit(self) -> None:
        """Save this process's idle kernels that have a state folder, at interpreter exit, within
        _SHUTDOWN_SAVE_S (see _saving.save_at_exit)."""
        setup = self.runner.host_setup
        targets = [
            (key, kernel, self._state_dirs[key])
            for key, kernel in list(self._mine.items())
            # in_use: no event loop is left to wait for a copy being taken; runsc would refuse a second
            if kernel.alive and not kernel.in_use and key in self._state_dirs and kernel.ready is not None
        ]
        if not targets or setup is None or self.settings.max_image_bytes == 0:
            return
        identity = {**self.runner.sandbox_identity_now(setup), "kernel_program": _KERNEL_DIGEST}
        flags = self.runner.checkpoint_flags()
        _saving.save_at_exit(targets, self._registry, identity, flags, self._refusal, _SHUTDOWN_SAVE_S)

    def kernels(self) -> dict[str, Kernel]:
        """The kernels this process runs, by key."""
        return dict(self._mine)

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
        self, key: str, workdir: Path, limits: Limits, state_dir: Path | None, code: str, language: str
    ) -> Kernel:
        """A new kernel for the key, whose first cell is `code`: resumed from the warm-start template
        when that cell needs more than the standard library (see _warm.wants_template), else cold."""
        if state_dir is not None:  # an older image is stale from now on: never resumed over a newer state
            await asyncio.to_thread(_hibernate.discard, state_dir)
        await self._reserve(key, workdir)
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
            KERNEL_SOURCE, "python", workdir, limits, prefix="cs-k-", compile_once=True
        )
        kernel = Kernel(sandbox, limits)
        try:
            await kernel.start(watch)
        except BaseException as error:
            await kernel.close()
            await asyncio.to_thread(self._unreserve, key, str(error) or "the kernel could not start")
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
    ) -> Kernel | None:
        """The chat's saved kernel, resumed; None (and the sentence in `notes` when a saved state
        was lost) when there is none to resume."""
        if state_dir is None or entry is None or entry.running or not entry.image:
            return None
        t0 = time.monotonic()
        try:
            identity = await self._image_identity(limits)
            image = await asyncio.to_thread(_hibernate.load, state_dir, entry.image, identity)
            await self._reserve(key, workdir)
            sandbox, watch = await self.runner.prepare(
                KERNEL_SOURCE,
                "python",
                workdir,
                limits,
                prefix="cs-k-",
                compile_once=True,
                restore_from=image.folder,
            )
            kernel = Kernel(sandbox, limits)
            try:
                await kernel.resume_checked(
                    watch, image.ready, "", functools.partial(_hibernate.verify, image)
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
        await self._register(key, kernel, workdir)
        # Resumed: the image is behind the live state from now on, so it goes (a crash must not bring
        # back an older state without a word).
        await asyncio.to_thread(_hibernate.discard, state_dir)
        log.info("kernel %s of %s resumed from disk in %.2f s", kernel.cid, key, time.monotonic() - t0)
        return kernel

    async def _image_identity(self, limits: Limits) -> dict[str, object]:
        if self._identity is None:
            self._identity = {**await self.runner.sandbox_identity(), "kernel_program": _KERNEL_DIGEST}
        return {**self._identity, "lifetime_limits": list(lifetime_limits(limits))}

    async def _register(self, key: str, kernel: Kernel, workdir: Path) -> None:
        kernel.last_used = time.monotonic()  # idle from now, not from before its (slow) start
        self._mine[key] = kernel
        sock = self._socket_path(key, kernel.cid)
        try:
            self._servers[key] = await _relay.listen(sock, functools.partial(self._serve, key))
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
        ended = self._ended.get(kernel.cid)
        if ended is not None:  # another call is ending it: return once the registry says why
            await asyncio.shield(ended)
            return
        ended = self._ended[kernel.cid] = asyncio.get_running_loop().create_future()
        try:
            await self._end_once(key, kernel, reason, save)
        finally:
            ended.set_result(None)

    async def _end_once(self, key: str, kernel: Kernel, reason: str, save: bool) -> None:
        if save and self._mine.get(key) is kernel:
            del self._mine[key]  # being saved: no run may use it meanwhile (they wait in _settled)
        server = self._servers.pop(key, None)
        if server is not None:
            server.close()
        state_dir = self._state_dirs.get(key)
        image, unsaved = "", ""
        if save and state_dir is not None and kernel.alive and self.settings.max_image_bytes != 0:
            done = asyncio.get_running_loop().create_future()
            self._ending[key] = done
            try:
                image, unsaved = await self._save_state(key, kernel, state_dir)
            finally:
                self._ending.pop(key, None)
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
        if self._mine.get(key) is kernel:
            del self._mine[key]
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._socket_path(key, kernel.cid))  # its own: a newer kernel's has another name

    async def _save_state(self, key: str, kernel: Kernel, state_dir: Path) -> tuple[str, str]:
        """Checkpoint the kernel into `state_dir`: (image id, "") or ("", why it could not be kept)."""
        entry = await asyncio.to_thread(self._registry.get, key)
        if entry is not None and entry.cid == kernel.cid:
            entry.saving = True  # other workers of this chat wait for the image rather than start anew
            await asyncio.to_thread(self._registry.save, entry)
        identity = functools.partial(self._image_identity, kernel.limits)
        flags = self.runner.checkpoint_flags()
        return await _saving.save(key, kernel, state_dir, flags, identity, self._refusal)

    def _refusal(self, state_dir: Path, image: _hibernate.SavedImage) -> str | None:
        return _saving.refusal(
            state_dir, image, self.settings.max_image_bytes, self.settings.max_saved_bytes_together
        )

    async def _settled(self, key: str) -> None:
        """Wait while this process saves the key's kernel (its next run resumes the image)."""
        ending = self._ending.get(key)
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
        if time.monotonic() - self._touched.get(key, 0.0) >= _TOUCH_EVERY_S:
            self._touched[key] = time.monotonic()
            await asyncio.to_thread(self._registry.touch, key, kernel.cid, time.time())


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
