"""What watches a kernel for its whole life (a part of Kernel, apart for reading): its memory (the
cgroup's OOM kills), the growth of /mnt/data (a GrowthWatch calls back here), and the CPU a thread left
running by a cell uses between runs. Each one that trips stops the sandbox at once and leaves the
sentence the run (or the next one) says."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import TYPE_CHECKING

from ._disk import MAX_DEPTH
from ._procs import pids_by_marker
from ._supervise import human_bytes
from .models import MIB, Limits

if TYPE_CHECKING:
    from ._plan import Sandbox

log = logging.getLogger("code_sessions.runner")

_OOM_POLL_S = 0.25
CPU_POLL_S = 1.0
CPU_IDLE_SHARE = 0.2  # of one core, what a kernel may use between runs for good


class _Watchers:
    """The lifetime watchers, for Kernel."""

    sandbox: Sandbox
    limits: Limits
    _violation: str | None
    _exceeded: str | None
    _spun: str | None
    _idle_since: float | None
    _cpu_budget_s: float
    _tasks: list[asyncio.Task[None]]

    if TYPE_CHECKING:

        @property
        def alive(self) -> bool: ...
        @property
        def cid(self) -> str: ...
        async def _kill_now(self) -> None: ...

    async def _watch_oom(self) -> None:
        cgroup = self.sandbox.cgroup
        assert cgroup is not None
        while True:
            await asyncio.sleep(_OOM_POLL_S)
            if cgroup.oom_kills():
                self._violation = self._violation or "out of memory"
                return

    async def _watch_cpu(self) -> None:
        """Between runs, a thread a cell left running may use the CPU in bursts, not for good: a
        bucket of `timeout_s` CPU seconds (the run's own time limit), refilled at CPU_IDLE_SHARE of one
        core (gVisor's idle sentry uses about a twentieth), starts full at the end of every run. A
        thread that spins empties it, and the kernel is stopped with a sentence (the next run says it),
        instead of burning a core until the idle timeout."""
        bucket: float | None = None
        last_cpu = last_t = 0.0
        while True:
            await asyncio.sleep(CPU_POLL_S)
            idle_since = self._idle_since
            if idle_since is None or not self.alive:
                bucket = None  # a run is going on (its time limit bounds it)
                continue
            cpu, now = await asyncio.to_thread(self._cpu_seconds), time.monotonic()
            if bucket is None or idle_since > last_t:  # a run ended since the last look: a full bucket
                bucket, last_cpu, last_t = self._cpu_budget_s, cpu, now
                continue
            used = max(0.0, cpu - last_cpu)
            bucket = min(self._cpu_budget_s, bucket + CPU_IDLE_SHARE * (now - last_t)) - used
            last_cpu, last_t = cpu, now
            if bucket < 0 and self._idle_since is not None and self.alive:
                self._spun = (
                    "a thread its cell left running kept the CPU busy between runs (more than "
                    f"{self._cpu_budget_s:g} s of CPU time, the time limit of a run)"
                )
                log.info("kernel %s: stopped for spinning between runs", self.cid)
                await self._kill_now()
                return

    def _disk_exceeded(self, grown: int | None) -> None:
        if grown is None:
            self._exceeded = f"folders nested more than {MAX_DEPTH} levels deep in /mnt/data"
        else:
            limit = human_bytes(self.limits.max_write_bytes)
            self._exceeded = f"it wrote more than {limit} to /mnt/data (grew by {grown / MIB:.0f} MiB)"
        # Stop the writer now; the run (or the next one) reports it.
        self._tasks.append(asyncio.ensure_future(self._kill_now()))

    def _cpu_seconds(self) -> float:
        return _cpu_seconds(self.host_pids())

    def host_pids(self) -> list[int]:
        """The kernel's host processes (runsc, the sentry, the gofer, ptrace stubs)."""
        cgroup = self.sandbox.cgroup
        if cgroup is not None:
            return cgroup.pids()
        return pids_by_marker(str(self.sandbox.bundle))


def _cpu_seconds(pids: list[int]) -> float:
    """User and system CPU time of these processes (all their threads), in seconds."""
    ticks = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            continue  # it exited meanwhile
    return ticks / _CLOCK_TICKS


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
