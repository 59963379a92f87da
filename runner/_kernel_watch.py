"""What watches a kernel for its whole life: its memory (the cgroup's OOM kills), the growth of
/mnt/data (a GrowthWatch), and the CPU a thread left running by a cell uses between runs. A `Watchers`
belongs to one `Kernel`, which tells it when a run begins and ends; each watcher that trips stops the
sandbox at once (the kernel's `kill`) and leaves the sentence the run (or the next one) says."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable

from ._disk import MAX_DEPTH, GrowthWatch
from ._plan import Sandbox
from ._procs import pids_by_marker
from ._supervise import human_bytes
from .models import MIB, Limits

log = logging.getLogger("code_sessions.runner")

_OOM_POLL_S = 0.25
# Between runs the watchers look rarely: fifty idle kernels' watchers looking every second or faster
# cost more of a core than the kernels themselves (docs/benchmarks.md). An out-of-memory kill between
# runs ends the sandbox, and its cause is read from the cgroup then; a run's start wakes the OOM poll.
_IDLE_OOM_POLL_S = 5.0
CPU_POLL_S = 5.0
CPU_IDLE_SHARE = 0.2  # of one core, what a kernel may use between runs for good


class Watchers:
    """The lifetime watchers of one kernel, and their verdicts (None while nothing tripped)."""

    def __init__(self, sandbox: Sandbox, limits: Limits, kill: Callable[[], Awaitable[None]]) -> None:
        self._sandbox = sandbox
        self._limits = limits  # the kernel's lifetime limits
        self._kill = kill
        self.out_of_memory = False  # the cgroup killed a process of the sandbox
        self.exceeded: str | None = None  # the disk watcher's verdict, from its thread
        self.spun: str | None = None  # the CPU watcher's verdict: a thread spun between runs
        self._idle_since: float | None = None  # monotonic end of the last run (None: one is running)
        self._run_began = asyncio.Event()
        self._cpu_budget_s = limits.timeout_s
        self._growth: GrowthWatch | None = None
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def tripped(self) -> bool:
        return self.out_of_memory or self.exceeded is not None or self.spun is not None

    def start(self) -> None:
        """Begin watching (the sandbox runs; called in the event loop)."""
        loop = asyncio.get_running_loop()

        def exceeded(grown: int | None) -> None:  # called from the disk watcher's thread
            loop.call_soon_threadsafe(self._disk_exceeded, grown)

        self._growth = GrowthWatch(
            str(self._sandbox.workdir), self._limits.max_write_bytes, exceeded, pids=self.host_pids
        )
        if self._sandbox.cgroup is not None:
            self._tasks.append(asyncio.create_task(self._watch_oom()))
        self._growth.start()
        self._tasks.append(asyncio.create_task(self._watch_cpu()))

    def stop(self) -> None:
        if self._growth is not None:
            self._growth.stop()
        for task in self._tasks:
            task.cancel()

    def run_begins(self, limits: Limits) -> None:
        """A run starts: the watchers that idle slowly look now, its writes are counted from here,
        and its time limit is the CPU bucket after it."""
        self._idle_since = None
        self._run_began.set()
        self._cpu_budget_s = limits.timeout_s
        if self._growth is not None:
            self._growth.rebase(limits.max_write_bytes)

    def idle(self) -> None:
        """No run is in progress (the kernel started, or its run ended)."""
        self._idle_since = time.monotonic()
        if self._growth is not None:
            self._growth.idle()

    async def _watch_oom(self) -> None:
        cgroup = self._sandbox.cgroup
        assert cgroup is not None
        while True:
            if self._idle_since is None:
                await asyncio.sleep(_OOM_POLL_S)
            else:
                self._run_began.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._run_began.wait(), _IDLE_OOM_POLL_S)
            if cgroup.oom_kills():
                self.out_of_memory = True
                return

    async def _watch_cpu(self) -> None:
        """Between runs, a thread a cell left running may use the CPU in bursts, not for good: a
        bucket of `timeout_s` CPU seconds (the run's own time limit), refilled at CPU_IDLE_SHARE of one
        core (an idle sentry uses next to none on ptrace, 1.5% of a core on systrap), starts full at
        the end of every run, looked at every CPU_POLL_S. A
        thread that spins empties it, and the kernel is stopped with a sentence (the next run says it),
        instead of burning a core until the idle timeout."""
        bucket: float | None = None
        last_cpu = last_t = 0.0
        while True:
            await asyncio.sleep(CPU_POLL_S)
            idle_since = self._idle_since
            if idle_since is None or self.tripped:
                bucket = None  # a run is going on (its time limit bounds it)
                continue
            cpu, now = await asyncio.to_thread(_cpu_seconds, self.host_pids()), time.monotonic()
            if bucket is None or idle_since > last_t:  # a run ended since the last look: a full bucket
                bucket, last_cpu, last_t = self._cpu_budget_s, cpu, now
                continue
            used = max(0.0, cpu - last_cpu)
            bucket = min(self._cpu_budget_s, bucket + CPU_IDLE_SHARE * (now - last_t)) - used
            last_cpu, last_t = cpu, now
            if bucket < 0 and self._idle_since is not None and not self.tripped:
                self.spun = (
                    "a thread its cell left running kept the CPU busy between runs (more than "
                    f"{self._cpu_budget_s:g} s of CPU time, the time limit of a run)"
                )
                log.info("kernel %s: stopped for spinning between runs", self._sandbox.cid)
                await self._kill()
                return

    def _disk_exceeded(self, grown: int | None) -> None:
        if grown is None:
            self.exceeded = f"folders nested more than {MAX_DEPTH} levels deep in /mnt/data"
        else:
            limit = human_bytes(self._limits.max_write_bytes)
            self.exceeded = f"it wrote more than {limit} to /mnt/data (grew by {grown / MIB:.0f} MiB)"
        # Stop the writer now; the run (or the next one) reports it.
        self._tasks.append(asyncio.ensure_future(self._kill()))

    def host_pids(self) -> list[int]:
        return host_pids(self._sandbox)


def host_pids(sandbox: Sandbox) -> list[int]:
    """A kernel's host processes (runsc, the sentry, the gofer, ptrace stubs)."""
    cgroup = sandbox.cgroup
    if cgroup is not None:
        return cgroup.pids()
    return pids_by_marker(str(sandbox.bundle))


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
