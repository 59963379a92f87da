"""Drive the installed function (dist/code_sessions.py, loaded the way Open WebUI loads it) in-process.

Only Open WebUI's side is stood in for: where DATA_DIR is, who the user is, the base model (the same
scripted model as the end-to-end tests), the uploaded-file store and the Files API that published
copies go through (tests/support/files_api.py: FilesPublisher's ids, owner checks and attachments).
Storage, the sandbox (real runsc) and the whole pipe run for real. Use it for many hostile cases that
would be slow through HTTP; the claims about Open WebUI itself are made in tests/e2e with a real server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import types
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from demo import scripted_model
from tests.support.files_api import FilesApi

REPO = Path(__file__).resolve().parents[2]
BUNDLE = REPO / "dist" / "code_sessions.py"
FUNCTION_ID = "code_sessions"
MODEL = f"{FUNCTION_ID}.{scripted_model.MODEL_ID}"
PLOTLY_URL = "/code-sessions/plotly/harness.js"  # where the harness's host says plotly.js is served


def load_like_open_webui(content: str) -> types.ModuleType:
    """What open_webui/utils/plugin.py does: blind import rewriting, exec in a throwaway module."""
    for old, new in {
        "from utils": "from open_webui.utils",
        "from apps": "from open_webui.apps",
        "from main": "from open_webui.main",
        "from config": "from open_webui.config",
    }.items():
        content = content.replace(old, new)
    name = f"function_{FUNCTION_ID}_{uuid.uuid4().hex}"
    module = types.ModuleType(name)
    sys.modules[name] = module
    try:
        exec(content, module.__dict__)
    finally:
        sys.modules.pop(name, None)
    return module


# What a stream read from the network gives the event loop at the least: a reader returns what its
# buffer holds without suspending, and suspends when it is drained (aiohttp's buffer: 64 KiB).
_NETWORK_BUFFER = 64 * 1024


async def _sse(chunks: Iterable[dict]) -> AsyncIterator[bytes]:
    buffered = 0
    for chunk in chunks:
        event = f"data: {json.dumps(chunk)}\n\n".encode()
        yield event
        buffered += len(event)
        if buffered >= _NETWORK_BUFFER:
            buffered = 0
            await asyncio.sleep(0)
    yield b"data: [DONE]\n\n"


class UploadStore:
    """Open WebUI's store of uploaded files, as the harnesses stand in for it."""

    uploads: dict[str, tuple[str, str, bytes]]  # id -> (owner, name, bytes)

    def upload(self, owner: str, name: str, data: bytes) -> dict:
        """Store a file as the user's upload; returns the file item a request carries."""
        file_id = uuid.uuid4().hex
        self.uploads[file_id] = (owner, name, data)
        return {"type": "file", "id": file_id, "name": name}


@dataclass
class PipeHarness(UploadStore):
    data_dir: Path
    valves: dict[str, Any] = field(default_factory=dict)
    uploads: dict[str, tuple[str, str, bytes]] = field(default_factory=dict)  # id -> (owner, name, bytes)
    requests: list[dict] = field(default_factory=list)
    stored_valves: dict[str, Any] = field(default_factory=dict)
    # What Open WebUI's process holds for every file of one bundle (OpenWebUI.shared): pass another
    # harness's to be the same worker process, so that their files share one store and set of kernels.
    process: dict = field(default_factory=dict)
    # Where Open WebUI's storage provider keeps uploaded files (and so the published copies):
    # DATA_DIR/uploads, as Open WebUI's default; a test may put it on another disk.
    uploads_dir: Path | None = None

    def __post_init__(self) -> None:
        self.module = load_like_open_webui(BUNDLE.read_text())
        self.pipe = self.module.Pipe()
        self.cache_dir = self.data_dir / "cache"  # what Open WebUI serves to every logged-in user
        self.embeds: list[str] = []  # the last answer's embed (its charts), as Open WebUI would show it
        self.user_valves: dict = {}  # the user's valves of the Pipe (Open WebUI hands them to every call)
        self.files = FilesApi(
            self.module, self.uploads_dir or self.data_dir / "uploads", self.data_dir / "files-api.json"
        )
        self.pipe._host = _HarnessHost(self)  # the one object through which the function asks Open WebUI
        self.chats: dict[str, str] = {}  # chat id -> owner, for every chat a message was sent in
        self.deleted_chats: set[tuple[str, str]] = set()  # what Open WebUI would no longer find
        self.unsaved_chats: set[str] = set()  # chats Open WebUI has not written yet (being created)
        # Each saved chat's tree of messages as Open WebUI keeps it: message id -> its parent's id.
        self.trees: dict[str, dict[str, str | None]] = {}
        # What Open WebUI proves of a clone's claim (webui/clones.py, through a real one in tests/e2e):
        # (clone chat id, user id) -> its source, as webui.CloneSource holds it.
        self.clones: dict[tuple[str, str], Any] = {}
        self.set_valves(base_models=scripted_model.MODEL_ID, **self.valves)

    # -- driving it ---------------------------------------------------------------------------------

    def set_valves(self, **changes: Any) -> None:
        """What Open WebUI does before each call: validate and assign the stored valves."""
        self.stored_valves = {**self.stored_valves, **changes}
        self.pipe.valves = self.pipe.Valves(**self.stored_valves)

    async def say(self, user_id: str, chat_id: str, text: str, **options: Any) -> str:
        """One user message through Pipe.pipe, as Open WebUI calls it (`options`: `start`'s); returns
        the visible answer."""
        result = await self.start(user_id, chat_id, text, **options)
        if isinstance(result, str):
            return result
        if isinstance(result, dict):
            return json.dumps(result)
        answer = "".join([piece async for piece in result])
        await settle(self.pipe)
        return answer

    async def start(
        self,
        user_id: str,
        chat_id: str,
        text: str,
        *,
        history: list[dict] | None = None,
        files: list[dict] | None = None,
        task: str | None = None,
        message_id: str | None = None,
        user_message: dict | None = None,
    ) -> Any:
        """`say` up to what Pipe.pipe returns (a string, or the answer's stream not read yet): a test
        reads the stream itself, and may stop it as Open WebUI does when the user stops the answer.
        `message_id`: the answer's message, which can hold attachments (Open WebUI always names it; the
        default None stands for a message that cannot, so that files not named are named in the text).
        `user_message` ({id, parentId}): where the message is in the chat's tree, which Open WebUI
        records before it calls the function (a regenerate sends the same user message again)."""
        self.pipe.valves = self.pipe.Valves(**self.stored_valves)
        body = {
            "model": MODEL,
            "messages": [*(history or []), {"role": "user", "content": text}],
            "stream": True,
        }
        statuses: list[dict] = []

        async def emit(event: dict) -> None:
            statuses.append(event)

        self.events = statuses
        self.chats.setdefault(chat_id, user_id)
        self.message_id = message_id
        record_turn(self.trees, chat_id, message_id, user_message)
        return await self.pipe.pipe(
            body,
            __user__={
                "id": user_id,
                "name": user_id,
                "role": "user",
                "valves": self.pipe.UserValves(**self.user_valves),
            },
            __request__=None,
            __event_emitter__=emit,
            __chat_id__=chat_id,
            __task__=task,
            __files__=files or [],
            __message_id__=message_id,
            __metadata__={"user_message": user_message} if user_message else {},
        )

    async def aclose(self) -> None:
        """What the end of the Open WebUI process would do: stop the background loop, close the store."""
        await stop_adapter(self.pipe)

    @property
    def sessions_root(self) -> Path:
        return self.data_dir / "code_sessions"


def record_turn(
    trees: dict[str, dict[str, str | None]], chat_id: str, message_id: str | None, user_message: dict | None
) -> None:
    """What Open WebUI's chat turn does to the chat's tree before the model is asked (models/chats.py
    `insert_chat_turn`): the user message under its parent (kept where it is when it exists: a
    regenerate), the answer under the user message; an API caller's answer, sent without a user
    message, is filed with no parent."""
    if not message_id:
        return
    tree = trees.setdefault(chat_id, {})
    if user_message:
        tree.setdefault(user_message["id"], user_message.get("parentId"))
        tree[message_id] = user_message["id"]
    else:
        tree.setdefault(message_id, None)


async def settle(adapter: Any) -> None:
    """Wait for what the answer left to the background (its state saved for the conversation's
    branches): a moment after the answer, as a user would see it. The real server's timing is
    proven through a real Open WebUI (tests/e2e)."""
    services = adapter._services
    if services is not None:
        await services.branches.settle()


async def stop_adapter(adapter: Any) -> None:
    """Stop an adapter's background loop and close its services (its kernels stop with them, as with
    Open WebUI's process), also for the other files of its process that share them."""
    task = adapter._background
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    services = adapter._services
    if services is not None:
        shared = adapter._host.shared()
        for key in [k for k, entry in shared.items() if getattr(entry, "services", None) is services]:
            del shared[key]
        await services.close()
        adapter._turns = adapter._services_key = None


class _HarnessHost:
    """Open WebUI, stood in for (engine.Host, every method of it: tests/function/test_host_seam.py):
    where DATA_DIR is, who the user is, the base model (the scripted one), the uploaded-file store, the
    saved valves, and which chats exist."""

    def __init__(self, harness: PipeHarness) -> None:
        self._harness = harness
        self._module = harness.module

    def locations(self, storage_root: str, function_id: str) -> Any:
        h = self._harness
        root = Path(storage_root) if storage_root else h.data_dir / "code_sessions"
        return types.SimpleNamespace(
            root=root,
            publish_dir=h.cache_dir / "functions" / function_id,
            url_prefix=f"/cache/functions/{function_id}/",
        )

    def shared(self) -> dict:
        return self._harness.process

    def index_url(self, choice: str) -> str:
        # Open WebUI's own database is SQLite here: empty and "sqlite" both mean the index file.
        return "" if choice.strip().lower() in ("", "sqlite") else choice.strip()

    def publisher(self, places: Any) -> Any:
        # Open WebUI's Files API, stood in for with FilesPublisher's behaviour (tests/support/files_api.py);
        # the real publisher is proven through a real Open WebUI (tests/e2e).
        return self._harness.files.publisher()

    def _open_webui(self) -> Any:
        # Open WebUI's rules about its chat ids, read from the loaded bundle so they cannot drift.
        return __import__(self._module._CS_PACKAGE + ".webui.host", fromlist=["host"]).OpenWebUI()

    def temporary_chat(self, chat_id: str) -> bool:
        return self._open_webui().temporary_chat(chat_id)

    def saves_chat(self, chat_id: str) -> bool:
        return self._open_webui().saves_chat(chat_id)

    def can_attach(self, chat_id: str, message_id: str | None) -> bool:
        return self._open_webui().can_attach(chat_id, message_id)

    async def attach(
        self,
        chat_id: str,
        message_id: Any,
        user_id: str,
        links: list,
        emit: Any,
        *,
        inline_urls=(),
        replacing=(),
    ) -> None:
        """The message's attachments as Open WebUI's `attach` makes them (webui/host.py and
        webui/files.py; proven in tests/e2e): every linked file but the images the text shows inline,
        without the copies these replace."""
        if not self.can_attach(chat_id, message_id):
            return
        await self._harness.files.attach(
            chat_id, message_id, user_id, links, emit, inline_urls=inline_urls, replacing=replacing
        )

    async def embed(self, embed: Any, emit: Any) -> None:
        """The message's one embed, as Open WebUI's `embed` sends it (webui/host.py, which serves its
        plotly.js at a URL of its own; proven in tests/e2e): kept here as the last embed of the
        harness, its plotly.js at PLOTLY_URL."""
        if embed is not None:
            assert embed.script.name == "plotly.min.js", embed.script
            self._harness.embeds = [await asyncio.to_thread(embed.html, PLOTLY_URL)]

    async def user(self, user_id: str) -> Any:
        return types.SimpleNamespace(id=user_id, role="user")

    async def call_model(self, request: Any, user: Any, form: dict, *, stream: bool) -> Any:
        self._harness.requests.append(json.loads(json.dumps(form)))
        reply = scripted_model.answer(form)
        if not stream:
            return scripted_model._completion(form, reply)
        return types.SimpleNamespace(body_iterator=_sse(scripted_model._chunks(form, reply)))

    async def read_upload(self, file_id: str, user_id: str) -> tuple[bytes | None, str]:
        owner, name, data = self._harness.uploads.get(file_id, (None, "", b""))
        return (data, name) if owner == user_id else (None, "")

    async def stored_valves(self, function_id: str) -> dict:
        return dict(self._harness.stored_valves)

    async def store_valves(self, function_id: str, valves: dict) -> None:
        self._harness.stored_valves = dict(valves)

    # A Tool's valves, and who may use it: no Tool is installed beside the Pipe alone (tool_harness.py's
    # host has one).
    async def stored_tool_valves(self, tool_id: str) -> dict:
        return {}

    async def store_tool_valves(self, tool_id: str, valves: dict) -> None:
        raise LookupError(f"no Tool {tool_id!r} is installed")

    async def may_use_tool(self, user_id: str, role: str, tool_id: str) -> bool:
        return False

    async def message_lineage(
        self, chat_id: str, message_id: str, user_message: dict | None = None
    ) -> tuple[list[str], bool]:
        """Open WebUI's walk up the chat's tree (webui/host.py), over the harness's record of it. A
        temporary chat has no record in Open WebUI: the real host's own fallback answers for it."""
        if not self.saves_chat(chat_id):
            found: tuple[list[str], bool] = await self._open_webui().message_lineage(
                chat_id, message_id, user_message
            )
            return found
        tree = self._harness.trees.get(chat_id, {})
        chain = [message_id]
        current = tree.get(message_id)
        while current is not None:
            chain.append(current)
            if current not in tree:
                return chain, False
            current = tree[current]
        return chain, message_id in tree

    # -- files in: upload links and Knowledge, for a user with no Knowledge base (webui/uploads.py and
    # webui/knowledge.py; the route and the Knowledge API are proven through a real Open WebUI)

    def upload_links_folder(self) -> Path:
        return self._harness.data_dir / "code_sessions_upload_links"

    def serve_uploads(self, receiver: Any) -> bool:
        return False  # no web server in-process: tests/e2e POST to the real route

    async def upload_url(self, request: Any, token: str) -> str:
        return f"http://127.0.0.1/code-sessions/upload/{token}"

    async def save_to_knowledge(self, request: Any, user_id: str, target: str, name: str, data: bytes) -> str:
        if not target:
            return "You have no Knowledge base you may add to: make one under Workspace → Knowledge."
        return f"Not saved: you have no Knowledge base named “{target}” (or it is not shared with you)."

    async def chat_messages(self, chat_id: str) -> tuple[str, dict[str, dict]]:
        """The saved chat as Open WebUI's `chat_messages` reads it (webui/host.py; the buttons that read
        it are proven through a real Open WebUI in tests/e2e/test_actions.py): the harness keeps each
        message's place in the tree and its attachments, not its text."""
        tree = self._harness.trees.get(chat_id, {}) if self.saves_chat(chat_id) else {}
        files = self._harness.files.message_files
        return "", {
            message: {"id": message, "parentId": parent, "files": list(files.get((chat_id, message), []))}
            for message, parent in tree.items()
        }

    async def knowledge_bases(self, user_id: str) -> list[tuple[str, str]]:
        return []  # the harness's users have no Knowledge base (as save_to_knowledge says)

    async def clone_origin(self, chat_id: str, user_id: str) -> Any:
        """Open WebUI's proof of a clone's claim (webui/clones.py), as the test recorded it."""
        return self._harness.clones.get((chat_id, user_id))

    async def chat_owners(self, chat_ids: list[str]) -> dict[str, str]:
        h = self._harness
        self.lookups = getattr(self, "lookups", 0) + 1
        return {
            chat: h.chats[chat]
            for chat in chat_ids
            if chat in h.chats
            and (h.chats[chat], chat) not in h.deleted_chats
            and chat not in h.unsaved_chats
        }


def code(source: str, reply: str = "", language: str = "python") -> str:
    """A user message that makes the scripted model run `source`, then answer `reply`."""
    return f"```{language}\n{source}\n```\n" + (f"reply: {reply}" if reply else "")
