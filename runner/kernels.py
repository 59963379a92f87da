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
import errno
import fcntl
import functools
import hashlib
import json
import logging
import os
import secrets
import shutil
import socket
import stat
import struct
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import _hibernate
from ._hibernate import ImageRefused
from ._kernel import KERNEL_SOURCE, Kernel, KernelLost, NotSaved, lifetime_limits
from ._orphans import owner_stamp
from ._supervise import human_bytes
from ._warm import WarmStart
from .capabilities import run_quick
from .models import KernelSettings, Limits, Outcome, RunResult
from .runner import Runner

__all__ = ["KernelPool", "reset_sentence", "unsaved_sentence"]

log = logging.getLogger("code_sessions.runner")

# How often this process looks at its kernels: idle ones stop, and ones another host asked to stop
# (the chat moved there) stop within this.
_REAP_EVERY_S = 2.0
_HANDOVER_WAIT_S = 10.0  # how long a host waits for another one to stop a chat's kernel
_TOUCH_EVERY_S = 30.0
_CONNECT_TIMEOUT_S = 2.0
_MAX_MESSAGE = 80 * 1024 * 1024  # a run request carries the code (the kernel takes up to 64 MiB)
_HEADER = struct.Struct(">I")
_REPLY_MARGIN_S = 15.0  # a relayed run's reply may come this long after its time limit
_STOP_REPLY_S = 10.0  # a stop request is answered at once (the kernel is stopped after the reply)
_SETTLE_REMOTE_S = 8.0  # after the asker gives up, how long it waits for the cell there to stop
_ROOM_WAIT_S = 30.0  # how long a start waits for a kernel to become idle before going over max_kernels
_ROOM_POLL_S = 0.1
_STARTING = "starting-"  # the cid of a registry entry that holds a place for a kernel being started
_SAVING_WAIT_S = 90.0  # how long a run waits for another worker to finish saving its chat's kernel
_SHUTDOWN_SAVE_S = 8.0  # at exit, how long saving every idle kernel may take (a stop timeout is ~10 s)
_KERNEL_DIGEST = hashlib.sha256(KERNEL_SOURCE.encode()).hexdigest()[:16]


def _host_id() -> str:
    """This host, for the registry (shared by several hosts when the store is): its name and boot,
    or CODE_SESSIONS_HOST_ID (replicas sharing one machine, as in the tests, are told apart by it)."""
    if os.environ.get("CODE_SESSIONS_HOST_ID"):
        return os.environ["CODE_SESSIONS_HOST_ID"][:200]
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}:{boot}"


_HOST = _host_id()


def reset_sentence(reason: str) -> str:
    return f"The Python state was reset ({reason}); files in /mnt/data are kept."


def unsaved_sentence(reason: str) -> str:
    return f"The Python state could not be kept ({reason}); files in /mnt/data are kept."


@dataclass
class _Entry:
    key: str
    cid: str
    host: str
    owner: str  # "<pid> <start time> <pool>" of the process (and its pool) that started it
    socket: str
    workdir: str
    started_at: float
    last_used: float
    running: bool
    reason: str = ""  # why it ended, once it has
    stop_requested: str = ""  # another host asks the owner to stop it (the chat moved there)
    image: str = ""  # it ended saved to disk: the id of its image in the chat's state folder
    unsaved: bool = False  # it should have been saved, and `reason` says why it could not be
    saving: bool = False  # its owner is writing its image now: wait, then resume it

    @classmethod
    def load(cls, path: Path) -> _Entry | None:
        try:
            data = json.loads(path.read_bytes()[: 1 << 16])
            fields = cls.__dataclass_fields__
            entry = cls(**{k: data[k] for k in fields if k in data})
        except (OSError, ValueError, KeyError, TypeError):
            return None
        typed = all(isinstance(getattr(entry, k), type(getattr(cls, k, ""))) for k in ("image", "reason"))
        return entry if typed else None


class KernelPool:
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
            if entry is not None and entry.running and entry.owner != self._owner and self._owned_here(entry):
                try:
                    result = await self._run_remote(entry, workdir, code, language, limits)
                except _OwnerSilent as silent:
                    await self._strand(entry, str(silent))
                    result = None
                if result is not None:
                    log.info(
                        "kernel %s of %s: run by the worker that holds it (%s)", entry.cid, key, entry.owner
                    )
                    return result
                entry = await asyncio.to_thread(self._entry, key)  # it ended meanwhile: why?
            if entry is not None and entry.running and entry.host != _HOST:
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
                    kernel = await self._start(key, workdir, limits, state_dir)
                except KernelLost as lost:
                    return _refused(str(lost), notes)
        try:
            result = await kernel.run(code, language, limits)
        except KernelLost as lost:  # it had died since the last run: once more in a new one
            await self._end(key, kernel, str(lost))
            notes.append(reset_sentence(str(lost)))
            try:
                kernel = await self._start(key, workdir, limits, state_dir)
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
            entry = await asyncio.to_thread(self._entry, key)
            if entry is not None and entry.running and self._owned_here(entry):
                try:
                    await self._ask(entry, {"op": "stop", "reason": reason})
                except _OwnerSilent as silent:
                    await self._strand(entry, str(silent))
            elif entry is not None and not forget:
                entry.running, entry.reason = False, reason  # the next run says this, not an older why
                await asyncio.to_thread(self._save, entry)
        entry = await asyncio.to_thread(self._entry, key)
        if entry is not None and entry.image and not forget:
            entry.image = ""
            await asyncio.to_thread(self._save, entry)
        for folder in {state_dir, self._state_dirs.pop(key, None)} - {None}:
            assert folder is not None
            await asyncio.to_thread(_hibernate.discard, folder)
        if forget:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._entry_path(key))

    async def hibernate(self, key: str) -> str | None:
        """Save the key's kernel to its state folder now and stop it, as idling would. None when it
        was saved; else why not (no kernel of it here, no state folder, or what the save said)."""
        await self._settled(key)
        kernel = self._mine.get(key)
        if kernel is None:
            return "no kernel of this chat runs in this process"
        await self._end(key, kernel, "it was saved", save=True)
        entry = await asyncio.to_thread(self._entry, key)
        if entry is None:
            return "its registry entry is gone"
        return None if entry.image else entry.reason or "it was not saved"

    async def close(self) -> None:
        """Stop every kernel of this process (its owner is going away), saving the idle ones that
        have a state folder, all within _SHUTDOWN_SAVE_S; the rest are stopped with their state."""
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
        _SHUTDOWN_SAVE_S: every `runsc checkpoint` at once (processes: no new thread may start this
        late), then each image sealed. Blocking, as no event loop is left. A kernel not saved in
        time dies with the process, and its next run says so."""
        setup = self.runner._setup
        targets = [
            (key, kernel, self._state_dirs[key])
            for key, kernel in list(self._mine.items())
            if kernel.alive and not kernel.busy and key in self._state_dirs and kernel.ready is not None
        ]
        if not targets or setup is None or self.settings.max_image_bytes == 0:
            return
        identity = {**self.runner.sandbox_identity_now(setup), "kernel_program": _KERNEL_DIGEST}
        started: list[tuple[str, Kernel, Path, Path, subprocess.Popen[bytes], _Entry]] = []
        for key, kernel, state_dir in targets:
            entry = self._entry(key)
            if entry is None or entry.cid != kernel.cid:
                continue
            try:
                staging = _hibernate.new_staging(state_dir)
                argv = kernel.checkpoint_argv(staging, self.runner.checkpoint_flags())
                job = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            except OSError as error:
                log.warning("kernel %s of %s: not saved at exit: %s", kernel.cid, key, error)
                continue
            entry.saving = True
            self._save(entry)
            started.append((key, kernel, state_dir, staging, job, entry))
        deadline = time.monotonic() + _SHUTDOWN_SAVE_S
        for key, kernel, state_dir, staging, job, entry in started:
            image_id, why = "", "Open WebUI stopped before it was written"
            try:
                code = job.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                job.kill()
                code = None
            try:
                if code == 0:
                    full = {**identity, "lifetime_limits": list(lifetime_limits(kernel.limits))}
                    image = _hibernate.seal(staging, state_dir, full, kernel.ready_fields())
                    refused = self._refusal(state_dir, image)
                    if refused is not None:
                        _hibernate.discard(state_dir)
                        why = refused
                    else:
                        image_id = image.id
                elif code is not None:
                    why = f"runsc could not save it (exit status {code})"
            except (OSError, ImageRefused) as error:
                log.warning("kernel %s of %s: not saved at exit: %s", kernel.cid, key, error)
                why = "its image could not be written"
            finally:
                shutil.rmtree(staging, ignore_errors=True)
            entry.running, entry.saving, entry.image = False, False, image_id
            entry.unsaved, entry.reason = not image_id, "" if image_id else why
            self._save(entry)

    def kernels(self) -> dict[str, Kernel]:
        """The kernels this process runs, by key."""
        return dict(self._mine)

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
                entry = await asyncio.to_thread(self._entry, key)
                if key in self._in_run or self._mine.get(key) is not kernel:
                    continue  # a run began meanwhile
                if entry is not None and entry.cid != kernel.cid:
                    await self._end(key, kernel, "another kernel took over its chat")
                elif entry is not None and entry.stop_requested:
                    await self._end(key, kernel, entry.stop_requested, save=True)

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

    async def _start(self, key: str, workdir: Path, limits: Limits, state_dir: Path | None) -> Kernel:
        if state_dir is not None:  # an older image is stale from now on: never resumed over a newer state
            await asyncio.to_thread(_hibernate.discard, state_dir)
        await self._reserve(key, workdir)
        if self.warm_start:
            warm = await self._warm.resume(workdir, limits, await self._image_identity(limits))
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
        entry: _Entry | None,
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
            await asyncio.to_thread(self._save_if_same, entry)
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
            await asyncio.to_thread(self._prepare_socket, sock)
            self._servers[key] = await asyncio.start_unix_server(
                lambda r, w, k=key: self._serve(k, r, w), path=str(sock)
            )
            os.chmod(sock, 0o600)
        except OSError as error:  # other workers then start their own after this one stops
            log.warning("kernel %s: cannot serve it to other workers: %s", kernel.cid, error)
        entry = _Entry(
            key, kernel.cid, _HOST, self._owner, str(sock), str(workdir), time.time(), time.time(), True
        )
        await asyncio.to_thread(self._save, entry)

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
        entry = await asyncio.to_thread(self._entry, key)
        if entry is not None and entry.cid == kernel.cid:
            entry.running, entry.saving, entry.stop_requested = False, False, ""
            entry.image, entry.unsaved = image, bool(unsaved)
            entry.reason = unsaved or ("" if image else kernel.lost or reason)
            await asyncio.to_thread(self._save, entry)
        # A kernel that died is held until the registry says why it ended: a run meanwhile finds it
        # lost and waits for this (`_end` again), then reads the real cause, not a running entry.
        if self._mine.get(key) is kernel:
            del self._mine[key]
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._socket_path(key, kernel.cid))  # its own: a newer kernel's has another name

    async def _save_state(self, key: str, kernel: Kernel, state_dir: Path) -> tuple[str, str]:
        """Checkpoint the kernel into `state_dir`: (image id, "") or ("", why it could not be kept)."""
        t0 = time.monotonic()
        entry = await asyncio.to_thread(self._entry, key)
        if entry is not None and entry.cid == kernel.cid:
            entry.saving = True  # other workers of this chat wait for the image rather than start anew
            await asyncio.to_thread(self._save, entry)
        staging: Path | None = None
        try:
            staging = await asyncio.to_thread(_hibernate.new_staging, state_dir)
            await kernel.checkpoint(staging, self.runner.checkpoint_flags())
            identity = await self._image_identity(kernel.limits)
            image = await asyncio.to_thread(
                _hibernate.seal, staging, state_dir, identity, kernel.ready_fields()
            )
            staging = None
            refused = await asyncio.to_thread(self._refusal, state_dir, image)
            if refused is not None:
                await asyncio.to_thread(_hibernate.discard, state_dir)
                raise NotSaved(refused)
        except NotSaved as error:
            log.warning("kernel %s of %s: not saved: %s", kernel.cid, key, error)
            return "", str(error)
        except (OSError, ImageRefused) as error:
            why = "the disk is full" if getattr(error, "errno", None) == errno.ENOSPC else str(error)
            log.warning("kernel %s of %s: not saved: %s", kernel.cid, key, error)
            await asyncio.to_thread(_hibernate.discard, state_dir)
            return "", f"its image could not be written: {why}"[:300]
        finally:
            if staging is not None:
                await asyncio.to_thread(shutil.rmtree, staging, True)
        log.info(
            "kernel %s of %s saved to disk in %.2f s (%.1f MiB)",
            kernel.cid,
            key,
            time.monotonic() - t0,
            image.size / 2**20,
        )
        return image.id, ""

    def _refusal(self, state_dir: Path, image: _hibernate.SavedImage) -> str | None:
        """Why a sealed image may not be kept (blocking: it reads the neighbours' records), or None."""
        size = f"{image.size / 2**20:.0f} MiB"
        if self.settings.max_image_bytes is not None and image.size > self.settings.max_image_bytes:
            limit = human_bytes(self.settings.max_image_bytes)
            return f"its image of {size} is over the {limit} allowed for a saved state"
        together_max = self.settings.max_saved_bytes_together
        if together_max is not None:
            together = _hibernate.saved_bytes_beside(state_dir)
            if together > together_max:
                return (
                    f"with its image of {size}, this user's saved states would take "
                    f"{human_bytes(together)}, over the {human_bytes(together_max)} allowed together"
                )
        return None

    async def _settled(self, key: str) -> None:
        """Wait while this process saves the key's kernel (its next run resumes the image)."""
        ending = self._ending.get(key)
        if ending is not None:
            await asyncio.shield(ending)

    async def _entry_once_saved(self, key: str) -> _Entry | None:
        """The key's registry entry, once no other worker of this host is saving its kernel."""
        deadline = time.monotonic() + _SAVING_WAIT_S
        while True:
            entry = await asyncio.to_thread(self._entry, key)
            if entry is None or not (entry.running and entry.saving and self._owned_here(entry)):
                return entry
            if time.monotonic() > deadline:
                return entry
            await asyncio.sleep(0.05)

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
            place = _Entry(
                key,
                f"{_STARTING}{secrets.token_hex(6)}",
                _HOST,
                self._owner,
                "",
                str(workdir),
                now,
                now,
                True,
            )
            await asyncio.to_thread(self._save, place)
        finally:
            os.close(fd)  # releases the lock

    def _unreserve(self, key: str, why: str) -> None:
        entry = self._entry(key)
        if entry is not None and entry.cid.startswith(_STARTING) and entry.owner == self._owner:
            entry.running, entry.reason = False, why[:300]
            self._save(entry)

    async def _make_room(self, key: str) -> None:
        """Beyond max_kernels on this host, stop (save) the least recently used idle one. A kernel
        running a cell, or still starting, is never chosen (its owner says when it is busy); with
        none idle, wait up to _ROOM_WAIT_S for one to be, then go over the limit rather than kill a
        run."""
        deadline = time.monotonic() + _ROOM_WAIT_S
        most = self.settings.max_kernels
        reason = f"too many kernels were running (at most {most}); it was the least recently used"
        busy: set[str] = set()  # keys another worker said are running a cell now
        entries = [e for e in await asyncio.to_thread(self._running_here) if e.key != key]
        while len(entries) >= self.settings.max_kernels:
            idle = [
                e
                for e in entries
                if not e.cid.startswith(_STARTING)
                and e.key not in busy
                and e.key not in self._in_run
                and not (e.key in self._mine and self._mine[e.key].busy)
            ]
            if not idle:
                if time.monotonic() > deadline:
                    return
                await asyncio.sleep(_ROOM_POLL_S)
                busy.clear()
                entries = [e for e in await asyncio.to_thread(self._running_here) if e.key != key]
                continue
            victim = min(idle, key=lambda e: e.last_used)
            if victim.key in self._mine:
                await self._end(victim.key, self._mine[victim.key], reason, save=True)
            else:
                # Its owner saves it and records that itself; a busy one it keeps, and says so.
                request = {"op": "stop", "reason": reason, "save": True, "if_idle": True}
                try:
                    reply = await self._ask(victim, request)
                except _OwnerSilent as silent:
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

    # ------------------------------------------------------------------ other workers

    def _owned_here(self, entry: _Entry) -> bool:
        """A running entry whose owning process is alive on this host (its kernel dies with it)."""
        if entry.host != _HOST:
            return False
        try:
            pid, started = entry.owner.split()[:2]
            with open(f"/proc/{int(pid)}/stat", "rb") as fh:
                return fh.read().rsplit(b")", 1)[1].split()[19].decode() == started
        except (OSError, ValueError, IndexError):
            return False

    def _lost_sentence(self, entry: _Entry | None) -> str:
        """What the next run says of a state it could not resume ("" when nothing was lost)."""
        if entry is None:
            return ""  # this chat never had a kernel (or its chat was deleted): nothing was lost
        if entry.running:
            if entry.host != _HOST:
                return reset_sentence("this chat's previous runs were on another server")
            return reset_sentence(
                "Open WebUI restarted" if not self._owned_here(entry) else "the kernel stopped"
            )
        if entry.unsaved:
            return unsaved_sentence(entry.reason or "it could not be saved")
        return reset_sentence(entry.reason or "the kernel stopped")

    async def _take_over(self, entry: _Entry) -> None:
        """The chat's kernel runs on another host (its runs reach that host's replica no longer): ask
        that host to stop it, and wait until it has, so the chat never has two kernels at once. A host
        that does not answer within _HANDOVER_WAIT_S is taken to be gone (its kernels died with it)."""
        reason = "this chat's previous runs were on another server"
        entry.stop_requested = reason
        await asyncio.to_thread(self._save_if_same, entry)
        deadline = time.monotonic() + _HANDOVER_WAIT_S
        while time.monotonic() < deadline:
            now = await asyncio.to_thread(self._entry, entry.key)
            if now is None or now.cid != entry.cid or not now.running:
                return
            await asyncio.sleep(0.2)
        log.warning(
            "kernel %s of %s on %s did not stop when asked: taken to be gone",
            entry.cid,
            entry.key,
            entry.host,
        )

    async def _run_remote(
        self, entry: _Entry, workdir: Path, code: str, language: str, limits: Limits
    ) -> RunResult | None:
        """The run, by the worker that holds the chat's kernel; None if that kernel is gone. Raises
        _OwnerSilent if that worker does not answer within the run's time limit and a margin."""
        request = {
            "op": "run",
            "code": code,
            "language": language,
            "limits": limits.model_dump(),
            "workdir": str(workdir),
        }
        reply = await self._ask(entry, request, limits.timeout_s + _REPLY_MARGIN_S)
        if reply is None or "result" not in reply:
            return None
        return RunResult.model_validate(reply["result"])

    async def _ask(
        self, entry: _Entry, request: dict[str, Any], reply_within: float = _STOP_REPLY_S
    ) -> dict[str, Any] | None:
        """One request to the worker serving `entry`'s kernel, naming the chat and kernel it is for.
        None when no such kernel answers there; _OwnerSilent when the worker accepts and says nothing
        for `reply_within` s (stopped, stuck). If the caller is cancelled (the user stopped the
        answer), the worker is told (the connection is half-closed), and the caller waits, bounded, for
        the cell there to stop: what it wrote is then on disk before the caller reconciles."""
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_unix_connection(entry.socket, limit=_MAX_MESSAGE), _CONNECT_TIMEOUT_S
            )
        except (OSError, TimeoutError):
            return None
        try:
            await _send(writer, {**request, "key": entry.key, "cid": entry.cid})
            try:
                return await asyncio.wait_for(_receive(reader), reply_within)
            except TimeoutError:
                raise _OwnerSilent(
                    f"the worker holding it did not answer within {reply_within:g} s"
                ) from None
            except asyncio.CancelledError:
                with contextlib.suppress(OSError):
                    writer.write_eof()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.shield(_receive(reader)), _SETTLE_REMOTE_S)
                raise
        except (OSError, ValueError, asyncio.IncompleteReadError):
            return None
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def _strand(self, entry: _Entry, why: str) -> None:
        """The worker holding the chat's kernel does not answer: kill that kernel (same host, same
        user, same runsc state), so the chat never has two, and record why its state went."""
        with contextlib.suppress(Exception):
            setup = await self.runner.setup()
            base = [setup.runsc.path, "--root", str(self.runner.state_dir)]
            with contextlib.suppress(Exception):
                await run_quick([*base, "kill", "--all", entry.cid, "KILL"], _CONNECT_TIMEOUT_S * 5)
            with contextlib.suppress(Exception):
                await run_quick([*base, "delete", "--force", entry.cid], _CONNECT_TIMEOUT_S * 5)
        entry.running, entry.reason, entry.unsaved, entry.image = False, why, False, ""
        await asyncio.to_thread(self._save_if_same, entry)
        log.warning("kernel %s of %s: %s; stopped it", entry.cid, entry.key, why)

    async def _serve(self, key: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Another worker of this host asks this process's kernel. Only our own user's processes can
        reach the socket (mode 0600 in a 0700 folder owned by us) and the peer's credentials are
        checked too; a request must name this chat and this kernel, or it is refused (a registry
        entry pointing at another chat's socket never runs a cell in that chat)."""
        try:
            uid = _peer_uid(writer)
            if uid != os.geteuid():
                log.warning("kernel of %s: refused a request from uid %s", key, uid)
                await _send(writer, {"refused": "not our user"})
                return
            request = await _receive(reader)
            kernel = self._mine.get(key)
            if kernel is None or not kernel.alive:
                await _send(writer, {"gone": True})
                return
            if request.get("key") != key or request.get("cid") != kernel.cid:
                log.warning("kernel %s of %s: refused a request for another chat or kernel", kernel.cid, key)
                await _send(writer, {"refused": "not this chat's kernel"})
                return
            if request.get("op") == "stop":
                if request.get("if_idle") is True and (kernel.busy or key in self._in_run):
                    await _send(writer, {"busy": True})
                    return
                await _send(writer, {"ok": True})
                await self._end(
                    key, kernel, str(request.get("reason", "stopped")), save=request.get("save") is True
                )
                return
            limits = Limits.model_validate(request["limits"])
            misfit = self._misfit(kernel, Path(str(request.get("workdir", ""))), limits)
            if misfit is not None:  # as a local run would: this kernel cannot take it
                await self._end(key, kernel, misfit)
                await _send(writer, {"gone": True})
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
                await _send(writer, {"cancelled": True})
                return
            hangup.cancel()
            try:
                result = run.result()
            except KernelLost:
                await _send(writer, {"gone": True})
                return
            if not kernel.alive:
                await self._end(key, kernel, kernel.lost or "the kernel stopped")
            else:
                await self._note_use(key, kernel)
            await _send(writer, {"result": result.model_dump(mode="json")})
        except (OSError, ValueError, KeyError, asyncio.IncompleteReadError) as error:
            log.warning("kernel of %s: a request from another worker failed: %s", key, error)
        finally:
            writer.close()

    # ------------------------------------------------------------------ the registry

    def _digest(self, key: str) -> str:
        return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:32]

    def _entry_path(self, key: str) -> Path:
        return self.registry_dir / f"{self._digest(key)}.json"

    def _socket_path(self, key: str, cid: str) -> Path:
        # Named by the kernel, not only the chat: an old kernel's teardown never removes a newer
        # kernel's socket (a chat whose worker lost its socket is taken over by another worker).
        return self.socket_dir / f"{self._digest(key)[:20]}-{cid[-16:]}.sock"

    def _entry(self, key: str) -> _Entry | None:
        entry = _Entry.load(self._entry_path(key))
        return entry if entry is not None and entry.key == key else None

    def _save(self, entry: _Entry) -> None:
        """Best effort: a registry that cannot be written (a full disk) must not stop a chat from
        running code (which may be what frees the space). Until it can, other workers do not find
        this kernel, and a restart cannot say why the state went."""
        path = self._entry_path(entry.key)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        try:
            self.registry_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            tmp.write_text(json.dumps(entry.__dict__), encoding="utf-8")
            os.replace(tmp, path)
        except OSError as error:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            log.warning("kernel registry: cannot record %s: %s", entry.cid, error)

    def _save_if_same(self, entry: _Entry) -> None:
        now = self._entry(entry.key)
        if now is not None and now.cid == entry.cid:
            self._save(entry)

    async def _note_use(self, key: str, kernel: Kernel) -> None:
        """Keep the registry's last use roughly current (other workers' LRU reads it): at most every
        _TOUCH_EVERY_S, so a warm step does not pay a file write."""
        if time.monotonic() - self._touched.get(key, 0.0) >= _TOUCH_EVERY_S:
            self._touched[key] = time.monotonic()
            await asyncio.to_thread(self._touch, key, kernel)

    def _touch(self, key: str, kernel: Kernel) -> None:
        entry = self._entry(key)
        if entry is not None and entry.cid == kernel.cid:
            entry.last_used = time.time()
            self._save(entry)

    def _running_here(self) -> list[_Entry]:
        found = []
        with contextlib.suppress(FileNotFoundError), os.scandir(self.registry_dir) as listing:
            for item in listing:
                if item.name.endswith(".json"):
                    entry = _Entry.load(Path(item.path))
                    if entry is not None and entry.running and self._owned_here(entry):
                        found.append(entry)
        return found

    def _prepare_socket(self, path: Path) -> None:
        # The folder is what keeps other users off the socket (which is 0600 only once bound): 0700
        # and ours, even if it was there before with another mode.
        self.socket_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = self.socket_dir.lstat()
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise OSError(f"{self.socket_dir} is not a folder of ours")
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.chmod(self.socket_dir, 0o700)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


async def _send(writer: asyncio.StreamWriter, message: dict[str, Any]) -> None:
    body = json.dumps(message).encode()
    writer.write(_HEADER.pack(len(body)) + body)
    await writer.drain()


async def _receive(reader: asyncio.StreamReader) -> dict[str, Any]:
    (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    if size > _MAX_MESSAGE:
        raise ValueError(f"a message of {size} bytes")
    message = json.loads(await reader.readexactly(size))
    if not isinstance(message, dict):
        raise ValueError("not an object")
    return message


class _OwnerSilent(Exception):
    """The worker holding a chat's kernel accepted a request and did not answer in time."""


def _peer_uid(writer: asyncio.StreamWriter) -> int | None:
    sock = writer.get_extra_info("socket")
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (OSError, AttributeError):
        return None
    return struct.unpack("3i", creds)[1]


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


def _minutes(seconds: float) -> str:
    minutes = seconds / 60
    return f"{minutes:g} minutes" if minutes != 1 else "1 minute"
