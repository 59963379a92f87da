"""The whole product in a container started with the README's exact `docker run` flags (podman here):
Open WebUI in the image deploy/Dockerfile builds, gVisor inside it, the bundled function installed over
HTTP as an admin would, the offline demo model running inside the container too, and a user's flow
over HTTP only, through a restart of the container. Then the doctor, whose output docs/operations.md shows.

Outputs (logs, the doctor's report, timings) go to $CODE_SESSIONS_CONTAINER_OUT.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from demo import launcher
from tests.support.open_webui import BASE_MODEL, BUNDLE, MODEL, Account, OpenWebUI, Reply

from .recipe import (
    IMAGE,
    LABEL,
    OUT,
    PODMAN_EXTRA,
    REPO,
    podman,
    readme_recipe,
    remove_container,
    unique,
)

pytestmark = [pytest.mark.container]

MODEL_PORT = 8099  # inside the container
# Links as the function writes them: Open WebUI files, opened with the reader's own session.
LINK = r"/api/v1/files/[A-Za-z0-9-]+/content"
NAMED_LINK = re.compile(r"!?\[([^\]]+)\]\((" + LINK + r")\)")
LIST_FILES = "```python\nimport os\nprint('files:', sorted(os.listdir('/mnt/data')))\n```\n"
READ_BACK = "```python\nprint(open('/mnt/data/report.csv').read())\n```\nreply: Read it back."
DATA_STACK = (
    "```python\n"
    "import sys\n"
    "import matplotlib\n"
    "matplotlib.use('Agg')\n"
    "import matplotlib.pyplot as plt, numpy, openpyxl, pandas, PIL, scipy\n"
    "frame = pandas.read_csv('/mnt/data/report.csv')\n"
    "frame.plot(x='month', y='visitors').get_figure().savefig('/mnt/data/visitors.png')\n"
    "frame.to_excel('/mnt/data/report.xlsx', index=False)\n"
    "print('interpreter', sys.executable, 'pandas', pandas.__version__, 'rows', len(frame))\n"
    "```\n"
    "reply: Charted with pandas: /mnt/data/visitors.png and /mnt/data/report.xlsx"
)


@dataclass
class Box:
    """The running container and the people using it."""

    name: str
    volume: str
    url: str
    server: OpenWebUI
    timings: dict[str, float] = field(default_factory=dict)
    links: dict[str, tuple[Account, str, bytes]] = field(default_factory=dict)  # name -> owner, url, bytes
    turns: dict[str, Reply] = field(default_factory=dict)

    def account(self, key: str) -> Account:
        return self.server.accounts[key]

    def timed(self, key: str, start: float) -> None:
        self.timings[key] = round(time.monotonic() - start, 1)


def links_of(reply: Reply) -> dict[str, str]:
    return {name: url for name, url in NAMED_LINK.findall(reply.content)}


def wait_healthy(box_name: str, url: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = podman("inspect", "--format", "{{.State.Running}}", box_name, check=False).stdout.strip()
        if state != "true":
            logs = podman("logs", "--tail", "80", box_name, check=False)
            raise AssertionError(f"the container stopped:\n{logs.stdout}{logs.stderr}")
        try:
            if httpx.get(url + "/health", timeout=3).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError(f"{url}/health did not answer within {timeout:.0f} s")


def start_model(box_name: str) -> None:
    """The scripted demo model, inside the container, on its loopback (Open WebUI reaches it there)."""
    podman("exec", "-d", box_name, "python3", "/opt/scripted_model.py", "--port", str(MODEL_PORT))
    probe = f"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{MODEL_PORT}/v1/models')"
    for _ in range(60):
        if podman("exec", box_name, "python3", "-c", probe, check=False).returncode == 0:
            return
        time.sleep(0.5)
    raise AssertionError("the scripted model did not start inside the container")


@pytest.fixture(scope="module")
def box() -> Iterator[Box]:
    OUT.mkdir(parents=True, exist_ok=True)
    recipe = readme_recipe()
    name, volume = unique("cs-owui"), unique("cs-data")
    port = launcher.free_port()
    podman("volume", "create", "--label", LABEL, volume)
    command = [
        "run", "-d", "--name", name, "--label", LABEL, *PODMAN_EXTRA,
        "-p", f"127.0.0.1:{port}:8080", "-v", f"{volume}:/app/backend/data",
        *recipe.flags, IMAGE,
    ]  # fmt: skip
    (OUT / "podman-run.txt").write_text("podman " + subprocess.list2cmdline(command) + "\n")
    url = f"http://127.0.0.1:{port}"
    server = OpenWebUI(url, Path("/app/backend/data"), OUT / "open-webui.log", "", None)
    box = Box(name, volume, url, server)
    try:
        start = time.monotonic()
        podman(*command)
        wait_healthy(name, url)
        box.timed("first start of Open WebUI in the container", start)
        podman("cp", str(REPO / "demo" / "scripted_model.py"), f"{name}:/opt/scripted_model.py")
        start_model(name)
        start = time.monotonic()
        server.accounts["admin"] = server.account("admin@example.com", "Admin-Passw0rd", admin=True)
        server.accounts["ada"] = server.account("ada@example.com", "Ada-Passw0rd", admin=False)
        server.accounts["bob"] = server.account("bob@example.com", "Bob-Passw0rd", admin=False)
        admin = launcher.Admin(url, server.admin.token)
        admin.install_function(BUNDLE)
        admin.use_models_from(openai=(f"http://127.0.0.1:{MODEL_PORT}/v1", "scripted"))
        admin.set_valves(base_models=BASE_MODEL)
        admin.share_model(MODEL, f"Code · {BASE_MODEL}")
        box.timed("admin setup over HTTP", start)
        yield box
    finally:
        logs = podman("logs", name, check=False)
        (OUT / "open-webui.log").write_text(logs.stdout + logs.stderr)
        (OUT / "timings.json").write_text(json.dumps(box.timings, indent=2))
        print("\ntimings (s):", json.dumps(box.timings, indent=2))
        remove_container(name)
        podman("volume", "rm", "--force", volume, check=False)


def say(box: Box, who: str, text: str, key: str, previous: str | None = None) -> Reply:
    start = time.monotonic()
    reply = box.account(who).say(text, previous=box.turns[previous] if previous else None)
    box.timed(f"turn: {key}", start)
    box.turns[key] = reply
    return reply


def keep(box: Box, who: str, name: str, url: str) -> bytes:
    """Download a link as its owner (the bearer token), remember its bytes for after the restart."""
    response = box.account(who).get(url)
    assert response.status_code == 200, (url, response.status_code, response.text[:300])
    box.links[name] = (box.account(who), url, response.content)
    return response.content


def test_make_a_csv_report(box: Box) -> None:
    reply = say(box, "ada", "make a csv report", "csv")
    links = links_of(reply)
    assert "report.csv" in links, reply.content
    data = keep(box, "ada", "report.csv", links["report.csv"])
    assert data.startswith(b"month,visitors,signups"), data[:200]
    assert data.count(b"\n") == 7


def test_plot_it(box: Box) -> None:
    reply = say(box, "ada", "plot it", "plot", previous="csv")
    assert re.search(r"!\[chart\.png\]\(" + LINK + r"\)", reply.content), reply.content
    response = box.account("ada").get(links_of(reply)["chart.png"])
    assert response.headers["content-type"] == "image/png"
    assert keep(box, "ada", "chart.png", links_of(reply)["chart.png"]).startswith(b"\x89PNG\r\n\x1a\n")


def test_a_read_back_sees_the_same_bytes(box: Box) -> None:
    reply = say(box, "ada", READ_BACK, "read back", previous="plot")
    csv_text = box.links["report.csv"][2].decode().replace("\r\n", "\n").strip()
    assert csv_text in reply.content.replace("\r\n", "\n"), reply.content


def test_the_data_stack_of_the_image_works_in_the_sandbox(box: Box) -> None:
    reply = say(box, "ada", DATA_STACK, "pandas and matplotlib", previous="read back")
    assert "interpreter /usr/bin/python3" in reply.content and "rows 6" in reply.content, reply.content
    links = links_of(reply)
    assert keep(box, "ada", "visitors.png", links["visitors.png"]).startswith(b"\x89PNG")
    assert keep(box, "ada", "report.xlsx", links["report.xlsx"]).startswith(b"PK")


def test_a_second_chat_of_the_same_user_sees_none_of_it(box: Box) -> None:
    reply = say(box, "ada", LIST_FILES, "second chat")
    assert reply.chat_id != box.turns["csv"].chat_id
    assert "files: []" in reply.content, reply.content
    assert not links_of(reply)


def test_a_second_user_sees_none_of_it(box: Box) -> None:
    bob = box.account("bob")
    assert bob.get(f"/api/v1/chats/{box.turns['csv'].chat_id}").status_code in (401, 403, 404)
    reply = say(box, "bob", LIST_FILES, "second user")
    assert "files: []" in reply.content, reply.content
    # Ada's own link, in Bob's hands: Open WebUI refuses it (Files API access is the owner's).
    assert bob.get(box.links["report.csv"][1]).status_code == 404


def test_after_a_restart_files_and_links_are_still_there(box: Box) -> None:
    start = time.monotonic()
    podman("restart", "--time", "20", box.name, timeout=300)
    wait_healthy(box.name, box.url)
    box.timed("podman restart until healthy", start)
    start_model(box.name)
    for name, (owner, url, data) in box.links.items():
        response = owner.get(url)
        assert response.status_code == 200, (name, url, response.status_code)
        assert response.content == data, name
    # The saved chat still carries the links, and the chat's folder is still there for the next turn.
    chat = box.account("ada").get(f"/api/v1/chats/{box.turns['csv'].chat_id}").json()
    saved = json.dumps(chat["chat"]["history"]["messages"])
    for name in ("report.csv", "chart.png"):
        assert box.links[name][1] in saved, name
    reply = say(box, "ada", READ_BACK, "read back after the restart", previous="pandas and matplotlib")
    csv_text = box.links["report.csv"][2].decode().replace("\r\n", "\n").strip()
    assert csv_text in reply.content.replace("\r\n", "\n"), reply.content


def test_the_doctor_in_the_container(box: Box) -> None:
    doctor = podman("exec", box.name, "code-sessions-doctor", check=False)
    (OUT / "doctor.txt").write_text(
        f"$ docker exec open-webui code-sessions-doctor\n{doctor.stdout}{doctor.stderr}"
    )
    print(doctor.stdout)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert "gVisor sandbox works." in doctor.stdout
    assert "[ ok ] memory limit: cgroup" in doctor.stdout
    assert "[ ok ] compression: /usr/bin/zstd" in doctor.stdout  # saved kernels are compressed
    assert "[ ok ] python: /usr/bin/python3" in doctor.stdout
    # --init: what gVisor leaves behind is reaped. (tests/container/test_flags.py: without it, not.)
    zombies = podman(
        "exec", box.name, "sh", "-c", "grep -l '^State:.*Z' /proc/[0-9]*/status || true"
    ).stdout.split()  # fmt: skip
    assert not zombies, zombies
