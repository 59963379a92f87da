"""Run one `runsc run`, capture its output within caps, enforce the deadline and the watchers, and
make sure nothing of the sandbox outlives the run.

All waiting is asyncio; the only blocking work (walking the workdir, scanning /proc) runs in threads.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import ctypes
import errno
import functools
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._cgroups import RunCgroup
from ._disk import MAX_DEPTH, watch_growth
from ._procs import pids_by_marker, sigkill
from .capabilities import run_quick
from .models import KIB, MIB, Limits

_READ_CHUNK = 64 * KIB
_GRACE_KILL_S = 3.0  # after `runsc kill`, how long runsc may take to tear the sandbox down itself
_REAP_S = 5.0  # how long stragglers (ptrace stubs) may take to die after SIGKILL
_HELPER_TIMEOUT_S = 10.0
_OOM_POLL_S = 0.25
_PR_SET_PDEATHSIG = 1
_PRCTL: Any  # a ctypes function, or None where libc has no prctl
try:
    # Resolved once here: the child, between fork and exec, only calls it.
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
    _PRCTL.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    _PRCTL.restype = ctypes.c_int
except (OSError, AttributeError):  # pragma: no cover - every Linux libc has prctl
    _PRCTL = None


def die_with(parent: int) -> Callable[[], None]:
    """For the child, between fork and exec: be SIGKILLed when this process dies.

    Our process is the sandbox's only supervisor (deadline, limits, cleanup). If it is killed (an
    Open WebUI crash, an OOM kill), runsc must not run on unsupervised: it dies with us, and gVisor
    takes the sandbox down with it. What is left on disk is removed at the next start (_orphans)."""

    def preexec() -> None:
        if _PRCTL is not None:
            _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # we died before the request above took effect
            os._exit(1)

    return preexec


@functools.cache
def setpriv_prefix() -> tuple[str, ...] | None:
    """util-linux's `setpriv --pdeathsig KILL --`, if it is here and works (looked for once)."""
    found = shutil.which("setpriv")
    if found is None:
        return None
    prefix = (found, "--pdeathsig", "KILL", "--")
    try:
        done = subprocess.run([*prefix, "true"], capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return prefix if done.returncode == 0 else None


def dying_with_us(argv: list[str]) -> tuple[list[str], Callable[[], None] | None]:
    """(argv, preexec_fn) for a runsc that must be SIGKILLed when this process dies (see die_with).

    Through setpriv where it works: a child with a preexec_fn is forked, not vforked, and forking an
    Open WebUI worker copies its page tables in the event loop's thread. Measured here: 49 ms with a
    1.2 GB RSS, against 2 ms for a vfork. setpriv asks for the signal between its exec and runsc's; if
    we die in that instant, runsc runs on, and the next start sweeps it (_orphans)."""
    prefix = setpriv_prefix()
    if prefix is None:
        return argv, die_with(os.getpid())
    if not os.access(argv[0], os.X_OK):  # what the spawn would raise without setpriv in between
        raise FileNotFoundError(errno.ENOENT, "runsc is gone", argv[0])
    return [*prefix, *argv], None


def human_bytes(n: int) -> str:
    if n >= MIB and n % MIB == 0:
        return f"{n // MIB} MiB"
    if n >= KIB and n % KIB == 0:
        return f"{n // KIB} KiB"
    return f"{n} bytes"


class Capture:
    """The first ``cap`` bytes of a stream; the rest is counted and dropped."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.data = bytearray()
        self.total = 0

    @property
    def truncated(self) -> bool:
        return self.total > self.cap

    def feed(self, chunk: bytes) -> bool:
        """Keep what fits; True once the stream has gone past the cap."""
        room = self.cap - len(self.data)
        if room > 0:
            self.data += chunk[:room]
        self.total += len(chunk)
        return self.truncated

    def text(self) -> str:
        # An incremental decoder drops a multi-byte character cut in half at the cap instead of
        # turning it into a replacement character.
        text = codecs.getincrementaldecoder("utf-8")("replace").decode(
            bytes(self.data), final=not self.truncated
        )
        if self.truncated:
            sep = "" if text.endswith("\n") or not text else "\n"
            text += f"{sep}[... output truncated at {human_bytes(self.cap)} ...]\n"
        return text


@dataclass
class Facts:
    """What supervision observed; ``_outcome.classify`` turns it into a RunResult."""

    returncode: int | None = None
    stopped_for: str | None = None  # "timeout" | "output" | "disk" | "oom", when the runner stopped it
    stop_detail: str = ""
    duration_s: float = 0.0
    oom_kills: int = 0
    leftover_pids: list[int] = field(default_factory=list)


class Supervision:
    def __init__(
        self,
        *,
        argv: list[str],
        runsc_base: list[str],
        container_id: str,
        workdir: Path,
        limits: Limits,
        cgroup: RunCgroup | None,
        marker: str,
    ) -> None:
        self.argv = argv
        self.runsc_base = runsc_base  # runsc --root STATE, for kill/delete
        self.cid = container_id
        self.workdir = str(workdir)
        self.limits = limits
        self.cgroup = cgroup
        self.marker = marker  # a string only this run's runsc processes have on their command line
        self.stdout = Capture(limits.max_output_bytes)
        self.stderr = Capture(limits.max_output_bytes)
        self.facts = Facts()
        self._proc: asyncio.subprocess.Process | None = None
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._killed = False

    def request_stop(self, kind: str, detail: str) -> None:
        if not self._stop.is_set():
            self.facts.stopped_for, self.facts.stop_detail = kind, detail
            self._stop.set()

    async def run(self) -> Facts:
        # Started first: its baseline walk overlaps gVisor's boot (~0.25 s), which is longer than
        # walking a workdir of 10k files, so it is normally done before sandboxed code can write.
        self._tasks.append(
            asyncio.create_task(
                watch_growth(
                    self.workdir,
                    self.limits.max_write_bytes,
                    self._disk_full,
                    pids=self._host_pids,
                    stop_now=self._kill_host_processes,
                )
            )
        )
        t0 = time.monotonic()
        argv, preexec = dying_with_us(self.argv)
        self._proc = proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,  # one process group to kill if runsc itself hangs
            preexec_fn=preexec,
        )
        assert proc.stdout is not None and proc.stderr is not None
        readers = [
            asyncio.create_task(self._pump(proc.stdout, self.stdout, "stdout")),
            asyncio.create_task(self._pump(proc.stderr, self.stderr, "stderr")),
        ]
        if self.cgroup is not None:
            self._tasks.append(asyncio.create_task(self._watch_oom()))
        exited = asyncio.create_task(proc.wait())
        stopper = asyncio.create_task(self._stop.wait())
        try:
            await asyncio.wait(
                {exited, stopper}, timeout=self.limits.timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
            if not exited.done():
                self.request_stop("timeout", f"killed after {self.limits.timeout_s:g} s")
                await self._kill()
            self.facts.duration_s = time.monotonic() - t0
            self.facts.returncode = await exited
            # The pipes close once every holder is gone; that is immediate unless something survived.
            _, pending = await asyncio.wait(readers, timeout=_REAP_S)
            for task in pending:
                task.cancel()
        finally:
            stopper.cancel()
            exited.cancel()
            for task in readers:
                task.cancel()
        if self.cgroup is not None:
            self.facts.oom_kills = self.cgroup.oom_kills()
        return self.facts

    async def _pump(self, stream: asyncio.StreamReader, capture: Capture, name: str) -> None:
        while chunk := await stream.read(_READ_CHUNK):
            if capture.feed(chunk):
                self.request_stop("output", f"{name} passed {human_bytes(capture.cap)}")

    def _disk_full(self, growth: int | None) -> None:
        if growth is None:
            self.request_stop("disk", f"nested folders more than {MAX_DEPTH} levels deep in /mnt/data")
            return
        limit = human_bytes(self.limits.max_write_bytes)
        self.request_stop("disk", f"wrote more than {limit} to /mnt/data (grew by {growth / MIB:.0f} MiB)")

    async def _watch_oom(self) -> None:
        assert self.cgroup is not None
        while True:
            await asyncio.sleep(_OOM_POLL_S)
            if self.cgroup.oom_kills():
                self.request_stop("oom", "")
                return

    async def _kill(self) -> None:
        """Stop the whole sandbox: politely through runsc first, then by force."""
        if self._killed or self._proc is None:
            return
        self._killed = True
        proc = self._proc
        if proc.returncode is None:
            with contextlib.suppress(Exception):
                await run_quick([*self.runsc_base, "kill", "--all", self.cid, "KILL"], _HELPER_TIMEOUT_S)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(proc.wait()), _GRACE_KILL_S)
        if proc.returncode is None:
            await asyncio.to_thread(self._kill_host_processes)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
        # runsc run normally deletes the container itself; after a forced stop it may not have.
        with contextlib.suppress(Exception):
            await run_quick([*self.runsc_base, "delete", "--force", self.cid], _HELPER_TIMEOUT_S)

    async def close(self) -> None:
        """Idempotent final cleanup, also after cancellation: kill, reap, and free the cgroup."""
        for task in self._tasks:
            task.cancel()
        if self._proc is not None and self._proc.returncode is None:
            await self._kill()
        if self._proc is not None and (self._proc.returncode or 0) < 0 and not self._killed:
            # runsc itself was killed by a signal, so it could not delete its container's state.
            with contextlib.suppress(Exception):
                await run_quick([*self.runsc_base, "delete", "--force", self.cid], _HELPER_TIMEOUT_S)
        if self.cgroup is None and not self._killed:
            return  # normal exit without cgroups: runsc cleaned up; skip the /proc scan
        deadline = time.monotonic() + _REAP_S
        while pids := await asyncio.to_thread(self._host_pids):
            if time.monotonic() > deadline:
                self.facts.leftover_pids = pids
                break
            await asyncio.to_thread(sigkill, pids)
            await asyncio.sleep(0.02)
        if self.cgroup is not None:
            for _ in range(50):
                if self.cgroup.remove():
                    break
                await asyncio.sleep(0.02)

    def _host_pids(self) -> list[int]:
        if self.cgroup is not None:
            return self.cgroup.pids()
        return pids_by_marker(self.marker)

    def _kill_host_processes(self) -> None:
        sigkill(self._host_pids())
