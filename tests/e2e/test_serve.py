"""The README's product command, `./scripts/serve` (demo/serve.py), as a newcomer uses it: offline, with the
built-in demo model, "make a csv report", "plot it", "zip both", then a restart and the files still there.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import httpx
import pytest

from demo import launcher
from demo.scripted_model import MODEL_ID as BASE_MODEL
from tests.support.open_webui import LINK, MODEL, Account, OpenWebUI, Reply

pytestmark = [pytest.mark.e2e, pytest.mark.runsc]


class Serve:
    """One `python -m demo.serve` process and what it printed."""

    def __init__(self, data_dir: Path, port: int, output: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.output = output
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_API", "OLLAMA"))}
        with open(output, "a") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "demo.serve", "--port", str(port), "--data-dir", str(data_dir)],
                cwd=launcher.REPO,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def printed(self) -> str:
        return self.output.read_text(errors="replace")

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while "Ready: open" not in self.printed():
            assert self.process.poll() is None, f"demo.serve exited:\n{self.printed()[-3000:]}"
            assert time.monotonic() < deadline, f"demo.serve not ready in {timeout:.0f} s:\n{self.printed()}"
            time.sleep(0.5)

    def stop(self) -> None:
        launcher.stop(self.process)  # SIGTERM, like the README's Ctrl-C

    def account(self) -> Account:
        # No login on the embedded defaults: Open WebUI's single user is admin@localhost / admin.
        credentials = {"email": "admin@localhost", "password": "admin"}
        signin = httpx.post(self.url + "/api/v1/auths/signin", json=credentials, timeout=60)
        assert signin.status_code == 200, signin.text
        body = signin.json()
        server = OpenWebUI(self.url, Path(), self.output, "", self.process)
        account = Account(server, body["token"], body["id"], body["email"])
        # What the page does first: list the models (Open WebUI also refreshes its model cache here).
        models = [model["id"] for model in account.get("/api/models").json()["data"]]
        assert MODEL in models, models
        return account


def link_named(reply: Reply, name: str, image: bool = False) -> str:
    """The one Files API URL the answer links (or, with image=True, shows) under this name."""
    pattern = ("!" if image else r"(?<!!)") + r"\[" + re.escape(name) + r"\]\((" + LINK.pattern + r")\)"
    urls = set(re.findall(pattern, reply.content))
    assert len(urls) == 1, (name, reply.content)
    return urls.pop()


def model_url(serve: Serve) -> str:
    [url] = re.findall(r"scripted demo model \((http://127\.0\.0\.1:\d+/v1)\)", serve.printed())
    return url


def tool_and_filter_on_the_plain_model(user: Account) -> None:
    """The Tool (shared with everyone) and the Filter (on) are installed, and both enabled, once each,
    on the base model, so that the plain model can use sessions too."""
    tool = user.get(f"/api/v1/tools/id/{launcher.TOOL_ID}")
    assert tool.status_code == 200, tool.text
    assert user.get(f"/api/v1/functions/id/{launcher.FILTER_ID}").json()["is_active"]
    meta = user.get(f"/api/v1/models/model?id={BASE_MODEL}").json()["meta"]
    assert (meta["toolIds"], meta["filterIds"]) == ([launcher.TOOL_ID], [launcher.FILTER_ID])


def test_the_readme_product_command_runs_the_file_workflow_offline_and_keeps_files_across_a_restart(
    tmp_path: Path,
) -> None:
    data_dir = tmp_path / "open-webui" / "data"
    port = launcher.free_port()
    serve = Serve(data_dir, port, tmp_path / "serve.out")
    try:
        serve.wait_ready()
        assert "models from the built-in scripted demo model" in serve.printed()
        assert "Code · demo-scripted" in serve.printed()
        user = serve.account()
        tool_and_filter_on_the_plain_model(user)

        report = user.say("make a csv report of visitors per month", model=MODEL)
        report_link = link_named(report, "report.csv")
        csv = user.download(report_link)
        assert csv.status_code == 200 and csv.content.startswith(b"month,visitors")
        chart = user.say("now plot it as a chart", previous=report, model=MODEL)
        chart_link = link_named(chart, "chart.png", image=True)
        png = user.download(chart_link)
        assert png.headers["content-type"] == "image/png" and png.content.startswith(b"\x89PNG")
        bundle = user.say("zip both", previous=chart, model=MODEL)
        zip_link = link_named(bundle, "bundle.zip")
        archive = zipfile.ZipFile(io.BytesIO(user.download(zip_link).content))
        assert sorted(archive.namelist()) == ["chart.png", "report.csv"]
        # The page shows the answer's non-image files as chips under it: the saved chat holds them.
        messages = user.get(f"/api/v1/chats/{report.chat_id}").json()["chat"]["history"]["messages"]
        assert [f["url"] for f in messages[report.message_id]["files"]] == [report_link]
        assert [f["url"] for f in messages[bundle.message_id]["files"]] == [zip_link]
    finally:
        serve.stop()
    with pytest.raises(httpx.HTTPError):  # stopping the command stopped Open WebUI too
        httpx.get(serve.url + "/health", timeout=2)

    # Sessions live under the data folder the command was given, outside Open WebUI's cache.
    sessions = data_dir / "code_sessions" / "sessions"
    assert sorted(p.name for p in sessions.rglob("*") if p.is_file()) == [
        "bundle.zip",
        "chart.png",
        "report.csv",
    ]

    again = Serve(data_dir, port, tmp_path / "serve-again.out")
    try:
        again.wait_ready()
        user = again.account()
        tool_and_filter_on_the_plain_model(user)  # updated in place at the second start, not doubled
        # The demo model moved to another port: only a re-pointed Open WebUI can answer at all.
        assert model_url(serve) != model_url(again)
        listing = user.say("list my files", previous=bundle, model=MODEL)
        for name in ("bundle.zip", "chart.png", "report.csv"):
            assert name in listing.content, listing.content
        # Links outlive restarts: the same URLs, with a new login, give the same bytes.
        assert user.download(report_link).content == csv.content
        assert user.download(chart_link).content == png.content
        assert sorted(zipfile.ZipFile(io.BytesIO(user.download(zip_link).content)).namelist()) == [
            "chart.png",
            "report.csv",
        ]
    finally:
        again.stop()
