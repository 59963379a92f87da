"""Files in, for the Pipe, the Tool and the Filter: the upload link the model offers (a tool of both the
Pipe's loop and the Tool) and the upload route every loaded file puts on its worker. (Save to Knowledge
is a command of the engine's turn: engine/inbound.py.)

The work is engine.Inbound's (checks, sentences) and webui's (the route); this module only composes
them with the process's services. One `Inbound` serves a process; its links live where every worker
finds them (`OpenWebUI.upload_links_folder`), each naming where its chat's files are, so a worker that
never ran the chat can still receive its upload.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from engine import ChatSession, Engine, ExtraTool, Host, Inbound, Turns
from storage import Expiry, Policy, Quotas, Store, UploadLinks

__all__ = ["UPLOAD_LINK_TOOL", "serve_uploads", "upload_link_tool"]

LOCATION_ID = "code_sessions"  # as functions/adapter.py's: where older /cache copies lived

UPLOAD_LINK_TOOL = {
    "type": "function",
    "function": {
        "name": "upload_link",
        "description": (
            "Make a link the user can upload one file with, straight into /mnt/data at the path you "
            "choose (for files too big to attach, or that come from another system). The link takes "
            "one file, once, for a few minutes. Give the link to the user as it is."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string", "description": "where the file goes, e.g. /mnt/data/export.csv"}
            },
            "required": ["path"],
        },
    },
}


def serve_uploads(host: Host) -> None:
    """Put the upload route on this worker's Open WebUI app (at each file's load; a no-op outside
    Open WebUI), so a link works in every worker that has loaded one of the files."""
    host.serve_uploads(lambda: _inbound(host))


def upload_link_tool(host: Host, storage_root: str, index_database: str, request: object) -> ExtraTool:
    """The upload link as a tool (of the Pipe's loop, and the Tool's `upload_link`): a new link for the
    model to give the user, or the sentence why not. The file joins the state of the answer that offers
    the link. `storage_root` and `index_database`: the valves, which the link records for a worker that
    has no services yet."""

    async def call(chat: ChatSession, arguments: dict[str, Any]) -> str:
        path = arguments.get("path")
        if not isinstance(path, str) or not path.strip():
            return "Missing `path` (a string such as /mnt/data/export.csv)."
        inbound = _inbound(host)
        host.serve_uploads(lambda: inbound)
        settings = chat.settings
        where = _where(chat, storage_root, index_database)
        made = await inbound.make_link(chat, path, ttl_s=settings.upload_link_s, where=where)
        if isinstance(made, str):
            return made
        url = await host.upload_url(request, made.token)
        return made.sentence(url, settings.policy.max_file_bytes)

    return ExtraTool(UPLOAD_LINK_TOOL, call)


# ---- composition ---------------------------------------------------------------------------------------


def _inbound(host: Host) -> Inbound:
    shared = host.shared()
    inbound = shared.get("code-sessions:inbound")
    if not isinstance(inbound, Inbound):
        links = UploadLinks(host.upload_links_folder())
        inbound = shared["code-sessions:inbound"] = Inbound(
            links,
            lambda where: _store_for(host, where),
            chat_exists=lambda user_id, chat_id: _chat_exists(host, user_id, chat_id),
        )
    return inbound


async def _chat_exists(host: Host, user_id: str, chat_id: str) -> bool:
    """Whether Open WebUI still has the user's chat. A chat it keeps no row for (a temporary chat, a
    channel) exists as long as its session does (the store answers that)."""
    if not host.saves_chat(chat_id):
        return True
    owners = await host.chat_owners([chat_id])
    return owners.get(chat_id) == user_id


def _where(chat: ChatSession, storage_root: str, index_database: str) -> dict[str, Any]:
    """What a link records about where its chat's files are (for a worker that has no services yet),
    and the quotas of the message that made it."""
    store = chat.store
    return {
        "root": str(store.root),
        "storage_root": storage_root,
        "index": index_database,
        "owner": list(store.owner) if store.owner else None,
        "quotas": chat.settings.policy.quotas.to_dict(),
    }


def _engines(shared: dict[object, object]) -> list[Engine]:
    """The engines of this process (functions/adapter.py's SharedServices hold them)."""
    return [
        turns.services
        for entry in shared.values()
        if isinstance(turns := getattr(entry, "turns", None), Turns)
    ]


async def _store_for(host: Host, where: dict[str, Any]) -> tuple[Store, Policy]:
    """The store a link names (this process's own, its services', when it has one for that root, else
    one opened for uploads alone) and the quotas the link was made under."""
    root = Path(str(where.get("root") or ""))
    policy = Policy(Quotas(**dict(where.get("quotas") or {})), Expiry())
    shared = host.shared()
    for services in _engines(shared):
        if services.store.root == root:
            return services.store, policy
    key = ("code-sessions:upload-store", id(asyncio.get_running_loop()), str(root))
    store = shared.get(key)
    if not isinstance(store, Store):
        places = host.locations(str(where.get("storage_root") or ""), LOCATION_ID)
        owner = where.get("owner")
        store = Store(
            root,
            publisher=host.publisher(places),
            owner=(int(owner[0]), int(owner[1])) if owner else None,
            database_url=host.index_url(str(where.get("index") or "")),
            temporary_chat=host.temporary_chat,
        )
        await store.open()
        shared[key] = store
    return store, policy
