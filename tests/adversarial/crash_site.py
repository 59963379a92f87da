"""The dedicated Open WebUI of the crash test (tests/adversarial/test_crash.py), startable early."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import threading
import uuid
from pathlib import Path

from demo import launcher
from tests.support.open_webui import OpenWebUI


class CrashSite:
    """The dedicated Open WebUI (and its own scripted model) of this test, in a fresh DATA_DIR.

    Starting Open WebUI takes ~40 s, mostly imports; `begin()` does it in a thread, so the conftest can
    start it as soon as collection finishes and the other tests run meanwhile."""

    def __init__(self) -> None:
        self.home = Path(tempfile.mkdtemp(prefix="code-sessions-crash-"))
        self.data_dir, self.log = self.home / "data", self.home / "open-webui.log"
        self.port = launcher.free_port()
        self.env: dict[str, str] = {}
        self.model: subprocess.Popen | None = None
        self.server: OpenWebUI | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def begin(self) -> CrashSite:
        self._thread = threading.Thread(target=self._start_all, daemon=True)
        self._thread.start()
        return self

    def _start_all(self) -> None:
        try:
            model_port = launcher.free_port()
            self.model = launcher.start_model_server(model_port, self.home / "model.log")
            self.env = {
                "WEBUI_SECRET_KEY": uuid.uuid4().hex,
                "ENABLE_OLLAMA_API": "false",
                "OPENAI_API_BASE_URL": f"http://127.0.0.1:{model_port}/v1",
                "OPENAI_API_KEY": "scripted",
            }
            self.server = self.start()
        except BaseException as error:
            self._error = error

    def ready(self) -> OpenWebUI:
        if self._thread is None:
            self.begin()
        assert self._thread is not None
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self.server is not None
        return self.server

    def start(self) -> OpenWebUI:
        process = launcher.start_open_webui(self.data_dir, self.port, self.log, self.env)
        url = f"http://127.0.0.1:{self.port}"
        return OpenWebUI(url, self.data_dir, self.log, self.env["OPENAI_API_BASE_URL"][:-3], process)

    def stop(self) -> None:
        if self._thread is not None:
            self._thread.join()
        for process in (self.server.process if self.server else None, self.model):
            if process is not None:
                launcher.stop(process)
        shutil.rmtree(self.home, ignore_errors=True)


_early: list[CrashSite] = []


def begin_early() -> None:
    """Start the dedicated Open WebUI now (the conftest calls this once the crash test is selected)."""
    _early.append(CrashSite().begin())


def take_early_site() -> CrashSite | None:
    return _early.pop() if _early else None


def stop_early_site() -> None:
    """At the end of the session: an early start nobody took (the test was skipped or stopped)."""
    while _early:
        _early.pop().stop()
