"""One persistent Python kernel: a long-lived gVisor sandbox whose first process is our kernel program
(runner/_kernel_program/, joined into one file), running each cell in one namespace that lives
from run to run.

The sandbox is the one a fresh run gets (same bundle, mounts, user, no network), started once. What
differs is the time scale of each limit:

* for the kernel's whole life: memory (its cgroup), processes and threads (RLIMIT_NPROC), the size
  of any one file (RLIMIT_FSIZE), and the growth of /mnt/data, measured from the start of the latest
  run (so a thread a cell left running between runs is bounded too; past it, the kernel is killed);
* per run: the time limit (first an interrupt, SIGINT, which keeps the state; if the cell has not
  stopped after a grace, the whole sandbox is killed) and the output caps (the cell is interrupted).

The kernel runs the model's code in its own process, so everything it says is untrusted: frames are
decoded strictly (_wire), any violation kills the sandbox, and what a run changed in /mnt/data comes
from the host's own inotify watch, never from the kernel. The sandbox dies with the process that
started it (PR_SET_PDEATHSIG on runsc), so a kernel never outlives its Open WebUI worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

from . import _wire
from ._changes import ChangeWatch
from ._delta import Base
from ._diagnose import read_runsc_errors, tidy
from ._kernel_program import program
from ._kernel_program.protocol import FATAL_EXIT
from ._kernel_watch import Watchers, host_pids
from ._plan import Sandbox
from ._procs import sigkill
from ._supervise import Capture, dying_with_us, human_bytes
from .capabilities import run_quick
from .models import Limits, Outcome, RunResult

log = logging.getLogger("code_sessions.runner")

KERNEL_SOURCE = program()
# gVisor's boot plus the kernel's start (a cold one takes ~0.4 s here): at least this long, and as long
# as two runs' time limits, but never more than READY_MAX_S (a runsc that hangs must not hold a chat).
READY_MIN_S = 10.0
READY_MAX_S = 60.0
INTERRUPT_GRACE_S = 2.0  # after SIGINT, how long a cell has to stop before the sandbox is killed
FRAME_STALL_S = 5.0  # a frame begun and not finished this long is a broken protocol
_READ_CHUNK = 64 * 1024
_STDERR_KEPT = 4096
_HELPER_TIMEOUT_S = 10.0
_REAP_S = 5.0
_LIFETIME_FIELDS = ("memory_mb", "max_processes", "max_file_bytes")
CHECKPOINT_MAX_S = 60.0  # a kernel of 1 GiB takes a few seconds; a runsc that hangs must not hold a chat
RESUME_MAX_S = 30.0  # `runsc restore` to the probe's answer (0.4 s for a pandas-holding kernel here)


class KernelLost(Exception):
    """The kernel is gone (or had to go); the message says why, in words for the user."""


class NotSaved(Exception):
    """The kernel's state could not be written to disk; the message says why, in words for the user."""


def _short_error(text: str) -> str:
    return tidy(text, 300)


def lifetime_limits(limits: Limits) -> tuple[int, ...]:
    """The limits a kernel is started with and keeps (a change needs a new kernel)."""
    return tuple(getattr(limits, name) for name in _LIFETIME_FIELDS)


class Kernel:
    """One kernel. One run at a time (the caller holds the chat's lock; `run` also serialises). Its
    lifetime watchers are its own `Watchers` (runner/_kernel_watch.py)."""

    def __init__(self, sandbox: Sandbox, limits: Limits) -> None:
        self.sandbox = sandbox
        self.limits = limits  # the lifetime limits it was started with
        self.started_at = time.time()
        self.last_used = time.monotonic()
        self.ready: _wire.Ready | None = None
        # The template pages its memory descends from (a warm start, or an image stored against them):
        # its images are stored against them too (runner/_delta.py).
        self.base: Base | None = None
        self.lost: str | None = None  # why it ended, once it has: words for the user
        self._proc: asyncio.subprocess.Process | None = None
        self._decoder = _wire.FrameDecoder()
        self._state = _wire.ProtocolState()
        self._inbox: asyncio.Queue[_wire.Message | None] = asyncio.Queue()
        self._violation: str | None = None
        self._stderr = bytearray()
        self._tasks: list[asyncio.Task[None]] = []
        self._run_ids = 0
        self._busy = asyncio.Lock()  # held by a run and by a checkpoint
        self._running = False
        self._watch: ChangeWatch | None = None
        self._watchers = Watchers(sandbox, limits, self._kill_now)
        self._replies_ended = False
        self._closing: asyncio.Future[None] | None = None  # the teardown, once begun
        self._settling: asyncio.Future[None] | None = None  # stopping a cancelled run
        self._whole_folder_next = False
        self._stdin: asyncio.StreamWriter | None = None
        self._stdin_hold = -1  # a second descriptor of the request pipe's write end (see _spawn)

    # ------------------------------------------------------------------ lifecycle

    @property
    def alive(self) -> bool:
        """Running, and trusted: no protocol violation, no limit crossed, its reply channel open."""
        return (
            self.lost is None
            and self._violation is None
            and not self._watchers.tripped
            and not self._replies_ended
            and self._proc is not None
            and self._proc.returncode is None
        )

    @property
    def busy(self) -> bool:
        """A run is in progress (a copy of the state being taken is not one: it ends on its own within
        seconds, and a save waits for it)."""
        return self._running

    @property
    def in_use(self) -> bool:
        """A run is in progress or an image is being written."""
        return self._busy.locked()

    @property
    def cid(self) -> str:
        return self.sandbox.cid

    async def start(self, watch: ChangeWatch) -> None:
        """Start the sandbox and wait for the kernel's ready frame. `watch`: the workdir's change
        watch, set up before the sandbox exists (it stays for the kernel's life)."""
        await self._spawn(watch)
        wait = min(READY_MAX_S, max(READY_MIN_S, 2 * self.limits.timeout_s))
        try:
            message = await asyncio.wait_for(self._inbox.get(), wait)
        except TimeoutError:
            message = None
            self._violation = self._violation or f"it did not start within {wait:g} s"
        if not isinstance(message, _wire.Ready):
            why = self._why_gone()
            await self.close(why)
            raise KernelLost(why)
        self.ready = message
        self._watchers.idle()

    async def resume(
        self,
        watch: ChangeWatch,
        ready: dict[str, object],
        probe: str = "",
        unpack: Callable[[], None] | None = None,
    ) -> None:
        """Start the sandbox from a saved image (its argv is a `runsc restore`) and check that the
        kernel answers: `probe` (Python, run in the restored namespace) must end "ok" within
        RESUME_MAX_S. `ready`: the ready frame the kernel sent when it first started (a restored
        kernel does not send it again). `unpack`: a blocking callable that writes the image runsc
        restores into the sandbox's `image_dir` first (that copy is removed once the kernel answers).
        Raises KernelLost, with why, when it does not come back (and what `unpack` raises)."""
        try:
            message = _wire.parse_body(json.dumps({"t": "ready", **ready}).encode())
        except _wire.ProtocolError as error:
            raise KernelLost(f"its saved image has a bad kernel description ({error})") from None
        assert isinstance(message, _wire.Ready)
        if unpack is not None:
            await asyncio.to_thread(unpack)
        await self._spawn(watch)
        self.ready = self._state.ready = message
        limits = self.limits.model_copy(update={"timeout_s": RESUME_MAX_S})
        result = await self.run(probe, "python", limits)
        if result.outcome != Outcome.OK:
            why = result.reason or result.outcome.value
            errors = await asyncio.to_thread(
                read_runsc_errors, self.sandbox.bundle / "runsc.log", self.sandbox.bundle / "panic.log"
            )
            if errors:
                why = tidy(" | ".join(errors), 300)
            await self.close(why)
            raise KernelLost(f"its saved image could not be restored: {why}")
        self._whole_folder_next = True  # what the probe's run saw is not the user's to lose
        if unpack is not None:  # runsc has read it all: the unpacked copy goes, off the answer's path
            self._tasks.append(
                asyncio.ensure_future(asyncio.to_thread(shutil.rmtree, self.sandbox.image_dir, True))
            )

    async def resume_checked(
        self,
        watch: ChangeWatch,
        ready: dict[str, object],
        probe: str,
        check: Callable[[], None],
        unpack: Callable[[], None] | None = None,
    ) -> None:
        """resume(), while `check` (a blocking callable that raises on a bad image) runs in a thread;
        the kernel is kept only if both succeed (the check's error wins: it names the damage)."""
        checking = asyncio.ensure_future(asyncio.to_thread(check))
        resuming = asyncio.ensure_future(self.resume(watch, ready, probe, unpack))
        outcomes = await asyncio.gather(checking, resuming, return_exceptions=True)
        failures = [o for o in outcomes if isinstance(o, BaseException)]
        if failures:
            await self.close("its saved image was refused")
            raise failures[0]

    async def checkpoint(self, into: Path, flags: list[str], *, leave_running: bool = False) -> None:
        """Write the kernel's image into the empty folder `into` (`runsc checkpoint`); the sandbox
        exits once it is written, unless `leave_running` (a copy of the state: the kernel goes on).
        Waits for a run in progress. Raises NotSaved (why) when runsc cannot; a kernel that was to
        exit is then stopped all the same (a half-checkpointed sandbox is not trusted), and one left
        running goes on (if runsc left it unusable, its next run says so)."""
        async with self._busy:
            if not self.alive:
                raise NotSaved(self.lost or self._why_gone())
            argv = self.checkpoint_argv(into, [*flags, "--leave-running"] if leave_running else flags)
            try:
                code, out = await run_quick(argv, CHECKPOINT_MAX_S)
            except TimeoutError:
                await self.close("its image was not written in time")
                raise NotSaved(f"runsc did not write the image within {CHECKPOINT_MAX_S:g} s") from None
            except OSError as error:
                raise NotSaved(f"runsc could not be started: {error}") from None
            if code != 0:
                if not leave_running:
                    await self.close("runsc could not save it")
                errors = await asyncio.to_thread(read_runsc_errors, self.sandbox.bundle / "runsc.log")
                last = out.strip().splitlines()[-1:]
                detail = " | ".join(errors) or (last[0] if last else f"runsc exited with {code}")
                if "no space left on device" in detail.lower():  # runsc's words name its container
                    raise NotSaved("its image could not be written: the disk is full")
                raise NotSaved(_short_error(detail))
            if not leave_running:
                self.lost = "it was saved to disk"

    def host_pids(self) -> list[int]:
        """The kernel's host processes (runsc, the sentry, the gofer, ptrace stubs)."""
        return host_pids(self.sandbox)

    def checkpoint_argv(self, into: Path, flags: list[str]) -> list[str]:
        return [*self.sandbox.runsc_base, "checkpoint", *flags, f"--image-path={into}", self.cid]

    def ready_fields(self) -> dict[str, object]:
        """The ready frame's fields, for resume() of a saved image."""
        assert self.ready is not None
        ready = self.ready
        return {"v": ready.version, "python": ready.python, "pid": ready.pid, "packages": ready.packages}

    async def _spawn(self, watch: ChangeWatch) -> None:
        self._watch = watch
        loop = asyncio.get_running_loop()
        # The request pipe is ours, and a second descriptor of its write end is held outside the
        # event loop: uvloop (Open WebUI's loop) closes every pipe when the loop ends, and the kernel
        # would read EOF and exit before the exit handler can save it (KernelPool._save_at_exit).
        read_end, write_end = os.pipe()
        try:
            argv, preexec = dying_with_us(self.sandbox.argv)
            self._proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=read_end,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,  # one process group to kill if runsc itself hangs
                preexec_fn=preexec,
            )
            self._stdin_hold = os.dup(write_end)
            transport, protocol = await loop.connect_write_pipe(
                lambda: asyncio.streams.FlowControlMixin(loop=loop), os.fdopen(write_end, "wb", buffering=0)
            )
            write_end = -1  # the transport owns it now
            self._stdin = asyncio.StreamWriter(transport, protocol, None, loop)
        except BaseException:
            if write_end >= 0:
                os.close(write_end)
            await self.close()
            raise
        finally:
            os.close(read_end)
        self._tasks.append(asyncio.create_task(self._read_replies()))
        self._tasks.append(asyncio.create_task(self._read_stderr()))
        self._watchers.start()

    async def close(self, why: str | None = None) -> None:
        """Kill the sandbox and free everything it held (idempotent; shielded from cancellation).
        A kernel that already ended by itself (a limit, a crash, a broken protocol) keeps its own
        cause: whoever noticed first (the reaper, the next run) only knows that it stopped."""
        if self.lost is None:
            self.lost = (self._why_gone() if self._ended_by_itself() else None) or why or "it was stopped"
        # Every caller waits until the sandbox is gone, not only the first: a run that finds its
        # kernel already being closed (by the reaper) returns once nothing of it is left.
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._teardown())
        await asyncio.shield(self._closing)

    async def _teardown(self) -> None:
        if self._stdin is not None:
            self._stdin.close()
        if self._stdin_hold >= 0:
            os.close(self._stdin_hold)
            self._stdin_hold = -1
        self._watchers.stop()
        if self._watch is not None:
            self._watch.close()
        proc = self._proc
        base = self.sandbox.runsc_base
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(Exception):
                await run_quick([*base, "kill", "--all", self.cid, "KILL"], _HELPER_TIMEOUT_S)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(proc.wait()), 3.0)
            if proc.returncode is None:
                await asyncio.to_thread(sigkill, self.host_pids())
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
        with contextlib.suppress(Exception):
            await run_quick([*base, "delete", "--force", self.cid], _HELPER_TIMEOUT_S)
        for task in self._tasks:
            task.cancel()
        deadline = time.monotonic() + _REAP_S
        while pids := await asyncio.to_thread(self.host_pids):
            if time.monotonic() > deadline:
                log.warning("kernel %s: host processes %s did not exit", self.cid, pids)
                break
            await asyncio.to_thread(sigkill, pids)
            await asyncio.sleep(0.02)
        cgroup = self.sandbox.cgroup
        if cgroup is not None:
            for _ in range(50):
                if cgroup.remove():
                    break
                await asyncio.sleep(0.02)
        await asyncio.to_thread(shutil.rmtree, self.sandbox.bundle, True)

    # ------------------------------------------------------------------ one run

    async def run(self, code: str, language: str, limits: Limits) -> RunResult:
        """Run one cell. A kernel that is lost during it (killed on a limit, crashed, broke the
        protocol) is closed, `lost` says why, and the result says the state went with it."""
        async with self._busy:
            if self._settling is not None:  # a cancelled run is still being stopped
                await asyncio.shield(self._settling)
            if not self.alive:
                why = self.lost or self._why_gone()
                await self.close(why)
                raise KernelLost(why)
            self.last_used = time.monotonic()
            self._watchers.run_begins(limits)
            self._running = True
            try:
                return await self._run(code, language, limits)
            except asyncio.CancelledError:
                # The caller gave up (the user stopped the answer): the cell must not run on, writing
                # after the caller's bookkeeping is done. Interrupt it, kill the kernel if it does
                # not stop, and only then let the next run in.
                self._settling = asyncio.ensure_future(self._stop_cancelled_run())
                await asyncio.shield(self._settling)
                raise
            finally:
                self._running = False
                self.last_used = time.monotonic()
                self._watchers.idle()

    async def _stop_cancelled_run(self) -> None:
        """Interrupt the cancelled cell and take its replies off the inbox, its "done" included: the
        reader marks the run finished when it queues that "done", before anyone reads it, and a next
        run must not read it as its own."""
        run_id = self._run_ids
        try:
            if not self.alive:
                return
            if self._state.current == run_id:
                await self._interrupt()
            deadline = time.monotonic() + INTERRUPT_GRACE_S
            while True:
                if self._state.current != run_id and self._inbox.empty():
                    return  # its "done" was read (or it never started), and nothing of it is left
                try:
                    message = await asyncio.wait_for(self._inbox.get(), max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    message = None
                if message is None:
                    await self.close("its answer was stopped while a cell ran, and the cell did not stop")
                    return
                if isinstance(message, _wire.Done) and message.run_id == run_id:
                    return
        finally:
            self._settling = None

    async def _run(self, code: str, language: str, limits: Limits) -> RunResult:
        assert self._proc is not None and self._stdin is not None
        t0 = time.monotonic()
        self._run_ids += 1
        run_id = self._run_ids
        stdout, stderr = Capture(limits.max_output_bytes), Capture(limits.max_output_bytes)
        watch = await self._fresh_watch()
        self._state.start(run_id)
        try:
            self._stdin.write(_wire.encode_run(run_id, language, code))  # type: ignore[arg-type]
            await self._stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            pass  # it died: the reply reader says so
        deadline = t0 + limits.timeout_s
        interrupted: str | None = None  # why we interrupted the cell: "timeout" or "output"
        detail = ""
        done: _wire.Done | None = None
        while done is None:
            timeout = max(0.0, deadline - time.monotonic())
            try:
                # A message already waiting needs no timer (wait_for makes a task and a timer handle).
                inbox = self._inbox
                message = (
                    inbox.get_nowait() if not inbox.empty() else await asyncio.wait_for(inbox.get(), timeout)
                )
            except TimeoutError:
                if interrupted is None:
                    interrupted, detail = "timeout", f"interrupted after {limits.timeout_s:g} s"
                    await self._interrupt()
                    deadline = time.monotonic() + INTERRUPT_GRACE_S
                    continue
                await self.close(
                    f"the cell did not stop within {INTERRUPT_GRACE_S:g} s of being interrupted "
                    f"at the {limits.timeout_s:g} s time limit"
                )
                return self._result(Outcome.TIMEOUT, None, stdout, stderr, t0, self.lost, watch)
            if message is None:  # the kernel is gone, or broke the protocol
                outcome, why = self._gone()
                await self.close(why)
                return self._result(outcome, None, stdout, stderr, t0, why, watch)
            if isinstance(message, _wire.Output) and message.run_id == run_id:
                capture = stdout if message.stream == "stdout" else stderr
                if capture.feed(message.text.encode("utf-8", "surrogatepass")) and interrupted is None:
                    interrupted, detail = "output", f"{message.stream} passed {human_bytes(capture.cap)}"
                    await self._interrupt()
                    deadline = time.monotonic() + INTERRUPT_GRACE_S
            elif isinstance(message, _wire.Done) and message.run_id == run_id:
                done = message
        if interrupted == "timeout":
            outcome, reason = Outcome.TIMEOUT, f"{detail}; the Python state is kept"
        elif interrupted == "output":
            outcome, reason = Outcome.OUTPUT_LIMIT, f"{detail}; the Python state is kept"
        elif done.status == "ok":
            outcome, reason = Outcome.OK, None
        elif done.status == "interrupted":
            outcome, reason = Outcome.ERROR, "interrupted"
        elif done.exit_code is None:  # the kernel could not start the cell (only bash cells can fail so)
            outcome, reason = Outcome.ERROR, _could_not_start(language, stderr.text())
        else:
            outcome, reason = Outcome.ERROR, f"exit code {done.exit_code}"
        return self._result(outcome, done.exit_code, stdout, stderr, t0, reason, watch, done)

    def _result(
        self,
        outcome: Outcome,
        exit_code: int | None,
        stdout: Capture,
        stderr: Capture,
        t0: float,
        reason: str | None,
        watch: ChangeWatch | None,
        done: _wire.Done | None = None,
    ) -> RunResult:
        changed = self._harvest(watch)
        return RunResult(
            figures=done.figures if done is not None else (),
            figures_more=done.more if done is not None else 0,
            outcome=outcome,
            exit_code=exit_code,
            stdout=stdout.text(),
            stderr=stderr.text(),
            stdout_truncated=stdout.truncated,
            stderr_truncated=stderr.truncated,
            duration_s=round(time.monotonic() - t0, 3),
            reason=reason,
            container_id=self.cid,
            changed=changed,
            state_kept=self.alive,
        )

    async def _fresh_watch(self) -> ChangeWatch | None:
        """The change watch, set up again if it gave up (a folder was made, its queue overflowed...):
        while the kernel lives, it also sees what happens between runs."""
        watch = self._watch
        if watch is None or not watch.active:
            self._watch = watch = await asyncio.to_thread(ChangeWatch.start, str(self.sandbox.workdir))
        return watch

    def _harvest(self, watch: ChangeWatch | None) -> tuple[str, ...] | None:
        if watch is None or not self.alive:
            # A killed kernel's last writes may still be arriving: list the whole folder.
            return None
        changed = watch.harvest()
        # A new kernel's first run: what happened in the folder before this kernel's watch began (a
        # thread its predecessor left, writing) is nobody's to know: list the whole folder once. So
        # too the first run after a resume (the probe's run took what the watch had seen).
        if self._whole_folder_next and self._run_ids > 1:
            self._whole_folder_next = False
            return None
        return None if self._run_ids == 1 else changed

    async def _interrupt(self) -> None:
        """SIGINT to the kernel (PID 1 of its sandbox): KeyboardInterrupt in the cell, state kept."""
        with contextlib.suppress(Exception):
            await run_quick([*self.sandbox.runsc_base, "kill", self.cid, "INT"], _HELPER_TIMEOUT_S)

    # ------------------------------------------------------------------ what the kernel says

    async def _read_replies(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        reader = self._proc.stdout
        decoder = self._decoder
        try:
            while True:
                if decoder.mid_frame:
                    # The kernel writes each frame whole: one left half-written this long was not
                    # the kernel's (a cell wrote a length and no body), and nothing after it can
                    # be framed. Said now, not at the time limit, as a broken protocol.
                    try:
                        chunk = await asyncio.wait_for(reader.read(_READ_CHUNK), FRAME_STALL_S)
                    except TimeoutError:
                        raise _wire.ProtocolError(
                            f"a frame stopped after {decoder.received} of its bytes and the rest did not "
                            f"come within {FRAME_STALL_S:g} s"
                        ) from None
                else:
                    chunk = await reader.read(_READ_CHUNK)
                if not chunk:
                    break
                for message in decoder.feed(chunk):
                    self._inbox.put_nowait(self._state.accept(message))
            decoder.eof()
        except _wire.ProtocolError as error:
            self._violation = f"it broke the protocol ({error})"
        except asyncio.CancelledError:
            # Cancelled, not ended: the kernel's teardown, or the event loop ending with the process
            # (an Open WebUI restart), which still saves the kernel at exit (KernelPool).
            raise
        self._replies_ended = True
        self._inbox.put_nowait(None)

    async def _read_stderr(self) -> None:
        assert self._proc is not None and self._proc.stderr is not None
        while chunk := await self._proc.stderr.read(_READ_CHUNK):
            self._stderr += chunk
            del self._stderr[:-_STDERR_KEPT]

    async def _kill_now(self) -> None:
        with contextlib.suppress(Exception):
            await run_quick([*self.sandbox.runsc_base, "kill", "--all", self.cid, "KILL"], _HELPER_TIMEOUT_S)

    def _ended_by_itself(self) -> bool:
        return (
            self._violation is not None
            or self._watchers.tripped
            or self._replies_ended
            or (self._proc is not None and self._proc.returncode is not None)
        )

    def _why_gone(self) -> str:
        return self._gone()[1]

    def _gone(self) -> tuple[Outcome, str]:
        """How a kernel that went away ends its run, and why in words: decided by what the watchers
        and the cgroup saw, never by reading the words (the kernel's own stderr is hostile)."""
        watchers = self._watchers
        if watchers.exceeded is not None:
            return Outcome.DISK_LIMIT, watchers.exceeded
        if watchers.spun is not None:
            return Outcome.KERNEL_LOST, watchers.spun
        cgroup = self.sandbox.cgroup
        if watchers.out_of_memory or (cgroup is not None and cgroup.oom_kills()):
            return (
                Outcome.OOM,
                f"it ran out of memory (limit {self.limits.memory_mb} MB for the whole kernel)",
            )
        if self._violation is not None:
            return Outcome.KERNEL_LOST, f"the kernel stopped responding: {self._violation}"
        code = self._proc.returncode if self._proc is not None else None
        if code == FATAL_EXIT:
            return Outcome.KERNEL_LOST, "the kernel stopped responding: a cell broke the kernel itself"
        tail = self._stderr.decode("utf-8", "replace").strip().splitlines()[-1:] if self._stderr else []
        extra = f" ({tail[0][:200]})" if tail else ""
        return Outcome.KERNEL_LOST, f"the kernel stopped responding: it exited{extra}"


_KERNEL_NOTE = re.compile(r"\[code-sessions: (cannot [^\]\n]{1,300})\]")


def _could_not_start(language: str, stderr: str) -> str:
    """The reason of a cell the kernel could not start: its own notice on stderr says why (a cell
    that prints a fake one only misleads itself)."""
    notices = _KERNEL_NOTE.findall(stderr)
    detail = f" ({notices[-1]})" if notices else ""
    return f"the {language} cell could not start{detail}"
