"""Open WebUI killed in the middle of a run (SIGKILL to its process only, like a crash), then restarted.

A dedicated Open WebUI with its own DATA_DIR: the shared one must not die. After the crash the sandbox of
the killed run must not go on running; after the restart the index and the disk agree (the storage CLI's
`check`), the earlier files and links are intact, and nothing of the killed run is left on the host.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from demo import launcher
from tests.adversarial.crash_site import CrashSite, take_early_site
from tests.support import sandbox
from tests.support.open_webui import BASE_MODEL, MODEL
from tests.support.sandbox import live_processes

pytestmark = [pytest.mark.e2e, pytest.mark.runsc]

REPO = Path(__file__).resolve().parents[2]
RUNNER_BUNDLES = Path("/run/code-sessions-runner")
RUNSC_STATE = Path("/run/code-sessions-runsc")

LOOP_FOREVER = (
    "```python\nimport time\nopen('/mnt/data/before.txt', 'w').write('before')\ni = 0\nwhile True:\n"
    "    open('/mnt/data/beat', 'w').write(str(time.time()))\n"
    "    if i < 20:\n        open(f'/mnt/data/n{i:02}', 'w').write(str(i))\n"
    "    i += 1\n    time.sleep(0.1)\n```\nreply: never reached"
)


@pytest.fixture
def site() -> Iterator[CrashSite]:
    found = take_early_site() or CrashSite().begin()
    try:
        yield found
    finally:
        found.stop()


def run_of(data_dir: Path) -> str | None:
    """The container id of the sandbox running with a folder of this DATA_DIR at /mnt/data."""
    for config in RUNNER_BUNDLES.glob("cs-*/config.json"):
        try:
            spec = json.loads(config.read_text())
        except (OSError, ValueError):
            continue
        if any(str(data_dir) in mount.get("source", "") for mount in spec.get("mounts", [])):
            return config.parent.name
    return None


def leftovers(cid: str) -> list[str]:
    return sandbox.leftovers(cid, RUNSC_STATE, RUNNER_BUNDLES)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_crash_mid_run_then_restart(site: CrashSite):
    """Naive: the orphaned sandbox runs on forever (no supervisor), its files never reach the index, and
    its runsc container, bundle and cgroup stay on the host."""
    server = site.ready()
    data_dir, log = site.data_dir, site.log
    try:
        admin = server.account("admin@example.com", "Admin-Passw0rd", admin=True)
        server.accounts["admin"] = admin
        server.admin_http.install_function()
        server.admin_http.set_valves(base_models=BASE_MODEL, timeout_seconds=120)
        server.admin_http.share_model(MODEL, f"Code · {BASE_MODEL}")
        first = admin.say(
            "```python\nopen('/mnt/data/keep.txt', 'w').write('keep')\n```\nreply: /mnt/data/keep.txt"
        )
        link = first.links()[-1]
        other = admin.say("```python\nopen('/mnt/data/other.txt', 'w').write('other')\n```\nreply: ok")
        sessions = data_dir / "code_sessions" / "sessions"
        before = {p: digest(p) for p in sessions.rglob("*") if p.is_file()}
        # The published copy: an Open WebUI file, its bytes where Open WebUI's storage put them.
        record = admin.get(link.removesuffix("/content")).json()
        assert Path(record["path"]).is_relative_to(data_dir), record
        before[Path(record["path"])] = hashlib.sha256(b"keep").hexdigest()

        # The run that the crash interrupts: it never ends by itself (timeout 120 s).
        threading.Thread(
            target=lambda: _swallow(lambda: admin.say(LOOP_FOREVER, previous=first)), daemon=True
        ).start()
        deadline = time.monotonic() + 60
        while not list(sessions.rglob("n05")):
            assert time.monotonic() < deadline, launcher.tail(log)
            time.sleep(0.2)
        cid = run_of(data_dir)
        assert cid, "the run's bundle was not found"
        [beat] = list(sessions.rglob("beat"))

        os.kill(server.process.pid, signal.SIGKILL)  # Open WebUI only, not its process group: a crash
        server.process.wait()
        deadline = time.monotonic() + 10
        while live_processes(cid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert live_processes(cid) == [], "the sandbox outlived Open WebUI"
        stamp = beat.read_text()
        time.sleep(0.5)
        assert beat.read_text() == stamp, "the sandboxed code is still running"

        server = site.server = site.start()  # same DATA_DIR, same secret: tokens still valid
        server.accounts["admin"] = admin
        # The answer the crash cut short stays in the chat: the next message continues from it.
        after = admin.say(
            "```python\nimport os\nprint(sorted(os.listdir('/mnt/data')))\n```\nreply: listed",
            previous=admin.newest(first),
        )
        assert "'before.txt'" in after.content and "'keep.txt'" in after.content
        assert leftovers(cid) == []
        check = subprocess.run(
            [sys.executable, "-m", "storage", "--root", str(data_dir / "code_sessions"), "check"],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        assert check.returncode == 0, check.stdout + check.stderr
        assert "index matches disk" in check.stdout
        for path, value in before.items():
            assert digest(path) == value, f"{path} changed"
        assert admin.download(link).content == b"keep"
        assert other.chat_id in {chat["id"] for chat in admin.get("/api/v1/chats/?page=1").json()}
    except BaseException:
        print(f"--- open-webui log ---\n{launcher.tail(log, 120)}", file=sys.stderr)
        raise


def _swallow(call) -> None:
    with contextlib.suppress(httpx.HTTPError, AssertionError):  # the server dies under it: the point
        call()
