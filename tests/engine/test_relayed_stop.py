"""A chat whose kernel lives in worker B, served through worker A, and the user stops the answer mid-cell
(issue 20, defect 1): afterwards the index matches the disk, the cell has stopped in B, and the chat's
next step runs at once. Two real processes (B a subprocess holding its Engine and kernel pool, A this
test's), one store, real gVisor.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from engine import Engine, Settings
from runner import KernelPool, Limits, Runner
from storage import Store

pytestmark = pytest.mark.runsc

REPO = Path(__file__).resolve().parents[2]
LIMITS = Limits(timeout_s=30, memory_mb=256)

# Worker B: its own Store, Runner, pool and Engine; it runs the chat's first step (its kernel starts
# here), says so, and keeps serving the kernel to other workers.
WORKER = textwrap.dedent(
    """
    import asyncio, json, sys
    from pathlib import Path
    from engine import Engine, Settings
    from runner import KernelPool, Limits, Runner
    from storage import Store

    async def main(root, sockets):
        runner = Runner()
        async with Store(Path(root), owner=(runner.sandbox_uid, runner.sandbox_gid)) as store:
            pool = KernelPool(runner, Path(root) / "kernels", socket_dir=Path(sockets))
            engine = Engine(store, runner, Settings(limits=Limits(timeout_s=30, memory_mb=256)), kernels=pool)
            chat = await engine.chat("u", "c")
            step = await chat.run("import time\\nopen('r.log', 'w').write('start\\\\n')", "python")
            print(json.dumps({"ok": step.ok, "cid": step.run.container_id}), flush=True)
            await asyncio.sleep(3600)

    asyncio.run(main(*sys.argv[1:]))
    """
)

WRITER = "while True:\n    open('r.log', 'a').write('x' * 100)\n    time.sleep(0.02)"


async def indexed_size(store: Store, path: str) -> int | None:
    session = await store.session("u", "c")
    return {f.path: f.size for f in await session.files.list()}.get(path)


async def test_a_stopped_relayed_run_leaves_the_index_matching_the_disk(tmp_path: Path) -> None:
    root = tmp_path / "store"
    sockets = Path(tempfile.mkdtemp(prefix="cs-stop-", dir="/tmp")) / "s"  # a socket path is short
    b = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(root), str(sockets)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert b.stdout is not None
        held = json.loads(await asyncio.to_thread(b.stdout.readline))
        assert held["ok"], held
        runner = Runner()
        async with Store(root, owner=(runner.sandbox_uid, runner.sandbox_gid)) as store:
            pool = KernelPool(runner, root / "kernels", socket_dir=sockets)
            engine = Engine(store, runner, Settings(limits=LIMITS), kernels=pool)
            try:
                chat = await engine.chat("u", "c")
                log = chat.session.path / "r.log"
                step = asyncio.create_task(chat.run(WRITER, "python"))
                deadline = time.monotonic() + 30
                while log.stat().st_size < 5000:  # the cell writes, in B's kernel
                    assert time.monotonic() < deadline and not step.done(), "the cell did not write"
                    await asyncio.sleep(0.1)
                assert pool.kernels() == {}  # the run went to B: no kernel of this chat here
                step.cancel()  # the user stops the answer
                with pytest.raises(asyncio.CancelledError):
                    await step
                on_disk = log.stat().st_size
                assert await indexed_size(store, "r.log") == on_disk
                await asyncio.sleep(2)
                assert log.stat().st_size == on_disk, "the cell went on writing in worker B"
                assert await store.check() == []
                started = time.monotonic()
                after = await (await engine.chat("u", "c")).run("print(len(open('r.log').read()))", "python")
                assert after.ok and after.run is not None and after.run.stdout == f"{on_disk}\n"
                assert after.run.container_id == held["cid"] and after.run.notes == ()  # B's kernel, kept
                assert time.monotonic() - started < 10, "the next step waited behind the stopped cell"
                assert await indexed_size(store, "r.log") == on_disk
            finally:
                await pool.close()
    finally:
        b.kill()
        b.wait()
        shutil.rmtree(sockets.parent, ignore_errors=True)
