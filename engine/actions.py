"""The buttons under an answer (Open WebUI's Actions, functions/code_sessions_actions.py): the answer's
branch as a notebook, the chat's files in one view, the chat's folder as one zip, and the answer's files
into a Knowledge base. Each is what a typed command or a model's step would do, decided here (`press`,
which the Action reaches through `Turns.press`); the host only reads and shows.

Who may press them: the chat's owner. Open WebUI's route lets its admins act on any chat too, and the
request's body is the client's: the owner is checked again here (`owned`), before anything of the chat
is opened, and the answer's text, files and tree are read from the host's saved chat, never the body.
Every refusal and every limit is one sentence (`Reply`).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from storage import StorageError, human_bytes, is_export

from .host import Emit, Host
from .markup import code_span, escape_text
from .notebook import BranchMessage, build_notebook, notebook_bytes, notebook_name
from .service import ChatSession, Engine

__all__ = [
    "BUTTONS",
    "NOT_OWNER",
    "Ask",
    "Reply",
    "answer_to_knowledge",
    "chat_files",
    "export_notebook",
    "folder_zip",
    "owned",
    "press",
]

# The buttons, by the id Open WebUI calls the Action with (`<function id>.<id>`), and their names.
BUTTONS = {
    "notebook": "Export as notebook",
    "files": "Files of this chat",
    "zip": "Download all files (zip)",
    "knowledge": "Save to Knowledge",
}

MAX_LINKED = 50  # files the view lists, each with its download link
ZIP_MAX_BYTES = 1 << 30  # as webui.files.MAX_STORED_BYTES: Open WebUI holds a copy in memory to store it
MAX_KNOWLEDGE_FILES = 20
_MAX_BRANCH = 100_000
_MAX_PACKAGES = 40

# Asks the user to pick one of (value, label): the value, or None when they did not.
Ask = Callable[[str, str, Sequence[tuple[str, str]]], Awaitable[str | None]]


@dataclass(frozen=True, slots=True)
class Reply:
    """What a button says: plain sentences for a notification, or (with a `title`) markdown for a
    dialog, every name in it escaped; `level`: info, success, warning or error."""

    text: str
    title: str = ""
    level: str = "info"


NOT_OWNER = Reply("These buttons work in your own chats only.", level="warning")


async def owned(host: Host, user_id: str, chat_id: str) -> bool:
    """Whether the chat is the user's: a saved chat the host says is theirs, or a temporary chat (whose
    files are kept under the user's own id, so no one else's can be reached)."""
    if not user_id or not chat_id:
        return False
    if not host.saves_chat(chat_id):
        return not chat_id.startswith("channel:")
    owners = await host.chat_owners([chat_id])
    return owners.get(chat_id) == user_id


def _branch(messages: dict[str, dict[str, Any]], message_id: str) -> list[str]:
    """The ids from the first message to `message_id`, following parents in the saved tree."""
    chain: list[str] = []
    seen: set[str] = set()  # a set, not the list: a long chain stays linear
    current: Any = message_id
    while (
        isinstance(current, str) and current in messages and current not in seen and len(chain) < _MAX_BRANCH
    ):
        chain.append(current)
        seen.add(current)
        current = messages[current].get("parentId")
    return chain[::-1]


def _message(data: dict[str, Any]) -> BranchMessage:
    content = data.get("content")
    output = data.get("output")
    items = tuple(item for item in output if isinstance(item, dict)) if isinstance(output, list) else ()
    return BranchMessage(
        str(data.get("id") or ""),
        str(data.get("role") or ""),
        content if isinstance(content, str) else "",
        items,
    )


async def press(
    services: Engine,
    chat: ChatSession,
    host: Host,
    button: str,
    message_id: str,
    request: object,
    emit: Emit | None,
    ask: Ask,
) -> Reply:
    """What the button `button` (one of BUTTONS) under the answer `message_id` does, for the chat's
    owner (`owned`, checked before the chat is opened)."""
    if button == "notebook":
        return await export_notebook(services, chat, host, message_id, emit)
    if button == "files":
        return await chat_files(chat)
    if button == "zip":
        title, _ = await host.chat_messages(chat.session.chat_id)
        return await folder_zip(chat, title)
    return await answer_to_knowledge(chat, host, request, message_id, ask)


async def export_notebook(
    engine: Engine, chat: ChatSession, host: Host, message_id: str, emit: Emit | None
) -> Reply:
    """The branch leading to the answer as a notebook, attached to the answer (an export of the chat,
    storage/_exports.py: counted, and deleted with it)."""
    session = chat.session
    title, messages = await host.chat_messages(session.chat_id)
    if messages.get(message_id, {}).get("role") != "assistant":
        return Reply("Export as notebook works on an answer of this chat.", level="warning")
    ids = _branch(messages, message_id)
    branch = [_message({**messages[i], "id": i}) for i in ids]
    answers = [m.id for m in branch if m.role == "assistant"]
    records = await session.history.runs(answers)
    links = {link.url: link.path for link in await session.links() if not is_export(link.path)}
    environment = await engine.runner.environment()
    packages = ", ".join(f"{p.name} {p.version}" for p in environment.packages[:_MAX_PACKAGES])
    where = (
        f"{environment.os_name}, Python {environment.python}" if environment.built else environment.describe()
    )
    if packages:
        where += f"; packages: {packages}"
    # Off the loop: the notebook grows with the branch and its outputs (figures, stdout).
    notebook = await asyncio.to_thread(
        functools.partial(
            build_notebook,
            branch,
            records,
            links,
            title=title or "Chat",
            environment=where,
            python=environment.python or "3",
        )
    )
    name = notebook_name(title or "chat", len(answers))
    slot = "notebook-" + hashlib.sha256(message_id.encode("utf-8", "surrogatepass")).hexdigest()[:24]
    try:
        data = await asyncio.to_thread(notebook_bytes, notebook)
        link, replaced = await session.export_bytes(slot, name, data)
    except StorageError as error:
        return Reply(f"Not exported: {error}", level="warning")
    await host.attach(session.chat_id, message_id, session.user_id, [link], emit, replacing=replaced)
    runs = sum(1 for cell in notebook["cells"] if cell["cell_type"] == "code") - 1
    lost = sum(
        1 for cell in notebook["cells"] if cell["cell_type"] == "code" and cell["execution_count"] is None
    )
    kept = f", {lost} of them no longer kept" if lost else ""
    return Reply(
        f"Attached {name} to this answer: the conversation up to it as a notebook, {runs} runs{kept}.",
        level="success",
    )


def _download(url: str) -> str:
    return url + ("&" if "?" in url else "?") + "attachment=true"


async def chat_files(chat: ChatSession) -> Reply:
    """/mnt/data in one view: every file with its size and when it last changed, the first MAX_LINKED
    with a download link (a copy for download each, as an answer's link makes: counted, reused while
    the file is the same)."""
    session = chat.session
    entries = await session.files.list()
    title = "Files of this chat"
    if not entries:
        return Reply("This chat's /mnt/data is empty.", title=title)
    total = sum(entry.size for entry in entries)
    rows: list[str] = []
    for entry in entries[:MAX_LINKED]:
        target = await chat.resolve(entry.path)
        changed = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(entry.mtime))
        download = f" · **[download]({_download(target.url)})**" if target is not None else ""
        name = code_span("/mnt/data/" + entry.path)
        rows.append(f"- {name} · {human_bytes(entry.size)} · {changed}{download}")
    files = f"{len(entries)} files" if len(entries) != 1 else "1 file"
    lines = [f"{files}, {human_bytes(total)} in all:", "", *rows]
    if len(entries) > MAX_LINKED:
        lines += ["", f"And {len(entries) - MAX_LINKED} more: the zip of the chat's files has them all."]
    notes = chat.unlinked_notes()
    if notes:
        lines += ["", *(f"- {note}" for note in notes)]
    return Reply("\n".join(lines), title=title)


async def folder_zip(chat: ChatSession, title: str) -> Reply:
    """The chat's folder as it is now, one zip (bounded by ZIP_MAX_BYTES and the user's storage),
    published as the chat's zip export (the one before it replaced)."""
    session = chat.session
    name = notebook_name(title or "chat", 0).replace("-answer-0.ipynb", "-files.zip")
    try:
        async with session.lock(timeout=chat.lock_timeout_s):
            link, files, size = await session.export_zip(name, max_bytes=ZIP_MAX_BYTES)
    except StorageError as error:
        return Reply(str(error), level="warning")
    if files == 0:
        return Reply("This chat's /mnt/data is empty: there is nothing to zip.")
    count = f"{files} files" if files != 1 else "1 file"
    return Reply(
        f"**[Download {escape_text(link.name)}]({_download(link.url)})**: {count}, {human_bytes(size)} "
        f"({human_bytes(link.size)} zipped), as this chat's /mnt/data holds them now.",
        title="This chat's files as a zip",
    )


async def answer_to_knowledge(
    chat: ChatSession, host: Host, request: object, message_id: str, ask: Ask
) -> Reply:
    """The files the answer linked or attached (the versions it linked: their copies' bytes) into one
    of the user's Knowledge bases, asked for when there are several."""
    session = chat.session
    _, messages = await host.chat_messages(session.chat_id)
    message = messages.get(message_id) or {}
    if message.get("role") != "assistant":
        return Reply("Save to Knowledge works on an answer of this chat.", level="warning")
    ours = {link.ref: link for link in await session.links() if not is_export(link.path)}
    text = str(message.get("content") or "")
    refs = [
        str(f.get("id")) for f in message.get("files") or () if isinstance(f, dict) and f.get("id") in ours
    ]
    refs += [ref for ref, link in ours.items() if link.url in text]
    chosen = list(dict.fromkeys(refs))
    if not chosen:
        return Reply("This answer has no files of this chat to save.", level="warning")
    bases = await host.knowledge_bases(session.user_id)
    if not bases:
        return Reply(
            "You have no Knowledge base you may add to: make one under Workspace → Knowledge.",
            level="warning",
        )
    names = ", ".join(
        escape_text(ours[ref].name) for ref in chosen[:MAX_KNOWLEDGE_FILES]
    )  # the dialog's markdown
    target = bases[0][0]
    if len(bases) > 1:
        picked = await ask("Save to Knowledge", f"Which Knowledge base should {names} go into?", bases)
        if not picked or picked not in {base for base, _ in bases}:
            return Reply("Not saved: no Knowledge base was chosen.")
        target = picked
    policy = chat.settings.policy
    said: list[str] = []
    for ref in chosen[:MAX_KNOWLEDGE_FILES]:
        link = ours[ref]
        too_large = policy.file_too_large(link.size)
        if too_large is not None:
            said.append(f"Not saved: {link.name} is {human_bytes(link.size)}, {too_large}.")
            continue
        over = policy.over_quota(await session.user_usage())
        if over is not None:
            said.append(f"Not saved to Knowledge: you are {over}. Delete some files first.")
            break
        data, _ = await host.read_upload(ref, session.user_id)  # the copy the answer linked: its bytes
        if data is None:
            said.append(f"Not saved: the copy of {link.name} is gone.")
            continue
        said.append(await host.save_to_knowledge(request, session.user_id, target, link.name, data))
    if len(chosen) > MAX_KNOWLEDGE_FILES:
        more = len(chosen) - MAX_KNOWLEDGE_FILES
        said.append(f"{more} more files were not saved (at most {MAX_KNOWLEDGE_FILES} at once).")
    ok = all(sentence.startswith("Saved") for sentence in said)
    return Reply(" ".join(said), level="success" if ok else "warning")
