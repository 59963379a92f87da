"""What an admin sees of saved kernels through `python -m storage` (a real subprocess), with a real kernel
saved by the pool in real gVisor: `usage` counts its image for its user (not against the file quota),
`check` finds the index and the disk in agreement, a purge by the CLI takes the image with the chat's
folder, and an image left without its session is drift `check` names."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine import Engine, Settings
from runner import KernelPool, Limits, Runner
from storage import Store, human_bytes

pytestmark = pytest.mark.runsc

REPO = Path(__file__).resolve().parents[2]
LIMITS = Limits(timeout_s=30, memory_mb=256)


def file_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def cli(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CODE_SESSIONS_") and k != "DATA_DIR"}
    return subprocess.run(
        [sys.executable, "-m", "storage", "--root", str(root), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


async def test_the_cli_shows_saved_kernels_and_a_purge_takes_them(tmp_path: Path) -> None:
    runner = Runner()
    root = tmp_path / "store"
    async with Store(root, owner=(runner.sandbox_uid, runner.sandbox_gid)) as store:
        pool = KernelPool(runner, root / "kernels")
        engine = Engine(store, runner, Settings(limits=LIMITS), kernels=pool)
        try:
            chat = await engine.chat("alice", "chat-1")
            step = await chat.run(
                # Random bytes: saved images are compressed, and these stay as they are.
                "import os\nblob = os.urandom(10_500_000)\nopen('a.txt', 'w').write('a')", "python"
            )
            assert step.ok, step.for_model()
            assert await pool.hibernate(chat.kernel_key) is None  # saved, as the idle reaper does
            state = chat.session.state_path
            saved = file_bytes(state)
            assert (state / "kernel" / "meta.json").is_file() and saved > 10_000_000
        finally:
            await pool.close()

    usage = cli(root, "usage", "--json")
    assert usage.returncode == 0, usage.stderr
    [alice] = json.loads(usage.stdout)["users"]
    assert alice["user_id"] == "alice" and alice["saved_state_bytes"] == saved
    assert alice["bytes"] == 1 and alice["files"] == 1  # the image is not a file of the chat
    table = cli(root, "usage")
    assert "SAVED STATE" in table.stdout and human_bytes(saved) in table.stdout, table.stdout
    check = cli(root, "check")
    assert check.returncode == 0 and "index matches disk" in check.stdout, check.stdout + check.stderr

    # An image whose session is gone (written while its chat was deleted elsewhere) is drift.
    stray = state.parent / "no-such-chat.kernel"
    shutil.copytree(state, stray)
    drift = cli(root, "check", "--json")
    assert drift.returncode == 1, drift.stdout + drift.stderr
    assert [(d["kind"], str(stray) in d["detail"]) for d in json.loads(drift.stdout)] == [
        ("stray saved state", True)
    ]
    shutil.rmtree(stray)

    purge = cli(root, "cleanup", "--chat", "chat-1", "--json")
    assert purge.returncode == 0 and json.loads(purge.stdout)["sessions_removed"] == 1, purge.stdout
    assert not state.exists()
    assert json.loads(cli(root, "usage", "--json").stdout)["users"] == []
    assert cli(root, "check").returncode == 0
