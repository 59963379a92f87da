"""How long the event loop could not run while something went through it (the guide's "nothing heavy on
the event loop", measured on a machine that is not quiet).

`LoopLag` runs a ticker task on the loop under test that wakes every `interval_s`. For each gap between
two wake-ups (its lateness: the gap less the interval) it reads how much CPU time this process's
threads used (their CPU clocks) and how long they waited in the run queue for a CPU
(/proc/self/task/*/schedstat), and keeps two measures of the longest stall:

* `held_s`, what this process itself held the loop for: the lateness less the time the loop's own
  thread waited in the run queue for a CPU, but never more than the CPU time our threads used in the
  gap (a thread of ours computing off the loop while the loop's thread waits for a CPU the machine
  gave to others is load, not a stall). It counts a callback that computed for long, and another thread
  of ours holding the GIL in one long C call (a backtracking regular expression, a json.loads of
  megabytes); it cannot count time other processes, or the hypervisor (this machine is a VM whose CPUs
  are shared), took the CPUs from us: we used no CPU then. Independent of the machine's load, so it
  is asserted strictly: `held_s < STALL_LIMIT_S`.
* `stall_s`, the lateness less the time our threads waited in the run queue: it also counts a
  blocking call on the loop (time.sleep, a sync read) that uses no CPU, but also a pause of the whole
  VM. It is compared with a floor measured at the same moment: a reference ticker in a process of its
  own (no loop, no GIL of ours) records the longest pause its own run-queue wait does not explain;
  the assertion is `stall_s < STALL_LIMIT_S + floor_s`. On a quiet machine the floor is a few ms.

Where the kernel keeps no schedstat (no CONFIG_SCHED_INFO), nothing is subtracted for the run queue:
`stall_s` is then the plain wall-clock lag, stricter, never looser.

    async with LoopLag() as lag:
        await the_hostile_path()
    lag.assert_quiet()
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import subprocess
import sys
import threading
import time
from types import TracebackType
from typing import Any

__all__ = ["STALL_LIMIT_S", "LoopLag"]

STALL_LIMIT_S = 0.1  # the longest the loop may be held: the guide's "no stall over 100 ms"

# The reference ticker: the longest pause of a thread that only sleeps, less its own run-queue wait.
_REFERENCE = """
import sys, threading, time
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
def queued():
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0
worst, wall, wait = 0.0, time.monotonic(), queued()
print("ready", flush=True)
while not done.is_set():
    time.sleep(INTERVAL)
    now, now_wait = time.monotonic(), queued()
    worst = max(worst, now - wall - INTERVAL - (now_wait - wait))
    wall, wait = now, now_wait
print(worst, flush=True)
"""


def _cpu() -> dict[int, float]:
    """{thread: CPU seconds it has used} of the Python threads of this process. Each thread's CPU
    clock (clock_gettime of pthread_getcpuclockid), which counts a thread running right now up to this
    instant; /proc's schedstat does not (it is brought up to date at the scheduler's ticks, which a
    CPU running one busy thread may not get for hundreds of milliseconds)."""
    found = {}
    for thread in threading.enumerate():
        if thread.ident is None:
            continue
        try:
            found[thread.ident] = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except OSError:  # a thread that ended meanwhile
            continue
    return found


def _queued() -> dict[str, float] | None:
    """{thread: seconds it has waited in the run queue for a CPU} of this process's threads (None: not
    known here). A thread's figure is brought up to date each time it is given a CPU: by the end of a
    gap the loop spent waiting for one of our threads, that thread has run."""
    found = {}
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/schedstat", "rb") as handle:
                found[task] = int(handle.read().split()[1]) / 1e9
        except (OSError, IndexError, ValueError):  # a thread that ended meanwhile
            continue
    return found


def _grown(before: dict[Any, float], after: dict[Any, float]) -> float:
    """How much the threads' figures grew between two looks (a thread that ended in between takes its
    part with it: the gap then counts a little more as a stall, never less)."""
    return sum(value - before.get(thread, 0.0) for thread, value in after.items())


class LoopLag:
    """Measure the event loop's stalls (see the module's docstring) while the `async with` body runs."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.held_s = 0.0  # the longest stall this process's CPU time explains (load-independent)
        self.stall_s = 0.0  # the longest stall our threads' run-queue wait does not explain
        self.gap_s = 0.0  # the longest wall-clock gap between two ticks, whatever its cause
        self.floor_s = 0.0  # the reference process's longest unexplained pause, at the same time
        self.ticks = 0
        self.schedstat = _queued() is not None
        self._task: asyncio.Task[None] | None = None
        self._started = asyncio.Event()
        self._reference: subprocess.Popen[str] | None = None

    async def __aenter__(self) -> LoopLag:
        # A full collection now: late in a suite the test process's heap is large, and a collection of
        # all of it falling inside the measure (over 100 ms) is the suite's pause, not the path's.
        gc.collect()
        self._reference = await asyncio.to_thread(self._start_reference)
        self._task = asyncio.create_task(self._tick())
        await self._started.wait()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        await asyncio.sleep(self.interval_s * 2)  # the gap that ends with the body is counted too
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        reference = self._reference
        if reference is not None:
            out, _ = await asyncio.to_thread(reference.communicate, "", 30)
            self.floor_s = float(out.split()[-1]) if reference.returncode == 0 else 0.0

    def _start_reference(self) -> subprocess.Popen[str]:
        process = subprocess.Popen(
            [sys.executable, "-c", _REFERENCE.replace("INTERVAL", repr(self.interval_s))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "ready"
        return process

    async def _tick(self) -> None:
        loop_thread = str(threading.get_native_id())  # its run-queue wait is up to date: it runs now
        wall, cpu, queued = time.monotonic(), _cpu(), _queued() or {}
        self._started.set()
        while True:
            await asyncio.sleep(self.interval_s)
            now, now_cpu, now_queued = time.monotonic(), _cpu(), _queued() or {}
            late = now - wall - self.interval_s
            self.gap_s = max(self.gap_s, now - wall)
            self.stall_s = max(self.stall_s, late - _grown(queued, now_queued))
            loop_waited = now_queued.get(loop_thread, 0.0) - queued.get(loop_thread, 0.0)
            self.held_s = max(self.held_s, min(late - loop_waited, _grown(cpu, now_cpu)))
            self.ticks += 1
            wall, cpu, queued = now, now_cpu, now_queued

    def summary(self) -> str:
        how = "" if self.schedstat else " (no schedstat here: wall clock)"
        return (
            f"held by this process {self.held_s * 1000:.1f} ms at most; longest stall "
            f"{self.stall_s * 1000:.1f} ms against a floor of {self.floor_s * 1000:.1f} ms; longest wall "
            f"gap {self.gap_s * 1000:.1f} ms; {self.ticks} ticks{how}"
        )

    def assert_quiet(self, limit_s: float = STALL_LIMIT_S) -> None:
        """No stall over `limit_s` that this process caused (see the module's docstring)."""
        assert self.ticks > 0, self.summary()
        assert self.held_s < limit_s, self.summary()
        assert self.stall_s < limit_s + self.floor_s, self.summary()
