"""Fixtures that start the real thing: the scripted model server and Open WebUI 0.12.4 from PyPI.

One Open WebUI per test session (it takes ~30 s to start), on 127.0.0.1, with its own DATA_DIR, the bundled
function installed through the HTTP API the way an admin would, an admin and a second user.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from demo import launcher

FUNCTION_ID = launcher.FUNCTION_ID
BUNDLE = launcher.BUNDLE
OWUI_VENV = launcher.OWUI_VENV
BASE_MODEL = "demo-scripted"
MODEL = f"{FUNCTION_ID}.{BASE_MODEL}"
# What an answer links: a file of Open WebUI's Files API that code-sessions published.
LINK = re.compile(r"/api/v1/files/code-sessions-[0-9a-f-]{36}/content")


@dataclass
class Reply:
    chat_id: str
    message_id: str
    content: str
    history: list[dict]

    def links(self) -> list[str]:
        return LINK.findall(self.content)


@dataclass
class Account:
    """A logged-in Open WebUI user, talking to the server over HTTP only."""

    server: OpenWebUI
    token: str
    user_id: str
    email: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def get(self, path: str, **kwargs) -> httpx.Response:
        return httpx.get(self.server.url + path, headers=self.headers, timeout=60, **kwargs)

    def delete(self, path: str) -> httpx.Response:
        return httpx.delete(self.server.url + path, headers=self.headers, timeout=60)

    def post(self, path: str, payload: object = None, **kwargs) -> httpx.Response:
        return httpx.post(self.server.url + path, headers=self.headers, json=payload, timeout=300, **kwargs)

    def say(
        self, text: str, previous: Reply | None = None, files: list[dict] | None = None, model: str = MODEL
    ) -> Reply:
        """Send one user message the way the web UI does (the server saves both messages in the chat)."""
        user_id, assistant_id = str(uuid.uuid4()), str(uuid.uuid4())
        history = [*previous.history] if previous else []
        user_message = {
            "id": user_id,
            "role": "user",
            "content": text,
            "childrenIds": [],
            "parentId": previous.message_id if previous else None,
        }
        if files:
            user_message["files"] = files
        payload = {
            "model": model,
            "messages": [*history, {"role": "user", "content": text}],
            "stream": False,
            "parent_id": previous.message_id if previous else None,
            "user_message": user_message,
            "id": assistant_id,
        }
        if previous:
            payload["chat_id"] = previous.chat_id
        if files:
            payload["files"] = files
        response = self.post("/api/chat/completions", payload)
        assert response.status_code == 200, response.text
        body = response.json()
        assert "choices" in body, body
        content = body["choices"][0]["message"]["content"]
        chat_id = previous.chat_id if previous else self._chat_of(assistant_id)
        return Reply(
            chat_id,
            assistant_id,
            content,
            [*history, {"role": "user", "content": text}, {"role": "assistant", "content": content}],
        )

    def newest(self, reply: Reply) -> Reply:
        """The chat's newest message as Open WebUI holds it: what the web UI's next message continues
        from (an answer cut short by a crash has no reply of its own, but stays in the chat's tree)."""
        chat = self.get(f"/api/v1/chats/{reply.chat_id}").json()
        return Reply(reply.chat_id, chat["chat"]["history"]["currentId"], "", reply.history)

    def _chat_of(self, message_id: str) -> str:
        for chat in self.get("/api/v1/chats/?page=1").json():
            detail = self.get(f"/api/v1/chats/{chat['id']}").json()
            if message_id in detail["chat"]["history"]["messages"]:
                return chat["id"]
        raise AssertionError(f"no chat holds message {message_id}")

    def upload(self, name: str, data: bytes) -> dict:
        response = httpx.post(
            self.server.url + "/api/v1/files/?process=false",
            headers=self.headers,
            files={"file": (name, data, "text/csv")},
            timeout=60,
        )
        assert response.status_code == 200, response.text
        record = response.json()
        return {"type": "file", "id": record["id"], "name": name}

    def download(self, link: str) -> httpx.Response:
        return self.get(link)


def say_streamed(
    account: Account,
    text: str,
    previous: Reply | None = None,
    *,
    files: list[dict] | None = None,
    model: str = MODEL,
    tool_ids: tuple[str, ...] = (),
) -> Reply:
    """One message as the web UI sends it (streamed, with a socket's `session_id`, so the answer runs
    as a background task with an event emitter, and its events are saved: embeds, files); then the
    saved answer once its task is done. `tool_ids`: the model's tools the UI preselects."""
    user_id, assistant_id = str(uuid.uuid4()), str(uuid.uuid4())
    history = [*previous.history] if previous else []
    user_message = {
        "id": user_id,
        "role": "user",
        "content": text,
        "childrenIds": [],
        "parentId": previous.message_id if previous else None,
    }
    payload: dict = {
        "model": model,
        "messages": [*history, {"role": "user", "content": text}],
        "stream": True,
        "session_id": f"test-{uuid.uuid4().hex[:8]}",
        "parent_id": previous.message_id if previous else None,
        "user_message": user_message,
        "id": assistant_id,
        "tool_ids": list(tool_ids),
    }
    if previous:
        payload["chat_id"] = previous.chat_id
    if files:
        payload["files"] = files
        user_message["files"] = files
    response = account.post("/api/chat/completions", payload)
    assert response.status_code == 200, response.text
    chat_id = response.json()["chat_id"]
    content = saved_answer(account, chat_id, assistant_id)
    return Reply(
        chat_id,
        assistant_id,
        content,
        [*history, {"role": "user", "content": text}, {"role": "assistant", "content": content}],
    )


class TreeChat:
    """A chat driven as the web UI drives it: every request names its user message (a new one, or the
    same one again for a regenerate) and the answer's id, and Open WebUI files both in the chat's tree.
    `streamed`: sent with a socket's session_id (the answer runs as a background task, read back once
    saved), else answered in the response."""

    def __init__(self, account: Account, *, streamed: bool = False) -> None:
        self.account = account
        self.streamed = streamed
        self.chat_id = ""
        self.texts: dict[str, str] = {}  # message id -> its text, to send the branch's history
        self.parents: dict[str, str | None] = {}

    def history(self, message_id: str | None) -> list[dict]:
        chain = []
        while message_id is not None:
            role = "assistant" if message_id.startswith("a-") else "user"
            chain.append({"role": role, "content": self.texts[message_id]})
            message_id = self.parents[message_id]
        return chain[::-1]

    def send(self, text: str, *, parent: str | None, again: str | None = None) -> tuple[str, str]:
        """A new user message under the answer `parent`, or the user message `again` once more (a
        regenerate). Returns (answer id, the answer's text)."""
        user_id = again or f"u-{uuid.uuid4()}"
        answer_id = f"a-{uuid.uuid4()}"
        if again is None:
            self.texts[user_id], self.parents[user_id] = text, parent
        else:
            text, parent = self.texts[again], self.parents[again]
        user_message: dict = {"id": user_id, "role": "user", "content": text, "parentId": parent}
        payload: dict = {
            "model": MODEL,
            "messages": [*self.history(parent), {"role": "user", "content": text}],
            "stream": self.streamed,
            "parent_id": parent,
            "user_message": user_message,
            "id": answer_id,
        }
        if self.streamed:
            payload["session_id"] = f"test-{uuid.uuid4().hex[:8]}"
            user_message["childrenIds"] = []
        if self.chat_id:
            payload["chat_id"] = self.chat_id
        response = self.account.post("/api/chat/completions", payload)
        assert response.status_code == 200, response.text
        if self.streamed:
            self.chat_id = self.chat_id or response.json()["chat_id"]
            content = saved_answer(self.account, self.chat_id, answer_id)
        else:
            content = response.json()["choices"][0]["message"]["content"]
            self.chat_id = self.chat_id or self.account._chat_of(answer_id)
        self.texts[answer_id], self.parents[answer_id] = content, user_id
        return answer_id, content

    def user_of(self, answer_id: str) -> str:
        parent = self.parents[answer_id]
        assert parent is not None
        return parent


def saved_answer(account: Account, chat_id: str, message_id: str, timeout: float = 180) -> str:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        tasks = account.get(f"/api/tasks/chat/{chat_id}").json().get("task_ids")
        chat = account.get(f"/api/v1/chats/{chat_id}").json()["chat"]
        message = chat["history"]["messages"].get(message_id)
        if message and message.get("done") and not tasks:
            return message_text(message)
        time.sleep(0.5)
    raise AssertionError(f"the answer {message_id} was not done within {timeout:.0f} s")


def message_text(message: dict) -> str:
    """The answer's text as the web UI shows it: the outlet's content, else the output's text parts."""
    if message.get("content"):
        return message["content"]
    return "\n".join(
        part.get("text", "")
        for item in message.get("output") or []
        if item.get("type") == "message"
        for part in item.get("content") or []
    )


@dataclass
class OpenWebUI:
    url: str
    data_dir: Path
    log: Path
    model_url: str
    process: subprocess.Popen
    accounts: dict[str, Account] = field(default_factory=dict)

    def account(self, email: str, password: str, *, admin: bool) -> Account:
        if admin:
            response = httpx.post(
                self.url + "/api/v1/auths/signup",
                timeout=60,
                json={"name": email.split("@")[0], "email": email, "password": password},
            )
        else:
            response = self.accounts["admin"].post(
                "/api/v1/auths/add",
                {"name": email.split("@")[0], "email": email, "password": password, "role": "user"},
            )
        assert response.status_code == 200, response.text
        signin = httpx.post(
            self.url + "/api/v1/auths/signin", json={"email": email, "password": password}, timeout=60
        ).json()
        return Account(self, signin["token"], signin["id"], email)

    @property
    def admin(self) -> Account:
        return self.accounts["admin"]

    def valves(self) -> dict:
        return self.admin_http.valves()

    def set_valves(self, **changes) -> dict:
        return self.admin_http.set_valves(**changes)

    @property
    def admin_http(self) -> launcher.Admin:
        return launcher.Admin(self.url, self.admin.token)

    def model_requests(self) -> list[dict]:
        return httpx.get(self.model_url + "/_requests", timeout=10).json()

    @property
    def sessions_root(self) -> Path:
        return self.data_dir / "code_sessions"


@pytest.fixture(scope="session")
def model_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = launcher.free_port()
    process = launcher.start_model_server(port, tmp_path_factory.mktemp("model") / "model.log")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        launcher.stop(process)


@contextlib.contextmanager
def running_open_webui(
    home: Path,
    model_server: str,
    users: Iterable[str],
    *,
    env: dict[str, str] | None = None,
    timeout: float = 300,
) -> Iterator[OpenWebUI]:
    """Open WebUI started in `home` with the bundled function installed and its model shared: an admin
    and one ordinary account per name in `users` (password `<Name>-Passw0rd`). Stopped at the end; its
    log's tail is printed if anything fails."""
    assert shutil.which("runsc"), "runsc is missing: run ./scripts/setup"
    assert BUNDLE.exists(), "dist/code_sessions.py is missing: run python tools/bundle.py"
    data_dir, log = home / "data", home / "open-webui.log"
    port = launcher.free_port()
    environment = {
        "WEBUI_SECRET_KEY": uuid.uuid4().hex,
        "ENABLE_OLLAMA_API": "false",
        "OPENAI_API_BASE_URL": model_server + "/v1",
        "OPENAI_API_KEY": "scripted",
        **(env or {}),
    }
    process = launcher.start_open_webui(data_dir, port, log, environment, timeout=timeout)
    server = OpenWebUI(f"http://127.0.0.1:{port}", data_dir, log, model_server, process)
    try:
        server.accounts["admin"] = server.account("admin@example.com", "Admin-Passw0rd", admin=True)
        for name in users:
            password = f"{name.title()}-Passw0rd"
            server.accounts[name] = server.account(f"{name}@example.com", password, admin=False)
        admin = server.admin_http
        admin.install_function()
        admin.set_valves(base_models=BASE_MODEL, timeout_seconds=20)
        admin.share_model(MODEL, f"Code · {BASE_MODEL}")
        yield server
    except BaseException:
        print(f"--- open-webui log ---\n{launcher.tail(log, 120)}", file=sys.stderr)
        raise
    finally:
        launcher.stop(server.process)  # the one running now: a test may have started it again


@pytest.fixture(scope="session")
def open_webui(tmp_path_factory: pytest.TempPathFactory, model_server: str) -> Iterator[OpenWebUI]:
    with running_open_webui(tmp_path_factory.mktemp("open-webui"), model_server, ["bob"]) as server:
        yield server
