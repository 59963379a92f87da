"""The floors of a warm step, measured by the bench itself in the same run as the step.

* A bare python kept alive inside one `runsc run` of the runner's own bundle (same sandbox as a
  kernel's: rootfs, mounts, user, limits, runsc flags), talking over its stdin and stdout as the
  kernel does: an echo (one line in, the same line back: the least any round trip into a sandbox
  costs) and a `print(1)` cell (the line is exec'd and its output flushed back). No framing, no
  output pumps, no limits, no change watch: what our kernel adds on top of these is its own cost.
* A Jupyter kernel (ipykernel, started by jupyter_client, no sandbox at all) running `print(1)`:
  execute_interactive, from the request to the kernel's idle status. The peer figure.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from runner import HostSetup, Limits, Runner
from runner import _bundle as runner_bundle

from ._common import CGROUP_PARENT

# One request per read: the host waits for each answer before it sends the next.
_BARE_LOOP = """\
import os, sys
while True:
    line = os.read(0, 65536)
    if not line:
        break
    if line[:1] == b"#":
        os.write(1, line)
    else:
        exec(line, {})
        sys.stdout.flush()
"""


class BarePython:
    """A python in one `runsc run`, kept alive: echo() and cell() are one round trip each."""

    def __init__(self, proc: asyncio.subprocess.Process, bundle: Path) -> None:
        self._proc = proc
        self.bundle = bundle  # its host processes carry it in their command lines
        assert proc.stdin is not None and proc.stdout is not None
        self._stdin = proc.stdin
        self._stdout = proc.stdout

    async def _ask(self, line: bytes, want: bytes) -> float:
        start = time.perf_counter()
        self._stdin.write(line)
        await self._stdin.drain()
        got = await self._stdout.readexactly(len(want))
        elapsed = time.perf_counter() - start
        if got != want:
            raise RuntimeError(f"the bare python answered {got[:80]!r}")
        return elapsed

    async def echo(self) -> float:
        return await self._ask(b"#echo\n", b"#echo\n")

    async def cell(self) -> float:
        return await self._ask(b"print(1)\n", b"1\n")


@contextlib.asynccontextmanager
async def bare_python(
    runner: Runner, setup: HostSetup, workdir: Path, limits: Limits, *, platform: str | None = None
) -> AsyncIterator[BarePython]:
    """Start the bare python in the runner's sandbox setup (as run_overhead.bare_run does), on the
    kernels' platform (a kernel's sandbox), or on `platform`."""
    cid = "bench-" + secrets.token_hex(8)
    bundle = runner_bundle.write_bundle(runner.bundle_dir, cid, _BARE_LOOP, "python")
    proc: asyncio.subprocess.Process | None = None
    try:
        spec = runner_bundle.make_spec(
            rootfs=setup.rootfs,
            bundle=bundle,
            workdir=workdir,
            language="python",
            interpreter=runner._interpreter("python"),
            limits=limits,
            uid=runner.sandbox_uid,
            gid=runner.sandbox_gid,
            cgroups_path=f"/{CGROUP_PARENT}/{cid}" if setup.cgroups is not None else None,
            rlimit_as=setup.cgroups is None,
            netns_path=None,
        )
        (bundle / "config.json").write_text(json.dumps(spec), encoding="utf-8")
        argv = [*runner._runsc_argv(setup, bundle, kernel=True), "run", "--bundle", str(bundle), cid]
        if platform is not None:
            argv[argv.index("--platform") + 1] = platform
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            start_new_session=True,
        )
        bare = BarePython(proc, bundle)
        await asyncio.wait_for(bare.echo(), 60)  # booted
        yield bare
    finally:
        if proc is not None and proc.returncode is None:
            assert proc.stdin is not None
            proc.stdin.close()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        await asyncio.to_thread(shutil.rmtree, bundle, True)


class Jupyter:
    """An ipykernel started by jupyter_client (asyncio), outside any sandbox."""

    def __init__(self, client: Any) -> None:
        self._client = client

    async def cell(self) -> float:
        out: list[str] = []

        def hook(msg: dict[str, Any]) -> None:
            if msg["msg_type"] == "stream":
                out.append(msg["content"]["text"])

        start = time.perf_counter()
        reply = await self._client.execute_interactive("print(1)", output_hook=hook, timeout=30)
        elapsed = time.perf_counter() - start
        if reply["content"]["status"] != "ok" or "".join(out) != "1\n":
            raise RuntimeError(f"the Jupyter kernel answered {reply['content']['status']} {out!r}")
        return elapsed


@contextlib.asynccontextmanager
async def jupyter() -> AsyncIterator[Jupyter | None]:
    """A Jupyter kernel, or None when jupyter_client or ipykernel is not installed (the dev extra)."""
    try:
        from jupyter_client.manager import start_new_async_kernel
    except ImportError:
        yield None
        return
    manager, client = await start_new_async_kernel(kernel_name="python3", startup_timeout=120)
    try:
        yield Jupyter(client)
    finally:
        client.stop_channels()
        await manager.shutdown_kernel(now=True)


async def interleave(
    rounds: int, steps: Mapping[str, Callable[[], Awaitable[float]]]
) -> dict[str, list[float]]:
    """`rounds` rounds of every step, the order reversed every other round; seconds per step."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for i in range(rounds):
        for name in names if i % 2 == 0 else reversed(names):
            times[name].append(await steps[name]())
    return times
